"""Worker kernels of checkpoints: write this rank's pieces into its own safetensors file, read
the regions this rank's shards need from whichever files hold them.

Both return a status tensor ``[[bytes, count]]`` that the controller fetches: the fetch is what
waits for the files, and a kernel that raised turns into a WorkerError there. Error messages
start with the file they concern, so the controller can name it.
"""

from __future__ import annotations

import contextlib
import os
import stat
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


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PROC_FD = "/proc/self/fd"
# safetensors' names for the dtypes a checkpoint holds (what ``get_slice(...).get_dtype()`` says)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)


def fsync_path(path: str) -> None:
    """fsync the file at ``path`` and take write access from group and others (whatever the
    umask: a checkpoint file is never world-writable)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~0o022)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_data_file(directory: str, file: str):
    """``safe_open`` of the data file ``file`` directly inside ``directory``, refusing anything
    but a regular file there: a name with a path in it, a symbolic link (``O_NOFOLLOW``), a
    device or a directory. Raises OSError (or safetensors' error for a malformed file).

    The file is opened once and safetensors reads that same open file (``/proc/self/fd``), so
    it cannot be swapped for a link between the check and the read.
    """
    if file != os.path.basename(file) or file in ("", ".", "..") or "\x00" in file:
        raise PermissionError(f"{file!r} is not a file name inside the checkpoint directory")
    path = os.path.join(directory, file)
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermissionError(f"{path} is not a regular file")
        via = f"{_PROC_FD}/{fd}" if os.path.isdir(_PROC_FD) else path
        with safe_open(via, framework="pt", device="cpu") as f:
            yield f
    finally:
        os.close(fd)


def check_piece(f, name: str, dtype: torch.dtype, shape: tuple) -> None:
    """Raise ValueError unless the open file ``f`` holds ``name`` with exactly ``dtype`` and ``shape``."""
    if name not in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
        raise ValueError(f"has no tensor {name!r}")
    piece = f.get_slice(name)
    saved_dtype, saved_shape = SAFETENSORS_DTYPES.get(piece.get_dtype()), tuple(piece.get_shape())
    if saved_dtype != dtype or saved_shape != tuple(shape):
        raise ValueError(f"holds {name!r} as {piece.get_dtype()} of shape {saved_shape}; the index says "
                         f"{str(dtype).removeprefix('torch.')} of shape {tuple(shape)}")


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
    """Copy saved regions into ``dests``: ``reads`` is ``(slot, file, name, shape, src, dst)`` per
    region: the piece ``name`` of ``file`` (which must have exactly ``shape`` and the dtype of
    ``dests[slot]``: nothing is converted), ``src``/``dst`` as ``((start, stop), ...)`` in the
    piece and in ``dests[slot]``. Returns the bytes read.

    The controller has checked every file before asking; the checks here hold for a file that
    changed since. All the files are checked before the first copy. Each file is opened once
    (mmap: only the regions asked for are read)."""
    by_file = defaultdict(list)
    for r in reads:
        by_file[r[1]].append(r)
    for file, items in by_file.items():
        try:
            with open_data_file(directory, file) as f:
                for slot, _file, name, shape, _src, _dst in items:
                    check_piece(f, name, dests[slot].dtype, shape)
        except Exception as exc:
            raise CheckpointFileError(os.path.join(directory, file), "read", exc) from exc
    nbytes = 0
    for file, items in by_file.items():
        try:
            with open_data_file(directory, file) as f:
                for slot, _file, name, shape, src, dst in items:
                    check_piece(f, name, dests[slot].dtype, shape)
                    value = f.get_slice(name)[as_slices(src)]
                    with torch.no_grad():
                        dests[slot][as_slices(dst)].copy_(value)
                    nbytes += value.numel() * value.element_size()
        except Exception as exc:
            raise CheckpointFileError(os.path.join(directory, file), "read", exc) from exc
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
