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


def reduce_all(values, op: str) -> torch.Tensor:
    acc = values[0].clone()
    for v in values[1:]:
        if op in ("sum", "avg"):
            acc.add_(v)
        elif op == "max":
            torch.maximum(acc, v, out=acc)
        elif op == "min":
            torch.minimum(acc, v, out=acc)
        else:
            raise ValueError(f"unknown reduce op {op!r}")
    if op == "avg":
        acc.div_(len(values))
    return acc


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


def combine_all(kind: str, values: list, dim: int, reduce_op: str, dim2: int, offset: int = 0) -> list:
    """Every group member's result of a communicating step, from all contributions.

    Each member gets its own tensor (members may later change theirs in place).
    """
    k = len(values)
    if kind == "shift":
        return [values[(i + offset) % k].clone() for i in range(k)]
    if kind == "all_gather":
        full = torch.cat(values, dim=dim)
        return [full] + [full.clone() for _ in range(k - 1)]
    if kind == "all_reduce":
        total = reduce_all(values, reduce_op)
        return [total] + [total.clone() for _ in range(k - 1)]
    if kind == "reduce_scatter":
        total = reduce_all(values, reduce_op)
        return [chunk_of(total, dim, k, i).clone() for i in range(k)]
    if kind == "all_to_all":
        # member j holds shard j along ``dim`` of the whole; member i gets chunk i along dim2
        return [torch.cat([chunk_of(v, dim2, k, i) for v in values], dim=dim) for i in range(k)]
    raise ValueError(kind)


def combine_one(kind: str, values: list, dim: int, reduce_op: str, dim2: int, index: int,
                offset: int = 0) -> torch.Tensor:
    """Member ``index``'s result of a communicating step (the values of :func:`combine_all`)."""
    if kind == "shift":
        return values[(index + offset) % len(values)].clone()
    if kind == "all_gather":
        return torch.cat(values, dim=dim)
    if kind == "all_reduce":
        return reduce_all(values, reduce_op)
    if kind == "reduce_scatter":
        return chunk_of(reduce_all(values, reduce_op), dim, len(values), index).clone()
    if kind == "all_to_all":
        return torch.cat([chunk_of(v, dim2, len(values), index) for v in values], dim=dim)
    raise ValueError(kind)
