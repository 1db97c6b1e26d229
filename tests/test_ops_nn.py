"""Neural-network ops against plain torch: softmax, norms, embedding, attention and losses.

Every case runs forward and backward on distributed inputs and on plain tensors, with shapes that
give uneven (and some empty) shards on 4 ranks, under strict mode so that a missing sharding rule
fails the test instead of silently running replicated.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.controller.session import current_session

from .helpers import assert_close, check, distribute, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1, S2, S3 = dt.Shard(0), dt.Shard(1), dt.Shard(2), dt.Shard(3)


@pytest.fixture(autouse=True)
def strict(runner):
    """Every op in this file has a native rule: a replicated fallback raises."""
    dt.set_strict(True)


# ---------------------------------------------------------------------------------------------
# softmax / log_softmax
# ---------------------------------------------------------------------------------------------
SOFTMAX_CASES = [  # (dim, placements): the softmax dim sharded, other dims sharded, Partial input
    (0, (S0, R)), (1, (S0, S1)), (-1, (S2, S1)), (-1, (P, S1)), (1, (R, S2)), (2, (S2, S2)),
]


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
@pytest.mark.parametrize("dim,spec", SOFTMAX_CASES, ids=str)
def test_softmax(mesh, fn, dim, spec):
    x = torch.randn(10, 7, 3)
    check(mesh, lambda t: fn(t, dim=dim), [x], [spec], grad=(0,))


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
def test_softmax_over_a_sharded_dim_keeps_the_shards(mesh1d, fn):
    t = torch.randn(5, 10)  # the softmax dim: 10 on 4 ranks, uneven
    x = distribute(t, mesh1d, [S1]).requires_grad_()
    y = fn(x, dim=1)
    assert y.placements == (S1,)  # no all-gather of the softmax dim
    g = torch.randn(5, 10)
    y.backward(distribute(g, mesh1d, [S1]))
    t.requires_grad_()
    ref = fn(t, dim=1)
    ref.backward(g)
    assert_close(y, ref.detach())
    assert_close(x.grad, t.grad)
    assert x.grad.placements == (S1,)


def test_softmax_keeps_shards_of_other_dims(mesh1d):
    x = distribute(torch.randn(10, 7), mesh1d, [S0])
    assert F.softmax(x, dim=1).placements == (S0,)
    assert F.log_softmax(x, dim=-1).placements == (S0,)


# ---------------------------------------------------------------------------------------------
# layer_norm / rms_norm
# ---------------------------------------------------------------------------------------------
LAYER_NORM_CASES = [  # (placements, number of normalized dims, affine parameters)
    ((S0, R), 1, "weight_bias"), ((S1, S0), 1, "weight"), ((S0, S1), 2, "weight_bias"),
    ((S0, S0), 1, "none"), ((R, S2), 1, "weight_bias"), ((P, S0), 2, "weight"),
]


@pytest.mark.parametrize("spec,normalized,affine", LAYER_NORM_CASES, ids=str)
def test_layer_norm(mesh, spec, normalized, affine):
    x = torch.randn(10, 7, 6)
    shape = tuple(x.shape[-normalized:])
    w, b = torch.randn(shape), torch.randn(shape)

    def fn(x, w, b):
        return F.layer_norm(x, shape, w if affine != "none" else None, b if affine == "weight_bias" else None)

    grad = {"weight_bias": (0, 1, 2), "weight": (0, 1), "none": (0,)}[affine]
    check(mesh, fn, [x, w, b], [spec, (R, R), (R, R)], grad=grad)


def test_layer_norm_is_local_for_batch_shards(mesh2d):
    x = distribute(torch.randn(10, 7, 6), mesh2d, [S0, S1])
    y = F.layer_norm(x, (6,), distribute(torch.ones(6), mesh2d, [R, R]))
    assert y.placements == (S0, S1)


@pytest.mark.parametrize("spec,with_weight", [((S0, R), True), ((S1, S0), False), ((S0, S1), True),
                                              ((P, S0), True)], ids=str)
def test_rms_norm(mesh, spec, with_weight):
    x = torch.randn(10, 7, 6)
    w = torch.randn(6)
    check(mesh, lambda x, w: F.rms_norm(x, (6,), w if with_weight else None, eps=1e-5), [x, w], [spec, (R, R)],
          grad=(0, 1) if with_weight else (0,))


FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)


@pytest.mark.skipif(FUSED_RMS_NORM is None, reason="this torch has no aten._fused_rms_norm")
@pytest.mark.parametrize("spec,normalized,with_weight", [((S0, R), 1, True), ((S1, S0), 1, False),
                                                         ((S0, S1), 2, True), ((P, S0), 1, True)], ids=str)
def test_fused_rms_norm_runs_on_the_shards(mesh, spec, normalized, with_weight):
    # F.rms_norm calls this op on CUDA tensors (so on the handles of a cuda mesh); the workers
    # run it and its backward themselves, never a decomposition into elementwise ops
    x = torch.randn(10, 7, 6)
    shape = list(x.shape[-normalized:])
    w = torch.randn(shape)

    def fn(x, w):
        return FUSED_RMS_NORM.default(x, shape, w if with_weight else None, 1e-5)

    s = current_session()
    with s.recording() as rec:
        out = check(mesh, fn, [x, w], [spec, (R, R)], grad=(0, 1) if with_weight else (0,))
    targets = {s.plan_names[i.plan_id].target for i in rec.instructions if type(i).__name__ == "Call"}
    # where torch has a kernel of the op for the mesh's device (CUDA), the op reaches dtorch whole;
    # elsewhere torch itself decomposes it before any tensor subclass sees it
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", mesh.device_type.upper()):
        # (its backward is whatever torch's autograd formula runs: tests/test_model_ops.py
        # checks that the workers run the same ops as torch for a whole Llama step)
        assert "aten::_fused_rms_norm" in targets
    placements = on_mesh(mesh, spec)
    if all(p == R or (isinstance(p, dt.Shard) and p.dim < x.ndim - normalized) for p in placements):
        assert out[0].placements == tuple(placements)  # shards of leading dims stay
    # (a Partial input is reduced first, the norm is not linear: to Replicate, or on CUDA, where the
    # op reaches dtorch whole, reduce-scattered to a shard of the leading dim)


@pytest.mark.filterwarnings("ignore:dtorch. aten.add_.Scalar has no sharding rule")
def test_rms_norm_over_sharded_normalized_dim(mesh):
    # mean over the sharded dim is a Partial sum, and rms_norm adds eps to it in place
    # (aten.add_.Scalar), which no rule allows on a Partial tensor: values only, fallback allowed
    dt.set_strict(False)
    x, w = torch.randn(10, 7, 6), torch.randn(6)
    check(mesh, lambda x, w: F.rms_norm(x, (6,), w, eps=1e-5), [x, w], [(R, S2), (R, R)], grad=(0, 1), native=False)


# ---------------------------------------------------------------------------------------------
# embedding
# ---------------------------------------------------------------------------------------------
EMBEDDING_CASES = [  # (table placements, index placements)
    ((R, R), (S0, R)), ((R, R), (S1, S0)), ((S1, R), (R, R)), ((S0, R), (R, R)), ((S0, S1), (R, S0)),
    ((S1, S0), (S0, R)), ((S0, S0), (R, R)),
]


@pytest.mark.parametrize("vocab,padding_idx", [(11, None), (3, 1)])  # 3 rows on 4 ranks: an empty shard
@pytest.mark.parametrize("table_spec,idx_spec", EMBEDDING_CASES, ids=str)
def test_embedding(mesh, vocab, padding_idx, table_spec, idx_spec):
    weight = torch.randn(vocab, 6)
    idx = torch.randint(0, vocab, (5, 7))
    idx[0, :3] = torch.tensor([0, vocab - 1, 1])
    check(mesh, lambda w, i: F.embedding(i, w, padding_idx=padding_idx), [weight, idx], [table_spec, idx_spec],
          grad=(0,))


def test_embedding_scale_grad_by_freq(mesh):
    weight = torch.randn(11, 6)
    idx = torch.tensor([[0, 3, 3, 3, 10, 0, 5], [3, 3, 1, 2, 10, 10, 10], [4, 4, 4, 4, 4, 4, 0]])
    for table_spec, idx_spec in [((R, R), (S1, S0)), ((S0, R), (R, R)), ((S1, R), (S0, R))]:
        check(mesh, lambda w, i: F.embedding(i, w, scale_grad_by_freq=True), [weight, idx], [table_spec, idx_spec],
              grad=(0,))


def test_embedding_vocab_sharded_gives_partial(mesh1d):
    weight = distribute(torch.randn(11, 6), mesh1d, [S0])
    idx = distribute(torch.randint(0, 11, (4, 5)), mesh1d, [R])
    assert F.embedding(idx, weight).placements == (P,)
    weight = distribute(torch.randn(11, 6), mesh1d, [S1])
    assert F.embedding(idx, weight).placements == (S2,)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------
def _mask(kind, b, h, lq, lk):
    gen = torch.Generator().manual_seed(3)
    if kind == "none":
        return None
    shape = {"2d": (lq, lk), "3d": (h, lq, lk), "4d": (b, h, lq, lk), "bcast": (b, 1, 1, lk)}[kind.split("-")[0]]
    if kind.endswith("bool"):
        m = torch.rand(shape, generator=gen) > 0.3
        m[..., 0] = True  # every query sees at least one key
        return m
    return torch.randn(shape, generator=gen)


SDPA_CASES = [  # (placements of q, k and v, mask or causal)
    ((S0, R), "plain"), ((S1, R), "causal"), ((S0, S1), "2d"), ((S1, R), "3d-bool"), ((R, S1), "4d"),
    ((S0, S0), "bcast-bool"), ((S1, S0), "3d-bool"), ((P, R), "causal"),
]


@pytest.mark.parametrize("spec,attn", SDPA_CASES, ids=str)
def test_sdpa(mesh, spec, attn):
    # batch == heads == query length: a rule that matches dims by size alone mis-shards the mask;
    # 3 on 4 ranks leaves one rank with an empty shard
    b, h, lq, lk, e = 3, 3, 3, 5, 8
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, h, lk, e), torch.randn(b, h, lk, e)
    m = None if attn in ("plain", "causal") else _mask(attn, b, h, lq, lk)
    tensors, specs = [q, k, v], [spec, spec, spec]
    if m is not None:
        tensors.append(m)
        specs.append(spec if attn == "4d" else (R, R))  # a full mask shards like q

    def fn(q, k, v, m=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=attn == "causal")

    if attn.endswith("bool") and S1 in spec:
        # torch sends boolean masks to the math path, whose (B*H) views gather a head shard: a
        # surprising gather that strict mode refuses (test_sdpa_bool_mask_gather_is_refused)
        dt.set_strict(True, gathers=False)
    out = check(mesh, fn, tensors, specs, grad=(0, 1, 2), atol=1e-5, rtol=1e-4)
    if P not in spec and not attn.endswith("bool"):
        # batch and head shards pass through the fused kernel (torch sends boolean masks to the
        # math path, whose (B*H) views cannot keep a head shard)
        assert out[0].placements == tuple(on_mesh(mesh, spec))


def test_sdpa_bool_mask_gather_is_refused(mesh):
    q, k, v = torch.randn(3, 3, 3, 8), torch.randn(3, 3, 5, 8), torch.randn(3, 3, 5, 8)
    m = _mask("3d-bool", 3, 3, 3, 5)
    qd, kd, vd = (distribute(t, mesh, on_mesh(mesh, (S1, R))) for t in (q, k, v))
    with pytest.raises(dt.OpError, match=r"all-gathers input 0 \(3, 3, 3, 8\)\[.*Shard\(dim=1\).*refused in strict"):
        F.scaled_dot_product_attention(qd, kd, vd, attn_mask=distribute(m, mesh, [R] * mesh.ndim))


@pytest.mark.parametrize("spec", [(S1, R), (S0, S1)], ids=str)
def test_sdpa_larger_uneven(mesh, spec):
    b, h, l, e = 5, 7, 9, 16
    q, k, v = (torch.randn(b, h, l, e) for _ in range(3))
    out = check(mesh, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v],
                [spec] * 3, grad=(0, 1, 2), atol=1e-5, rtol=1e-4)
    assert out[0].placements == tuple(on_mesh(mesh, spec))


@pytest.mark.parametrize("spec", [(S0, R), (S1, S0)], ids=str)
def test_sdpa_bf16_fused_kernels(mesh, spec):
    # bf16 takes torch's flash kernels; on CUDA their outputs include the sizes max_q and max_k as
    # Python ints, which the backward takes back; 6 heads and 3 batches shard unevenly on 4 ranks
    b, h, l, e = 3, 6, 16, 64
    q, k, v = (torch.randn(b, h, l, e).to(torch.bfloat16) for _ in range(3))
    out = check(mesh, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v],
                [spec] * 3, grad=(0, 1, 2), atol=3e-2, rtol=3e-2)
    assert out[0].placements == tuple(on_mesh(mesh, spec))


# ---------------------------------------------------------------------------------------------
# cross_entropy / nll_loss
# ---------------------------------------------------------------------------------------------
CE, NLL = "cross_entropy", "nll_loss"
LOSS_CASES = [  # (loss, reduction, class weights, ignore_index, batch, logits placements, target placements)
    (CE, "mean", False, -100, 10, (S0, R), (S0, R)),
    (CE, "mean", True, 2, 10, (S0, S0), (R, R)),
    (CE, "mean", False, 2, 3, (S0, R), (S0, R)),  # 3 rows on 4 ranks: an empty shard
    (CE, "sum", True, -100, 10, (R, S0), (S0, S0)),
    (CE, "none", False, 2, 10, (S0, R), (R, R)),
    (CE, "mean", True, -100, 10, (S1, R), (R, R)),  # class dim sharded
    (NLL, "mean", True, 2, 10, (S0, R), (S0, R)),
    (NLL, "sum", False, 2, 3, (S0, S0), (R, R)),
    (NLL, "none", True, -100, 10, (R, S0), (S0, S0)),
    (NLL, "mean", False, -100, 3, (S0, S0), (S0, S0)),
]


def _targets(n, c, ignore_index):
    t = torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(n))
    if ignore_index >= 0:
        t[: min(n - 1, 4)] = ignore_index  # whole shards are ignored, but not every row
    return t


@pytest.mark.parametrize("loss,reduction,weighted,ignore_index,batch,spec,tspec", LOSS_CASES, ids=str)
def test_classification_loss(mesh, loss, reduction, weighted, ignore_index, batch, spec, tspec):
    c = 6
    x = torch.randn(batch, c) * 3
    t = _targets(batch, c, ignore_index)
    w = torch.rand(c) + 0.5

    def fn(x, t, w):
        inp = x if loss == CE else F.log_softmax(x, dim=1)
        f = getattr(F, loss)
        return f(inp, t, weight=w if weighted else None, reduction=reduction, ignore_index=ignore_index)

    check(mesh, fn, [x, t, w], [spec, tspec, (R, R)], grad=(0,))


CE_VARIANTS = {  # name: (logits shape, target kind, cross_entropy kwargs)
    "sequence": ((10, 6, 5), "index", {"ignore_index": 2}),  # [N, C, T]: nll_loss2d
    "image": ((3, 6, 5, 2), "index", {"reduction": "sum"}),
    "image_none": ((3, 6, 5, 2), "index", {"reduction": "none", "weight": "w"}),
    "label_smoothing": ((10, 6), "index", {"label_smoothing": 0.1}),
    "probabilities": ((10, 6), "probs", {}),
}


@pytest.mark.parametrize("name", list(CE_VARIANTS))
@pytest.mark.parametrize("spec", [(S0, R), (S2, S0)], ids=str)
def test_cross_entropy_variants(mesh, name, spec):
    shape, target_kind, kwargs = CE_VARIANTS[name]
    if len(shape) == 2 and S2 in spec:
        spec = (S0, S0)
    x = torch.randn(shape)
    target_shape = (shape[0],) + shape[2:]
    if target_kind == "probs":
        t = torch.softmax(torch.randn(shape), dim=1)
        tspec = spec
    else:
        t = torch.randint(0, shape[1], target_shape, generator=torch.Generator().manual_seed(1))
        tspec = tuple(dt.Shard(p.dim - 1 if p.dim > 1 else 0) if isinstance(p, dt.Shard) else p for p in spec)
    w = torch.rand(shape[1]) + 0.5
    kwargs = dict(kwargs)

    def fn(x, t, w):
        if kwargs.get("weight") == "w":
            return F.cross_entropy(x, t, **dict(kwargs, weight=w))
        return F.cross_entropy(x, t, **kwargs)

    check(mesh, fn, [x, t, w], [spec, tspec, (R, R)], grad=(0,))


def test_mean_loss_over_uneven_shards_is_exact(mesh1d):
    # shards of 3, 3, 3, 1 rows: averaging per-shard means would be far off
    x = torch.zeros(10, 4)
    x[9, 0] = -50.0  # only the last (single-row) shard has a large loss
    t = torch.zeros(10, dtype=torch.long)
    xd, td = distribute(x, mesh1d, [S0], requires_grad=True), distribute(t, mesh1d, [S0])
    got = F.cross_entropy(xd, td).full_tensor()
    torch.testing.assert_close(got, F.cross_entropy(x, t), rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_on_class_sharded_logits(mesh, reduction, weighted):
    """Vocab-parallel loss: logits sharded on the class dim are never gathered."""
    torch.manual_seed(0)
    logits = torch.randn(6, 11)  # 11 classes: uneven shards
    target = torch.randint(0, 11, (6,))
    target[2] = -100  # ignored
    weight = torch.rand(11) + 0.5 if weighted else None
    place = [dt.Shard(1)] + [dt.Shard(0)] * (mesh.ndim - 1)
    x = distribute(logits, mesh, place).requires_grad_()
    dt.set_strict(True)
    got = F.cross_entropy(x, target, weight=weight, reduction=reduction)
    logits.requires_grad_()
    ref = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
    assert_close(got, ref.detach())
    g = torch.randn_like(ref)
    got.backward(distribute(g, mesh, [dt.Replicate()] * mesh.ndim) if ref.ndim == 0 else g)
    ref.backward(g)
    assert_close(x.grad, logits.grad)
    assert any(p == dt.Shard(1) for p in x.grad.placements)
    assert dt.fallback_counts() == {}
