"""Flux (diffusers' FluxTransformer2DModel, unmodified) on a mesh against the same model on the
controller: tp=4, sp=4 (Ulysses) and tp=2 x sp=2, uneven sequence lengths, both runners."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt
import dtorch_hf

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402

from dtorch_hf.families import flux as flux_family  # noqa: E402
from hf_testing import (  # noqa: E402
    TRANSFORMER_MESHES, make_transformer_mesh, record_moves, rel_err)

# 1 double-stream + 1 single-stream block, 4 heads of 16, RoPE axes 4+6+6 = head_dim
CONFIG = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
              num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
# (latent patches h x w, text tokens, batch): 16 image + 5 text tokens (text 2/1/1/1 on sp 4,
# the joint 21 uneven), and 15 image + 7 text (both streams uneven), batch 1 and 2
CASES = {"16img+5txt": (4, 4, 5, 1), "15img+7txt-b2": (3, 5, 7, 2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()       # "accelerate not found" on every load
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flux")
    FluxTransformer2DModel(**CONFIG).save_pretrained(path)
    return path


def _inputs(h, w, txt, batch):
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(batch, txt, 32, generator=g),
                pooled_projections=torch.randn(batch, 16, generator=g),
                timestep=torch.tensor([0.3, 0.7])[:batch], img_ids=img_ids.reshape(-1, 3),
                txt_ids=torch.zeros(txt, 3))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mesh_name", sorted(TRANSFORMER_MESHES))
def test_forward_matches(session, saved, monkeypatch, mesh_name, case):
    ref = FluxTransformer2DModel.from_pretrained(saved).eval()
    model = FluxTransformer2DModel.from_pretrained(saved).eval()
    assert dtorch_hf.parallelize(model, make_transformer_mesh(mesh_name)) is model
    q = model.transformer_blocks[0].attn.to_q.weight
    assert isinstance(q, dt.DTensor)
    assert (dt.Shard(0) in q.placements) == ("tp" in mesh_name)
    moves = record_moves(monkeypatch, flux_family)
    x = _inputs(*CASES[case])
    with torch.no_grad():
        got = model(**x)
        want = ref(**x)
    assert type(got) is type(want)
    assert isinstance(got.sample, dt.DTensor)
    assert rel_err(got.sample, want.sample) <= 1e-4
    if "sp" in mesh_name:
        # Ulysses ran: sequence shards -> head shards (q, k, v of both streams) and back, at
        # batch 2 too (its Linears keep the sequence shards at any batch: dtorch_core's one-op linear)
        assert (1, 2, tuple(x["hidden_states"].shape[:2]) + (4, 16)) in moves
        assert any(m[:2] == (2, 1) for m in moves)
    else:
        assert not moves
    assert not dt.fallback_counts(), dt.fallback_counts()


@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
@pytest.mark.parametrize("mesh_name", ["sp4", "cfg2xsp2"])
def test_single_stream_blocks_stay_on_sequence_shards(session, saved, mesh_name, sp_mode):
    """diffusers' single-stream block concatenates the text and image streams along the
    sequence and splits them at its end; dtorch_hf keeps them apart there, so on "sp" the block
    gathers nothing: Ulysses' all-to-alls (or ring attention's shifts) are its only collectives
    besides the rowwise proj_out's reduction on tp (none here)."""
    ref = FluxTransformer2DModel.from_pretrained(saved).eval()
    model = FluxTransformer2DModel.from_pretrained(saved).eval()
    dtorch_hf.parallelize(model, make_transformer_mesh(mesh_name), sp_mode=sp_mode)
    x = _inputs(*CASES["15img+7txt-b2"][:3], 2 if "cfg" in mesh_name else 1)
    with torch.no_grad(), dt.debug.comm_mode() as comm:
        got = model(**x)
    with torch.no_grad():
        assert rel_err(got.sample, ref(**x).sample) <= 1e-4
    single = {}
    for module, counts in comm.counts_by_module().items():
        if ".single_transformer_blocks." in module:
            for kind, n in counts.items():
                single[kind] = single.get(kind, 0) + n
    allowed = {"all_to_all"} if sp_mode == "ulysses" else {"shift"}
    assert single and set(single) <= allowed, single
