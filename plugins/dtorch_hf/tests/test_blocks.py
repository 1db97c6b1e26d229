"""The adaLN-Zero blocks in inference (dtorch_hf/blocks.py, families/flux.py's single block) and
the ops they run (dtorch_hf/modulate.py's gated residual, dtorch_hf/rms_norm.py) against
diffusers: bit-equal values on replicated and split inputs (uneven), the block's gates and
second norms as one op each, diffusers' own forward with gradients, and whole models on meshes."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from dtorch_hf.blocks import one_op_blocks
from dtorch_hf.families import flux as flux_family
from dtorch_hf.families import sd3 as sd3_family
from dtorch_hf.modulate import gated_add_op, one_op_modulation
from dtorch_hf.rms_norm import one_op_rms_norms
from hf_testing import make_transformer_mesh, rel_err

import dtorch_core as dt
import dtorch_hf
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call

R = dt.Replicate()
B, S, D = 3, 7, 8  # on 4 ranks: batch 3 -> 1/1/1/0, sequence 7 -> 2/2/2/1
GATE_OPS = ("aten.unsqueeze.default", "aten.mul.Tensor", "aten.add.Tensor")


def _op_names(rec) -> list[str]:
    return [current_session().plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]


@pytest.mark.parametrize("placements", [([R], [R]), ([dt.Shard(0)], [dt.Shard(0)]), ([dt.Shard(1)], [R])],
                         ids=["replicated", "batch shards", "sequence shards"])
def test_gated_add_matches_diffusers_expression(session, placements):
    mesh = dt.init_device_mesh("cpu", (4,))
    x, gate, y = torch.randn(B, S, D), torch.randn(B, D), torch.randn(B, S, D)
    want = x + gate.unsqueeze(1) * y
    dx, dy = (dt.distribute_tensor(t, mesh, placements[0]) for t in (x, y))
    with current_session().recording() as rec:
        got = gated_add_op(dx, dt.distribute_tensor(gate, mesh, placements[1]), dy)
    assert _op_names(rec) == ["dtorch_hf.gated_add.default"]
    assert got.placements == tuple(placements[0])
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)


@pytest.mark.parametrize("norm", [RMSNorm(D, eps=1e-6), RMSNorm(D, eps=1e-5, elementwise_affine=False),
                                  RMSNorm(D, eps=1e-6, bias=True)], ids=["weight", "no affine", "bias"])
@pytest.mark.parametrize("dim", [None, 0, 1, 2], ids=["replicated", "batch", "sequence", "heads"])
def test_rms_norm_matches_diffusers(session, norm, dim):
    mesh = dt.init_device_mesh("cpu", (4,))  # (3, 7, 5, 8): heads 5 -> 2/1/1/1
    torch.manual_seed(0)
    for p in norm.parameters():
        p.data.normal_()
    x = torch.randn(B, S, 5, D)
    want = norm(x)
    model = torch.nn.Module()
    model.norm = RMSNorm(D, eps=norm.eps, elementwise_affine=norm.weight is not None, bias=norm.bias is not None)
    model.norm.load_state_dict(norm.state_dict())
    one_op_rms_norms(model)
    dt.nn.parallelize_module(model, mesh, {})
    dx = dt.distribute_tensor(x, mesh, [R if dim is None else dt.Shard(dim)])
    with torch.no_grad(), current_session().recording() as rec:
        got = model.norm(dx)
    assert _op_names(rec) == ["dtorch_hf.rms_norm.default"]
    assert got.placements == dx.placements
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)
    # with gradients: diffusers' forward, differentiable
    with current_session().recording() as rec:
        got = model.norm(dx.requires_grad_())
    assert "dtorch_hf.rms_norm.default" not in _op_names(rec) and got.placements == dx.placements
    got.sum().backward()
    assert dx.grad is not None


def _distributed(block, processor):
    """``block`` inside a model whose parameters are DTensors (replicated on 4 devices), with
    dtorch_hf's forwards installed as the families install them."""
    model = torch.nn.Module()
    model.block = block
    if processor is not None:
        model.block.attn.set_processor(processor)
    one_op_modulation(model)
    one_op_blocks(model)
    one_op_rms_norms(model)
    dt.nn.parallelize_module(model, dt.init_device_mesh("cpu", (4,)), {})
    return model.block


def _replicated(*tensors):
    mesh = dt.init_device_mesh("cpu", (4,))
    return [dt.distribute_tensor(t, mesh, [R]) for t in tensors]


def _both(make, processor, forward=None):
    """A block made by ``make`` and its copy with dtorch_hf's forwards on DTensors (``forward``:
    the family's forward for it): (diffusers' outputs, dtorch's, the op names dtorch recorded,
    the distributed block, its inputs)."""
    torch.manual_seed(0)
    plain, block = make().eval(), make().eval()
    block.load_state_dict(plain.state_dict())
    block = _distributed(block, processor)
    if forward is not None:
        block.forward = forward(block)
    inputs = torch.randn(2, 6, 32), torch.randn(2, 5, 32), torch.randn(2, 32)
    with torch.no_grad():
        want = plain(*inputs)
        with current_session().recording() as rec:
            got = block(*_replicated(*inputs))
    return want, got, _op_names(rec), block, inputs


def _assert_equal(got, want, runner) -> None:
    # bit-equal on thread workers; process workers run with their own intra-op threads, whose
    # reductions (matmul, attention) round differently by up to ~2e-7, with or without these forwards
    exact = 0 if runner == "thread" else 1e-6
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g.full_tensor(), w, rtol=exact, atol=exact)


BLOCKS = {
    "sd3": lambda: JointTransformerBlock(32, 4, 8, context_pre_only=False, qk_norm="rms_norm"),
    "sd3 last": lambda: JointTransformerBlock(32, 4, 8, context_pre_only=True),
    "sd3.5 dual attention": lambda: JointTransformerBlock(32, 4, 8, qk_norm="rms_norm", use_dual_attention=True),
    "flux": lambda: FluxTransformerBlock(32, 4, 8),
}


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_double_stream_block_matches_diffusers_with_one_op_gates(session, kind):
    flux = kind == "flux"
    processor = flux_family.DtorchFluxAttnProcessor() if flux else sd3_family.DtorchSD3AttnProcessor()
    want, got, names, block, inputs = _both(BLOCKS[kind], processor)
    streams = 1 if block.norm2_context is None and not flux else 2
    branches = streams + (1 if getattr(block, "use_dual_attention", False) else 0)
    assert names.count("dtorch_hf.gated_add.default") == streams + branches
    # both first norms (the last SD3 block's context norm is AdaLayerNormContinuous; SD3.5's
    # image norm modulates twice), each stream's second norm
    assert names.count("dtorch_hf.norm_modulate.default") == 2 + streams + branches - streams
    if not flux:  # Flux's q/k norms are torch's RMSNorm, decomposed on the CPU
        assert not [n for n in names if n in GATE_OPS], names
    assert "aten.unsqueeze.default" not in names
    _assert_equal(got, want, session)
    # training: diffusers' own forward, differentiable
    got = block(*(t.requires_grad_() for t in _replicated(*inputs)))
    assert got[1].requires_grad
    got[1].sum().backward()
    assert block.ff.net[2].weight.grad is not None


def test_single_stream_block_matches_diffusers_with_one_op_gate(session):
    want, got, names, _, _ = _both(lambda: FluxSingleTransformerBlock(32, 4, 8), flux_family.DtorchFluxAttnProcessor(),
                                   flux_family._single_block)
    assert names.count("dtorch_hf.gated_add.default") == 1 and "aten.unsqueeze.default" not in names
    _assert_equal(got, want, session)


SD3_CONFIG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                  num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32, pooled_projection_dim=16,
                  out_channels=4, pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=(0,))
FLUX_CONFIG = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))


def _sd3_inputs(batch):
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(batch, 4, 6, 10, generator=g),
                encoder_hidden_states=torch.randn(batch, 7, 16, generator=g),
                pooled_projections=torch.randn(batch, 16, generator=g), timestep=torch.tensor([0.3, 0.7])[:batch])


def _flux_inputs(batch):
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(3, 5, 3)
    img_ids[..., 1] = torch.arange(3)[:, None]
    img_ids[..., 2] = torch.arange(5)[None, :]
    return dict(hidden_states=torch.randn(batch, 15, 16, generator=g),
                encoder_hidden_states=torch.randn(batch, 7, 32, generator=g),
                pooled_projections=torch.randn(batch, 16, generator=g), timestep=torch.tensor([0.3, 0.7])[:batch],
                img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(7, 3))


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("mesh_name", ["tp4", "sp4", "cfg2xsp2"])
def test_models_on_a_mesh_run_the_one_op_blocks(session, family, mesh_name):
    """15 image + 7 text tokens (uneven on every sp size), batch 2: the whole model's output
    against diffusers', with every gate of every block one op."""
    torch.manual_seed(0)
    cls, config, inputs = ((SD3Transformer2DModel, SD3_CONFIG, _sd3_inputs) if family == "sd3"
                           else (FluxTransformer2DModel, FLUX_CONFIG, _flux_inputs))
    ref = cls(**config).eval()
    model = cls(**config).eval()
    model.load_state_dict(ref.state_dict())
    dtorch_hf.parallelize(model, make_transformer_mesh(mesh_name))
    x = inputs(2)
    with torch.no_grad():
        want = ref(**x).sample
        with current_session().recording() as rec:
            got = model(**x).sample
    names = _op_names(rec)
    # SD3: blocks 2 + 1 streams, block 0's second attention; Flux: 2 streams, and the single
    # block's gate per stream under "sp" (one joint stream otherwise)
    expected = 4 + 1 + 2 if family == "sd3" else 4 + (2 if "sp" in mesh_name else 1)
    assert names.count("dtorch_hf.gated_add.default") == expected
    assert "aten.unsqueeze.default" not in names, names
    # the timestep and text embeddings' SiLUs, and one of temb shared by every adaLN module
    assert names.count("aten.silu.default") == 3
    assert rel_err(got, want) <= 1e-4
