"""Checks of a checkpoint read from a directory someone else may have written, all done on the
controller before anything is allocated or written into the model:

- every data file the index lists is a regular file directly inside the directory (names were
  checked when the index was parsed; symbolic links, devices and directories are refused) and
  has the size the index says;
- the pieces of every key tile its global shape exactly: inside its bounds, no overlap, no hole;
- every piece is in its file under its name with exactly the dtype of its key and the shape of
  its region (so nothing is converted, and no claimed shape is larger than the bytes behind it).

The workers check the files again when they read them (``kernels.read_into``), for a file that
changed in between.
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from pathlib import Path

from ..errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointIOError,
)
from .index import CheckpointIndex, TensorEntry, read_index
from .kernels import check_piece, open_data_file
from .layout import intersect, numel


def read_verified(directory: Path) -> CheckpointIndex:
    """``read_index(directory)`` followed by every check of this module."""
    index = read_index(directory)
    check_files(directory, index)
    for key, entry in index.tensors.items():
        check_tiling(key, entry, index)
    check_pieces(directory, index)
    return index


def check_files(directory: Path, index: CheckpointIndex) -> None:
    """Every listed file is a regular file inside ``directory`` with the size the index says."""
    for name, size in index.files.items():
        try:
            st = os.lstat(directory / name)
        except FileNotFoundError:
            raise CheckpointIncompleteError(f"checkpoint {directory} is incomplete: {name} is missing") from None
        except OSError as exc:
            raise CheckpointIOError(f"cannot read {directory / name} ({exc}); check its permissions", rank=None,
                                    file=str(directory / name)) from exc
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CheckpointCorruptError(
                f"checkpoint {directory}: data file {name} is {kind}; only regular files inside the "
                "checkpoint directory are read: the checkpoint is damaged or hostile, load another one",
                entry=name,
            )
        if st.st_size != size:
            raise CheckpointIncompleteError(
                f"checkpoint {directory} is incomplete: {name} has {st.st_size} bytes, the index says {size}"
            )


def check_tiling(key: str, entry: TensorEntry, index: CheckpointIndex) -> None:
    """The pieces of ``key`` cover its shape exactly once and name files the index lists."""
    shape = entry.shape

    def bad(problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"the checkpoint index is damaged: the pieces of {key!r} (shape {shape}) {problem}; the "
            "checkpoint cannot be trusted, load another one", entry=key,
        )

    for i, piece in enumerate(entry.pieces):
        if piece.file not in index.files:
            raise bad(f"name {piece.file}, which the index does not list among its files (piece {i})")
        if len(piece.region) != len(shape):
            raise bad(f"include a region of {len(piece.region)} dims (piece {i})")
        for d, ((offset, length), n) in enumerate(zip(piece.region, shape)):
            if offset < 0 or length < 0 or offset + length > n:
                raise bad(f"include indices {offset}..{offset + length} of dim {d}, outside 0..{n} (piece {i})")
    covered = sum(numel(p.region) for p in entry.pieces)
    total = numel(tuple((0, n) for n in shape))
    _check_disjoint(entry.pieces, bad)
    # disjoint and inside the bounds: they tile the shape exactly when they hold as many elements
    if covered != total:
        raise bad(f"hold {covered} elements, the shape has {total}: part of it is in no piece")


def _check_disjoint(pieces, bad) -> None:
    """Raise ``bad(...)`` if two pieces overlap. Sweeps along dim 0 so that only pieces sharing
    rows of dim 0 are compared (the pieces of a sharded tensor form a grid)."""
    def lo(i):
        return pieces[i].region[0][0] if pieces[i].region else 0

    def hi(i):  # a 0-dim piece is one element
        return lo(i) + pieces[i].region[0][1] if pieces[i].region else 1

    active: list = []
    for i in sorted((i for i, p in enumerate(pieces) if numel(p.region)), key=lo):
        region = pieces[i].region
        active = [j for j in active if hi(j) > lo(i)]
        for j in active:
            if intersect(pieces[j].region, region) is not None:
                raise bad(f"overlap: pieces {j} and {i} both hold {intersect(pieces[j].region, region)}")
        active.append(i)


def check_pieces(directory: Path, index: CheckpointIndex) -> None:
    """Every piece is in its file, under its name, with its key's dtype and its region's shape."""
    by_file = defaultdict(list)
    for key, entry in index.tensors.items():
        for piece in entry.pieces:
            by_file[piece.file].append((key, entry, piece))
    for file, items in by_file.items():
        try:
            with open_data_file(str(directory), file) as f:
                for key, entry, piece in items:
                    try:
                        check_piece(f, piece.name, entry.dtype, tuple(n for _, n in piece.region))
                    except ValueError as exc:
                        raise CheckpointCorruptError(
                            f"checkpoint file {directory / file} does not match the index for {key!r}: it "
                            f"{exc}. Nothing is converted: the checkpoint is damaged, load another one",
                            entry=key,
                        ) from None
        except CheckpointCorruptError:
            raise
        except Exception as exc:  # safetensors' own error for a file it cannot parse
            raise CheckpointCorruptError(
                f"checkpoint file {directory / file} cannot be read as safetensors ({type(exc).__name__}: "
                f"{exc}); the checkpoint is damaged, load another one", entry=file,
            ) from exc
