"""Ring attention (``sp_mode="ring"``) for Flux and SD3 against the same models on the controller:
sp=4, tp=2 x sp=2 and cfg=2 x sp=2 (a batch of 2), uneven text and image lengths, both runners. The key/value blocks travel
by ``shift`` collectives only (no all-gather or all-to-all inside attention), and a backward of
the output's sum gives torch's input gradients. ``ring_attention`` itself is checked on
streams where a rank's whole block is padding, and replayed under dt.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt
import dtorch_hf

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402

import test_flux  # noqa: E402
import test_sd3  # noqa: E402
from dtorch_hf.ring import ring_attention  # noqa: E402
from hf_testing import make_transformer_mesh, rel_err  # noqa: E402

RING_MESHES = ("sp4", "tp2xsp2", "cfg2xsp2")  # cfg: a batch of 2, one row per cfg rank
# model, its config, per case the inputs of a batch size, attention modules per forward
MODELS = {
    "flux": (FluxTransformer2DModel, test_flux.CONFIG,
             {"16img+5txt": lambda b: test_flux._inputs(4, 4, 5, b), "15img+7txt": lambda b: test_flux._inputs(3, 5, 7, b)},
             2),
    "sd3": (SD3Transformer2DModel, test_sd3.CONFIG,
            {"16img+5txt": lambda b: test_sd3._inputs(8, 8, 5, b), "15img+7txt": lambda b: test_sd3._inputs(6, 10, 7, b)},
            3),  # two joint attentions and block 0's attn2
}
ATTENTION_KINDS = {"shift"}  # inside attention modules, besides the tp projections' reductions
TP_KINDS = {"all_reduce", "reduce_scatter"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()
    paths = {}
    for name, (cls, config, _, _) in MODELS.items():
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(name)
        cls(**config).save_pretrained(paths[name])
    return paths


def _as_leaves(inputs, mesh):
    """The float inputs with a batch dim as replicated DTensor leaves (their gradients are read
    back); the model's entry hooks lay them out on the sequence as they would plain tensors."""
    out = {}
    for k, v in inputs.items():
        if k in ("hidden_states", "encoder_hidden_states"):
            out[k] = dt.distribute_tensor(v, mesh, [dt.Replicate()] * mesh.ndim).requires_grad_()
        else:
            out[k] = v
    return out


def _attention_comms(comm) -> dict:
    """Collective kinds issued inside attention modules (their own projections excluded)."""
    kinds: dict = {}
    for module, counts in comm.counts_by_module().items():
        if module.endswith((".attn", ".attn2")):
            for kind, n in counts.items():
                kinds[kind] = kinds.get(kind, 0) + n
    return kinds


@pytest.mark.parametrize("case", ["16img+5txt", "15img+7txt"])
@pytest.mark.parametrize("mesh_name", RING_MESHES)
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_ring_forward_and_backward_match(session, saved, model_name, mesh_name, case):
    cls, _, cases, attentions = MODELS[model_name]
    mesh = make_transformer_mesh(mesh_name)
    ref = cls.from_pretrained(saved[model_name])
    model = cls.from_pretrained(saved[model_name])
    assert dtorch_hf.parallelize(model, mesh, sp_mode="ring") is model
    x = cases[case](2 if "cfg" in mesh_name else 1)
    leaves = _as_leaves(x, mesh)
    ref_inputs = {k: (v.clone().requires_grad_() if k in leaves and isinstance(leaves[k], dt.DTensor) else v)
                  for k, v in x.items()}
    with dt.debug.comm_mode() as comm:
        got = model(**leaves).sample
    want = ref(**ref_inputs).sample
    assert isinstance(got, dt.DTensor)
    assert rel_err(got, want) <= 1e-4
    kinds = _attention_comms(comm)
    sp = mesh.size(mesh.mesh_dim_names.index("sp"))
    # K and V travel together: sp - 1 shifts per attention call, and nothing gathered or moved
    # to head shards (Ulysses' all-to-all) inside attention
    assert kinds.get("shift") == attentions * (sp - 1), kinds
    assert set(kinds) <= ATTENTION_KINDS | TP_KINDS, kinds
    by_op = comm.counts_by_op()
    assert set(by_op.get("aten.roll.default", {})) == {"shift"}, by_op

    with dt.debug.comm_mode() as back:
        got.sum().backward()
    want.sum().backward()
    # the backward ring: K/V pass sp - 1 times, their gradients sp times (the module tracker
    # names no module in backward: collectives are told apart by the op that issued them). The
    # only gathers are the backward of the entry hooks' redistribution of the inputs
    back_ops = back.counts_by_op()
    assert back_ops.pop("aten.roll.default") == {"shift": attentions * (2 * sp - 1)}, back_ops
    assert all(set(kinds) <= TP_KINDS for op, kinds in back_ops.items() if op != "redistribute"), back_ops
    for name in ("hidden_states", "encoder_hidden_states"):
        assert rel_err(leaves[name].grad, ref_inputs[name].grad) <= 1e-4, name
    ref_q = dict(ref.named_parameters())["transformer_blocks.0.attn.to_q.weight"].grad
    assert rel_err(model.transformer_blocks[0].attn.to_q.weight.grad, ref_q) <= 1e-4
    assert not set(dt.fallback_counts()) - {"aten.convolution.default", "aten.convolution_backward.default"}, \
        dt.fallback_counts()


# (stream lengths): a rank whose block is all padding (3 over 4: 1/1/1/0), one stream with two
# empty blocks (5 over 4 is 2/2/1/0), and an even one (nothing padded, no mask)
STREAMS = [(3,), (5, 2), (8,)]


@pytest.mark.parametrize("lengths", STREAMS, ids=str)
def test_ring_attention_of_padded_blocks(session, lengths):
    mesh = make_transformer_mesh("sp4")
    torch.manual_seed(0)
    qkv = [[torch.randn(1, s, 2, 8, requires_grad=True) for s in lengths] for _ in range(3)]
    dists = [[dt.distribute_tensor(t.detach(), mesh, [dt.Shard(1)]).requires_grad_() for t in ts] for ts in qkv]
    with dt.debug.comm_mode() as comm:
        outs = ring_attention(*dists, mesh_dim=0)
    assert comm.counts() == {"shift": 3}, comm.counts()
    joint = [torch.cat(ts, dim=1).transpose(1, 2) for ts in qkv]
    want = F.scaled_dot_product_attention(*joint).transpose(1, 2).split(list(lengths), dim=1)
    weights = [torch.randn(w.shape) for w in want]
    for o, w in zip(outs, want):
        assert o.placements == (dt.Shard(1),)
        assert rel_err(o, w) <= 1e-5
    sum((o * dt.distribute_tensor(w, mesh, [dt.Shard(1)])).sum() for o, w in zip(outs, weights)).backward()
    sum((o * w).sum() for o, w in zip(want, weights)).backward()
    for d, t in zip([t for ts in dists for t in ts], [t for ts in qkv for t in ts]):
        assert rel_err(d.grad, t.grad) <= 1e-5


def test_ring_attention_replays_under_compile(session):
    """Captured once, the ring (its shifts and the per-step key biases) replays as one program."""
    mesh = make_transformer_mesh("sp4")

    def step(q, k, v):
        return ring_attention([q], [k], [v], mesh_dim=0)[0]

    compiled = dt.compile(step)
    for _ in range(4):
        q, k, v = (torch.randn(1, 7, 2, 8) for _ in range(3))
        got = compiled(*(dt.distribute_tensor(t, mesh, [dt.Shard(1)]) for t in (q, k, v)))
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        assert rel_err(got, want.transpose(1, 2)) <= 1e-5
    assert compiled.replays > 0
