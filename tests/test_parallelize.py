"""parallelize_module with parallel styles trains a small GPT like plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtorch_core as dt

from .helpers import assert_close, train


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)  # a key bias gets a zero gradient (AdamW noise)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (lin(x).view(b, s, -1, d // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, ff)
        self.out = nn.Linear(ff, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=23, d=16, heads=4, ff=40, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def plan(sequence_parallel: bool):
    col, row = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    out = dt.Shard(1) if sequence_parallel else dt.Replicate()
    p = {
        "embed": row(output_layouts=out),  # vocab-sharded table
        "blocks.*.attn.q": col(),
        "blocks.*.attn.k": col(),
        "blocks.*.attn.v": col(),
        "blocks.*.attn.proj": row(output_layouts=out),
        "blocks.*.fc": col(),
        "blocks.*.out": row(output_layouts=out),
        "head": col(output_layouts=dt.Replicate()),
    }
    if sequence_parallel:
        p.update({"blocks.*.ln1": dt.nn.SequenceParallel(), "blocks.*.ln2": dt.nn.SequenceParallel(),
                  "ln": dt.nn.SequenceParallel()})
    return p


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_with_parallel_styles_trains_like_torch(mesh, sequence_parallel):
    torch.manual_seed(0)
    ref = GPT()
    tp = mesh["tp"] if mesh.ndim == 2 else mesh
    model = dt.nn.parallelize_module(copy.deepcopy(ref), tp, plan(sequence_parallel))
    assert all(isinstance(p, dt.DTensor) for p in model.parameters())
    assert model.blocks[1].fc.weight.placements == (dt.Shard(0),)
    assert model.embed.weight.placements == (dt.Shard(0),)
    batches = [(torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7))) for _ in range(3)]
    with dt.debug.comm_mode() as comm:
        model(batches[0][0])
    # the styles move activations at module boundaries (their input/output layouts); the ops
    # inside the modules never gather a weight or an activation
    assert {op: c for op, c in comm.counts_by_op().items() if op != "redistribute"} == {}
    assert comm.counts().get("all_reduce", 0) + comm.counts().get("reduce_scatter", 0) == 1 + 2 * len(ref.blocks)
    expected = train(ref, batches, adamw, lm_loss, 3)
    got = train(model, batches, adamw, lm_loss, 3)
    assert got == pytest.approx(expected, rel=1e-4)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert dt.fallback_counts() == {}


def test_unmatched_pattern_and_wrong_module_raise(mesh1d):
    with pytest.raises(dt.PlacementError, match="matches no sub-module"):
        dt.nn.parallelize_module(GPT(), mesh1d, {"blocks.*.nope": dt.nn.ColwiseParallel()})
    with pytest.raises(dt.PlacementError, match="supports nn.Linear"):
        dt.nn.parallelize_module(GPT(), mesh1d, {"ln": dt.nn.ColwiseParallel()})


def test_buffers_and_unplanned_parameters_are_replicated(mesh1d):
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    dt.nn.parallelize_module(model, mesh1d, {"0": dt.nn.ColwiseParallel()})
    assert model[0].weight.placements == (dt.Shard(0),)
    assert model[1].weight.placements == (dt.Replicate(),)
    assert isinstance(model[1].running_mean, dt.DTensor)
    assert model[1].running_mean.placements == (dt.Replicate(),)


def test_tensor_and_data_parallel_gpt_trains_like_torch(mesh2d):
    torch.manual_seed(0)
    ref = GPT()
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh2d["tp"], plan(False))
    model = dt.nn.data_parallel(model, mesh2d["dp"])
    # 3 sequences on 2 data-parallel ranks: an uneven batch split
    batches = [(torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7))) for _ in range(3)]
    expected = train(ref, batches, adamw, lm_loss, 3)
    got = train(model, batches, adamw, lm_loss, 3)
    assert got == pytest.approx(expected, rel=1e-4)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert p._spec.placements[0] == dt.Replicate(), name  # replicated over dp
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert dt.fallback_counts() == {}


def test_data_parallel_alone_shards_the_batch(mesh2d):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    model = dt.nn.data_parallel(copy.deepcopy(ref), mesh2d["dp"])
    x = torch.randn(5, 5)
    out = model(x)
    assert out.placements == (dt.Shard(0),)
    assert_close(out, ref(x).detach())
    with pytest.raises(dt.PlacementError, match="1-D mesh"):
        dt.nn.data_parallel(nn.Linear(2, 2), mesh2d)


def test_vocab_parallel_head_with_loss_parallel(mesh1d):
    """A colwise LM head that keeps its logits sharded; torch-style loss_parallel code runs."""
    torch.manual_seed(0)
    ref = GPT()
    p = plan(False)
    p["head"] = dt.nn.ColwiseParallel(output_layouts=dt.Shard(-1))  # logits stay vocab-sharded
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh1d, p)
    tokens, targets = torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7))
    logits = model(tokens)
    assert logits.placements == (dt.Shard(2),)
    with dt.nn.loss_parallel():
        loss = F.cross_entropy(logits.reshape(-1, 23), targets.reshape(-1))
        loss.backward()
    ref_loss = F.cross_entropy(ref(tokens).reshape(-1, 23), targets.reshape(-1))
    ref_loss.backward()
    assert loss.full_tensor().item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (name, p_ref), q in zip(ref.named_parameters(), model.parameters()):
        assert_close(q.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert dt.fallback_counts() == {}


class TiedLM(nn.Module):
    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # weight tying

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


def test_tied_parameters_stay_one_parameter(mesh2d):
    torch.manual_seed(0)
    ref = TiedLM()
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh2d["tp"], {
        "embed": dt.nn.RowwiseParallel(), "head": dt.nn.ColwiseParallel(output_layouts=dt.Replicate())})
    model = dt.nn.data_parallel(model, mesh2d["dp"])
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
    batches = [(torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))) for _ in range(3)]
    expected = train(ref, batches, adamw, lm_loss, 3)
    got = train(model, batches, adamw, lm_loss, 3)
    assert got == pytest.approx(expected, rel=1e-4)
    assert_close(model.embed.weight, ref.embed.weight.detach(), rtol=1e-4, atol=1e-5)
    with pytest.raises(dt.PlacementError, match="tied to a parameter already laid out"):
        dt.nn.parallelize_module(TiedLM(), mesh2d["tp"], {"embed": dt.nn.RowwiseParallel(),
                                                          "head": dt.nn.RowwiseParallel()})


def test_data_parallel_reduces_all_gradients_in_one_merged_exchange(mesh2d, monkeypatch):
    from dtorch_core.controller.session import current_session
    from dtorch_core.ir.instructions import Collective, MergedAllReduce

    torch.manual_seed(0)
    ref = GPT()
    model = dt.nn.data_parallel(dt.nn.parallelize_module(copy.deepcopy(ref), mesh2d["tp"], plan(False)),
                                mesh2d["dp"])
    tokens, targets = torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7))
    loss = lm_loss(model(tokens), targets)
    session = current_session()
    sent = []
    emit = session.emit
    monkeypatch.setattr(session, "emit", lambda ins: (sent.append(ins), emit(ins)))
    loss.backward()
    merged = [i for i in sent if type(i) is MergedAllReduce]
    # every gradient still Partial over dp after backward goes into the one exchange (the planner
    # makes some of them Replicate directly, gathering a small activation over dp instead)
    assert len(merged) == 1 and merged[0].mesh_dim == 0 and len(merged[0].srcs) >= 5
    assert not any(type(i) is Collective and i.kind == "all_reduce" and i.mesh_dim == 0 for i in sent)
    lm_loss(ref(tokens), targets).backward()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert p.grad._spec.placements[0] == dt.Replicate(), name
        assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=name)
