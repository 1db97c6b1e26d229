"""Worker kernels of checkpoints: write this rank's pieces into its own safetensors file, read
the regions this rank's shards need from whichever files hold them.

Both return a status tensor ``[[bytes, count]]`` that the controller fetches: the fetch is what
waits for the files, and a kernel that raised turns into a WorkerError there. Error messages
start with the file they concern, so the controller can name it.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .layout import as_slices

WRITE_KERNEL = "dtorch::checkpoint_write"
READ_KERNEL = "dtorch::checkpoint_read"
FILE_ERROR_PREFIX = "checkpoint file "


class CheckpointFileError(OSError):
    """A file of a checkpoint could not be written or read (the message starts with the path)."""

    def __init__(self, path: str, what: str, exc: BaseException):
        super().__init__(f"{FILE_ERROR_PREFIX}{path}: {what} failed: {type(exc).__name__}: {exc}")
        self.path = path


def _status(nbytes: int, count: int) -> torch.Tensor:
    return torch.tensor([[nbytes, count]], dtype=torch.int64)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, names, tensors, metadata: dict | None = None) -> int:
    """Write ``tensors`` under ``names`` into a safetensors file at ``path``, fsync it, return
    its size. Tensors that share memory (safetensors refuses them) are copied."""
    out = {}
    seen = set()
    for name, t in zip(names, tensors):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.numel() else None
        if not t.is_contiguous() or (key is not None and key in seen):
            t = t.contiguous().clone()
        seen.add(key)
        out[name] = t
    try:
        save_file(out, path, metadata=metadata)
        fsync_path(path)
        return os.path.getsize(path)
    except Exception as exc:
        raise CheckpointFileError(path, "write", exc) from exc


def write_kernel(*tensors, path: str, names: tuple, rank: int):
    """Write this rank's pieces (``tensors``, the local shards) as ``names`` into ``path``."""
    if not names:
        return _status(0, 0)
    nbytes = write_file(path, names, tensors, {"format": "dtorch-checkpoint", "rank": str(rank)})
    return _status(nbytes, len(names))


def read_into(directory: str, reads, dests) -> int:
    """Copy saved regions into ``dests``: ``reads`` is ``(slot, file, name, src, dst)`` per region,
    ``src``/``dst`` as ``((start, stop), ...)`` in the saved piece and in ``dests[slot]``.
    Returns the bytes read. Each file is opened once (mmap: only the regions asked for are read)."""
    by_file = defaultdict(list)
    for r in reads:
        by_file[r[1]].append(r)
    nbytes = 0
    for file, items in by_file.items():
        path = os.path.join(directory, file)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for slot, _file, name, src, dst in items:
                    value = f.get_slice(name)[as_slices(src)]
                    target = dests[slot]
                    with torch.no_grad():
                        target[as_slices(dst)].copy_(value)
                    nbytes += value.numel() * value.element_size()
        except Exception as exc:
            raise CheckpointFileError(path, "read", exc) from exc
    return nbytes


def read_kernel(*dests, directory: str, reads: tuple, zero: tuple = ()):
    """Fill this rank's local shards ``dests`` in place from the checkpoint in ``directory``.

    ``zero``: slots of Partial(sum) shards whose value lives on another rank of the group.
    """
    for slot in zero:
        dests[slot].zero_()
    nbytes = read_into(directory, reads, dests)
    return _status(nbytes, len(reads))


def register(registry) -> None:
    registry.add(WRITE_KERNEL, write_kernel)
    registry.add(READ_KERNEL, read_kernel)
