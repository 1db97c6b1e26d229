"""view / reshape: which shards survive a reshape, checked exactly per rank.

A reshape groups input and output dims where their products match ((2, 15) -> (30,) is one
group). A shard of a group's first non-1 input dim stays a shard of its first non-1 output dim
(the common case: the batch of a (batch, seq, features) -> (batch * seq, features) flatten). A
shard of a later dim of the group can stay one too, where every rank's region is still one
contiguous run of the flattened group: the flatten of (batch, seq) with the batch split over
one mesh dim into single rows and the sequence split over a later mesh dim (CFG x sequence
parallel), or the split back. Those strategies are offered and every combination is checked
per rank by :func:`view_localize`: the local output must hold exactly the elements of the local
input, which a shape check alone cannot tell (uneven shards can have the right sizes in the
wrong places). A combination that fails is rejected (``NotLocal``) and the next one is tried.
"""

from __future__ import annotations

from ..planner.schema import NotLocal, Strategy
from ..placement import Shard
from .common import ALL_PARTIALS, replicate_all


def view_groups(in_shape, out_shape) -> list:
    """``[(input dims, output dims)]`` of a reshape, where the products match; dims of size 1
    between groups belong to none."""
    groups = []
    i = j = 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni and j < no:
        if in_shape[i] == 1 and out_shape[j] != 1:
            i += 1
            continue
        if out_shape[j] == 1 and in_shape[i] != 1:
            j += 1
            continue
        gi, gj = i, j
        pi, pj = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= ni:
                    break
                pi *= in_shape[i]
                i += 1
            else:
                if j >= no:
                    break
                pj *= out_shape[j]
                j += 1
        if pi == pj and in_shape[gi] != 1 and out_shape[gj] != 1:
            groups.append((tuple(range(gi, i)), tuple(range(gj, j))))
    return groups


def view_rule(call):
    x, out = call.inputs[0], call.outputs[0]
    in_shape, out_shape = tuple(x.shape), tuple(out.shape)
    strategies = [replicate_all(call)]
    for ins, outs in view_groups(in_shape, out_shape):
        in_dims = [d for d in ins if in_shape[d] != 1]
        out_dims = [d for d in outs if out_shape[d] != 1]
        strategies.append(Strategy((Shard(in_dims[0]),), (Shard(out_dims[0]),)))
        # later dims: kept only where view_localize finds every rank's run contiguous
        for d in in_dims[1:]:
            strategies.append(Strategy((Shard(d),), (Shard(out_dims[0]),)))
        for d in out_dims[1:]:
            strategies.append(Strategy((Shard(in_dims[0]),), (Shard(d),)))
    for p in ALL_PARTIALS:
        strategies.append(Strategy((p,), (p,)))
    return strategies


def _run(shape, region, dims):
    """(start, length) of ``region`` over ``dims`` of ``shape`` as one row-major run, or None
    where it is not contiguous: inside the group, the dims after the first partial one (from
    the innermost) must be whole and the dims before it single indices."""
    if any(region[d][1] == 0 for d in dims):
        return (0, 0)
    start, total, stride = 0, 1, 1
    partial = False
    for d in reversed(dims):
        off, n = region[d]
        if partial and n != 1:
            return None
        partial = partial or n != shape[d]
        start += off * stride
        total *= n
        stride *= shape[d]
    return (start, total)


def _same_elements(in_shape, out_shape, in_region, out_region) -> bool:
    for ins, outs in view_groups(in_shape, out_shape):
        a = _run(in_shape, in_region, ins)
        b = _run(out_shape, out_region, outs)
        if a is None or b is None or a != b:
            return False
    return True


def view_localize(local):
    """The local view size; raises NotLocal where this rank's shard of the output does not hold
    exactly the elements of its shard of the input."""
    in_spec, out_spec = local.in_specs[0], local.out_specs[0]
    in_shape, out_shape = tuple(in_spec.shape), tuple(out_spec.shape)
    sharded = any(isinstance(p, Shard) for p in in_spec.placements + out_spec.placements)
    if sharded and not _same_elements(in_shape, out_shape, local.in_regions[0], local.out_regions[0]):
        raise NotLocal
    args = list(local.args)
    args[1] = [n for _, n in local.out_regions[0]]
    return tuple(args), local.kwargs

