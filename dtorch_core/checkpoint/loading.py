"""``dt.checkpoint.load``: every worker reads the regions its shards need, whatever the saved layout."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from ..errors import CheckpointIOError
from ..ir.instructions import Slot
from ..mesh import root_coordinate
from ..placement import Partial
from ..tensor import DTensor
from . import publish
from .calls import run_kernel
from .kernels import READ_KERNEL, CheckpointFileError, read_into
from .layout import reads_for
from .state import plan_load
from .verify import read_verified

log = structlog.get_logger(__name__)


def load(model: torch.nn.Module, optimizer, path) -> dict:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (may be None) in place;
    return the ``extra`` dict it was saved with.

    The model keeps its current mesh and placements: each worker reads from whichever files hold
    them just the regions its own shards need (any saved mesh and placements load onto any
    current ones), plain tensors are read by the controller. Optimizer state is matched by
    parameter name; state the optimizer does not have yet is created laid out like its parameter.
    Everything is checked before anything is written into the model or optimizer, so a load
    that raises leaves them as they were: CheckpointIncompleteError for a directory without a
    complete checkpoint, CheckpointCorruptError for a damaged or hostile one (a file outside the
    directory or not a regular file, pieces that do not match the index or do not tile their
    tensor, a malformed index; it names the entry) and CheckpointMismatchError (naming the
    missing, unexpected and mismatched keys) for a checkpoint of another model. Only a file that
    changes or fails to read after those checks raises CheckpointIOError mid-load.
    """
    start = time.monotonic()
    directory = publish.resolve(Path(path).absolute())  # workers may run in another cwd
    index = read_verified(directory)
    targets = plan_load(model, optimizer, index)
    nbytes = 0
    plain = []
    by_mesh: dict = {}
    for key, dest in targets.tensors.items():
        entry = index.tensors[key]
        if isinstance(dest, DTensor):
            by_mesh.setdefault(dest._spec.mesh, []).append((dest, entry))
        else:
            plain.append((dest, entry))
    for mesh, items in by_mesh.items():
        try:
            nbytes += _read_mesh(mesh, items, directory)
        except CheckpointIOError as exc:
            raise CheckpointIOError(f"{exc}. {_PARTLY}", rank=exc.rank, file=exc.file) from exc
    if plain:
        reads = []
        for slot, (dest, entry) in enumerate(plain):
            region = tuple((0, n) for n in dest.shape)
            reads.extend(_reads(region, entry, slot))
        try:
            nbytes += read_into(str(directory), reads, [d for d, _ in plain])
        except CheckpointFileError as exc:
            raise CheckpointIOError(f"checkpoint read failed on the controller: {exc}. {_PARTLY}", rank=None,
                                    file=exc.path) from exc
    targets.finish()
    log.info("checkpoint loaded", path=str(path), files=len(index.files), bytes=nbytes,
             tensors=len(targets.tensors), seconds=round(time.monotonic() - start, 3))
    return dict(index.extra)


_PARTLY = ("the files changed or became unreadable after they were checked, so the model may be partly "
           "loaded: load a good checkpoint again before using it")


def _reads(region, entry, slot: int) -> list:
    """The kernel's reads of ``region`` of ``entry`` into ``slot``: (slot, file, name, piece shape, src, dst)."""
    return [(slot, piece.file, piece.name, tuple(n for _, n in piece.region), src, dst)
            for piece, src, dst in reads_for(region, entry.pieces)]


def _read_mesh(mesh, items: list, directory: Path) -> int:
    per_rank = {}
    args = tuple(Slot(i) for i in range(len(items)))
    for rank in mesh.ranks:
        coord = root_coordinate(mesh, rank)
        reads = []
        zero = []
        for slot, (dest, entry) in enumerate(items):
            spec = dest._spec
            if any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[m] != 0
                   for m, p in enumerate(spec.placements)):
                zero.append(slot)  # the group's value lives on its first rank; the rest add zero
                continue
            region = spec.region(coord)
            reads.extend(_reads(region, entry, slot))
        per_rank[rank] = (args, {"directory": str(directory), "reads": tuple(reads), "zero": tuple(zero)})
    done = run_kernel(mesh, READ_KERNEL, [d for d, _ in items], per_rank, "checkpoint read", writes_inputs=True)
    return sum(nbytes for nbytes, _ in done.values())
