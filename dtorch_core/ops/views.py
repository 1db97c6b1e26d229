"""View and shape ops: view/reshape, expand, transpose/permute, squeeze/unsqueeze (and their
in-place forms), select, slice, split, unbind, repeat, roll, tril/triu, view(dtype), and the
backward ops that rebuild a shape (slice/select_backward)."""

from __future__ import annotations

import attrs
import torch

from .common import ALL_PARTIALS, LINEAR_PARTIALS, add_all, dim_map_strategies
from .reshape import view_localize, view_rule
from ..errors import OpError
from ..planner.schema import NotLocal, Rule
from ..placement import Shard
from ..planner.dispatch import dispatch_direct
from ..planner.moves import issue_shift
from ..spec import contiguous_stride

aten = torch.ops.aten


def _norm(d, nd):
    return d % nd if nd else 0


def local_out_shape_arg(index):
    """localize: replace the size argument at ``args[index]`` with the local output shape."""

    def localize(local):
        args = list(local.args)
        args[index] = [n for _, n in local.out_regions[0]]
        return tuple(args), local.kwargs

    return localize


def expand_rule(call):
    x, out = call.inputs[0], call.outputs[0]
    off = out.ndim - x.ndim
    mapping = {d: d + off for d in range(x.ndim) if x.shape[d] == out.shape[d + off]}
    return dim_map_strategies(call, mapping, partials=ALL_PARTIALS)


def permute_rule(call):
    x = call.inputs[0]
    dims = [_norm(d, x.ndim) for d in call.args[1]]
    return dim_map_strategies(call, {d: dims.index(d) for d in range(x.ndim)}, partials=ALL_PARTIALS)


def transpose_rule(call):
    x = call.inputs[0]
    nd = x.ndim
    if call.op == aten.t.default:
        d0, d1 = 0, max(nd - 1, 0)
    else:
        d0, d1 = _norm(call.args[1], nd), _norm(call.args[2], nd)
    mapping = {d: d for d in range(nd)}
    if nd:
        mapping[d0], mapping[d1] = d1, d0
    return dim_map_strategies(call, mapping, partials=ALL_PARTIALS)


def _diagonal_dims(call, nd, first: int) -> list:
    """Dims of a diagonal's input that are not its diagonal: args[first:] are offset, dim1, dim2."""
    args = list(call.args) + [None] * 4
    d1 = args[first + 1] if args[first + 1] is not None else call.kwargs.get("dim1", 0)
    d2 = args[first + 2] if args[first + 2] is not None else call.kwargs.get("dim2", 1)
    return [d for d in range(nd) if d not in (_norm(d1, nd), _norm(d2, nd))]


def diagonal_rule(call):
    """The dims besides the two the diagonal runs along keep their shards (a view)."""
    rest = _diagonal_dims(call, call.inputs[0].ndim, 1)
    return dim_map_strategies(call, {d: k for k, d in enumerate(rest)}, partials=ALL_PARTIALS)


def diagonal_backward_rule(call):
    """grad (rest..., diagonal) -> a tensor of the input's shape: grad's dims keep their shards."""
    rest = _diagonal_dims(call, len(call.args[1]), 2)
    return dim_map_strategies(call, {k: d for k, d in enumerate(rest)}, partials=LINEAR_PARTIALS)


def as_strided_decomposition(op):
    """as_strided reads its input's storage. A view's storage is its base's; a view of a tensor
    that is not replicated would be gathered into a copy holding only the view's elements, so
    the offsets would point at other data than in torch: refuse it rather than return wrong
    values (the replicated fallback handles every other case exactly)."""

    def run(x, *args, **kwargs):
        if getattr(x, "_view_state", 0) and not x._spec.is_replicated():
            raise OpError(
                f"{op} of a view of a sharded tensor ({tuple(x.shape)} {list(x.placements)}) would read a "
                "gathered copy's storage, not the base's as torch does; call .contiguous() (or clone()) on "
                "the view first, or redistribute its base to Replicate"
            )
        return dispatch_direct(op, (x, *args), kwargs)

    return run


def squeeze_rule(call):
    x = call.inputs[0]
    nd = x.ndim
    if len(call.args) > 1:
        dims = call.args[1] if isinstance(call.args[1], (list, tuple)) else [call.args[1]]
        dims = {_norm(d, nd) for d in dims if x.shape[_norm(d, nd)] == 1}
    else:
        dims = {d for d in range(nd) if x.shape[d] == 1}
    mapping, o = {}, 0
    for d in range(nd):
        if d in dims:
            continue
        mapping[d] = o
        o += 1
    return dim_map_strategies(call, mapping, partials=ALL_PARTIALS)


def unsqueeze_rule(call):
    x = call.inputs[0]
    at = _norm(call.args[1], x.ndim + 1)
    return dim_map_strategies(call, {d: d if d < at else d + 1 for d in range(x.ndim)}, partials=ALL_PARTIALS)


def keep_dims_except(dim_arg_index, drop=False):
    """Ops that work along one dim (select, slice, split, unbind, narrow...): that dim must be
    whole; the others keep their shards (shifted down if ``drop`` removes the dim)."""

    def strategies(call):
        x = call.inputs[0]
        nd = x.ndim
        dim = call.args[dim_arg_index] if len(call.args) > dim_arg_index else call.kwargs.get("dim", 0)
        dim = _norm(dim, nd)
        mapping = {}
        for d in range(nd):
            if d == dim:
                continue
            mapping[d] = d - 1 if drop and d > dim else d
        return dim_map_strategies(call, mapping, partials=ALL_PARTIALS)

    return strategies


def rebuild_backward(dim_arg_index, drop):
    """slice_backward / select_backward(grad, input_sizes, dim, ...): the inverse mapping."""

    def strategies(call):
        out = call.outputs[0]
        nd = out.ndim
        dim = _norm(call.args[dim_arg_index], nd)
        mapping = {}
        for d in range(nd):
            if d == dim:
                continue
            gd = d - 1 if drop and d > dim else d
            mapping[gd] = d
        return dim_map_strategies(call, mapping, partials=LINEAR_PARTIALS)

    return Rule(strategies, local_out_shape_arg(1))


def inplace_view_decomposition(inplace, out_of_place):
    """``squeeze_`` and friends change the shape of their input: run the out-of-place view
    (planned with its rule), then make the input's handle show the result, as
    ``torch.utils._python_dispatch.return_and_correct_aliasing`` does for wrapper subclasses:
    the wrapper's sizes and strides are updated by running the op on it without dispatch."""

    def run(x, *args, **kwargs):
        out = out_of_place(x, *args, **kwargs)
        with torch.utils._mode_utils.no_dispatch():
            meta_in_tls = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                inplace(x, *args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
        x._spec, x._view, x._handle = out._spec, out._view, out._handle
        return x

    return run


def squeeze_decomposition(x, dim=None):
    """Squeeze exactly the dims of global size 1: on an uneven shard a local dim can have size 1
    where the global one does not, and a plain ``squeeze()`` would drop it there."""
    nd = x.ndim
    if dim is None:
        dims = range(nd)
    elif isinstance(dim, int):
        dims = [dim]
    else:
        dims = dim
    dims = sorted({_norm(d, nd) for d in dims if x.shape[_norm(d, nd)] == 1}) if nd else []
    if not dims:
        return dispatch_direct(aten.alias.default, (x,), {})
    return dispatch_direct(aten.squeeze.dims, (x, dims), {})


INPLACE_VIEWS = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}


def register(registry) -> None:
    for inplace, out_of_place in INPLACE_VIEWS.items():
        registry.add_decomposition(inplace, inplace_view_decomposition(inplace, out_of_place), replace=True)
    for op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        registry.add(op, Rule(view_rule, view_localize), replace=True)
    registry.add(aten.expand.default, Rule(expand_rule, local_out_shape_arg(1)), replace=True)
    registry.add(aten.permute.default, permute_rule, replace=True)
    registry.add(aten.diagonal.default, diagonal_rule, replace=True)
    for op in (aten.as_strided.default, aten.as_strided_.default):
        registry.add_decomposition(op, as_strided_decomposition(op), replace=True)
    registry.add(aten.diagonal_backward.default, Rule(diagonal_backward_rule, local_out_shape_arg(1)), replace=True)
    for op in (aten.transpose.int, aten.t.default):
        registry.add(op, transpose_rule, replace=True)
    add_all(registry, aten.squeeze, squeeze_rule)
    for name in ("default", "dim", "dims"):
        registry.add_decomposition(getattr(aten.squeeze, name), squeeze_decomposition, replace=True)
    registry.add(aten.unsqueeze.default, unsqueeze_rule, replace=True)
    registry.add(aten.select.int, keep_dims_except(1, drop=True), replace=True)
    registry.add(aten.slice.Tensor, keep_dims_except(1), replace=True)
    registry.add(aten.narrow.default, keep_dims_except(1), replace=True)
    registry.add(aten.split.Tensor, keep_dims_except(2), replace=True)
    registry.add(aten.split_with_sizes.default, keep_dims_except(2), replace=True)
    registry.add(aten.unbind.int, keep_dims_except(1, drop=True), replace=True)
    registry.add(aten.slice_backward.default, rebuild_backward(2, drop=False), replace=True)
    registry.add(aten.select_backward.default, rebuild_backward(2, drop=True), replace=True)
    for packet in (aten.flip,):
        add_all(registry, packet, _flip_like)
    registry.add(aten.view.dtype, view_dtype_rule, replace=True)
    registry.add(aten.repeat.default, Rule(repeat_rule), replace=True)
    registry.add(aten.roll.default, roll_rule, replace=True)
    registry.add_decomposition(aten.roll.default, roll_decomposition, replace=True)
    registry.add(aten.constant_pad_nd.default, Rule(constant_pad_rule, constant_pad_localize), replace=True)
    for packet in (aten.tril, aten.triu, aten.tril_, aten.triu_):
        add_all(registry, packet, Rule(triangle_rule, triangle_localize))


def view_dtype_rule(call):
    """``view(dtype)`` reinterprets bits: sums of partial values do not survive, and the last
    dim changes size when the element size does."""
    x, out = call.inputs[0], call.outputs[0]
    same = x.dtype.itemsize == out.dtype.itemsize
    keep = range(x.ndim) if same else range(x.ndim - 1)
    return dim_map_strategies(call, {d: d for d in keep}, partials=())


def repeat_rule(call):
    x = call.inputs[0]
    repeats = list(call.args[1])
    off = len(repeats) - x.ndim
    return dim_map_strategies(call, {d: d + off for d in range(x.ndim) if repeats[d + off] == 1},
                              partials=ALL_PARTIALS)


def roll_decomposition(x, shifts, dims=()):
    """``roll`` by whole shards of a dim sharded evenly over one mesh dim is one ``shift``
    collective (each rank receives one peer's shard, nothing is gathered); several dims roll one
    after another; other rolls go to :func:`roll_rule`, which keeps the rolled dims whole."""
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(dims) > 1 and len(dims) == len(shifts):
        for s, d in zip(shifts, dims):
            x = aten.roll.default(x, [s], [d])
        return x
    if len(dims) == 1 and len(shifts) == 1:
        offset = _shard_offset(x._spec, shifts[0], _norm(dims[0], x.ndim))
        if offset is not None:
            spec = x._spec
            spec = attrs.evolve(spec, stride=contiguous_stride(spec.shape))
            return issue_shift(x, offset[0], offset[1], spec, op_name=str(aten.roll.default))
    return dispatch_direct(aten.roll.default, (x, shifts, dims), {})


def _shard_offset(spec, shift: int, dim: int):
    """``(mesh dim, offset)`` of the shift that rolls ``dim`` by ``shift``, where one mesh dim
    shards it evenly and ``shift`` is a multiple of the shard length; else None."""
    sharding = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == dim]
    if len(sharding) != 1:
        return None
    m = sharding[0]
    parts, length = spec.mesh.shape[m], spec.shape[dim]
    if length % parts or shift % (length // parts or 1):
        return None
    # the roll puts chunk i - q at chunk i: member i receives from member i - q
    q = shift // (length // parts) if length else 0
    return m, (-q) % parts


def roll_rule(call):
    x = call.inputs[0]
    dims = call.args[2] if len(call.args) > 2 else call.kwargs.get("dims", [])
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:  # rolls the flattened tensor: every dim moves
        return dim_map_strategies(call, {}, partials=ALL_PARTIALS)
    rolled = {_norm(d, x.ndim) for d in dims}
    return dim_map_strategies(call, {d: d for d in range(x.ndim) if d not in rolled}, partials=ALL_PARTIALS)


def constant_pad_rule(call):
    """constant_pad_nd (F.pad; SDPA pads bool masks on CUDA): a dim padded or cropped at its end
    only may stay sharded (each rank pads or crops its own shard, see
    :func:`constant_pad_localize`); other changed dims stay whole, the rest may be sharded.
    Every rank pads with ``value``, so Partial avg/max/min stay valid, and Partial sum too when
    the value is zero."""
    x = call.inputs[0]
    pad = list(call.args[1])
    value = call.args[2] if len(call.args) > 2 else call.kwargs.get("value", 0)
    changed = {x.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    partials = ALL_PARTIALS if value == 0 else tuple(p for p in ALL_PARTIALS if p.reduce_op != "sum")
    kept = {d: d for d in range(x.ndim) if d not in changed or _end_only(pad, x.ndim, d)}
    return dim_map_strategies(call, kept, partials=partials)


def _end_only(pad, ndim: int, d: int) -> bool:
    i = 2 * (ndim - 1 - d)
    return i + 1 < len(pad) and pad[i] == 0


def constant_pad_localize(local):
    """Each rank pads (or crops) the end of its shard of an end-padded dim to its output region,
    where that is exact: the longer tensor's region, cut where the shorter one ends, must be the
    shorter one's region (torch.chunk's layout of a padded length usually is); otherwise
    ``NotLocal``, and the dim is gathered instead."""
    args = list(local.args)
    pad = list(args[1])
    x_spec, out_spec = local.in_specs[0], local.out_specs[0]
    ndim = len(x_spec.shape)
    for d in range(ndim):
        if not _end_only(pad, ndim, d) or pad[2 * (ndim - 1 - d) + 1] == 0:
            continue
        (i_off, i_len), (o_off, o_len) = local.in_regions[0][d], local.out_regions[0][d]
        shorter, longer = ((i_off, i_len), (o_off, o_len)) if o_len >= i_len else ((o_off, o_len), (i_off, i_len))
        end = min(x_spec.shape[d], out_spec.shape[d])
        cut = (longer[0], max(0, min(longer[0] + longer[1], end) - longer[0]))
        if cut != shorter and (cut[1] or shorter[1]):
            raise NotLocal
        pad[2 * (ndim - 1 - d) + 1] = o_len - i_len
    args[1] = pad
    return tuple(args), local.kwargs


def triangle_rule(call):
    """tril/triu: every dim may be sharded; ``triangle_localize`` shifts the diagonal by the
    shard's row and column offsets. Zeroing is linear and keeps maxima: Partials pass."""
    x = call.inputs[0]
    return dim_map_strategies(call, {d: d for d in range(x.ndim)}, partials=ALL_PARTIALS)


def triangle_localize(local):
    args = list(local.args)
    diagonal = args[1] if len(args) > 1 else local.kwargs.get("diagonal", 0)
    region = local.in_regions[0]
    shifted = diagonal + region[-2][0] - region[-1][0]
    kwargs = dict(local.kwargs)
    if len(args) > 1:
        args[1] = shifted
    else:
        kwargs["diagonal"] = shifted
    return tuple(args), kwargs


def _flip_like(call):
    x = call.inputs[0]
    dims = call.args[1] if len(call.args) > 1 else ()
    dims = {_norm(d, x.ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    return dim_map_strategies(call, {d: d for d in range(x.ndim) if d not in dims}, partials=ALL_PARTIALS)
