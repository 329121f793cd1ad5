"""The error shape every ``mlora.batch`` failure shares.

A ``CodedError`` carries a stable ``code`` (``E_...``, the contract scripts
match on) and a message that ends with what to do; ``str(err)`` is
``"CODE: message"``. Concrete classes mix it with the builtin they specialise
(``ValueError`` for bad input, ``RuntimeError`` for a state that cannot go on)
so callers can catch either way. Imports nothing of mlora: every room of
``mlora.batch`` may raise these.
"""

from __future__ import annotations


class CodedError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class JobError(CodedError):
    """The job cannot start or continue; ``code`` is stable, the message says what to do."""

    def __init__(self, code: str, message: str, exit_code: int = 1):
        super().__init__(code, message)
        self.exit_code = exit_code


class ModelError(CodedError, ValueError):
    """An unsupported or broken base checkpoint, or a tensor-parallel layout it cannot take.
    ``code`` is one of E_MODEL_ARCH, E_MODEL_CONFIG, E_MODEL_WEIGHTS, E_TP_LAYOUT, E_TP_SHAPE."""
