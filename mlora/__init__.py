"""mlora: many LoRA adapters over one shared base model.

Sub-packages (DESIGN.md): ``lora_tools`` (artifacts, identity, validation),
``kernels`` (segmented LoRA execution), ``compress`` (JD-Full / JD-Diag bundles),
``batch`` (the offline engine) and ``cli`` (the ``mlora`` command).
"""

__version__ = "0.1.0"
