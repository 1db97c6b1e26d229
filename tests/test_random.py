"""Random ops: dropout, dt.rand/dt.randn and in-place random fills.

A seed set with ``dt.manual_seed`` fixes the global values: they do not depend on the placement
or the runner, replicas hold identical values, and shards hold their part of the global tensor.
Dropout is checked against its definition (output == input * mask / (1 - p), the mask recovered
from the output) since torch's own random stream is not the one the workers use.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import DEVICE, assert_close, distribute, needs_world_size, on_mesh

R, P = dt.Replicate(), dt.Partial("sum")
S0, S1, S2 = dt.Shard(0), dt.Shard(1), dt.Shard(2)
SHAPE = (10, 7, 3)  # uneven on 4 ranks (3, 3, 3, 1 / 2, 2, 2, 1 / 1, 1, 1, 0)


@pytest.fixture(autouse=True)
def strict(runner):
    dt.set_strict(True)


def _input():
    return torch.rand(SHAPE, generator=torch.Generator().manual_seed(5)) + 0.5  # no zeros


def _fresh_session(runner, mesh_shape):
    """Reset the fixture's session (strict mode, seed) and return a mesh on it."""
    dt.set_strict(True)
    dt.manual_seed(0)
    return dt.init_device_mesh(DEVICE, mesh_shape)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------
DROPOUT_SPECS = [(R, R), (S0, R), (S1, S0), (R, S2), (P, S1)]


def _dropout(kind, x, p):
    if kind == "functional":
        return F.dropout(x, p, training=True)
    if kind == "module":
        return nn.Dropout(p).train()(x)
    if kind == "inplace":
        return F.dropout(x * 1.0, p, training=True, inplace=True)
    return torch.native_dropout(x, p, True)[0]


@pytest.mark.parametrize("kind", ["functional", "module", "inplace", "native"])
@pytest.mark.parametrize("p", [0.3, 0.75])
@pytest.mark.parametrize("spec", DROPOUT_SPECS, ids=str)
def test_dropout_matches_its_definition(mesh, kind, p, spec):
    x = _input()
    xd = distribute(x, mesh, on_mesh(mesh, spec), requires_grad=True)
    dt.manual_seed(11)
    y = _dropout(kind, xd, p)
    full = y.full_tensor()
    mask = full != 0
    assert_close(full, x * mask / (1 - p))
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 0.12, kept
    g = torch.randn(SHAPE)
    (full * g).sum().backward()
    assert_close(xd.grad.full_tensor(), g * mask / (1 - p))
    assert dt.fallback_counts() == {}


def test_dropout_same_mask_for_every_placement(mesh):
    x = _input()
    results = []
    for spec in DROPOUT_SPECS:
        dt.manual_seed(3)
        results.append(F.dropout(distribute(x, mesh, on_mesh(mesh, spec)), 0.4, training=True).full_tensor())
    for spec, r in zip(DROPOUT_SPECS[1:], results[1:]):
        assert torch.equal(r, results[0]), spec


@pytest.mark.parametrize("kind", ["functional", "native"])
def test_dropout_same_values_on_every_runner(runner, mesh, kind):
    x = _input()

    def run(mesh):
        dt.manual_seed(21)
        first = _dropout(kind, distribute(x, mesh, on_mesh(mesh, (S0, S1))), 0.5).full_tensor()
        second = _dropout(kind, distribute(x, mesh, on_mesh(mesh, (R, R))), 0.5).full_tensor()
        return first, second

    got = run(mesh)
    assert not torch.equal(got[0], got[1])  # successive calls draw fresh masks
    reference = run(_fresh_session("inline", mesh.shape))
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


@needs_world_size(4)
def test_dropout_replicas_are_identical(mesh):
    # 2-D: Shard(1) over the first mesh dim, replicated over the second (ranks 0/1 and 2/3 pair up)
    spec, pairs = ((S1, R), [(0, 1), (2, 3)]) if mesh.ndim == 2 else ((R, R), [(0, 1), (0, 2), (0, 3)])
    x = _input()
    dt.manual_seed(0)
    y = F.dropout(distribute(x, mesh, on_mesh(mesh, spec)), 0.5, training=True)
    shards = y.local_shards()
    for a, b in pairs:
        assert torch.equal(shards[a], shards[b])
    full = y.full_tensor()
    assert_close(full, x * (full != 0) / 0.5)


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA's fused attention kernels draw dropout_p inside the kernel, "
                    "per local (batch, head): the values depend on the shard (README, known limitations)")
def test_attention_dropout_same_for_every_placement(mesh):
    q, k, v = (torch.randn(3, 5, 7, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    # on CPU dropout takes the math path, whose (B*H) views gather a head shard (a surprising
    # gather, refused in plain strict mode; tests/test_ops_nn.py checks that)
    dt.set_strict(True, gathers=False)
    outs = []
    for spec in [(R, R), (S1, R), (S0, S1)]:
        dt.manual_seed(5)
        qd, kd, vd = (distribute(t, mesh, on_mesh(mesh, spec)) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, dropout_p=0.3).full_tensor())
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    no_dropout = F.scaled_dot_product_attention(q, k, v)
    assert not torch.allclose(outs[0], no_dropout)  # dropout did act
    assert dt.fallback_counts() == {}


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_edge_probabilities(mesh, p):
    x = _input()
    xd = distribute(x, mesh, on_mesh(mesh, (S0, S1)), requires_grad=True)
    y = F.dropout(xd, p, training=True)
    assert_close(y, F.dropout(x, p, training=True))


def test_dropout_eval_is_identity(mesh):
    x = _input()
    module = nn.Dropout(0.5).eval()
    assert_close(module(distribute(x, mesh, on_mesh(mesh, (S0, S1)))), module(x))


# ---------------------------------------------------------------------------------------------
# rand / randn factories
# ---------------------------------------------------------------------------------------------
FACTORY_SPECS = [(R, R), (S0, R), (S1, S0), (S2, S2), (P, S0), (dt.Partial("max"), S1)]


@pytest.mark.parametrize("kind", ["rand", "randn"])
def test_random_factory_values_do_not_depend_on_placement_or_runner(runner, mesh, kind):
    factory = getattr(dt, kind)

    def draw(mesh):
        out = []
        for spec in FACTORY_SPECS:
            dt.manual_seed(1234)
            t = factory(*SHAPE, device_mesh=mesh, placements=on_mesh(mesh, spec))
            assert t.shape == SHAPE and t.dtype == torch.get_default_dtype()
            assert t.placements == tuple(on_mesh(mesh, spec))
            out.append(t.full_tensor())
        return out

    got = draw(mesh)
    for spec, g in zip(FACTORY_SPECS, got):
        assert torch.equal(g, got[0]), spec
    reference = draw(_fresh_session("inline", mesh.shape))
    assert torch.equal(got[0], reference[0])
    if kind == "rand":
        assert got[0].min() >= 0 and got[0].max() < 1
    assert len(torch.unique(got[0])) == got[0].numel()  # shards are not copies of each other


@pytest.mark.parametrize("kind", ["rand", "randn"])
def test_random_factory_seeding(mesh, kind):
    factory = getattr(dt, kind)
    dt.manual_seed(7)
    a = factory(10, 7, device_mesh=mesh, placements=on_mesh(mesh, (S0, S1))).full_tensor()
    b = factory(10, 7, device_mesh=mesh, placements=on_mesh(mesh, (S0, S1))).full_tensor()
    dt.manual_seed(7)
    c = factory(10, 7, device_mesh=mesh, placements=on_mesh(mesh, (S0, S1))).full_tensor()
    dt.manual_seed(8)
    d = factory(10, 7, device_mesh=mesh, placements=on_mesh(mesh, (S0, S1))).full_tensor()
    assert torch.equal(a, c) and not torch.equal(a, b) and not torch.equal(a, d)


def test_randn_statistics(mesh1d):
    dt.manual_seed(0)
    x = dt.randn(4000, device_mesh=mesh1d, placements=[S0]).full_tensor()
    assert abs(x.mean().item()) < 0.1 and abs(x.std().item() - 1) < 0.1


def test_random_factory_dtype_and_grad(mesh):
    dt.manual_seed(0)
    x = dt.rand(5, 3, device_mesh=mesh, placements=on_mesh(mesh, (S0, R)), dtype=torch.float64, requires_grad=True)
    assert x.dtype == torch.float64 and x.requires_grad
    (x * 2).sum().backward()
    assert_close(x.grad.full_tensor(), torch.full((5, 3), 2.0, dtype=torch.float64))


def test_replicated_random_is_identical_on_every_rank(mesh):
    dt.manual_seed(4)
    x = dt.randn(*SHAPE, device_mesh=mesh, placements=on_mesh(mesh, (R, R)))
    shards = list(x.local_shards().values())
    assert all(torch.equal(s, shards[0]) for s in shards[1:])


# ---------------------------------------------------------------------------------------------
# random ops on existing tensors: bernoulli, uniform_/normal_ (nn.init), rand_like/randn_like
# ---------------------------------------------------------------------------------------------
RANDOM_OPS = {
    "bernoulli_p": lambda t: torch.bernoulli(t, 0.3),
    "bernoulli_probs": lambda t: torch.bernoulli(t.clamp(0, 1) * 0.6),
    "bernoulli_": lambda t: t.clone().bernoulli_(0.7),
    "uniform_": lambda t: nn.init.uniform_(t.clone(), -2.0, 3.0),
    "normal_": lambda t: nn.init.normal_(t.clone(), 1.0, 0.5),
    "exponential_": lambda t: t.clone().exponential_(2.0),
    "random_": lambda t: t.clone().random_(0, 1000),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
}


@pytest.mark.parametrize("name", list(RANDOM_OPS))
def test_random_ops_on_tensors(runner, mesh, name):
    op = RANDOM_OPS[name]
    x = _input() - 0.5

    def draw(mesh):
        out = []
        for spec in [(R, R), (S0, S1), (S2, R)]:
            dt.manual_seed(99)
            y = op(distribute(x, mesh, on_mesh(mesh, spec)))
            assert isinstance(y, dt.DTensor) and y.shape == x.shape
            out.append(y.full_tensor())
        return out

    got = draw(mesh)
    assert dt.fallback_counts() == {}
    for g in got[1:]:
        assert torch.equal(g, got[0])
    ref = op(x)  # plain torch: same dtype, shape and support
    assert got[0].dtype == ref.dtype
    if name.startswith("bernoulli"):
        assert set(got[0].unique().tolist()) <= {0.0, 1.0}
        if name == "bernoulli_probs":
            assert not got[0][x.clamp(0, 1) == 0].any()  # probability 0 never fires
    elif name == "uniform_":
        assert got[0].min() >= -2 and got[0].max() < 3
    elif name == "exponential_":
        assert got[0].min() > 0
    elif name == "random_":
        assert got[0].min() >= 0 and got[0].max() < 1000 and torch.equal(got[0], got[0].round())
    if name not in ("random_",) and not name.startswith("bernoulli"):
        assert len(torch.unique(got[0])) == got[0].numel()
    reference = draw(_fresh_session("inline", mesh.shape))
    assert torch.equal(got[0], reference[0])
