"""mlora: many LoRA adapters over one shared base model.

Sub-packages (docs/design.md, Components), top to bottom: ``cli`` (the ``mlora``
command), ``bench`` (the ``mlora bench`` commands), ``batch`` (the offline engine),
``compress`` (JD-Full / JD-Diag bundles), ``lora_tools`` (artifacts, identity,
validation) and ``kernels`` (segmented LoRA execution). Dependencies point one way:
``kernels`` and ``lora_tools`` import nothing else of mlora.
"""

__version__ = "0.1.0"
