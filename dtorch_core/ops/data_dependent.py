"""Ops whose output shape depends on the values: nonzero (argwhere, ``torch.where(cond)``),
masked_select, boolean-mask indexing (``x[mask]``), unique, unique_consecutive, unique(dim=...)
and repeat_interleave without ``output_size``.

Meta tensors cannot say their output sizes, so each is a decomposition that learns them from
the workers, as torch synchronises with the device on CUDA: a read of a few integers, after
which the op's outputs have ordinary specs.

- ``nonzero`` and ``masked_select`` keep the input's shards: each rank counts its shard's
  selected elements; after the read of the counts each rank writes its selection (as global
  linear positions, and the values for masked_select) padded to the largest count, one
  all-gather over the sharded mesh dims collects them, and every rank drops the padding and
  sorts by position. The result is Replicate (the form index tensors take in the indexing
  rules): its rows come in any number per shard, which no Shard layout (torch.chunk sizes)
  could hold.
- ``x[mask]`` with boolean indices: masked_select where one mask covers all of ``x``; otherwise
  each mask becomes the columns of its ``nonzero`` and the integer indexing rule plans the rest.
- The others gather their inputs (unique needs every value), run once on each rank to report
  the output shapes, then run with those shapes. The inverse of ``unique``/``unique_consecutive``
  takes the input's placements back (a local slice of the replicated result).
"""

from __future__ import annotations

import math

import attrs
import torch

from ..ir.instructions import Slot
from ..mesh import root_coordinate
from ..placement import Replicate, Shard
from ..planner.choose import common_mesh
from ..planner.dispatch import dispatch_direct
from ..planner.moves import fetch_full, issue_redistribute, without_partial
from ..planner.plans import kernel_plan
from ..planner.trees import flatten_outputs, map_structure, substitute
from ..spec import TensorSpec, contiguous_stride
from ..tensor import DTensor, view_for

aten = torch.ops.aten

COUNT = "dtorch::select_count"
PADDED = "dtorch::select_padded"
FINISH = "dtorch::select_finish"
SHAPES = "dtorch::output_shapes"
SCATTER = "dtorch::masked_scatter"
# dtypes as the shape report codes them (a kernel's output is a tensor of integers)
_DTYPES = (torch.int64, torch.int32, torch.bool, torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int16, torch.int8, torch.uint8, torch.complex64, torch.complex128)
_SHAPE_REPORT = 64  # int64 entries: [outputs, then per output: dtype code, ndim, sizes...]


# ---------------------------------------------------------------------------------------------
# controller side
# ---------------------------------------------------------------------------------------------
def _spec(mesh, placements, shape, dtype) -> TensorSpec:
    return TensorSpec(mesh, tuple(placements), tuple(shape), contiguous_stride(shape), dtype)


def _call(session, mesh, target, inputs, per_rank, specs, view, op_name, rebuild=None):
    """Run worker call ``target`` on ``inputs`` (placed as the call needs them), giving outputs
    of ``specs`` (one spec: one output). The worker's plan is defined once per target, input
    specs and arguments: output sizes that change from call to call (they follow the values)
    reuse it, so a loop over masks of changing counts defines nothing new."""
    specs = (specs,) if isinstance(specs, TensorSpec) else tuple(specs)
    # the inputs' sizes are left out too (a worker plan names tensors, not shapes): gathered
    # selections change size with the values
    key = ("data-dependent", target, tuple((x._spec.mesh, x._spec.placements, x._spec.dtype) for x in inputs),
           repr(sorted(per_rank.items())))
    plan = session.plans.get(key)
    views = tuple(view_for(s, view) for s in specs)
    if plan is None:
        plan = session.plans[key] = kernel_plan(
            session, mesh, target, per_rank, op_name=op_name, pure=True, n_inputs=len(inputs), out_specs=specs,
            out_views=views, rebuild=rebuild or (lambda outs: outs[0]))
    elif plan.out_specs != specs or plan.out_views != views:
        plan = attrs.evolve(plan, out_specs=specs, out_views=views)  # the same worker plan
    return plan.run(session, (), {}, list(inputs))


def _placed(x: DTensor, placements) -> DTensor:
    return x if x._spec.placements == tuple(placements) else issue_redistribute(x, tuple(placements))


def _select(x: DTensor, values: DTensor | None, op_name: str, *, unravel: bool = True) -> DTensor:
    """The positions of ``x``'s non-zeros as ``nonzero`` gives them (values None; with
    ``unravel=False`` as sorted linear positions), or the elements of ``values`` (placed like
    ``x``) at those positions, in row-major order."""
    session, mesh, view = x._handle.session, x._spec.mesh, x._view
    slots = (Slot(0),) if values is None else (Slot(0), Slot(1))
    inputs = [x] if values is None else [x, values]
    one_each = _spec(mesh, [Shard(m) for m in range(mesh.ndim)], mesh.shape, torch.int64)
    counts = _call(session, mesh, COUNT, [x], {r: ((Slot(0),), {"ndim": mesh.ndim}) for r in mesh.ranks}, one_each,
                   None, op_name)
    # every rank learns the widest shard's count from the gathered counts (the controller's
    # sizes are not arguments of the worker plans: those stay the same from call to call)
    counts = issue_redistribute(counts, (Replicate(),) * mesh.ndim, op_name=op_name)
    known = fetch_full(counts)  # the sync point
    sharded = [m for m, p in enumerate(x._spec.placements) if isinstance(p, Shard)]
    width = int(known.max())
    pieces = {}  # the count of each piece of the gathered vector (ranks along replicated dims agree)
    per_rank = {}
    for rank in mesh.ranks:
        coord = root_coordinate(mesh, rank)
        region = x._spec.region(coord)
        per_rank[rank] = (slots + (Slot(len(slots)),), {"offsets": tuple(o for o, _ in region), "shape": x._spec.shape})
        pieces[tuple(coord[m] for m in sharded)] = int(known[coord])
    n_pieces = math.prod(mesh.shape[m] for m in sharded)  # = len(pieces)
    gathered_pl = [Shard(0) if m in sharded else Replicate() for m in range(mesh.ndim)]
    dtype = torch.int64 if values is None else values.dtype
    # positions and values travel as one int64 vector: a value is at most 8 bytes
    padded = _call(session, mesh, PADDED, inputs + [counts], per_rank,
                   _spec(mesh, gathered_pl, (n_pieces * width * (1 if values is None else 2),), torch.int64),
                   None, op_name)
    gathered = issue_redistribute(padded, (Replicate(),) * mesh.ndim, op_name=op_name)
    total = sum(pieces.values())
    out_shape = (total, x.ndim) if values is None and unravel else (total,)
    finish = {"pieces": n_pieces, "values": None if values is None else dtype, "shape": x._spec.shape,
              "unravel": unravel}
    return _call(session, mesh, FINISH, [gathered], {r: ((Slot(0),), finish) for r in mesh.ranks},
                 _spec(mesh, (Replicate(),) * mesh.ndim, out_shape, dtype), view, op_name)


def nonzero(x):
    x = _placed(x, without_partial(x._spec.placements))
    return _select(x, None, "aten.nonzero.default")


def masked_select(x, mask):
    if type(x) is not DTensor or type(mask) is not DTensor or x.element_size() > 8:
        # (a value travels in one int64 slot of the gathered vector)
        return _replicated(aten.masked_select.default, (x, mask), {})
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    if tuple(x.shape) != tuple(shape):
        x = x.expand(shape)
    if tuple(mask.shape) != tuple(shape):
        mask = mask.expand(shape)
    target = without_partial(x._spec.placements)
    x = _placed(x, target)
    mask = _placed(mask, target)
    return _select(mask, x, "aten.masked_select.default")


def index(x, indices):
    if not _has_mask(indices):
        return dispatch_direct(aten.index.Tensor, (x, indices), {})
    if len(indices) == 1 and tuple(indices[0].shape) == tuple(x.shape) and type(x) is DTensor \
            and type(indices[0]) is DTensor:
        return masked_select(x, indices[0].to(torch.bool))
    return aten.index.Tensor(x, _integer_indices(indices))


def masked_scatter(x, mask, source):
    """``x`` with the elements of ``source`` (in order) where ``mask`` is set: each rank finds
    its positions' places among all selected positions and fills its own shard."""
    if type(x) is not DTensor or type(mask) is not DTensor:
        return _replicated(aten.masked_scatter.default, (x, mask, source), {})
    if tuple(mask.shape) != tuple(x.shape):
        mask = mask.expand(x.shape)
    x = _placed(x, without_partial(x._spec.placements))  # not linear in x: source replaces it
    mask = _placed(mask, x._spec.placements)
    positions = _select(mask, None, "aten.masked_scatter.default", unravel=False)
    session, mesh = x._handle.session, x._spec.mesh
    flat = source.reshape(-1)
    flat = issue_redistribute(flat, (Replicate(),) * mesh.ndim, op_name="aten.masked_scatter.default") \
        if type(flat) is DTensor else _put_replicated(session, flat, mesh)
    per_rank = {}
    for rank in mesh.ranks:
        region = x._spec.region(root_coordinate(mesh, rank))
        per_rank[rank] = ((Slot(0), Slot(1), Slot(2), Slot(3)),
                          {"offsets": tuple(o for o, _ in region), "shape": x._spec.shape})
    return _call(session, mesh, SCATTER, [x, mask, flat, positions], per_rank, x._spec, x._view,
                 "aten.masked_scatter.default")


def masked_scatter_(x, mask, source):
    aten.copy_.default(x, masked_scatter(x, mask, source))
    return x


def index_put(x, indices, values, accumulate=False):
    """``x[indices] = values`` (``index_put``): a boolean mask over all of ``x`` fills or
    scatters shard by shard; other masks become integer indices (their ``nonzero``)."""
    if not _has_mask(indices):
        return dispatch_direct(aten.index_put.default, (x, indices, values, accumulate), {})
    if len(indices) == 1 and tuple(indices[0].shape) == tuple(x.shape) and type(x) is DTensor:
        mask = indices[0].to(torch.bool)
        if values.numel() == 1:
            value = values.reshape(())
            return aten.add.Tensor(x, aten.mul.Tensor(mask, value)) if accumulate else \
                aten.where.self(mask, value.to(x.dtype), x)
        if accumulate:
            return aten.add.Tensor(x, masked_scatter(aten.zeros_like.default(x), mask, values))
        return masked_scatter(x, mask, values)
    return aten.index_put.default(x, _integer_indices(indices), values, accumulate)


def index_put_(x, indices, values, accumulate=False):
    if not _has_mask(indices):
        return dispatch_direct(aten.index_put_.default, (x, indices, values, accumulate), {})
    aten.copy_.default(x, index_put(x, indices, values, accumulate))
    return x


def _has_mask(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


# only calls with a mask take these decompositions (planner/dispatch.py asks once per cache key):
# integer indexing keeps its rule's plan, served by the native hot path
index.applies = index_put.applies = index_put_.applies = lambda args, kwargs: _has_mask(
    args[1] if len(args) > 1 else kwargs.get("indices", ()))


def _integer_indices(indices) -> list:
    out = []
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            out.extend(aten.nonzero.default(i).unbind(1))  # torch's own reading of a mask
        else:
            out.append(i)
    return out


def _replicated(func, args, kwargs):
    """``func`` on every rank with replicated inputs, after a first run reports its output
    shapes (the sync point)."""
    tensors: list = []
    map_structure((tuple(args), tuple(kwargs.values())), tensors.append)
    mesh, view = common_mesh(func, tensors)
    session = next(t for t in tensors if type(t) is DTensor)._handle.session
    everywhere = (Replicate(),) * mesh.ndim
    rep = [issue_redistribute(t, everywhere, op_name=str(func)) if type(t) is DTensor
           else _put_replicated(session, t, mesh) for t in tensors]
    template_args, template_kwargs = substitute(args, kwargs, Slot)
    per_rank = {r: (template_args, {**template_kwargs, "dtorch_op": func.name()}) for r in mesh.ranks}
    report = fetch_full(_call(session, mesh, SHAPES, rep, per_rank, _spec(mesh, everywhere, (_SHAPE_REPORT,),
                                                                           torch.int64), None, str(func))).tolist()
    specs = []
    pos = 1
    for _ in range(report[0]):
        dtype, ndim = _DTYPES[report[pos]], report[pos + 1]
        specs.append(_spec(mesh, everywhere, report[pos + 2:pos + 2 + ndim], dtype))
        pos += 2 + ndim
    metas = tuple(torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs)
    _, rebuild = flatten_outputs(metas if len(func._schema.returns) > 1 else metas[0])
    return _call(session, mesh, func.name(), rep, {r: (template_args, template_kwargs) for r in mesh.ranks}, specs,
                 view, str(func), rebuild)


def _put_replicated(session, t: torch.Tensor, mesh) -> DTensor:
    """A plain tensor meeting DTensors in the op, as a replicated DTensor (its own copy)."""
    spec = _spec(mesh, (Replicate(),) * mesh.ndim, t.shape, t.dtype)
    return DTensor._make(spec, mesh, session.put_replicated(t, mesh), session)


def _unique_like(func):
    def run(x, *args, **kwargs):
        out = _replicated(func, (x,) + args, kwargs)
        if type(x) is not DTensor or x._spec.is_replicated():
            return out
        values, inverse, *rest = out
        if tuple(inverse.shape) == tuple(x.shape):  # requested (else an empty tensor)
            inverse = issue_redistribute(inverse, without_partial(x._spec.placements), x._view, op_name=str(func))
        return (values, inverse, *rest)
    return run


def _replicated_op(func):
    return lambda *args, **kwargs: _replicated(func, args, kwargs)


def repeat_interleave(repeats, output_size=None):
    if output_size is not None:
        return dispatch_direct(aten.repeat_interleave.Tensor, (repeats,), {"output_size": output_size})
    return _replicated(aten.repeat_interleave.Tensor, (repeats,), {})


# ---------------------------------------------------------------------------------------------
# worker kernels
# ---------------------------------------------------------------------------------------------
def select_count_kernel(mask, *, ndim):
    """The number of non-zeros of this shard, as this rank's element of a mesh-shaped tensor."""
    return torch.count_nonzero(mask).to(torch.int64).reshape((1,) * ndim)


def select_padded_kernel(mask, *rest, offsets, shape):
    """This shard's selected global positions (and values) padded with -1 to the widest shard's
    count (``rest``: the values, if any, then every rank's count)."""
    values, counts = rest if len(rest) == 2 else (None, rest[0])
    width = int(counts.max())
    pos = _global_positions(mask, offsets, shape)
    out = torch.full((width * (1 if values is None else 2),), -1, dtype=torch.int64, device=mask.device)
    out[:pos.numel()] = pos
    if values is not None:
        picked = values[mask.to(torch.bool)]
        out[width:width + picked.numel()] = _as_int64(picked)
    return out


def select_finish_kernel(gathered, *, pieces, values, shape, unravel):
    """Drop the padding of the gathered pieces and sort by position: nonzero's rows (values
    None; the sorted positions if not ``unravel``) or the selected values in their dtype."""
    width = gathered.numel() // (pieces * (1 if values is None else 2))
    if width == 0:
        if values is not None:
            return torch.zeros(0, dtype=values, device=gathered.device)
        return gathered.new_zeros((0, len(shape)) if unravel else (0,))
    pieces = gathered.reshape(-1, width if values is None else 2 * width)
    pos = pieces[:, :width].reshape(-1)
    keep = pos >= 0
    pos = pos[keep]
    order = torch.argsort(pos)
    if values is not None:
        return _from_int64(pieces[:, width:].reshape(-1)[keep][order], values)
    flat = pos[order]
    if not unravel:
        return flat
    cols = []
    for size in reversed(shape):  # every size is > 0 here: a tensor with a 0 dim selects nothing
        cols.append(flat % size)
        flat = flat // size
    return torch.stack(cols[::-1], dim=1) if shape else flat.new_zeros((flat.numel(), 0))


def masked_scatter_kernel(x, mask, source, positions, *, offsets, shape):
    """This shard of ``masked_scatter``: a selected element at global position p takes
    ``source[k]``, k the number of selected positions before p."""
    out = x.clone()
    pos = _global_positions(mask, offsets, shape)
    if pos.numel():
        out[mask.to(torch.bool)] = source[torch.searchsorted(positions, pos)].to(x.dtype)
    return out


def _global_positions(mask, offsets, shape):
    """The row-major positions in the global tensor of ``shape`` of this shard's non-zeros
    (the shard starts at ``offsets``), in increasing order."""
    local = torch.nonzero(mask)
    stride = contiguous_stride(shape)
    pos = torch.zeros(local.shape[0], dtype=torch.int64, device=mask.device)
    for d in range(local.shape[1]):
        pos += (local[:, d] + offsets[d]) * stride[d]
    return pos


def _as_int64(t):
    if t.dtype == torch.int64:
        return t
    raw = t.contiguous().view(torch.uint8).reshape(t.numel(), t.element_size())
    padded = torch.zeros(t.numel(), 8, dtype=torch.uint8, device=t.device)
    padded[:, :t.element_size()] = raw
    return padded.view(torch.int64).reshape(-1)


def _from_int64(t, dtype):
    if dtype == torch.int64:
        return t
    size = torch.empty((), dtype=dtype).element_size()
    return t.contiguous().view(torch.uint8).reshape(-1, 8)[:, :size].contiguous().view(dtype).reshape(-1)


def output_shapes_kernel(*args, dtorch_op, **kwargs):
    from ..worker.kernels import resolve_op

    out = resolve_op(dtorch_op)(*args, **kwargs)
    flat = [out] if isinstance(out, torch.Tensor) else list(out)
    report = [len(flat)]
    for t in flat:
        report += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    device = flat[0].device
    return torch.tensor(report + [0] * (_SHAPE_REPORT - len(report)), dtype=torch.int64, device=device)


def register(registry) -> None:
    registry.add_decomposition(aten.nonzero.default, nonzero)
    registry.add_decomposition(aten.masked_select.default, masked_select)
    registry.add_decomposition(aten.index.Tensor, index)
    registry.add_decomposition(aten.masked_scatter.default, masked_scatter)
    registry.add_decomposition(aten.masked_scatter_.default, masked_scatter_)
    registry.add_decomposition(aten.index_put.default, index_put)
    registry.add_decomposition(aten.index_put_.default, index_put_)
    registry.add_decomposition(aten.repeat_interleave.Tensor, repeat_interleave)
    for op in (aten._unique2.default, aten.unique_consecutive.default):
        registry.add_decomposition(op, _unique_like(op))
    registry.add_decomposition(aten.unique_dim.default, _replicated_op(aten.unique_dim.default))


def register_kernels(registry) -> None:
    registry.add(COUNT, select_count_kernel)
    registry.add(PADDED, select_padded_kernel)
    registry.add(FINISH, select_finish_kernel)
    registry.add(SHAPES, output_shapes_kernel)
    registry.add(SCATTER, masked_scatter_kernel)
