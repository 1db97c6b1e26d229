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


def combine(kind: str, values: list, index: int, dim: int, reduce_op: str, dim2: int) -> torch.Tensor:
    """Result for group member ``index`` of a communicating step, from all contributions."""
    k = len(values)
    if kind == "all_gather":
        return torch.cat(values, dim=dim)
    if kind == "all_reduce":
        return reduce_all(values, reduce_op)
    if kind == "reduce_scatter":
        return chunk_of(reduce_all(values, reduce_op), dim, k, index).clone()
    if kind == "all_to_all":
        # member j holds shard j along ``dim`` of the whole; it sends chunk ``index`` along dim2
        return torch.cat([chunk_of(v, dim2, k, index) for v in values], dim=dim)
    raise ValueError(kind)
