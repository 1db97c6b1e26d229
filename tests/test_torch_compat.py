"""Code written for torch.distributed.tensor runs unchanged: torch's placements and parallel
styles give the results of dtorch's own (and of plain torch), on every runner, uneven shards
included; what cannot be honoured raises naming the argument."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.distributed.tensor as tdt
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import parallel as tp
from torch.distributed.tensor.placement_types import _StridedShard

import dtorch_core as dt

from .helpers import BITWISE, DEVICE, assert_close, needs_world_size


# -- placements ------------------------------------------------------------------------------
def test_torch_placements_are_dtorch_placements(mesh2d):
    a = torch.randn(7, 5)  # 7 rows over 2: uneven
    ours = dt.distribute_tensor(a, mesh2d, [dt.Shard(0), dt.Shard(-1)])
    theirs = dt.distribute_tensor(a, mesh2d, [tdt.Shard(0), tdt.Shard(-1)])
    assert theirs.placements == ours.placements == (dt.Shard(0), dt.Shard(1))
    assert {r: t.shape for r, t in theirs.local_shards().items()} == {r: t.shape for r, t in ours.local_shards().items()}
    assert torch.equal(theirs.full_tensor(), a)

    moved = theirs.redistribute(mesh2d, [tdt.Replicate(), tdt.Partial("sum")])
    assert moved.placements == (dt.Replicate(), dt.Partial("sum"))
    assert torch.equal(moved.full_tensor(), a)
    sub = theirs.redistribute(mesh2d["tp"], [tdt.Replicate()])  # the "dp" dim keeps its shard
    assert sub.placements == (dt.Shard(0), dt.Replicate())
    assert torch.equal(sub.full_tensor(), a)

    for op in ("sum", "avg", "max", "min"):
        p = dt.distribute_tensor(a, mesh2d, [tdt.Partial(reduce_op=op), tdt.Replicate()])
        assert p.placements == (dt.Partial(op), dt.Replicate())
        assert_close(p.full_tensor(), a, msg=op)

    shards = {r: torch.full((2, 3), float(r)) for r in range(4)}
    local = dt.from_local(shards, mesh2d, [tdt.Shard(0), tdt.Shard(1)])
    assert local.placements == (dt.Shard(0), dt.Shard(1)) and local.shape == (4, 6)
    made = dt.randn(5, 3, device_mesh=mesh2d, placements=[tdt.Shard(0), tdt.Replicate()])
    same = dt.randn(5, 3, device_mesh=mesh2d, placements=[dt.Shard(0), dt.Replicate()])
    assert made.placements == same.placements


def test_torch_placements_without_a_dtorch_equivalent_raise(mesh2d):
    with pytest.raises(dt.PlacementError, match=r"_StridedShard .*split_factor=2.*Shard\(dim\) on each mesh dim"):
        dt.distribute_tensor(torch.randn(8, 2), mesh2d, [tdt.Shard(0), _StridedShard(0, split_factor=2)])
    with pytest.raises(dt.PlacementError, match="reduce_op must be one of .* got 'product'"):
        dt.distribute_tensor(torch.randn(8, 2), mesh2d, [tdt.Partial("product"), tdt.Replicate()])
    with pytest.raises(dt.PlacementError, match="is not a placement"):
        dt.distribute_tensor(torch.randn(8, 2), mesh2d, ["Shard(0)", tdt.Replicate()])


def test_torch_device_mesh_is_refused_with_what_to_use(mesh1d):
    from torch.distributed.device_mesh import DeviceMesh

    theirs = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)  # no process group needed
    x = dt.distribute_tensor(torch.randn(4), mesh1d, [dt.Shard(0)])
    for call in (lambda: dt.distribute_tensor(torch.randn(4), theirs, [tdt.Shard(0)]),
                 lambda: x.redistribute(theirs, [tdt.Replicate()]),
                 lambda: dt.nn.parallelize_module(nn.Linear(2, 2), theirs, tp.ColwiseParallel())):
        with pytest.raises(dt.PlacementError, match=r"torch.distributed's DeviceMesh .* dt.init_device_mesh"):
            call()


def test_importing_dtorch_does_not_import_torch_distributed_tensor():
    """Its import costs most of a second; dtorch converts torch's objects without it."""
    code = "import sys, dtorch_core; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- a torchtitan-style Llama plan -----------------------------------------------------------
def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        cos, sin = rope
        # -1 heads, as torchtitan writes it: the global view has every head
        q, k, v = (lin(x).view(b, s, -1, self.head_dim) for lin in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    # 12 features = 6 heads of 2 (whole heads per rank over 2 and 3); MLP 20, vocabulary 23 and
    # 7 positions (the sequence-parallel shards) split unevenly
    def __init__(self, vocab=23, dim=12, heads=6, hidden=20, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // heads

    def forward(self, tokens):
        s = tokens.shape[1]
        angles = torch.arange(s)[:, None] * torch.linspace(0.1, 1.0, self.head_dim)[None, :]
        rope = (angles.cos()[:, None, :], angles.sin()[:, None, :])  # plain tensors: replicated
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))


def titan_plans(lib):
    """torchtitan's Llama plans (model level and per block), from ``lib``: torch's module or
    dt.nn with dtorch's placements."""
    shard1, rep = (tdt.Shard(1), tdt.Replicate()) if lib is tp else (dt.Shard(1), dt.Replicate())
    model = {
        "tok_embeddings": lib.RowwiseParallel(input_layouts=rep, output_layouts=shard1),
        "norm": lib.SequenceParallel(),
        "output": lib.ColwiseParallel(input_layouts=shard1, output_layouts=rep),
    }
    block = {
        "attention_norm": lib.SequenceParallel(),
        "attention": lib.PrepareModuleInput(input_layouts=(shard1, None), desired_input_layouts=(rep, None)),
        "attention.wq": lib.ColwiseParallel(),
        "attention.wk": lib.ColwiseParallel(),
        "attention.wv": lib.ColwiseParallel(),
        "attention.wo": lib.RowwiseParallel(output_layouts=shard1),
        "ffn_norm": lib.SequenceParallel(),
        "feed_forward": lib.PrepareModuleInput(input_layouts=(shard1,), desired_input_layouts=(rep,)),
        "feed_forward.w1": lib.ColwiseParallel(),
        "feed_forward.w2": lib.RowwiseParallel(output_layouts=shard1),
        "feed_forward.w3": lib.ColwiseParallel(),
    }
    return model, block


def parallelize_titan(model, mesh, lib, nested: bool):
    model_plan, block_plan = titan_plans(lib)
    if nested:  # one call: a nested plan under a wildcard key
        return dt.nn.parallelize_module(model, mesh, {**model_plan, "layers.*": block_plan})
    for block in model.layers.values():  # torchtitan's loop
        dt.nn.parallelize_module(block, mesh, block_plan)
    return dt.nn.parallelize_module(model, mesh, model_plan)


def step(model, tokens, targets):
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return logits, loss


@needs_world_size(4)
@pytest.mark.parametrize("tp_size", [2, 3])
def test_torchtitan_llama_plan_with_torch_styles_matches_dtorch_styles_and_torch(runner, tp_size):
    torch.manual_seed(0)
    ref = Llama()
    tokens, targets = torch.randint(0, 23, (2, 7)), torch.randint(0, 23, (2, 7))  # 7 positions: uneven
    ref_logits, ref_loss = step(ref, tokens, targets)
    mesh = dt.init_device_mesh(DEVICE, (tp_size,), mesh_dim_names=("tp",))
    results = {}
    for lib, nested in ((tp, False), (dt.nn, False), (tp, True)):
        model = parallelize_titan(copy.deepcopy(ref), mesh, lib, nested)
        block = model.layers["1"]
        assert block.attention.wq.weight.placements == (dt.Shard(0),)
        assert block.attention.wo.weight.placements == (dt.Shard(1),)
        assert block.feed_forward.w2.weight.placements == (dt.Shard(1),)
        assert block.ffn_norm.weight.placements == (dt.Replicate(),)
        assert model.tok_embeddings.weight.placements == (dt.Shard(0),)
        logits, loss = step(model, tokens, targets)
        assert logits.placements == (dt.Replicate(),)
        assert_close(logits, ref_logits.detach(), rtol=1e-4, atol=1e-5, msg=f"{lib.__name__} logits")
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for name, p in ref.named_parameters():
            assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=f"{lib.__name__} {name}")
        results[(lib.__name__, nested)] = (loss.full_tensor(), grads)
        assert loss.full_tensor().item() == pytest.approx(ref_loss.item(), rel=1e-5)
    if BITWISE:  # the same plan, translated: the same ops on the workers
        (l_torch, g_torch), (l_ours, g_ours), (l_nested, _) = results.values()
        assert torch.equal(l_torch, l_ours) and torch.equal(l_torch, l_nested)
        assert all(torch.equal(g_torch[n], g_ours[n]) for n in g_torch)
    assert dt.fallback_counts() == {}


# -- the other styles and their arguments ----------------------------------------------------
class Scaled(nn.Module):
    """Records the placements its inputs arrive with."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def forward(self, x, y=None, *, mask=None):
        self.seen = {"x": x.placements, "y": getattr(y, "placements", None), "mask": mask.placements}
        return x * mask, x + 1


def test_prepare_module_input_output_with_kwargs(mesh1d):
    a, m = torch.randn(5, 3), torch.randn(5, 3)
    expected = (a * m, a + 1)
    for lib, placements in ((tp, tdt), (dt.nn, dt)):
        S, R = placements.Shard, placements.Replicate
        mod = dt.nn.parallelize_module(Scaled(), mesh1d, {"": lib.PrepareModuleInputOutput(
            input_layouts=(R(), None), desired_input_layouts=(S(0), S(1)),
            input_kwarg_layouts={"mask": S(1)}, desired_input_kwarg_layouts={"mask": S(0)},
            output_layouts=(S(0), None), desired_output_layouts=(R(), None))})
        y = dt.distribute_tensor(a, mesh1d, [dt.Shard(0)])
        out = mod(a, y, mask=m)
        # y's input_layouts entry is None: torch leaves it alone whatever the desired layout says
        assert mod.seen == {"x": (dt.Shard(0),), "y": (dt.Shard(0),), "mask": (dt.Shard(0),)}, lib.__name__
        assert out[0].placements == (dt.Replicate(),) and out[1].placements == (dt.Shard(0),)
        for got, want in zip(out, expected):
            assert_close(got, want)
    # dtorch's own: one layout applies to every output of a tuple; fewer layouts than outputs
    # leave the rest alone
    x, mask = dt.distribute_tensor(a, mesh1d, [dt.Shard(1)]), dt.distribute_tensor(m, mesh1d, [dt.Shard(1)])
    for desired, second in ((dt.Replicate(), dt.Replicate()), ((dt.Replicate(),), dt.Shard(1))):
        mod = dt.nn.parallelize_module(Scaled(), mesh1d, dt.nn.PrepareModuleOutput(desired_output_layouts=desired))
        out = mod(x, mask=mask)
        assert len(out) == 2 and out[0].placements == (dt.Replicate(),) and out[1].placements == (second,)


def test_prepare_module_output_and_sequence_parallel_on_a_block(mesh1d):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6), nn.Dropout(0.0))
    x = torch.randn(3, 5, 6)  # 5 positions over 4 ranks
    for lib, placements in ((tp, tdt), (dt.nn, dt)):
        model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh1d, {
            "0": lib.SequenceParallel(),
            "1": lib.ColwiseParallel(input_layouts=placements.Shard(1)),
            "3": lib.RowwiseParallel(output_layouts=placements.Shard(1)),
            "4": lib.SequenceParallel(),
            "": lib.PrepareModuleOutput(output_layouts=placements.Shard(1), desired_output_layouts=placements.Replicate()),
        })
        out = model(x)
        assert model[0].weight.placements == (dt.Replicate(),)
        assert out.placements == (dt.Replicate(),), lib.__name__
        assert_close(out, ref(x).detach(), rtol=1e-5, atol=1e-6)


class CustomColwise(tp.ColwiseParallel):
    """Like torchao's Float8ColwiseParallel: a subclass that may change what the style does."""


def test_unsupported_torch_style_arguments_are_named(mesh1d):
    lin = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(dt.PlacementError, match=r"ColwiseParallel\(output_layouts=.*_StridedShard"):
        dt.nn.parallelize_module(lin, mesh1d, {"0": tp.ColwiseParallel(output_layouts=_StridedShard(0, split_factor=2))})
    with pytest.raises(dt.PlacementError, match=r"RowwiseParallel\(input_layouts=.*got 'product'"):
        dt.nn.parallelize_module(lin, mesh1d, {"0": tp.RowwiseParallel(input_layouts=tdt.Partial("product"))})
    with pytest.raises(dt.PlacementError,
                       match=r"PrepareModuleInput\(desired_input_kwarg_layouts\['mask'\]=.*_StridedShard"):
        dt.nn.parallelize_module(lin, mesh1d, tp.PrepareModuleInput(
            input_kwarg_layouts={"mask": tdt.Shard(0)},
            desired_input_kwarg_layouts={"mask": _StridedShard(0, split_factor=2)}))
    with pytest.raises(dt.PlacementError, match=r"test_torch_compat.CustomColwise is a torch ParallelStyle that dtorch "
                                                r"cannot translate"):
        dt.nn.parallelize_module(lin, mesh1d, {"0": CustomColwise()})
    with pytest.raises(dt.PlacementError, match="ColwiseParallel supports nn.Linear and nn.Embedding"):
        dt.nn.parallelize_module(nn.Sequential(nn.LayerNorm(4)), mesh1d, {"0": tp.ColwiseParallel()})


# -- plan keys ---------------------------------------------------------------------------------
def test_plan_keys_match_one_name_per_part_as_torch_does(mesh1d):
    model = Llama(layers=2)
    names = [n for n, _ in dt.nn.parallelize.matching(model, "layers.*.attention.w[qk]")]
    assert names == ["layers.0.attention.wq", "layers.0.attention.wk", "layers.1.attention.wq",
                     "layers.1.attention.wk"]
    assert [n for n, _ in dt.nn.parallelize.matching(model, "layers.1")] == ["layers.1"]
    # '*' stands for one name, never a dotted run (torch's fnmatch on each part)
    with pytest.raises(dt.PlacementError, match=r"'\*\.wq' matches no sub-module: its part 'wq' matches none"):
        dt.nn.parallelize_module(Llama(), mesh1d, {"*.wq": tp.ColwiseParallel()})
    with pytest.raises(dt.PlacementError, match="plan entry 'output' is 3"):
        dt.nn.parallelize_module(Llama(), mesh1d, {"output": 3})


def test_vocab_sharded_logits_under_torchs_loss_parallel(runner):
    """torchtitan's loss-parallel head: the logits stay sharded over the vocabulary (23 over 2)
    and torch's loss_parallel() context changes nothing."""
    mesh = dt.init_device_mesh(DEVICE, (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = Llama(layers=1)
    tokens, targets = torch.randint(0, 23, (2, 7)), torch.randint(0, 23, (2, 7))
    model_plan, block_plan = titan_plans(tp)
    model_plan["output"] = tp.ColwiseParallel(input_layouts=tdt.Shard(1), output_layouts=tdt.Shard(-1),
                                              use_local_output=False)
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh, {**model_plan, "layers.*": block_plan})
    with tp.loss_parallel():
        logits, loss = step(model, tokens, targets)
    assert logits.placements == (dt.Shard(2),)
    ref_logits, ref_loss = step(ref, tokens, targets)
    assert_close(logits, ref_logits.detach(), rtol=1e-4, atol=1e-5)
    assert loss.full_tensor().item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, p in model.named_parameters():
        assert_close(p.grad, dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-5, msg=name)
