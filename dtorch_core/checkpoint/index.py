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
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import CheckpointError, CheckpointIncompleteError
from ..placement import Partial, Replicate, Shard
from .layout import Region, numel

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
    def from_json(cls, d: dict) -> "Piece":
        return cls(d["file"], d["name"], tuple(zip(map(int, d["offsets"]), map(int, d["sizes"]))))


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
    def from_json(cls, d: dict) -> "TensorEntry":
        return cls(
            tuple(int(n) for n in d["shape"]),
            parse_dtype(d["dtype"]),
            bool(d["distributed"]),
            None if d["mesh_shape"] is None else tuple(d["mesh_shape"]),
            None if d["placements"] is None else tuple(d["placements"]),
            tuple(Piece.from_json(p) for p in d["pieces"]),
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
        return cls(
            {k: TensorEntry.from_json(e) for k, e in d["tensors"].items()},
            dict(d["values"]),
            d["optimizer"],
            dict(d["extra"]),
            {k: int(v) for k, v in d["files"].items()},
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint names dtype {name!r}, which this torch does not have")
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
    with open(target, "w") as f:
        json.dump(index.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_index(directory: Path) -> CheckpointIndex:
    """Read and check the index of ``directory``: every file it lists must be there, whole.

    Raises CheckpointIncompleteError when the index or a file is missing or a file has the
    wrong size; CheckpointError when the index is not one this version can read.
    """
    target = directory / INDEX_NAME
    if not target.is_file():
        raise CheckpointIncompleteError(
            f"{directory} has no {INDEX_NAME}: it is not a complete dtorch checkpoint (a save that was "
            "interrupted, or another kind of directory); load an older checkpoint or save again"
        )
    try:
        with open(target) as f:
            raw = json.load(f)
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{target} is not a dtorch checkpoint index (format {raw.get('format')!r})")
        if raw.get("version") != VERSION:
            raise CheckpointError(
                f"{target} is checkpoint format version {raw.get('version')}; this dtorch reads version "
                f"{VERSION}: load it with the dtorch that wrote it"
            )
        index = CheckpointIndex.from_json(raw)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{target} is unreadable ({type(exc).__name__}: {exc}); the checkpoint is damaged") from exc
    for name, size in index.files.items():
        path = directory / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            what = "is missing" if actual is None else f"has {actual} bytes, the index says {size}"
            raise CheckpointIncompleteError(f"checkpoint {directory} is incomplete: {name} {what}")
    for key, entry in index.tensors.items():
        covered = sum(numel(p.region) for p in entry.pieces)
        total = numel(tuple((0, n) for n in entry.shape))
        if covered != total or any(p.file not in index.files for p in entry.pieces):
            raise CheckpointError(f"{target} is damaged: the pieces of {key!r} do not cover its shape {entry.shape}")
    return index


def check_json(value: Any, what: str) -> None:
    """Raise a CheckpointError naming ``what`` unless ``value`` is JSON-serialisable."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from None
