"""Compress-then-Serve JD-Full / JD-Diag collection bundles (spec 0x06G).

NOT BUILT YET: this package is step 5 (issue "Step 5 - mlora compress").
"""
