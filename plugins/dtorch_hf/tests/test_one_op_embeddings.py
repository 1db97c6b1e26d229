"""Flux's rotary tables and the timestep embedding as one op each (dtorch_hf/pos_embed.py,
dtorch_hf/timesteps.py) against diffusers' FluxPosEmbed and Timesteps: the values on replicated
and split inputs (uneven), one op each, plain ids and timesteps of a pipeline distributed once so
that no later op sends the tables again, and diffusers' own forward for plain models."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import Timesteps
from diffusers.models.transformers.transformer_flux import FluxPosEmbed
from dtorch_hf.pos_embed import distributed_pos_embed, flux_pos_embed_op
from dtorch_hf.timesteps import distributed_timesteps, one_op_timesteps

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


@pytest.mark.parametrize("placements", [[R], [dt.Shard(0)]], ids=["replicated", "batch shards"])
@pytest.mark.parametrize("module", [Timesteps(256, True, 1), Timesteps(256, True, 0), Timesteps(64, False, 1, scale=2)],
                         ids=["sd3", "flux", "scaled"])
def test_timestep_embedding_matches_diffusers(session, placements, module):
    mesh = dt.init_device_mesh("cpu", (4,))  # 3 timesteps -> 1/1/1/0
    timesteps = torch.tensor([999.0, 500.5, 1.0])
    want = module(timesteps)
    forward = distributed_timesteps(module, lambda: dt.distribute_tensor(torch.zeros(2), mesh, [R]))
    got = forward(dt.distribute_tensor(timesteps, mesh, placements))
    assert got.placements == tuple(placements)
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)
    with current_session().recording() as rec:
        got = forward(timesteps)  # plain timesteps: distributed, then one op
    names = [current_session().plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]
    assert names == ["dtorch_hf.timestep_embedding.default"]
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)


def test_a_model_gets_one_op_for_every_timesteps_module(session):
    embed = torch.nn.Module()
    embed.time_proj, embed.guidance_proj = Timesteps(256, True, 0), Timesteps(256, True, 0)
    one_op_timesteps(embed, lambda: torch.zeros(2))
    for m in (embed.time_proj, embed.guidance_proj):
        assert "forward" in vars(m)  # the instance's own forward (diffusers' for plain models)
        assert torch.equal(m(torch.tensor([3.0])), Timesteps(256, True, 0)(torch.tensor([3.0])))
