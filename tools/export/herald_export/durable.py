"""Crash-safe file system steps of the bundle write (issue 17, "faults that lose nothing").

- :func:`fsync_file` / :func:`fsync_dir`: every bundle file and the bundle directory reach the
  disk before the rename, the parent directory after it, so a power cut leaves the old bundle
  or the complete new one, never one with empty or torn files.
- :func:`exchange`: ``renameat2(RENAME_EXCHANGE)`` swaps the new bundle directory with the old
  one in one step, so ``out`` exists at every instant of the replacement.
- :func:`remove_stale`: the temporary siblings (``.<name>.partial-<pid>``,
  ``.<name>.old-<pid>``) a killed exporter could not remove are removed by the next export to
  the same path, those of live processes never.
- :data:`DISK_FULL` and :class:`WriteFailed`: a full disk anywhere in the write becomes one
  clear line naming the file (see ``bundle.export``).
"""

from __future__ import annotations

import ctypes
import hashlib
import errno
import os
import re
import shutil
import sys
from pathlib import Path

#: errno values that mean "the file system is full" (ENOSPC) or "this user's quota is" (EDQUOT).
DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class WriteFailed(Exception):
    """Writing ``path`` failed with ``error`` (an OSError, errno set where known)."""

    def __init__(self, path: str | Path, error: OSError):
        self.path = Path(path)
        self.error = error
        super().__init__(f"{path}: {error}")


def as_oserror(e: BaseException) -> OSError | None:
    """``e`` as an OSError, or None when it is not an I/O error.

    The safetensors library reports I/O errors as its own ``SafetensorError`` with the Rust
    ``io::Error`` text (``... No space left on device (os error 28)``); its errno is read from
    that text.
    """
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError":
        m = re.search(r"os error (\d+)", str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
    return None


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s data and metadata to the disk (its directory entry is :func:`fsync_dir`'s)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory: its entries (creations, renames) survive a power cut."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a: str | Path, b: str | Path) -> bool:
    """Swap the directory entries ``a`` and ``b`` atomically; both must exist.

    Linux ``renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)`` through libc. Returns False,
    having changed nothing, where that is not available: not Linux, a libc without the wrapper
    (glibc < 2.28), a kernel without the call (ENOSYS, before 3.15) or a file system without
    the flag (EINVAL); the caller then falls back to two plain renames. Raises OSError for any
    other failure.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, lower-case hex (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``/proc/<pid>``; a zombie counts as alive)."""
    return os.path.exists(f"/proc/{pid}")


def can_tell_pids() -> bool:
    """Whether :func:`pid_alive` can be trusted: without ``/proc`` every process looks dead."""
    return os.path.isdir("/proc/self")


def partial_name(out: Path, pid: int | None = None) -> Path:
    """The temporary directory an export to ``out`` writes: ``.<name>.partial-<pid>``."""
    return out.parent / f".{out.name}.partial-{os.getpid() if pid is None else pid}"


def old_name(out: Path, pid: int | None = None) -> Path:
    """Where the fallback swap parks the previous bundle: ``.<name>.old-<pid>``."""
    return out.parent / f".{out.name}.old-{os.getpid() if pid is None else pid}"


def remove_stale(out: Path) -> list[Path]:
    """Remove the temporary siblings of ``out`` left by killed exports; return what was removed.

    Only directories (and, for ``.partial-``, files: ``export pack``'s archive) named ``.<out.name>.partial-<pid>`` or ``.<out.name>.old-<pid>`` whose
    process is gone are touched (this process's own pid counts as gone: it has not created
    them yet). One exception to removing: a ``.old-<pid>`` directory while ``out`` does not
    exist is the complete previous bundle of an export killed between the two renames of the
    fallback swap (:func:`exchange` unsupported); it is renamed back to ``out``. Nothing is
    done where ``/proc`` is missing (live and dead processes cannot be told apart).
    """
    parent = out.parent
    if not can_tell_pids() or not parent.is_dir():
        return []
    pat = re.compile(r"\." + re.escape(out.name) + r"\.(partial|old)-([0-9]+)")
    stale = []
    for p in parent.iterdir():
        m = pat.fullmatch(p.name)
        # directories of both kinds; a file only as a partial (export pack's archive)
        if not m or p.is_symlink() or (not p.is_dir() and m.group(1) != "partial"):
            continue
        pid = int(m.group(2))
        if pid != os.getpid() and pid_alive(pid):
            continue
        stale.append((m.group(1), p))
    removed = []
    olds = sorted((p for kind, p in stale if kind == "old"), key=lambda p: p.stat().st_mtime, reverse=True)
    if olds and not os.path.lexists(out):
        os.rename(olds[0], out)
        fsync_dir(parent)
        stale = [(k, p) for k, p in stale if p != olds[0]]
    for _, p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def remove_stale_tempdirs(prefixes: tuple[str, ...], tmpdir: str | Path) -> list[Path]:
    """Remove ``<prefix><pid>-*`` directories in ``tmpdir`` whose process is gone.

    The command line makes its generated checkpoints (``--tiny``, ``--preset``; gigabytes for
    the real-dimension presets) in such directories and removes them when it exits; a killed
    exporter cannot, so the next one does.
    """
    if not can_tell_pids():
        return []
    pat = re.compile("(" + "|".join(re.escape(p) for p in prefixes) + r")([0-9]+)-[A-Za-z0-9_]+")
    removed = []
    try:
        entries = list(Path(tmpdir).iterdir())
    except OSError:
        return []
    for p in entries:
        m = pat.fullmatch(p.name)
        # directories of both kinds; a file only as a partial (export pack's archive)
        if not m or p.is_symlink() or (not p.is_dir() and m.group(1) != "partial"):
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or pid_alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
