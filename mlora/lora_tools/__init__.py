"""Adapter artifacts, base checkpoints, identity and validation (docs/design.md, Artifact identity;
docs/identity.md).

Public entry points:

* :func:`inspect_paths` - validate and identify adapters (what ``mlora validate``
  and ``mlora hash`` call);
* :func:`open_adapter`, :func:`scan_adapters` - the two phases behind it;
* :class:`BaseCheckpoint` - a lazily read Hugging Face base and its ``base_sha256``;
* :data:`CODES` - every finding code with its severity and advice.
"""

from mlora.lora_tools.adapter import AdapterArtifact, ModuleRecord, open_adapter, scan_adapters
from mlora.lora_tools.base import BaseCheckpoint, BaseCheckpointError, BaseIdentity
from mlora.lora_tools.findings import CODES, Finding
from mlora.lora_tools.manifest import AdapterReport, BaseLoadError, inspect_paths
from mlora.lora_tools.peft_config import LoraSpec, parse_lora_config

__all__ = [
    "AdapterArtifact", "AdapterReport", "BaseCheckpoint", "BaseCheckpointError", "BaseIdentity",
    "BaseLoadError", "CODES", "Finding", "LoraSpec", "ModuleRecord", "inspect_paths",
    "open_adapter", "parse_lora_config", "scan_adapters",
]
