"""The arithmetic of each redistribution kind, given every group member's contribution.

Shared by all communicators so that every runner computes bit-identical results: reductions
always run in group order.
"""

from __future__ import annotations

import torch

from ..placement import chunk_extent


def chunk_of(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    ext = chunk_extent(t.shape[dim], parts, index)
    return t.narrow(dim, ext.offset, ext.length)


def reduce_all(values, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reduction of ``values`` in group order. ``out``: where to build it instead of a new
    tensor (a consumed source): ``values[0]``, ``values[1]`` (read only by the first step), or
    a tensor that aliases none of them."""
    if out is None:
        acc, rest = values[0].clone(), values[1:]
    elif out is values[0]:
        acc, rest = out, values[1:]
    elif len(values) == 1:
        acc, rest = out.copy_(values[0]), ()
    else:
        acc, rest = _combine_two(values[0], values[1], op, out), values[2:]
    for v in rest:
        _combine_two(acc, v, op, acc)
    if op == "avg":
        acc.div_(len(values))
    return acc


def _combine_two(a, b, op: str, out) -> torch.Tensor:
    if op in ("sum", "avg"):
        return torch.add(a, b, out=out)
    if op == "max":
        return torch.maximum(a, b, out=out)
    if op == "min":
        return torch.minimum(a, b, out=out)
    raise ValueError(f"unknown reduce op {op!r}")


def _accumulator(values, owned) -> torch.Tensor | None:
    """A member's consumed source to reduce into, where group order allows (see reduce_all)."""
    for i in range(min(2, len(owned))):
        if owned[i]:
            return values[i]
    return None


def _spread(total: torch.Tensor, values, owned) -> list:
    """Every member's own tensor holding ``total``: a member whose source is consumed gets it
    back (as ``total`` itself or a copy into it), one other member ``total``, the rest clones."""
    results = [total if v is total else None for v in values]
    given = any(r is not None for r in results)
    for i, r in enumerate(results):
        if r is not None:
            continue
        if owned and owned[i]:
            results[i] = values[i].copy_(total)
        elif not given:
            results[i], given = total, True
        else:
            results[i] = total.clone()
    return results


def local_step(kind: str, x: torch.Tensor, index: int, size: int, dim: int, reduce_op: str) -> torch.Tensor:
    """Steps that need no communication."""
    if kind == "alias":
        return x
    if kind == "local_chunk":
        return chunk_of(x, dim, size, index).clone()
    if kind == "to_partial":
        if reduce_op == "sum" and index != 0:
            return torch.zeros_like(x)
        return x
    raise ValueError(kind)


def combine_all(kind: str, values: list, dim: int, reduce_op: str, dim2: int, offset: int = 0,
                owned=()) -> list:
    """Every group member's result of a communicating step, from all contributions.

    Each member gets its own tensor (members may later change theirs in place). ``owned[i]``:
    member i's contribution dies with the step and nothing else holds its memory, so its result
    may be built in it (all-reduce).
    """
    k = len(values)
    if kind == "shift":
        return [values[(i + offset) % k].clone() for i in range(k)]
    if kind == "all_gather":
        full = torch.cat(values, dim=dim)
        return [full] + [full.clone() for _ in range(k - 1)]
    if kind == "all_reduce":
        return _spread(reduce_all(values, reduce_op, _accumulator(values, owned)), values, owned)
    if kind == "reduce_scatter":
        # each member's chunk reduced alone: the same bits as chunks of the whole reduction
        return [_reduce_chunk(values, reduce_op, dim, i) for i in range(k)]
    if kind == "all_to_all":
        # member j holds shard j along ``dim`` of the whole; member i gets chunk i along dim2
        return [torch.cat([chunk_of(v, dim2, k, i) for v in values], dim=dim) for i in range(k)]
    raise ValueError(kind)


def _reduce_chunk(values, op: str, dim: int, index: int) -> torch.Tensor:
    return reduce_all([chunk_of(v, dim, len(values), index) for v in values], op)


def combine_one(kind: str, values: list, dim: int, reduce_op: str, dim2: int, index: int,
                offset: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Member ``index``'s result of a communicating step (the values of :func:`combine_all`).
    ``out``: member ``index``'s consumed source, aliasing none of ``values`` (all-reduce builds
    its result there)."""
    if kind == "shift":
        return values[(index + offset) % len(values)].clone()
    if kind == "all_gather":
        return torch.cat(values, dim=dim)
    if kind == "all_reduce":
        return reduce_all(values, reduce_op, out)
    if kind == "reduce_scatter":
        return _reduce_chunk(values, reduce_op, dim, index)
    if kind == "all_to_all":
        return torch.cat([chunk_of(v, dim2, len(values), index) for v in values], dim=dim)
    raise ValueError(kind)
