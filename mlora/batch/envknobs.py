"""Tuning knobs read from the environment (benchmarks and A/B runs).

One parser for every ``MLORA_*`` integer knob and one for every choice among names, so
that each refuses a malformed value the same way: a ``ValueError`` naming the variable,
what it expected and how to get the default back. None of these knobs is needed for a correct job (README, Environment
variables)."""

from __future__ import annotations

import os


def env_int(name: str, default: int | None, *, minimum: int = 0, unit: str = "") -> int | None:
    """The integer in the environment variable ``name``, ``default`` when it is unset or
    empty. Raises ValueError when it is not a whole number >= ``minimum`` (``unit`` says
    what it counts, for the message)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    if not text.isdigit() or int(text) < minimum:
        what = f"a whole number{' of ' + unit if unit else ''} >= {minimum}"
        default_text = "the automatic value" if default is None else str(default)
        raise ValueError(f"{name}={raw!r}: expected {what} (unset it for {default_text})")
    return int(text)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of the environment variable ``name``, one of ``choices``; ``default`` when it
    is unset or empty. Raises ValueError for any other value."""
    raw = os.environ.get(name)
    if not raw:
        return default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {choices} (unset it for {default!r})")
    return raw


def env_row_range(name: str, default: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The inclusive row range ``LO:HI`` in the environment variable ``name``; ``default`` when it
    is unset or empty, None for ``off``. Raises ValueError for anything else (naming the variable)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw == "off":
        return None
    lo, sep, hi = raw.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        default_text = "off" if default is None else f"{default[0]}:{default[1]}"
        raise ValueError(f"{name}={raw!r}: expected LO:HI, two whole numbers of rows with 1 <= LO <= HI, "
                         f"or off (unset it for the default, {default_text})")
    return int(lo), int(hi)
