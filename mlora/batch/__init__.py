"""The offline batch engine behind ``mlora batch-run`` (spec 0x01-0x05, 0x09).

NOT BUILT YET: this package is step 3 (issue "Step 3 - The offline engine").
"""
