"""Ring attention with an attention mask, against ``F.scaled_dot_product_attention`` with the
same mask on the whole tensors: boolean and additive float masks of every broadcast shape
(key padding, causal, per-head, 2-D), rows masked in some blocks and rows masked everywhere,
uneven lengths (13 tokens on 3 ranks, streams whose last ranks hold only padding), on sp, tp x sp
and cfg x sp, both runners; forward and backward. Then a tiny Flux with a text padding mask and
an additive mask (diffusers' ``joint_attention_kwargs={"attention_mask": ...}``) against the
unparallelized model, and the masked ring under dt.compile with a new mask each call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt
import dtorch_hf

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402
from diffusers.utils import logging as diffusers_logging  # noqa: E402

import test_flux  # noqa: E402
from dtorch_hf import ring_mask  # noqa: E402
from dtorch_hf.ring import ring_attention  # noqa: E402
from hf_testing import rel_err  # noqa: E402
from test_ring import TP_KINDS, _as_leaves, _attention_comms  # noqa: E402

HEADS, HEAD_DIM = 3, 8  # 3 heads: 2/1 on tp 2
NEG_INF = float("-inf")
# (shape, names), and the dims of a (batch, seq, heads, head_dim) tensor each mesh dim shards
MESHES = {"sp4": ((4,), ("sp",)), "sp3": ((3,), ("sp",)), "tp2xsp2": ((2, 2), ("tp", "sp")),
          "cfg2xsp2": ((2, 2), ("cfg", "sp"))}
SHARDED_DIM = {"sp": 1, "tp": 2, "cfg": 0}
# (mesh, stream lengths): 5 text tokens on 4 ranks are 2/2/1/0 (the last block all padding), 13
# on 3 are 5/5/3, and both streams uneven on tp x sp and cfg x sp
# (mesh, stream lengths, batch); on cfg x sp a row per cfg rank, two (the ring's (outer,
# block, inner) layout keeps each rank's rows one run), and 3 rows as 2 + 1 (the ring pads the
# batch, and a mask's batch dim, to 4 where they lie)
LAYOUTS = [("sp4", (5, 8), 1), ("sp3", (13,), 1), ("tp2xsp2", (7, 6), 1), ("cfg2xsp2", (5, 6), 2),
           ("cfg2xsp2", (5, 6), 3), ("cfg2xsp2", (5, 6), 4)]
# batches > 1 on "sp" alone: tests/test_sp_batch.py


def _mesh(name):
    shape, names = MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _placements(mesh):
    return [dt.Shard(SHARDED_DIM[name]) for name in mesh.mesh_dim_names]


def _key_padding(batch, total, g):
    """(batch, 1, 1, keys) bool: each row drops some keys (the last row more)."""
    mask = torch.ones(batch, 1, 1, total, dtype=torch.bool)
    mask[0, ..., 1:3] = False
    mask[-1, ..., 0:total // 2] = False
    return mask


def _causal(batch, total, g):
    """(queries, keys) bool, lower triangular: a query block meets key blocks that are wholly
    masked for it (the later ones) and wholly open (the earlier ones)."""
    return torch.ones(total, total, dtype=torch.bool).tril()


def _per_head_dead_rows(batch, total, g):
    """(batch, heads, queries, keys) bool, random, with query rows masked at every key."""
    mask = torch.rand(batch, HEADS, total, total, generator=g) > 0.6
    mask[0, 1, 0] = False
    mask[-1, :, total - 1] = False
    mask[:, 2, total // 2] = False
    return mask


def _additive(batch, total, g):
    """(batch, 1, queries, keys) float: finite biases, -inf entries and a row of -inf."""
    bias = torch.randn(batch, 1, total, total, generator=g)
    bias = bias.masked_fill(torch.rand(bias.shape, generator=g) > 0.7, NEG_INF)
    bias[-1, 0, 2] = NEG_INF
    return bias


def _min_padding(batch, total, g):
    """(1, heads, 1, keys) float: 0 to attend and the dtype's minimum to mask (transformers'
    convention), broadcast over batch and queries."""
    bias = torch.zeros(1, HEADS, 1, total)
    bias[..., : total // 3] = torch.finfo(torch.float32).min
    bias[0, 1, 0, -2:] = torch.finfo(torch.float32).min
    return bias


MASKS = {"key_padding": _key_padding, "causal": _causal, "per_head_dead_rows": _per_head_dead_rows,
         "additive": _additive, "min_padding": _min_padding}


def _streams(batch, lengths, g):
    return [[torch.randn(batch, s, HEADS, HEAD_DIM, generator=g, requires_grad=True) for s in lengths]
            for _ in range(3)]


def _sdpa(qkv, mask):
    """The reference: SDPA of the joint sequence on the whole tensors, split back per stream."""
    joint = [torch.cat(ts, dim=1).transpose(1, 2) for ts in qkv]
    out = F.scaled_dot_product_attention(*joint, attn_mask=mask).transpose(1, 2)
    return list(out.split([t.shape[1] for t in qkv[0]], dim=1))


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("mesh_name,lengths,batch", LAYOUTS,
                         ids=[f"{m}-{'+'.join(map(str, s))}-b{b}" for m, s, b in LAYOUTS])
def test_masked_ring_matches_sdpa(session, mesh_name, lengths, batch, mask_name):
    mesh = _mesh(mesh_name)
    g = torch.Generator().manual_seed(2)
    qkv = _streams(batch, lengths, g)
    mask = MASKS[mask_name](batch, sum(lengths), g)
    where = _placements(mesh)
    dists = [[dt.distribute_tensor(t.detach(), mesh, where).requires_grad_() for t in ts] for ts in qkv]
    sp = mesh.size(mesh.mesh_dim_names.index("sp"))
    with dt.debug.comm_mode() as comm:
        outs = ring_attention(*dists, mesh_dim=mesh.mesh_dim_names.index("sp"), attn_mask=mask)
    # the mask is cut into blocks where it lies: only the K/V shifts communicate
    assert comm.counts() == {"shift": sp - 1}, comm.counts()
    want = _sdpa(qkv, mask)
    for o, w in zip(outs, want):
        assert tuple(o.placements) == tuple(where)
        full = o.full_tensor()
        assert torch.isfinite(full).all()
        assert rel_err(full, w) <= 1e-5
    weights = [torch.randn(w.shape, generator=g) for w in want]
    loss = sum((o * dt.distribute_tensor(w, mesh, where)).sum() for o, w in zip(outs, weights))
    with dt.debug.comm_mode() as back:
        loss.backward()
    assert back.counts() == {"shift": 2 * sp - 1}, back.counts()
    sum((o * w).sum() for o, w in zip(want, weights)).backward()
    for d, t in zip([t for ts in dists for t in ts], [t for ts in qkv for t in ts]):
        grad = d.grad.full_tensor()
        assert torch.isfinite(grad).all()
        assert rel_err(grad, t.grad) <= 1e-5
    assert not dt.fallback_counts(), dt.fallback_counts()


def test_dead_rows_are_zero_as_in_sdpa(session):
    """A row masked at every key (False, or -inf) gives SDPA's 0, with zero gradient; a row
    masked in every block but one gives SDPA's softmax over that block's keys."""
    mesh = _mesh("sp4")
    g = torch.Generator().manual_seed(3)
    qkv = _streams(1, (9,), g)
    open_ = torch.ones(9, 9, dtype=torch.bool)
    open_[4] = False                    # query 4: nothing to attend to
    open_[6] = False
    open_[6, 3:6] = True                # query 6: key block 1 only (9 on 4 ranks: 3/3/3/0)
    for mask in (open_, torch.zeros(9, 9).masked_fill(~open_, NEG_INF)):
        dists = [dt.distribute_tensor(ts[0].detach(), mesh, [dt.Shard(1)]).requires_grad_() for ts in qkv]
        out = ring_attention(*([d] for d in dists), mesh_dim=0, attn_mask=mask)[0]
        want = _sdpa(qkv, mask)[0]
        full = out.full_tensor()
        assert torch.equal(full[:, 4], torch.zeros_like(full[:, 4]))
        assert torch.equal(want[:, 4], torch.zeros_like(want[:, 4]))
        assert rel_err(full[:, 6], want[:, 6]) <= 1e-5
        assert rel_err(full, want) <= 1e-5
        out.sum().backward()
        assert torch.equal(dists[0].grad.full_tensor()[:, 4], torch.zeros_like(full[:, 4]))


def test_row_at_dtype_minimum_gives_the_exact_softmax(session):
    """A float row at the dtype's minimum at every key: SDPA loses the scores to fp32 rounding
    there (QK^T + min == min) and returns the plain mean of V; the ring shifts each row by its
    largest entry first, so it returns softmax(QK^T) for that row, which is SDPA of the
    shifted mask (the same softmax in exact arithmetic). Other rows equal SDPA's."""
    mesh = _mesh("sp4")
    g = torch.Generator().manual_seed(4)
    qkv = _streams(1, (10,), g)
    bias = torch.randn(10, 10, generator=g)
    bias[3] = torch.finfo(torch.float32).min
    dists = [dt.distribute_tensor(ts[0].detach(), mesh, [dt.Shard(1)]) for ts in qkv]
    got = ring_attention(*([d] for d in dists), mesh_dim=0, attn_mask=bias)[0].full_tensor()
    shifted = bias - bias.amax(-1, keepdim=True)
    assert rel_err(got, _sdpa(qkv, shifted)[0]) <= 1e-5
    plain = _sdpa(qkv, bias)[0]
    assert rel_err(torch.cat([got[:, :3], got[:, 4:]], 1), torch.cat([plain[:, :3], plain[:, 4:]], 1)) <= 1e-5
    assert torch.allclose(plain[:, 3], qkv[2][0].detach().mean(1))  # SDPA's mean of V


def test_mask_as_a_dtensor_and_bad_masks(session):
    mesh = _mesh("tp2xsp2")
    g = torch.Generator().manual_seed(5)
    qkv = _streams(1, (7, 6), g)
    mask = _per_head_dead_rows(1, 13, g)
    dists = [[dt.distribute_tensor(t.detach(), mesh, _placements(mesh)) for t in ts] for ts in qkv]
    replicated = dt.distribute_tensor(mask, mesh, [dt.Replicate(), dt.Replicate()])
    outs = ring_attention(*dists, mesh_dim=1, attn_mask=replicated)
    for o, w in zip(outs, _sdpa(qkv, mask)):
        assert rel_err(o, w) <= 1e-5
    with pytest.raises(ValueError, match="does not broadcast"):
        ring_attention(*dists, mesh_dim=1, attn_mask=torch.ones(1, 2, 13, 13, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        ring_attention(*dists, mesh_dim=1, attn_mask=torch.ones(13, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match="boolean or floating point"):
        ring_attention(*dists, mesh_dim=1, attn_mask=torch.ones(13, 13, dtype=torch.int64))


def test_masked_ring_replays_under_compile(session):
    """The mask is an input of the captured step (laid out on the workers, not frozen on the
    controller): a new mask each call replays and gives SDPA's result for that mask."""
    mesh = _mesh("sp4")

    def step(q, k, v, mask):
        return ring_attention([q], [k], [v], mesh_dim=0, attn_mask=mask)[0]

    compiled = dt.compile(step)
    g = torch.Generator().manual_seed(6)
    for _ in range(5):
        q, k, v = (torch.randn(1, 7, 2, 8, generator=g) for _ in range(3))
        mask = torch.rand(1, 2, 7, 7, generator=g) > 0.5
        got = compiled(*(dt.distribute_tensor(t, mesh, [dt.Shard(1)]) for t in (q, k, v)), mask)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        assert rel_err(got, want.transpose(1, 2)) <= 1e-5
    assert compiled.replays > 0


# ---- through a tiny Flux: diffusers passes joint_attention_kwargs["attention_mask"] to every
# attention (double- and single-stream), over the joint text + image sequence, text first

@pytest.fixture(scope="module")
def saved_flux(tmp_path_factory):
    diffusers_logging.set_verbosity_error()
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flux")
    FluxTransformer2DModel(**test_flux.CONFIG).save_pretrained(path)
    return path


def _text_padding(batch, txt, img):
    """(batch, 1, 1, text + image) bool: the text prompt's padding tokens masked as keys."""
    mask = torch.ones(batch, 1, 1, txt + img, dtype=torch.bool)
    mask[0, ..., txt - 2:txt] = False
    mask[-1, ..., txt - 3:txt] = False
    return mask


def _additive_joint(batch, txt, img):
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(1, 1, txt + img, txt + img, generator=g) * 0.5
    return bias.masked_fill(torch.rand(bias.shape, generator=g) > 0.8, NEG_INF)


FLUX_MASKS = {"text_padding": _text_padding, "additive": _additive_joint}
FLUX_CASES = {"16img+5txt": (4, 4, 5), "15img+7txt": (3, 5, 7)}


@pytest.mark.parametrize("mask_name", sorted(FLUX_MASKS))
@pytest.mark.parametrize("case", sorted(FLUX_CASES))
@pytest.mark.parametrize("mesh_name", ["sp4", "tp2xsp2", "cfg2xsp2"])
def test_flux_with_a_mask_runs_the_ring(session, saved_flux, monkeypatch, mesh_name, case, mask_name):
    mesh = _mesh(mesh_name)
    layouts = []
    real_lay_out = ring_mask.lay_out_mask
    monkeypatch.setattr(ring_mask, "lay_out_mask", lambda *a: layouts.append(1) or real_lay_out(*a))
    ref = FluxTransformer2DModel.from_pretrained(saved_flux)
    model = FluxTransformer2DModel.from_pretrained(saved_flux)
    dtorch_hf.parallelize(model, mesh, sp_mode="ring")
    h, w, txt = FLUX_CASES[case]
    batch = 2 if "cfg" in mesh_name else 1
    x = test_flux._inputs(h, w, txt, batch)
    kwargs = {"attention_mask": FLUX_MASKS[mask_name](batch, txt, h * w)}
    leaves = _as_leaves(x, mesh)
    ref_inputs = {k: (v.clone().requires_grad_() if isinstance(leaves[k], dt.DTensor) else v) for k, v in x.items()}
    with dt.debug.comm_mode() as comm:
        got = model(**leaves, joint_attention_kwargs=dict(kwargs)).sample
    want = ref(**ref_inputs, joint_attention_kwargs=dict(kwargs)).sample
    assert rel_err(got, want) <= 1e-4
    assert len(layouts) == 1  # laid out once per model call, for both blocks
    kinds = _attention_comms(comm)
    sp = mesh.size(mesh.mesh_dim_names.index("sp"))
    # one double- and one single-stream attention, each a ring of sp - 1 K/V shifts: the mask
    # sends no collective, and nothing is gathered or moved to head shards
    assert kinds.get("shift") == 2 * (sp - 1), kinds
    assert set(kinds) <= {"shift"} | TP_KINDS, kinds
    got.sum().backward()
    want.sum().backward()
    for name in ("hidden_states", "encoder_hidden_states"):
        assert rel_err(leaves[name].grad, ref_inputs[name].grad) <= 1e-4, name
    assert not set(dt.fallback_counts()) - {"aten.convolution.default", "aten.convolution_backward.default"}, \
        dt.fallback_counts()


@pytest.mark.parametrize("mesh_name", ["sp4", "cfg2xsp2"])
def test_flux_ulysses_with_a_mask_keeps_single_blocks_on_shards(session, saved_flux, mesh_name):
    """The single-stream blocks pass the mask to the attention of their two streams (kept
    apart), so with Ulysses too a masked call gathers nothing there: all-to-alls only."""
    mesh = _mesh(mesh_name)
    ref = FluxTransformer2DModel.from_pretrained(saved_flux).eval()
    model = FluxTransformer2DModel.from_pretrained(saved_flux).eval()
    dtorch_hf.parallelize(model, mesh, sp_mode="ulysses")
    h, w, txt = FLUX_CASES["15img+7txt"]
    batch = 2 if "cfg" in mesh_name else 1
    x = test_flux._inputs(h, w, txt, batch)
    kwargs = {"attention_mask": _text_padding(batch, txt, h * w)}
    with torch.no_grad(), dt.debug.comm_mode() as comm:
        got = model(**x, joint_attention_kwargs=dict(kwargs)).sample
    with torch.no_grad():
        assert rel_err(got, ref(**x, joint_attention_kwargs=dict(kwargs)).sample) <= 1e-4
    single = {}
    for module, counts in comm.counts_by_module().items():
        if ".single_transformer_blocks." in module:
            for kind, n in counts.items():
                single[kind] = single.get(kind, 0) + n
    assert single and set(single) == {"all_to_all"}, single
