"""Segmented LoRA execution (spec 0x02-0x03, 0x06A-0x06E).

NOT BUILT YET: this package is step 2 (issue "Step 2 - Segmented LoRA kernels").
It must import nothing else from mlora.
"""
