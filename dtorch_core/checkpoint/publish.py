"""Atomic publication of a checkpoint directory.

A save writes into a fresh temporary directory beside ``path`` (same file system, so renames
are atomic), fsyncs every file and the directory, writes the index last, and then publishes:

- nothing at ``path`` yet: one ``rename``;
- an older checkpoint at ``path``: ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in
  one atomic step (Linux); where that is unavailable, the old one is first renamed aside to
  ``.<name>.old-*`` and the new one renamed into place. A crash between those two renames leaves
  no ``path`` but a complete old checkpoint aside, which ``resolve`` finds and loads.

So at every moment ``path`` (or, in that one window, the checkpoint aside) is complete and
loadable. Leftovers of interrupted saves are removed by the next save to the same path.

Permissions: whatever the umask, nothing of a checkpoint is writable by group or others. The
temporary directory is private (0700) while files are written into it, and opened up to 0755
(less what the umask removes) just before it is published; files end up 0644 (likewise).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

import structlog

from ..errors import CheckpointError, CheckpointIncompleteError
from .index import INDEX_NAME

log = structlog.get_logger(__name__)

_TMP = ".tmp-"
_OLD = ".old-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _siblings(path: Path, marker: str) -> list[Path]:
    prefix = f".{path.name}{marker}"
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.is_dir())


def _is_complete(directory: Path) -> bool:
    return (directory / INDEX_NAME).is_file()


DIR_MODE = 0o755  # less the umask; data files are 0644 likewise (kernels.fsync_path, index.write_index)


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (threads may be saving)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose new directories are 0755 less the umask (never world-writable)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            pass


def make_temp(path: Path) -> Path:
    """A new empty private directory beside ``path`` to save into; clears leftovers of earlier saves."""
    make_dirs(path.parent)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; choose another checkpoint path")
    if path.is_dir() and not _is_complete(path) and any(path.iterdir()):
        raise CheckpointError(
            f"{path} is a non-empty directory without {INDEX_NAME}, so not a dtorch checkpoint; refusing "
            "to replace it: remove it or choose another path"
        )
    for stale in _siblings(path, _TMP):
        log.info("removing an interrupted save", directory=str(stale))
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.parent / f".{path.name}{_TMP}{uuid.uuid4().hex[:12]}"
    tmp.mkdir(mode=0o700)  # nobody else may open a file in it while it is being written
    return tmp


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically; False if this system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def publish(tmp: Path, path: Path) -> None:
    """Make the complete checkpoint in ``tmp`` the one at ``path`` (see the module docstring)."""
    parent = path.parent
    os.chmod(tmp, DIR_MODE & ~(umask() | 0o022))
    fsync_dir(tmp)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        os.replace(tmp, path)  # an empty directory is replaced whole
    elif _exchange(tmp, path):
        fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old checkpoint
    else:
        aside = parent / f".{path.name}{_OLD}{uuid.uuid4().hex[:12]}"
        os.rename(path, aside)
        fsync_dir(parent)
        rename_into_place(tmp, path)
    fsync_dir(parent)
    for stale in _siblings(path, _OLD):  # checkpoints set aside, by this publish or a crashed one
        shutil.rmtree(stale, ignore_errors=True)


def rename_into_place(tmp: Path, path: Path) -> None:
    """The second rename of the fallback publish (its own function so tests can interrupt it)."""
    os.rename(tmp, path)


def resolve(path: Path) -> Path:
    """The directory holding the checkpoint published at ``path``.

    That is ``path`` itself, or, after a crash in the middle of replacing an older checkpoint,
    the older checkpoint set aside beside it. Raises CheckpointIncompleteError otherwise.
    """
    if _is_complete(path):
        return path
    if not path.exists():
        aside = [p for p in _siblings(path, _OLD) if _is_complete(p)]
        if aside:
            chosen = max(aside, key=lambda p: p.stat().st_mtime)
            log.warning("loading the checkpoint set aside by an interrupted save", path=str(path),
                        directory=str(chosen))
            return chosen
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist")
    raise CheckpointIncompleteError(
        f"{path} has no {INDEX_NAME}: it is not a complete dtorch checkpoint (a save that was "
        "interrupted, or another kind of directory); load an older checkpoint or save again"
    )
