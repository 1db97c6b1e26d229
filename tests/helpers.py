"""Helpers for comparing distributed results with plain torch."""

from __future__ import annotations

import itertools

import torch

import dtorch_core as dt


def placements_for(t: torch.Tensor, mesh, *, partial=True, limit=None):
    """Placement lists to try for ``t`` on ``mesh``: Replicate, Shard of each dim (uneven
    sizes included) and, if ``partial``, Partial(sum)."""
    one = [dt.Replicate()] + [dt.Shard(d) for d in range(t.ndim)]
    if partial:
        one.append(dt.Partial("sum"))
    out = list(itertools.product(one, repeat=mesh.ndim))
    return out if limit is None else out[:limit]


def distribute(t: torch.Tensor, mesh, placements, requires_grad=False):
    """Distribute ``t``; Partial(sum) placements get split values that add up to ``t``."""
    x = dt.distribute_tensor(t.detach(), mesh, placements)
    if requires_grad:
        x.requires_grad_(True)
    return x


def assert_close(actual, expected, *, rtol=1e-5, atol=1e-5, msg=""):
    if isinstance(actual, dt.DTensor):
        actual = actual.full_tensor()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}")
