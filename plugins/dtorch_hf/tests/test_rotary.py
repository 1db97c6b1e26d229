"""Flux's one-op rotary embedding (dtorch_hf/rotary.py) against diffusers' apply_rotary_emb:
values and gradients on every placement its rule allows (uneven sequence and head shards,
Partial), the shards kept without moving data, and one op each way."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import FluxPosEmbed, apply_rotary_emb
from dtorch_hf.rotary import rotary, rotary_backward_kernel

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call

R, P = dt.Replicate(), dt.Partial("sum")
B, S, H, D = 2, 7, 3, 8  # on 4 ranks: seq 7 -> 2,2,2,1; heads 3 -> 1,1,1,0


def _tables(seq: int):
    ids = torch.stack([torch.zeros(seq), torch.arange(seq), torch.arange(seq) % 3], dim=-1).float()
    return FluxPosEmbed(theta=10000, axes_dim=[2, 2, 4])(ids)  # Flux's (seq, D) cos and sin


PLACEMENTS = [
    ([dt.Shard(0)], [R], [R]),
    ([dt.Shard(2)], [R], [R]),
    ([dt.Shard(1)], [dt.Shard(0)], [dt.Shard(0)]),  # a sequence shard with its rows of the tables
    ([dt.Shard(1)], [R], [R]),                      # tables replicated: sliced where they live
    ([P], [R], [R]),
    ([R], [R], [R]),
]


@pytest.mark.parametrize("placements", PLACEMENTS, ids=lambda p: str(p[0][0]))
def test_rotary_matches_diffusers(session, placements):
    mesh = dt.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = torch.randn(B, S, H, D, requires_grad=True)
    cos, sin = _tables(S)
    want = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    cot = torch.randn(want.shape)
    want.backward(cot)
    dx = dt.distribute_tensor(x.detach(), mesh, placements[0]).requires_grad_()
    dcos, dsin = (dt.distribute_tensor(t, mesh, p) for t, p in zip((cos, sin), placements[1:]))
    got = rotary(dx, (dcos, dsin))
    assert got.placements == tuple(placements[0])
    torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=1e-6, atol=1e-6)
    got.backward(dt.distribute_tensor(cot, mesh, [R] if placements[0] == [P] else placements[0]))
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad, rtol=1e-5, atol=1e-6)


def test_rotary_is_one_op_each_way_and_moves_nothing(session):
    mesh = dt.init_device_mesh("cpu", (4,))
    x = dt.distribute_tensor(torch.randn(B, S, H, D), mesh, [dt.Shard(1)]).requires_grad_()
    tables = tuple(dt.distribute_tensor(t, mesh, [dt.Shard(0)]) for t in _tables(S))
    with current_session().recording() as rec, dt.debug.comm_mode() as comm:
        out = rotary(x, tables)
        out.backward(dt.distribute_tensor(torch.ones(out.shape), mesh, [dt.Shard(1)]))
    session_ = current_session()
    names = [session_.plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]
    assert names.count("dtorch_hf.rotary.default") == 1 and names.count("dtorch_hf.rotary_backward.default") == 1
    assert comm.counts() == {}


def test_backward_is_the_adjoint_in_bf16():
    """The backward kernel against autograd through diffusers' function, bf16 (its casts)."""
    torch.manual_seed(0)
    cos, sin = _tables(S)
    x = torch.randn(B, S, H, D, dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn(B, S, H, D, dtype=torch.bfloat16)
    apply_rotary_emb(x, (cos, sin), sequence_dim=1).backward(cot)
    torch.testing.assert_close(rotary_backward_kernel(cot, cos, sin), x.grad, rtol=1e-2, atol=1e-2)


def test_plain_tensors_and_table_gradients_keep_diffusers():
    cos, sin = _tables(S)
    x = torch.randn(B, S, H, D)
    assert torch.equal(rotary(x, (cos, sin)), apply_rotary_emb(x, (cos, sin), sequence_dim=1))
