"""Flux's rotary tables as one op (dtorch_hf/pos_embed.py) against diffusers' FluxPosEmbed: the
values on replicated and token-split ids (uneven), one op for the whole table, plain ids of a
pipeline distributed once so that no attention sends the tables again, and diffusers' own
forward for plain models."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxPosEmbed
from dtorch_hf.pos_embed import distributed_pos_embed, flux_pos_embed_op

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call, Put

R = dt.Replicate()
AXES = [2, 4, 6]


def _ids(text: int, h: int, w: int) -> torch.Tensor:
    """A pipeline's ids: the text tokens at 0, then the image's (0, row, column) grid."""
    img = torch.zeros(h, w, 3)
    img[..., 1] = torch.arange(h)[:, None]
    img[..., 2] = torch.arange(w)[None, :]
    return torch.cat([torch.zeros(text, 3), img.reshape(-1, 3)])


@pytest.mark.parametrize("placements", [[R], [dt.Shard(0)]], ids=["replicated", "token shards"])
@pytest.mark.parametrize("tokens", [(3, 2, 5), (0, 1, 1)], ids=["13 tokens", "1 token"])
def test_tables_match_diffusers(session, placements, tokens):
    mesh = dt.init_device_mesh("cpu", (4,))  # 13 tokens -> 4/3/3/3; 1 token -> 1/0/0/0
    ids = _ids(*tokens)
    want = FluxPosEmbed(theta=10000, axes_dim=AXES)(ids)
    got = flux_pos_embed_op(dt.distribute_tensor(ids, mesh, placements), AXES, 10000.0)
    for g, w in zip(got, want):
        assert g.placements == tuple(placements)
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape)
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)


def test_a_distributed_models_tables_are_one_op_and_plain_ids_are_sent_once(session):
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "sp"))
    pos_embed = FluxPosEmbed(theta=10000, axes_dim=AXES)
    weight = dt.distribute_tensor(torch.zeros(2, 2), mesh, [R, R])
    forward = distributed_pos_embed(pos_embed, lambda: weight)
    ids = _ids(3, 2, 5)
    want = pos_embed(ids)
    with current_session().recording() as rec:
        got = forward(ids)  # plain ids, as a pipeline passes them
    names = [current_session().plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]
    assert names == ["dtorch_hf.flux_pos_embed.default"]
    puts = [i for i in rec.instructions if type(i) is Put]
    assert len(puts) == 1  # the ids; the tables are made on the workers
    for g, w in zip(got, want):
        assert isinstance(g, dt.DTensor) and g.placements == (R, R)
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)


def test_plain_models_keep_diffusers_forward(session):
    pos_embed = FluxPosEmbed(theta=10000, axes_dim=AXES)
    forward = distributed_pos_embed(pos_embed, lambda: torch.zeros(2, 2))
    ids = _ids(3, 2, 5)
    for g, w in zip(forward(ids), pos_embed(ids)):
        assert type(g) is torch.Tensor and torch.equal(g, w)
