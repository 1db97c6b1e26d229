"""The checkpoint index (``index.json``): what every key is and where its pieces lie.

Written last, after every data file is on disk; a directory without it is not a checkpoint.
Per key it records the global shape and dtype, how the tensor was laid out when saved (mesh
shape and placements, for people and tools; loading only needs the pieces), and the pieces:
which file holds which region (offsets and sizes per dim). The pieces of a key tile the whole
tensor exactly once. The data files are safetensors, one per writer; the key is the tensor's
name inside the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointIncompleteError, CheckpointIOError
from ..placement import Partial, Replicate, Shard
from . import schema as sc
from .layout import Region

INDEX_NAME = "index.json"
FORMAT = "dtorch-checkpoint"
VERSION = 1


@attrs.frozen
class Piece:
    """One saved region of a tensor: ``file`` holds it under ``name``."""

    file: str
    name: str
    region: Region  # ((offset, length), ...) in the global tensor

    def to_json(self) -> dict:
        return {"file": self.file, "name": self.name,
                "offsets": [o for o, _ in self.region], "sizes": [n for _, n in self.region]}

    @classmethod
    def from_json(cls, d: Any, what: str, key: str) -> "Piece":
        offsets = sc.integers(sc.field(d, "offsets", what, key), f"{what} offsets", key)
        sizes = sc.integers(sc.field(d, "sizes", what, key), f"{what} sizes", key)
        if len(offsets) != len(sizes):
            raise sc.damaged(what, f"has {len(offsets)} offsets and {len(sizes)} sizes", key)
        return cls(sc.file_name(sc.field(d, "file", what, key), f"{what} file"),
                   sc.text(sc.field(d, "name", what, key), f"{what} name", key), tuple(zip(offsets, sizes)))


@attrs.frozen
class TensorEntry:
    """A saved tensor: global metadata and its pieces."""

    shape: tuple
    dtype: torch.dtype
    distributed: bool  # a DTensor when saved (else a plain tensor of the controller)
    mesh_shape: tuple | None
    placements: tuple | None  # placement names, one per root mesh dim
    pieces: tuple

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "distributed": self.distributed,
            "mesh_shape": None if self.mesh_shape is None else list(self.mesh_shape),
            "placements": None if self.placements is None else list(self.placements),
            "pieces": [p.to_json() for p in self.pieces],
        }

    @classmethod
    def from_json(cls, d: Any, key: str) -> "TensorEntry":
        what = f"tensor {key!r}"
        pieces = sc.seq(sc.field(d, "pieces", what, key), f"{what} pieces", key)
        return cls(
            sc.integers(sc.field(d, "shape", what, key), f"{what} shape", key),
            parse_dtype(sc.text(sc.field(d, "dtype", what, key), f"{what} dtype", key)),
            sc.boolean(sc.field(d, "distributed", what, key), f"{what} distributed", key),
            sc.optional(sc.field(d, "mesh_shape", what, key), sc.integers, f"{what} mesh_shape", key),
            sc.optional(sc.field(d, "placements", what, key), sc.texts, f"{what} placements", key),
            tuple(Piece.from_json(p, f"{what} piece {i}", key) for i, p in enumerate(pieces)),
        )


@attrs.frozen
class CheckpointIndex:
    """Everything ``index.json`` holds."""

    tensors: dict  # key -> TensorEntry
    values: dict  # key -> JSON value (non-tensor optimizer state)
    # None without an optimizer, else {"param_groups": [hyper-parameters + "params": parameter
    # names, per group], "state": {parameter name: [its state keys]}}
    optimizer: dict | None
    extra: dict
    files: dict  # file name -> size in bytes

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "extra": self.extra,
            "files": self.files,
            "optimizer": self.optimizer,
            "values": self.values,
            "tensors": {k: e.to_json() for k, e in self.tensors.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> "CheckpointIndex":
        tensors = sc.obj(sc.field(d, "tensors", "the index"), "tensors")
        files = sc.obj(sc.field(d, "files", "the index"), "files")
        return cls(
            {k: TensorEntry.from_json(e, k) for k, e in tensors.items()},
            dict(sc.obj(sc.field(d, "values", "the index"), "values")),
            _optimizer_from_json(sc.field(d, "optimizer", "the index")),
            dict(sc.obj(sc.field(d, "extra", "the index"), "extra")),
            {sc.file_name(k, "in files"): sc.integer(v, f"the size of file {k!r}", k) for k, v in files.items()},
        )


def _optimizer_from_json(d: Any) -> dict | None:
    """The optimizer's record, checked: a list of param groups (objects whose ``params`` is a
    list of parameter names) and a state map (parameter name -> list of state keys)."""
    if d is None:
        return None
    groups = sc.seq(sc.field(d, "param_groups", "optimizer"), "optimizer param_groups")
    for i, group in enumerate(groups):
        sc.texts(sc.field(group, "params", f"optimizer param group {i}"), f"optimizer param group {i} params")
    state = sc.obj(sc.field(d, "state", "optimizer"), "optimizer state")
    for name, keys in state.items():
        sc.texts(keys, f"optimizer state of {name!r}", f"optim.state.{name}")
    return {"param_groups": groups, "state": state}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"the checkpoint names dtype {name!r}, which this torch does not have; "
                                     "load it with a torch that has it", entry=str(name))
    return dtype


def placement_name(p) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    if isinstance(p, Replicate):
        return "Replicate()"
    raise CheckpointError(f"unknown placement {p!r}")


def write_index(directory: Path, index: CheckpointIndex) -> None:
    """Write ``index.json`` into ``directory`` and fsync it."""
    target = directory / INDEX_NAME
    # explicit mode (less the umask): never world-writable, even with umask 0
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(index.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_index(directory: Path) -> CheckpointIndex:
    """Read and parse the index of ``directory``, every field checked for its type (what it
    refers to is checked by ``verify``).

    Raises CheckpointIncompleteError when there is no index; CheckpointCorruptError when it is
    malformed (or not a regular file); CheckpointError when it is not one this version reads.
    """
    target = directory / INDEX_NAME
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise CheckpointIOError(f"cannot read {target} ({exc}); check the directory's permissions", rank=None,
                                file=str(target)) from exc
    if st is None or stat.S_ISDIR(st.st_mode):
        raise CheckpointIncompleteError(
            f"{directory} has no {INDEX_NAME}: it is not a complete dtorch checkpoint (a save that was "
            "interrupted, or another kind of directory); load an older checkpoint or save again"
        )
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(
            f"{target} is not a regular file (a symbolic link or a device); only regular files inside "
            "the checkpoint directory are read: the checkpoint is damaged or hostile, load another one",
            entry=INDEX_NAME,
        )
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            raw = json.load(f)
    except RecursionError:
        raise CheckpointCorruptError(f"{target} nests its JSON too deeply to be read; the checkpoint is damaged "
                                     "or hostile, load another one", entry=INDEX_NAME) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{target} is unreadable ({type(exc).__name__}: {exc}); the checkpoint is "
                                     "damaged, load another one", entry=INDEX_NAME) from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        what = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{target} is not a dtorch checkpoint index (format {what!r})")
    if raw.get("version") != VERSION:
        raise CheckpointError(
            f"{target} is checkpoint format version {raw.get('version')}; this dtorch reads version "
            f"{VERSION}: load it with the dtorch that wrote it"
        )
    return CheckpointIndex.from_json(raw)


def check_json(value: Any, what: str) -> None:
    """Raise a CheckpointError naming ``what`` unless ``value`` is JSON-serialisable."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from None
