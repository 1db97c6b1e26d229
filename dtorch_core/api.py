"""The public functions of dtorch (re-exported by ``dtorch_core``)."""

from __future__ import annotations

import contextlib
import contextvars
import math

import attrs
import structlog
import torch

from . import explain as _explain
from .controller import heap
from .controller import session as _session_mod
from .controller.session import Session, current_session
from .controller.settings import setting
from .errors import PlacementError
from .ir.instructions import Collective
from .logging import ensure_configured
from .mesh import DeviceMesh, register_root, root_coordinate
from .placement import Partial, Replicate, Shard, refuse_torch_mesh
from .planner import cache as plan_cache
from .planner import gathers as _gathers
from .planner.dispatch import dispatch
from .planner.factories import factory
from .planner.moves import (
    fetch_full,
    issue_redistribute,
    local_shard,
    local_shards,
    without_partial,
)
from .plugins import get_plugins
from .redistribute import same_local_regions
from .spec import TensorSpec, contiguous_stride, shard_region
from .tensor import (
    DTensor,
    TensorMethods,
    refuse_inside_torch_compile,
    root_placements,
    view_for,
)

log = structlog.get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# session
# ---------------------------------------------------------------------------------------------
def init(world_size: int | None = None, *, runner: str | None = None, device_type: str = "cpu",
         strict: bool | None = None, timeout: float | None = None, **options) -> Session:
    """Start the workers and make this process the controller.

    ``runner`` defaults to ``$DTORCH_RUNNER`` or ``"thread"``; ``world_size`` to
    ``$DTORCH_WORLD_SIZE`` or 1. ``strict=True`` (or ``DTORCH_STRICT=1``) makes ops without a
    sharding rule raise instead of running replicated, and refuses surprising gathers
    (docs/explain.md); ``dt.set_strict(True, gathers=False)`` keeps only the first.
    """
    ensure_configured()
    if _session_mod._session is not None:
        shutdown()
    # one validation for every setting, argument or environment variable (ConfigError names it)
    world_size = setting("world_size", world_size, "DTORCH_WORLD_SIZE", 1, "int", minimum=1,
                         overridden_by="`dtorch run --world-size`")
    strict = setting("strict", strict, "DTORCH_STRICT", False, "flag", overridden_by="`dtorch run --strict`")
    timeout = setting("timeout", timeout, "DTORCH_TIMEOUT", 300.0, "seconds",
                      overridden_by="`dtorch run --timeout`")
    plugins = get_plugins()  # resolved once here; the runner and the session get what they need
    runner = setting("runner", runner, "DTORCH_RUNNER", "thread", "name",
                     choices=[str(n) for n in plugins.registry("runners").names()],
                     overridden_by="`dtorch run --runner`")
    make_runner = plugins.registry("runners").get(runner)
    runner_obj = make_runner(world_size, device_type=device_type, timeout=timeout, plugins=plugins, **options)
    session = Session(runner_obj, ops=plugins.registry("ops"), kernels=plugins.registry("kernels"),
                      strict=strict, timeout=timeout)
    _gathers.set_refuse(session, strict)
    _session_mod.set_session(session)
    _explain.attach_new_session(session)  # a running dt.explain (dtorch run --explain) sees it
    if setting("gc_freeze", None, "DTORCH_GC_FREEZE", True, "flag"):
        heap.freeze_on_start()
    log.debug("session started", runner=runner, world_size=world_size)
    return session


def shutdown() -> None:
    """Stop the workers. Distributed tensors of this session become unusable."""
    session = _session_mod._session
    if session is None:
        return
    _session_mod.set_session(None)
    session.close()
    heap.unfreeze_on_end()


def is_initialized() -> bool:
    return _session_mod._session is not None


def device_type() -> str:
    """The device type this session's workers run on (``dt.init(device_type=...)``), which is the
    one ``dt.init_device_mesh`` takes: code that joins a running session asks it here."""
    return current_session().runner.device_type


def manual_seed(seed: int) -> None:
    """Seed every random op issued from now on (same values on every runner)."""
    current_session().manual_seed(seed)


def synchronize() -> None:
    """Wait until the workers have run every op issued so far."""
    current_session().synchronize()


def memory_stats() -> list[dict]:
    """Per device: ``{"rank", "live_tensors", "bytes", "plans", "frozen_objects", ...}`` (a sync
    point; ``frozen_objects``: what the worker's process keeps out of cyclic collections, see
    dtorch_core/controller/heap.py; device plugins add their counters)."""
    return current_session().memory_stats()


def fallback_counts() -> dict[str, int]:
    """How often each op without a sharding rule ran through the replicated fallback."""
    return dict(current_session().fallback_counts)


def gather_counts() -> dict[str, int]:
    """How often each view-like op ran a plan that all-gathers a sharded input whose shards its
    outputs lose (a "surprising gather", docs/explain.md); each warns once per op and module."""
    return _gathers.gather_counts(current_session())


def set_strict(strict: bool = True, *, gathers: bool | None = None) -> None:
    """Make ops without a sharding rule raise (True) or run replicated with a warning (False).

    ``gathers`` (default: the same as ``strict``) also refuses surprising gathers
    (docs/explain.md) with an ``OpError``; ``set_strict(True, gathers=False)`` lets them run
    (with their warning), ``set_strict(False, gathers=True)`` refuses only them."""
    session = current_session()
    session.strict = strict
    _gathers.set_refuse(session, strict if gathers is None else gathers)
    plan_cache.clear(session)


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names=None, ranks=None) -> DeviceMesh:
    """Create a mesh over the session's devices (ranks ``0..prod(shape)-1`` unless given)."""
    session = current_session()
    workers_on = session.runner.device_type
    if device_type != workers_on:
        raise PlacementError(
            f"a {device_type!r} mesh needs workers on {device_type!r}, but this session's run on "
            f"{workers_on!r}; call dt.init(device_type={device_type!r}) or make the mesh with {workers_on!r}"
        )
    mesh_shape = tuple(int(s) for s in mesh_shape)
    n = math.prod(mesh_shape)
    ranks = tuple(range(n)) if ranks is None else tuple(int(r) for r in ranks)
    if len(ranks) != n or len(set(ranks)) != n:
        raise PlacementError(f"mesh shape {mesh_shape} needs {n} distinct ranks, got {ranks}")
    if max(ranks) >= session.world_size:
        raise PlacementError(
            f"mesh {mesh_shape} needs {n} devices but the session has world_size={session.world_size}; "
            "call dt.init(world_size=...) with more devices"
        )
    if mesh_dim_names is not None:
        mesh_dim_names = tuple(mesh_dim_names)
        if len(mesh_dim_names) != len(mesh_shape) or len(set(mesh_dim_names)) != len(mesh_dim_names):
            raise PlacementError(f"mesh_dim_names {mesh_dim_names} must name each of {len(mesh_shape)} dims once")
    mesh = register_root(DeviceMesh(device_type, mesh_shape, ranks, mesh_dim_names))
    session.define_mesh(mesh)
    return mesh


# ---------------------------------------------------------------------------------------------
# creating distributed tensors
# ---------------------------------------------------------------------------------------------
def _coord(mesh: DeviceMesh, rank: int):
    return root_coordinate(mesh.root, rank)


_meta_as_uninitialised = contextvars.ContextVar("dtorch_meta_as_uninitialised", default=False)


@contextlib.contextmanager
def meta_as_uninitialised():
    """Inside, ``distribute_tensor`` of a meta tensor allocates uninitialised shards on the
    workers instead of raising (for ``dt.nn.materialize``, which fills them)."""
    token = _meta_as_uninitialised.set(True)
    try:
        yield
    finally:
        _meta_as_uninitialised.reset(token)


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh, placements=None) -> DTensor:
    """Split ``tensor`` (held by the controller) onto the mesh; uneven shards follow torch.chunk."""
    refuse_inside_torch_compile()
    session = current_session()
    refuse_torch_mesh(device_mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        raise PlacementError("distribute_tensor got a DTensor; use .redistribute() instead")
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    if tensor.is_meta:
        if not _meta_as_uninitialised.get():
            raise PlacementError(
                f"distribute_tensor got a meta tensor {tuple(tensor.shape)}: it has no values to distribute. "
                "Build the model inside dt.nn.meta_init() and create it on the workers with dt.nn.materialize"
            )
        # dt.nn.materialize places a meta-built model (through parallelize_module) as
        # uninitialised shards on the workers, then fills them
        return _factory("empty", tuple(tensor.shape), device_mesh, placements, tensor.dtype,
                        requires_grad=tensor.requires_grad)
    root = device_mesh.root
    full = root_placements(device_mesh, placements, tensor.ndim)
    data = tensor.detach()
    spec = TensorSpec(root, full, tuple(data.shape), contiguous_stride(data.shape), data.dtype)
    shards = {}
    for rank in root.ranks:
        region = shard_region(spec.shape, full, root.shape, _coord(root, rank))
        local = data
        for d, (off, length) in enumerate(region):
            if length != data.shape[d]:
                local = local.narrow(d, off, length)
        local = local.contiguous().clone()
        for m, p in enumerate(full):
            if isinstance(p, Partial) and p.reduce_op == "sum" and _coord(root, rank)[m] != 0:
                local.zero_()
        shards[rank] = local
    tid = session.put(shards, root)
    out = DTensor._make(spec, device_mesh, tid, session)
    if tensor.requires_grad:
        out.requires_grad_(True)
    return out


def from_local(local, device_mesh: DeviceMesh, placements, *, shape=None) -> DTensor:
    """Build a DTensor from local shards: a dict/list of one tensor per rank, or one tensor used
    as every rank's local shard. ``shape`` defaults to the shards laid out as torch.chunk does."""
    refuse_inside_torch_compile()
    session = current_session()
    root = device_mesh.root
    if isinstance(local, torch.Tensor):
        shards = {r: local.detach().clone() for r in root.ranks}
    elif isinstance(local, dict):
        shards = {r: t.detach().clone() for r, t in local.items()}
    else:
        shards = {r: t.detach().clone() for r, t in zip(root.ranks, local)}
    if set(shards) != set(root.ranks):
        raise PlacementError(f"from_local needs one shard per rank of the mesh {root.ranks}, got ranks {sorted(shards)}")
    first = shards[root.ranks[0]]
    full = root_placements(device_mesh, placements, first.ndim)
    if shape is None:
        # along a sharded dim the global size is the sum of the shards that tile it: the ranks at
        # coordinate 0 of every mesh dim that does not shard that dim
        shape = list(first.shape)
        for d in range(first.ndim):
            sharding = {m for m, p in enumerate(full) if isinstance(p, Shard) and p.dim == d}
            if sharding:
                shape[d] = sum(
                    shards[r].shape[d]
                    for r in root.ranks
                    if all(c == 0 for m, c in enumerate(_coord(root, r)) if m not in sharding)
                )
    shape = tuple(shape)
    spec = TensorSpec(root, full, shape, contiguous_stride(shape), first.dtype)
    for rank in root.ranks:
        expected = spec.local_shape(_coord(root, rank))
        if tuple(shards[rank].shape) != expected:
            raise PlacementError(
                f"from_local: rank {rank} has a shard of shape {tuple(shards[rank].shape)}, but global shape "
                f"{shape} with placements {full} gives it {expected}"
            )
    tid = session.put(shards, root)
    return DTensor._make(spec, device_mesh, tid, session)


def _factory(kind, shape, device_mesh, placements, dtype, fill=None, requires_grad=False):
    refuse_inside_torch_compile()
    if isinstance(shape, int):
        shape = (shape,)
    return factory(current_session(), kind, tuple(int(s) for s in shape), device_mesh, placements, dtype, fill,
                   requires_grad)


def zeros(*size, device_mesh, placements=None, dtype=None, requires_grad=False) -> DTensor:
    """A distributed tensor of zeros created on the workers (nothing moves from the controller)."""
    return _factory("zeros", _size(size), device_mesh, placements, dtype, requires_grad=requires_grad)


def ones(*size, device_mesh, placements=None, dtype=None, requires_grad=False) -> DTensor:
    return _factory("ones", _size(size), device_mesh, placements, dtype, requires_grad=requires_grad)


def empty(*size, device_mesh, placements=None, dtype=None, requires_grad=False) -> DTensor:
    return _factory("empty", _size(size), device_mesh, placements, dtype, requires_grad=requires_grad)


def full(size, fill_value, *, device_mesh, placements=None, dtype=None, requires_grad=False) -> DTensor:
    return _factory("full", _size((size,)), device_mesh, placements, dtype, fill=fill_value,
                    requires_grad=requires_grad)


def rand(*size, device_mesh, placements=None, dtype=None, requires_grad=False) -> DTensor:
    """Uniform random values; the global tensor is the same for any placement and runner."""
    return _factory("rand", _size(size), device_mesh, placements, dtype, requires_grad=requires_grad)


def randn(*size, device_mesh, placements=None, dtype=None, requires_grad=False) -> DTensor:
    return _factory("randn", _size(size), device_mesh, placements, dtype, requires_grad=requires_grad)


def arange(start, end=None, step=1, *, device_mesh, placements=None, dtype=None) -> DTensor:
    """Like ``torch.arange``; each rank computes only its own part."""
    if end is None:
        start, end = 0, start
    n = len(range(math.ceil((end - start) / step))) if step else 0
    return _factory("arange", (n,), device_mesh, placements, dtype, fill=(start, step))


def _size(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return tuple(size[0])
    return tuple(size)


# ---------------------------------------------------------------------------------------------
# reads
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# differentiable movement
# ---------------------------------------------------------------------------------------------
class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, placements, view):
        ctx.src = x._spec.placements
        ctx.src_view = x._view
        return issue_redistribute(x, placements, view)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return None, None, None
        return issue_redistribute(grad, without_partial(ctx.src), ctx.src_view), None, None


class _ToMesh(torch.autograd.Function):
    """A tensor moved onto another mesh of the same devices; its gradient moves back."""

    @staticmethod
    def forward(ctx, x, mesh, placements):
        ctx.src = x._spec.placements
        ctx.src_view = x._view
        return _to_mesh(x, mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return None, None, None
        return _to_mesh(grad, ctx.src_view, without_partial(ctx.src)), None, None


def _to_mesh(x: DTensor, mesh: DeviceMesh, placements) -> DTensor:
    """``x`` laid out as ``placements`` (over ``mesh.root``) on ``mesh``, another mesh of the same
    devices (no autograd). Where every rank already holds the region it needs nothing moves;
    otherwise the tensor is gathered on its own mesh first and each rank keeps its part."""
    src, root = x._spec, mesh.root
    if src.mesh.device_type != root.device_type or set(src.mesh.ranks) != set(root.ranks):
        raise PlacementError(
            f"redistribute from {x._view!r} (ranks {sorted(src.mesh.ranks)}) to {mesh!r} (ranks "
            f"{sorted(root.ranks)}): the meshes hold different devices, so the value has to pass through the "
            "controller; do it explicitly: dt.distribute_tensor(x.full_tensor(), mesh, placements)"
        )
    if src.has_partial():
        x = issue_redistribute(x, without_partial(src.placements))
    whole = without_partial(placements)
    wanted = attrs.evolve(x._spec, mesh=root, placements=whole)
    if not same_local_regions(x._spec, wanted):
        x = issue_redistribute(x, (Replicate(),) * src.mesh.ndim)
        wanted = attrs.evolve(x._spec, mesh=root, placements=(Replicate(),) * root.ndim)
    session = x._handle.session
    tid = session.new_tid()
    session.mesh_id(root)
    session.emit(Collective("alias", session.mesh_id(src.mesh), 0, x._tid, tid))
    view = mesh if mesh.is_root else view_for(wanted.with_placements(placements), mesh)
    if tuple(wanted.placements) == tuple(placements):
        return DTensor._make(wanted, view, tid, session)
    return issue_redistribute(DTensor._make(wanted, root, tid, session), placements, view)


def _redistribute_autograd(x: DTensor, device_mesh, placements) -> DTensor:
    mesh = device_mesh or x._view
    refuse_torch_mesh(mesh, "redistribute")
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    if mesh.root != x._spec.mesh:
        return _ToMesh.apply(x, mesh, root_placements(mesh, placements, x.ndim))
    full = root_placements(mesh, placements, x.ndim)
    if not mesh.is_root:
        # dims outside the sub-mesh keep their placements
        keep = list(x._spec.placements)
        for d in mesh.dims_in_root:
            keep[d] = full[d]
        full = tuple(keep)
    return _Redistribute.apply(x, full, mesh if mesh.is_root else view_for(x._spec.with_placements(full), mesh))


class _FullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.spec = x._spec
        ctx.view = x._view
        return fetch_full(x)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        rep = distribute_tensor(grad, spec.mesh, [Replicate()] * spec.mesh.ndim)
        return issue_redistribute(rep, without_partial(spec.placements), ctx.view)


def _full_tensor_autograd(x: DTensor) -> torch.Tensor:
    return _FullTensor.apply(x)


TENSOR_METHODS = TensorMethods(
    dispatch=dispatch,
    redistribute=_redistribute_autograd,
    full_tensor=_full_tensor_autograd,
    to_local=local_shard,
    local_shards=local_shards,
    from_local=from_local,
)
