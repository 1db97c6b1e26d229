"""dt.nn.materialize: a meta-built model gets, on the workers, the values torch gives on one CPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt

from .helpers import needs_world_size, train
from .test_parallelize import GPT, adamw, lm_loss, plan


class InitGPT(GPT):
    """The test GPT with what real ones do at init: tied embedding/head, a learned position table
    (trunc_normal_), ``_init_weights`` over every module (a second draw for each Linear), a
    scaled init of the residual projections, a computed mask buffer and a ``torch.tensor``
    buffer. ff=42 and vocab=23 shard unevenly over 2 and 4."""

    def __init__(self, seq=8):
        super().__init__(vocab=23, d=16, heads=4, ff=42, layers=2)
        self.head.weight = self.embed.weight
        self.pos = nn.Parameter(torch.zeros(1, seq, 16))
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))
        self.register_buffer("temperature", torch.tensor(1.25))
        self.apply(self._init_weights)
        nn.init.trunc_normal_(self.pos, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * len(self.blocks)))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) / self.temperature


class InitMLP(nn.Module):
    """Every kind of initialiser: kaiming/xavier/orthogonal/trunc_normal (rejection sampling),
    uniform_, normal_ of < 16 values (torch's scalar path; >= 16 take the vectorised one) from
    the global stream and from an explicit generator, a normal_ on a strided view, an in-place
    op on drawn values, an arange buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 7)
        self.fc3 = nn.Linear(7, 5)
        self.scale = nn.Parameter(torch.empty(7))
        self.register_buffer("offset", torch.arange(5).float() / 10)
        gen = torch.Generator().manual_seed(5)
        nn.init.kaiming_normal_(self.fc1.weight, nonlinearity="relu")
        nn.init.uniform_(self.fc1.bias, -0.5, 0.5)
        nn.init.xavier_uniform_(self.fc2.weight)
        nn.init.normal_(self.fc2.bias, generator=gen)
        nn.init.orthogonal_(self.fc3.weight)
        nn.init.normal_(self.fc3.bias, std=0.1)  # 5 values from the global stream
        nn.init.trunc_normal_(self.scale, mean=1.0, std=0.1, a=0.85, b=1.15)
        with torch.no_grad():
            self.fc2.weight[:, :3].normal_(0, 0.1)
            self.fc1.weight.mul_(0.5)

    def forward(self, x):
        h = F.gelu(self.fc2(F.relu(self.fc1(x)))) * self.scale
        return self.fc3(h) + self.offset


def assert_same_values(model, ref):
    """Every parameter and buffer of ``model`` (DTensors) equals ``ref``'s exactly."""
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    theirs = dict(ref.named_parameters()) | dict(ref.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert isinstance(ours[name], dt.DTensor), name
        assert torch.equal(ours[name].full_tensor(), t.detach()), name


def test_gpt_materializes_the_values_of_torch_and_trains_like_it(mesh):
    torch.manual_seed(0)
    ref = InitGPT()
    with dt.nn.meta_init():
        model = InitGPT()
    assert model.embed.weight.is_meta
    tp = mesh["tp"] if mesh.ndim == 2 else mesh
    torch.manual_seed(1)  # the seed decides, not the controller's generator now
    dt.nn.materialize(model, tp, plan(False), seed=0)
    assert model.blocks[0].fc.weight.placements == (dt.Shard(0),)
    assert model.head.weight is model.embed.weight  # still tied
    assert_same_values(model, ref)
    if mesh.ndim == 2:
        dt.nn.data_parallel(model, mesh["dp"])
    batches = [(torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7)))]
    assert train(model, batches, adamw, lm_loss, 1) == pytest.approx(train(ref, batches, adamw, lm_loss, 1), rel=1e-4)
    assert dt.fallback_counts() == {}


def test_custom_initialisers_without_a_plan(mesh):
    torch.manual_seed(7)
    ref = InitMLP()
    torch.manual_seed(7)
    with dt.nn.meta_init():
        model = InitMLP()
    torch.randn(100)  # the controller's generator moves on; the recorded state is used
    dt.nn.materialize(model, mesh)  # no seed: the state at meta_init
    assert model.fc1.weight.placements == (dt.Replicate(),) * mesh.ndim
    assert_same_values(model, ref)
    x, y = torch.randn(5, 6), torch.randn(5, 5)

    def opt(params):
        return torch.optim.SGD(params, lr=0.1)

    assert train(model, [(x, y)], opt, F.mse_loss, 1) == pytest.approx(train(ref, [(x, y)], opt, F.mse_loss, 1),
                                                                       rel=1e-5)


@needs_world_size(4)
def test_colwise_and_rowwise_shards_of_custom_initialisers(mesh1d):
    torch.manual_seed(3)
    ref = InitMLP()
    with dt.nn.meta_init():
        model = InitMLP()
    dt.nn.materialize(model, mesh1d, {"fc1": dt.nn.ColwiseParallel(), "fc2": dt.nn.RowwiseParallel()}, seed=3)
    assert model.fc1.weight.placements == (dt.Shard(0),) and model.fc2.weight.placements == (dt.Shard(1),)
    assert_same_values(model, ref)
    # 10 rows over 4 ranks: 3, 3, 3, 1
    assert [t.shape[0] for t in model.fc1.weight.local_shards().values()] == [3, 3, 3, 1]


def test_worker_holds_one_tensor_at_a_time():
    # Linear draws its weight twice (its own init, then _init_weights): the first draw is made
    # and freed at once, so the replay never holds more than the largest tensor (+ tiny ones)
    with dt.nn.meta_init() as trace:
        model = InitGPT()
    named = list(model.named_parameters()) + list(model.named_buffers())
    program = trace.compile(named)
    largest = max(t.numel() * t.element_size() for _, t in named)
    assert largest <= program.peak_bytes <= largest + 64
    assert program.peak_bytes < sum(t.numel() * t.element_size() for _, t in named) / 4


def test_plain_meta_model_replays_reset_parameters(mesh1d):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.Linear(9, 3), nn.Embedding(7, 3))
    torch.manual_seed(4)
    ref = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.Linear(9, 3), nn.Embedding(7, 3))
    torch.manual_seed(4)
    for module in ref.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    dt.nn.materialize(model, mesh1d, {"0": dt.nn.ColwiseParallel()}, seed=4)
    assert_same_values(model, ref)

    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("table", torch.arange(6.0))

    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(dt.MaterializeError, match="table"):
        dt.nn.materialize(model, mesh1d, seed=0)


def test_mistakes_raise_on_the_controller(mesh1d):
    with pytest.raises(dt.MaterializeError, match="random values for a cpu tensor"):
        with dt.nn.meta_init():
            torch.randn(3, device="cpu")
    with pytest.raises(dt.MaterializeError, match="do not nest"):
        with dt.nn.meta_init(), dt.nn.meta_init():
            pass
    assert torch.nn.init.orthogonal_.__name__ == "orthogonal_" and not hasattr(torch.nn.init.orthogonal_,
                                                                                "__wrapped__")
    with dt.nn.meta_init():
        model = InitGPT()
    for place in (dt.nn.fully_shard, dt.nn.data_parallel):  # meta tensors have no values to place
        with pytest.raises(dt.PlacementError, match="meta tensor"):
            place(model, mesh1d)
    with dt.nn.meta_init():
        model = InitGPT()
    with pytest.raises(dt.PlacementError, match="tied"):
        dt.nn.materialize(model, mesh1d, {"embed": dt.nn.ColwiseParallel()})  # head stays Replicate
