"""``dt.checkpoint.save``: every worker writes the shards it owns into its own file, in parallel."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

from ..planner.moves import issue_redistribute
from ..errors import CheckpointIOError
from ..ir.instructions import Slot
from ..placement import Partial, Replicate
from ..tensor import DTensor
from . import publish
from .calls import run_kernel
from .index import CheckpointIndex, Piece, TensorEntry, check_json, placement_name, write_index
from .kernels import WRITE_KERNEL, CheckpointFileError, write_file
from .layout import assign_writers
from .state import collect

log = structlog.get_logger(__name__)

CONTROLLER_FILE = "controller.safetensors"


def rank_file(rank: int, mesh_index: int) -> str:
    """The file a rank writes (a second mesh over the same ranks gets files of its own)."""
    return f"rank-{rank:05d}.safetensors" if mesh_index == 0 else f"mesh{mesh_index}-rank-{rank:05d}.safetensors"


def save(model: torch.nn.Module, optimizer, path, *, extra: dict | None = None) -> None:
    """Save ``model`` and ``optimizer`` (may be None) as a sharded checkpoint directory at ``path``.

    Each worker writes the shards it holds into its own safetensors file, all at once; of
    replicas only one rank writes each region, and the controller writes only the plain (not
    distributed) tensors it holds. ``index.json`` records every key's global shape, dtype,
    placements and pieces. The checkpoint appears at ``path`` only when complete (an older one
    there is replaced atomically). ``extra`` (a JSON-serialisable dict, e.g. ``{"step": 100}``)
    is stored in the index and returned by ``load``.
    """
    start = time.monotonic()
    path = Path(path).absolute()  # workers may run elsewhere (another cwd or host)
    extra = {} if extra is None else extra
    check_json(extra, "extra")
    state = collect(model, optimizer)
    tmp = publish.make_temp(path)
    try:
        entries, files = _write_all(state.tensors, tmp)
        index = CheckpointIndex(entries, state.values, state.optimizer, dict(extra), files)
        publish.fsync_dir(tmp)
        write_index(tmp, index)  # last: its presence is what makes the directory a checkpoint
        publish.publish(tmp, path)
    except BaseException:
        publish.discard(tmp)
        raise
    log.info("checkpoint saved", path=str(path), files=len(files), bytes=sum(files.values()),
             tensors=len(entries), seconds=round(time.monotonic() - start, 3))


def _write_all(tensors: dict, directory: Path) -> tuple[dict, dict]:
    """Write every tensor's pieces; returns (key -> TensorEntry, file name -> bytes)."""
    entries: dict = {}
    files: dict = {}
    first_key: dict = {}  # id of a tensor object -> the first key naming it (tied weights)
    aliases: dict = {}
    plain: dict = {}
    by_mesh: dict = {}
    for key, t in tensors.items():
        if id(t) in first_key:
            aliases[key] = first_key[id(t)]
            continue
        first_key[id(t)] = key
        if isinstance(t, DTensor):
            by_mesh.setdefault(t._spec.mesh, []).append((key, t))
        else:
            plain[key] = t
    for mesh_index, (mesh, items) in enumerate(by_mesh.items()):
        _write_mesh(mesh, mesh_index, items, directory, entries, files)
    if plain:
        names = list(plain)
        try:
            files[CONTROLLER_FILE] = write_file(str(directory / CONTROLLER_FILE), names, [plain[k] for k in names],
                                                {"format": "dtorch-checkpoint", "rank": "controller"})
        except CheckpointFileError as exc:
            raise CheckpointIOError(f"checkpoint write failed on the controller: {exc}", rank=None,
                                    file=exc.path) from exc
        for key, t in plain.items():
            region = tuple((0, n) for n in t.shape)
            pieces = (Piece(CONTROLLER_FILE, key, region),) if t.numel() else ()
            entries[key] = TensorEntry(tuple(t.shape), t.dtype, False, None, None, pieces)
    for key, first in aliases.items():
        entries[key] = entries[first]
    return {k: entries[k] for k in tensors}, files


def _write_mesh(mesh, mesh_index: int, items: list, directory: Path, entries: dict, files: dict) -> None:
    # a Partial tensor's value exists on no rank: reduce it first (to Replicate on those dims)
    tensors = []
    for _key, t in items:
        if t._spec.has_partial():
            t = issue_redistribute(t, tuple(Replicate() if isinstance(p, Partial) else p for p in t._spec.placements))
        tensors.append(t)
    specs = [t._spec for t in tensors]
    writers = assign_writers(specs, mesh, [s.dtype.itemsize for s in specs])
    per_rank = {r: ([], []) for r in mesh.ranks}  # rank -> (slots, names)
    file_of = {r: rank_file(r, mesh_index) for r in mesh.ranks}
    for i, ((key, original), spec, owned) in enumerate(zip(items, specs, writers)):
        for rank in owned:
            per_rank[rank][0].append(Slot(i))
            per_rank[rank][1].append(key)
        pieces = tuple(Piece(file_of[r], key, region) for r, region in sorted(owned.items()))
        entries[key] = TensorEntry(
            tuple(spec.shape), spec.dtype, True, tuple(mesh.shape),
            tuple(placement_name(p) for p in original._spec.placements), pieces,
        )
    args = {
        r: (tuple(slots), {"path": str(directory / file_of[r]), "names": tuple(names), "rank": r})
        for r, (slots, names) in per_rank.items()
    }
    # sizes come from the workers: the controller need not see the files of other hosts
    written = run_kernel(mesh, WRITE_KERNEL, tensors, args, "checkpoint write")
    for rank, (nbytes, count) in written.items():
        if count:
            files[file_of[rank]] = nbytes
