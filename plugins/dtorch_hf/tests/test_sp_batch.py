"""Sequence parallel at batch > 1 with no batch split ("sp" alone, or "tp" x "sp"): Flux and SD3,
Ulysses and ring, batches of 2 and 3, on sp=4, sp=3 (uneven: Flux's 13 image tokens are 5/5/3)
and tp=2 x sp=2, both runners. Against the unparallelized diffusers model: the forward output,
and one AdamW step (loss and every update). Strict gathers (``dt.set_strict(False,
gathers=True)``) refuse any gather whose shards are lost (where a (batch, seq) flatten would
have gathered the sequence), forward and backward; attention communicates only Ulysses'
all-to-alls or the ring's shifts. Then a masked ring at batch 2: each rank receives only its
query block's rows of the mask."""

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
from dtorch_core.controller.session import Session  # noqa: E402
from dtorch_hf.ring import ring_attention  # noqa: E402
from dtorch_hf.ring_mask import RingMask  # noqa: E402
from hf_testing import rel_err  # noqa: E402
from test_ring import TP_KINDS, _attention_comms  # noqa: E402
from test_training import _target, assert_step_matches  # noqa: E402

MESHES = {"sp4": ((4,), ("sp",)), "sp3": ((3,), ("sp",)), "tp2xsp2": ((2, 2), ("tp", "sp"))}


def _flux_inputs(batch):
    # 13 image tokens (1 x 13 latent patches: 5/5/3 on sp 3, 4/4/4/1 on sp 4) + 5 text tokens
    x = test_flux._inputs(1, 13, 5, 1)
    g = torch.Generator().manual_seed(batch)
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        x[name] = torch.randn((batch,) + tuple(x[name].shape[1:]), generator=g)
    x["timestep"] = torch.rand(batch, generator=g)
    return x


def _sd3_inputs(batch):
    # 15 image tokens (3 x 5 patches) + 7 text tokens (3/3/1 on sp 3)
    x = test_sd3._inputs(6, 10, 7, batch)
    x["timestep"] = torch.rand(batch, generator=torch.Generator().manual_seed(batch))
    return x


MODELS = {"flux": (FluxTransformer2DModel, test_flux.CONFIG, _flux_inputs),
          "sd3": (SD3Transformer2DModel, test_sd3.CONFIG, _sd3_inputs)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()
    paths = {}
    for name, (cls, config, _) in MODELS.items():
        torch.manual_seed(0)
        paths[name] = tmp_path_factory.mktemp(f"spbatch-{name}")
        cls(**config).save_pretrained(paths[name])
    return paths


@pytest.fixture
def strict_gathers(session):
    dt.set_strict(False, gathers=True)
    yield
    dt.set_strict(False)


def _mesh(name):
    shape, names = MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_batch_stays_on_sequence_shards(session, strict_gathers, saved, model_name, mesh_name, sp_mode, batch):
    _check_batch_on_shards(saved, model_name, _mesh(mesh_name), sp_mode, batch)


@pytest.mark.parametrize("batch", [2, 3, 4])
@pytest.mark.parametrize("sp_mode", ["ulysses", "ring"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_rows_split_before_sp_stay_on_their_shards(session, strict_gathers, saved, model_name, sp_mode, batch):
    """cfg=2 x sp=2 (the batch split on the mesh dim before "sp"): one row per cfg rank at batch
    2, two at batch 4, where the ring's merged (batch, block) dim is one contiguous run per rank
    only in its (outer, block, inner) layout (dtorch_hf/ring.py); 2 + 1 at batch 3, which the ring
    pads to 4 where the rows lie."""
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cfg", "sp"))
    _check_batch_on_shards(saved, model_name, mesh, sp_mode, batch)


def _check_batch_on_shards(saved, model_name, mesh, sp_mode, batch):
    cls, _, make_inputs = MODELS[model_name]
    mesh_name = "x".join(mesh.mesh_dim_names)
    ref = cls.from_pretrained(saved[model_name]).train()
    model = cls.from_pretrained(saved[model_name]).train()
    dtorch_hf.parallelize(model, mesh, sp_mode=sp_mode)
    x = make_inputs(batch)
    with torch.no_grad(), dt.debug.comm_mode() as comm:
        got = model(**x).sample
        want = ref(**x).sample
    assert rel_err(got, want) <= 1e-4
    kinds = _attention_comms(comm)
    # on tp x sp too, Ulysses' Shard(seq) -> Shard(heads) on "sp" is one all-to-all inside the
    # sp group over the tp rank's heads (nested under "tp"'s unchanged Shard(heads)): no gather
    attention = {"ulysses": "all_to_all", "ring": "shift"}[sp_mode]
    assert kinds.get(attention), kinds          # attention ran on sequence shards
    assert set(kinds) <= {attention} | TP_KINDS, kinds
    # one training step, forward and backward under the same strict gathers
    target = _target(want.shape)
    with dt.debug.comm_mode() as step:
        assert_step_matches(ref, model, lambda m: F.mse_loss(m(**x).sample, target))
    assert not dt.gather_counts(), dt.gather_counts()
    if "tp" in mesh_name:
        # forward and backward: nothing gathers along "sp" while "tp" shards the tensor (the
        # backward names no module, so this is told by placements, not by attention modules)
        tp, sp = mesh.mesh_dim_names.index("tp"), mesh.mesh_dim_names.index("sp")
        nested = [e for e, _ in step.events if e.mesh_dim == sp and isinstance(e.src[tp], dt.Shard)]
        assert nested and {e.kind for e in nested} <= {attention} | TP_KINDS, [(e.kind, e.src) for e in nested]
    assert not set(dt.fallback_counts()) - {"aten.convolution.default", "aten.convolution_backward.default"}, \
        dt.fallback_counts()


def _put_bytes(monkeypatch) -> list:
    """(dtype, {rank: numel}) of every tensor the controller sends to the workers."""
    sent = []
    real_put = Session.put

    def spy(self, shards, mesh):
        first = next(iter(shards.values()))
        sent.append((first.dtype, {rank: t.numel() for rank, t in shards.items()}))
        return real_put(self, shards, mesh)

    monkeypatch.setattr(Session, "put", spy)
    return sent


@pytest.mark.parametrize("mesh_name", ["sp4", "sp3", "tp2xsp2"])
def test_mask_rows_held_per_query_shard(session, strict_gathers, monkeypatch, mesh_name):
    """A per-head (batch, heads, queries, keys) boolean mask at batch 2: each rank receives its
    query block's rows of each stream (with every key) and nothing else of the mask, laid out
    without a collective; each step's bias a rank holds covers only those rows; the output and
    gradients equal SDPA's with the same mask."""
    mesh = _mesh(mesh_name)
    names = mesh.mesh_dim_names
    sp = mesh.size(names.index("sp"))
    lengths, batch, heads = (7, 6), 2, 3
    total = sum(lengths)
    g = torch.Generator().manual_seed(8)
    mask = torch.rand(batch, heads, total, total, generator=g) > 0.4
    qkv = [[torch.randn(batch, s, heads, 8, generator=g, requires_grad=True) for s in lengths] for _ in range(3)]
    where = [dt.Shard({"sp": 1, "tp": 2}[n]) for n in names]
    dists = [[dt.distribute_tensor(t.detach(), mesh, where).requires_grad_() for t in ts] for ts in qkv]
    sent = _put_bytes(monkeypatch)
    wrapped = RingMask(mask)
    with dt.debug.comm_mode() as comm:
        outs = ring_attention(*dists, mesh_dim=names.index("sp"), attn_mask=wrapped)
    assert comm.counts() == {"shift": sp - 1}, comm.counts()
    # the mask's bytes: one put per stream, each rank its rows (and its heads on tp)
    mask_puts = [counts for dtype, counts in sent if dtype == torch.bool]
    assert len(mask_puts) == len(lengths)
    for counts, length in zip(mask_puts, lengths):
        for rank, numel in counts.items():
            coord = dict(zip(names, mesh.get_coordinate(rank)))
            rows = len(torch.arange(length).chunk(sp)[coord["sp"]]) if coord["sp"] < len(torch.arange(length).chunk(sp)) else 0
            held_heads = len(torch.arange(heads).chunk(2)[coord["tp"]]) if "tp" in coord else heads
            assert numel == batch * held_heads * rows * total, (rank, numel)
        assert sum(counts.values()) == batch * heads * length * total  # each row sent once
    # the per-step biases: on each rank its block's rows (padded) against every key block
    (steps, _live), = wrapped._laid_out.values()
    block_rows = sum(-(-s // sp) for s in lengths)
    for rank in range(mesh.size()):
        coord = dict(zip(names, mesh.get_coordinate(rank)))
        held_heads = len(torch.arange(heads).chunk(2)[coord["tp"]]) if "tp" in coord else heads
        held = sum(step.to_local(rank).numel() for step in steps)
        assert held == batch * held_heads * block_rows * sp * block_rows, (rank, held)
    joint = [torch.cat(ts, dim=1).transpose(1, 2) for ts in qkv]
    want = F.scaled_dot_product_attention(*joint, attn_mask=mask).transpose(1, 2).split(list(lengths), dim=1)
    for o, w in zip(outs, want):
        assert rel_err(o, w) <= 1e-5
    sum(o.sum() for o in outs).backward()
    sum(w.sum() for w in want).backward()
    for d, t in zip([t for ts in dists for t in ts], [t for ts in qkv for t in ts]):
        assert rel_err(d.grad, t.grad) <= 1e-5
    assert not dt.gather_counts(), dt.gather_counts()
