"""The ``mlora`` command line: parse options, call the library, render.

Thin by design (docs/design.md, Components): options become config objects, one library
call does the work, this package renders and picks the exit code; no validation or
hashing logic lives here.
"""
