"""The ``mlora`` command line: parse options, call the library, render.

Thin by design (DESIGN.md): no validation or hashing logic lives here.
"""
