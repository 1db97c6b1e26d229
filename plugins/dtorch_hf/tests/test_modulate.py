"""adaLN-Zero's modulated norm as one op (dtorch_hf/modulate.py) against diffusers'
AdaLayerNormZero and AdaLayerNormZeroSingle: bit-equal on replicated, batch-split and
sequence-split inputs (uneven), one op where six were, and diffusers' own forward with gradients."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle
from dtorch_hf.modulate import norm_modulate_op, one_op_modulation

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call

R = dt.Replicate()
B, S, D = 3, 7, 8  # on 4 ranks: batch 3 -> 1/1/1/0, sequence 7 -> 2/2/2/1

PLACEMENTS = [([R], [R]), ([dt.Shard(0)], [dt.Shard(0)]), ([dt.Shard(1)], [R])]


def _op_names(rec) -> list[str]:
    return [current_session().plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]


@pytest.mark.parametrize("placements", PLACEMENTS, ids=["replicated", "batch shards", "sequence shards"])
def test_norm_modulate_matches_diffusers_expression(session, placements):
    mesh = dt.init_device_mesh("cpu", (4,))
    x, shift, scale = torch.randn(B, S, D), torch.randn(B, D), torch.randn(B, D)
    want = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)(x) * (1 + scale[:, None]) + shift[:, None]
    dx = dt.distribute_tensor(x, mesh, placements[0])
    dshift, dscale = (dt.distribute_tensor(t, mesh, placements[1]) for t in (shift, scale))
    got = norm_modulate_op(dx, dshift, dscale, 1e-6)
    assert got.placements == tuple(placements[0])
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)


@pytest.mark.parametrize("cls, chunks", [(AdaLayerNormZero, 6), (AdaLayerNormZeroSingle, 3)])
@pytest.mark.parametrize("placement", [R, dt.Shard(1)], ids=["replicated", "sequence shards"])
def test_modules_run_one_op_in_inference_and_diffusers_with_gradients(session, cls, chunks, placement):
    mesh = dt.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    plain = cls(D)
    model = torch.nn.Module()
    model.norm1 = cls(D)
    model.norm1.load_state_dict(plain.state_dict())
    one_op_modulation(model)
    dt.nn.parallelize_module(model, mesh, {})
    x, emb = torch.randn(B, S, D), torch.randn(B, D)
    dx = dt.distribute_tensor(x, mesh, [placement])
    demb = dt.distribute_tensor(emb, mesh, [R])
    with torch.no_grad():
        want = plain(x, emb=emb)
        with current_session().recording() as rec:
            got = model.norm1(dx, emb=demb)
    assert _op_names(rec).count("dtorch_hf.norm_modulate.default") == 1
    assert "aten.native_layer_norm.default" not in _op_names(rec)
    assert len(got) == len(want) == chunks - 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)
    # with gradients (training): diffusers' own forward, differentiable as before
    with current_session().recording() as rec:
        got = model.norm1(dx, emb=demb)
    assert "dtorch_hf.norm_modulate.default" not in _op_names(rec)
    got[0].sum().backward()
    assert model.norm1.linear.weight.grad is not None
