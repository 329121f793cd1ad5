"""Immutable output directories: written aside, renamed into place, never overwritten.

Owns the one way mlora creates a directory artifact (merged releases, compression
bundles, exported adapters): the contents go into a hidden temporary sibling
``.NAME.tmp-PID-*``, which is renamed to NAME only when complete. On an
exception or Ctrl-C the temporary is removed at once; after SIGKILL or a power
loss it stays hidden and the next write of NAME removes it (its process is
gone). An existing NAME, or one that appears while writing, is never replaced:
the final rename itself refuses an existing target (:func:`rename_noreplace`),
so two writers racing for NAME leave the first one's directory and give the
second its "appeared while writing" error. The files and the directory take
the user's umask, as ``open`` would give them, whatever mode the library that
wrote a file chose (safetensors writes 0600).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
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


def _libc_renameat2():
    """glibc's ``renameat2`` (Linux, glibc 2.28 and later), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1
# what rename(2) answers when the target is there: a non-empty directory, a file
_TARGET_THERE = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename the directory ``src`` to ``dst``; FileExistsError when anything is at ``dst``.

    Linux: ``renameat2(RENAME_NOREPLACE)``, one atomic step. Elsewhere, or on a file
    system without it: ``dst`` is created empty first (``mkdir`` fails on anything there),
    then ``src`` is renamed over it (rename replaces an empty directory only); every mlora
    writer takes the same first step, so none can slip in between. A SIGKILL between
    the two steps leaves ``dst`` empty (refused as existing by the next write)."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise FileExistsError(code, os.strerror(code), dst)
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not "this file system lacks the flag"
            raise OSError(code, os.strerror(code), src, None, dst)
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in _TARGET_THERE:  # someone filled the reserved directory: theirs now
            raise FileExistsError(exc.errno, os.strerror(exc.errno), dst) from None
        os.rmdir(dst)
        raise


def _umask() -> int:
    """The process's umask, read without changing it where the kernel reports it (Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (another thread could create a file in between)
    os.umask(mask)
    return mask


@contextmanager
def atomic_directory(out: str, exists: Callable[[str, bool], Exception], read_only: bool = True) -> Iterator[str]:
    """Yield a temporary directory to fill; on success rename it to ``out``. ``exists(path,
    during)`` builds the error for an ``out`` that exists before (``during`` False) or
    appears while writing (True). ``read_only``: the files are made read-only. The files
    and the directory take the umask (``0666`` / ``0444`` / ``0777`` minus it)."""
    out = check_new(out, exists)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporaries(parent, os.path.basename(out))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-{os.getpid()}-", dir=parent)
    try:
        yield tmp
        mask = _umask()
        for entry in os.listdir(tmp):
            path = os.path.join(tmp, entry)
            os.chmod(path, (0o777 if os.path.isdir(path) else 0o444 if read_only else 0o666) & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        try:
            rename_noreplace(tmp, out)
        except FileExistsError:
            raise exists(out, True) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
