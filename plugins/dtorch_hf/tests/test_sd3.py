"""SD3 (diffusers' SD3Transformer2DModel, unmodified) on a mesh against the same model on the
controller: tp=4, sp=4 (Ulysses) and tp=2 x sp=2, uneven sequence lengths, both runners."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt
import dtorch_hf

diffusers = pytest.importorskip("diffusers")
from diffusers import SD3Transformer2DModel  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402

from dtorch_hf.families import sd3 as sd3_family  # noqa: E402
from hf_testing import (  # noqa: E402
    TRANSFORMER_MESHES, make_transformer_mesh, record_moves, rel_err)

# 2 joint blocks (the last context_pre_only), 4 heads of 8 (caption_projection_dim = heads x
# head_dim, the joint attention's width), RMSNorm q/k norms, block 0 with SD3.5's second attention
CONFIG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
              num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32,
              pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8, qk_norm="rms_norm",
              dual_attention_layers=(0,))
# (latent H, W, text tokens): 4x4 = 16 image + 5 text tokens (text 2/1/1/1 on sp 4, the joint
# 21 uneven), batch 1, and 3x5 = 15 image + 7 text (both streams uneven), batch 2
CASES = {"16img+5txt": (8, 8, 5, 1), "15img+7txt-b2": (6, 10, 7, 2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()       # "accelerate not found" on every load
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sd3")
    SD3Transformer2DModel(**CONFIG).save_pretrained(path)
    return path


def _inputs(h, w, txt, batch=1):
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=g),
                encoder_hidden_states=torch.randn(batch, txt, 16, generator=g),
                pooled_projections=torch.randn(batch, 16, generator=g),
                timestep=torch.tensor([0.3, 0.7])[:batch])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mesh_name", sorted(TRANSFORMER_MESHES))
def test_forward_matches(session, saved, monkeypatch, mesh_name, case):
    ref = SD3Transformer2DModel.from_pretrained(saved).eval()
    model = SD3Transformer2DModel.from_pretrained(saved).eval()
    assert model.transformer_blocks[-1].context_pre_only and model.transformer_blocks[-1].ff_context is None
    assert dtorch_hf.parallelize(model, make_transformer_mesh(mesh_name)) is model
    for block in model.transformer_blocks:
        q = block.attn.to_q.weight
        assert isinstance(q, dt.DTensor)
        assert (dt.Shard(0) in q.placements) == ("tp" in mesh_name)
    moves = record_moves(monkeypatch, sd3_family)
    h, w, txt, batch = CASES[case]
    x = _inputs(h, w, txt, batch)
    with torch.no_grad():
        got = model(**x)
        want = ref(**x)
    assert type(got) is type(want)
    assert isinstance(got.sample, dt.DTensor)
    assert tuple(got.sample.shape) == tuple(want.sample.shape) == (batch, 4, h, w)
    assert rel_err(got.sample, want.sample) <= 1e-4
    if "sp" in mesh_name:
        # Ulysses ran: sequence shards -> head shards (q, k, v of both streams) and back, at
        # batch 2 too (its Linears keep the sequence shards at any batch: dtorch_core's one-op linear)
        img = (h // 2) * (w // 2)
        assert (1, 2, (batch, img, 4, 8)) in moves
        assert (1, 2, (batch, txt, 4, 8)) in moves
        assert any(m[:2] == (2, 1) for m in moves)
    else:
        assert not moves
    assert not dt.fallback_counts(), dt.fallback_counts()


def test_plan_follows_context_pre_only(saved):
    from dtorch_hf.families.sd3 import sd3_tp_plan

    plan = sd3_tp_plan(SD3Transformer2DModel.from_pretrained(saved))
    assert "transformer_blocks.0.attn.to_add_out" in plan and "transformer_blocks.0.ff_context.net.2" in plan
    assert "transformer_blocks.1.attn.to_add_out" not in plan
    assert not any(k.startswith("transformer_blocks.1.ff_context") for k in plan)
    assert "transformer_blocks.1.attn.add_q_proj" in plan and "transformer_blocks.0.attn2.to_q" in plan
