"""Immutable output directories: written aside, renamed into place, never overwritten.

Owns the one way mlora creates a directory artifact (merged releases, compression
bundles, exported adapters): the contents go into a hidden temporary sibling
``.NAME.tmp-PID-*``, which is renamed to NAME only when complete. On an
exception or Ctrl-C the temporary is removed at once; after SIGKILL or a power
loss it stays hidden and the next write of NAME removes it (its process is
gone). An existing NAME, or one that appears while writing, is never replaced.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def remove_stale_temporaries(parent: str, name: str) -> None:
    """Temporary directories of earlier writes of ``name`` whose process is gone."""
    prefix = f".{name}.tmp-"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            alive = int(pid) != os.getpid()  # our own pid: a previous write of this process
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def check_new(out: str, exists: Callable[[str, bool], Exception]) -> str:
    """The absolute path of ``out``; raises ``exists(path, False)`` when it is already there."""
    out = os.path.abspath(out)
    if os.path.lexists(out):
        raise exists(out, False)
    return out


@contextmanager
def atomic_directory(out: str, exists: Callable[[str, bool], Exception], read_only: bool = True) -> Iterator[str]:
    """Yield a temporary directory to fill; on success rename it to ``out``. ``exists(path,
    during)`` builds the error for an ``out`` that exists before (``during`` False) or
    appears while writing (True). ``read_only``: the files are made read-only."""
    out = check_new(out, exists)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporaries(parent, os.path.basename(out))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-{os.getpid()}-", dir=parent)
    try:
        yield tmp
        if read_only:
            for entry in os.listdir(tmp):
                os.chmod(os.path.join(tmp, entry), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(tmp, 0o755)
        if os.path.lexists(out):
            raise exists(out, True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
