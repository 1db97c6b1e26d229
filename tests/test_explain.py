"""dt.explain (placements and redistributions per op, by module), `dtorch run --explain`, and the
surprising gathers (warned once, counted, refused on request), on every runner, with the native
hot path and the Python dispatcher. Shapes give uneven shards on 4 workers."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.planner import gathers, native_dispatch
from dtorch_core.tensor import DTensor

from .helpers import DEVICE, WORLD_SIZE, assert_close, python_path

R = dt.Replicate()
NATIVE = native_dispatch.active() == "native"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["native", "python"])
def hot_path(request, runner):
    if request.param == "native" and not NATIVE:
        pytest.skip(f"the native hot path is not built here: {native_dispatch.active()}")
    with python_path() if request.param == "python" else contextlib.nullcontext():
        yield request.param


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)  # 10 hidden columns: 3, 3, 3, 1 on 4 workers
        self.fc2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FusedAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(6, 15)  # q, k, v of 5 columns: shards of 4, 4, 4, 3 cross them

    def forward(self, x):
        q, k, v = self.qkv(x).split(5, dim=-1)
        return q * k + v


def _tp_mlp(mesh):
    ref = MLP()
    plan = {"fc1": dt.nn.ColwiseParallel(), "fc2": dt.nn.RowwiseParallel()}
    return ref, dt.nn.parallelize_module(copy.deepcopy(ref), mesh, plan)


def _fresh_gather_log():
    """Forget the warnings already given in this session (the session outlives one test)."""
    log = gathers.log_of(session_module._session)
    log.warned.clear()
    return log


def test_explain_tp_mlp_placements_and_bytes(mesh1d, hot_path):
    ref, model = _tp_mlp(mesh1d)
    xs = torch.randn(3, 6)
    x = dt.distribute_tensor(xs, mesh1d, [R])
    model(x)  # plans made: the explained call is all cache hits (the native path's own case)
    installed = DTensor.__dict__["__torch_dispatch__"]
    ex = dt.explain(model, x)
    assert DTensor.__dict__["__torch_dispatch__"] is installed  # put back
    assert_close(ex.result.full_tensor(), ref(xs).detach())

    by_op = {(r.module, r.op): r for r in ex.ops}
    fc1 = by_op[("MLP.fc1", "dtorch.linear.default")]  # a distributed model's Linear: one op
    assert fc1.phase == "forward" and fc1.source.endswith(f"{os.path.basename(__file__)}:{_line_of('self.fc1(x)')}")
    assert fc1.outputs[0].shape == (3, 10) and fc1.outputs[0].placements == (dt.Shard(1),)
    assert fc1.redistributions == []
    fc2 = by_op[("MLP.fc2", "dtorch.linear.default")]
    assert [t.placements for t in fc2.inputs] == [(dt.Shard(1),), (dt.Shard(1),), (R,)]  # input, weight, bias
    assert fc2.outputs[0].placements == (dt.Partial("sum"),)
    assert by_op[("MLP", "aten.relu.default")].outputs[0].placements == (dt.Shard(1),)
    # RowwiseParallel's output layout: one all-reduce of the (3, 5) float32 output, asked for by the style
    (reduce,) = [r for r in ex.ops if r.redistributions]
    assert reduce.requested and reduce.module == "MLP.fc2" and reduce.op == "redistribute"
    (move,) = reduce.redistributions
    assert (move.kind, move.src, move.dst, move.mesh_dim) == ("all_reduce", (dt.Partial("sum"),), (R,), 0)
    nbytes = 3 * 5 * torch.float32.itemsize  # the (3, 5) output of fc2
    assert move.nbytes == nbytes
    assert ex.collectives() == {"all_reduce": {"count": 1, "bytes": nbytes}}
    modules = ex.modules()
    assert list(modules) == ["MLP.fc1", "MLP", "MLP.fc2"]
    assert modules["MLP.fc2"]["collectives"] == {"all_reduce": {"count": 1, "bytes": nbytes}}
    assert modules["MLP.fc1"]["collectives"] == {} and modules["MLP.fc1"]["ops"] == 1  # dtorch.linear
    text = str(ex)
    assert f"MLP.fc2: 1 ops; collectives: all_reduce x1 ({nbytes} B)" in text
    assert f"all_reduce [P(sum)]->[R] on mesh dim 0: {nbytes} B" in text and "(3,10)[S(1)]" in text
    assert json.loads(json.dumps(ex.to_dict()))["collectives"] == {"all_reduce": {"count": 1, "bytes": nbytes}}


def test_explain_on_a_2d_mesh_names_the_mesh_dim(mesh2d, runner):
    ref, model = _tp_mlp(mesh2d["tp"])
    xs = torch.randn(3, 6)  # 3 rows over "dp": 2 and 1
    x = dt.distribute_tensor(xs, mesh2d, [dt.Shard(0), R])
    ex = dt.explain(model, x)
    assert_close(ex.result.full_tensor(), ref(xs).detach())
    fc1 = next(r for r in ex.ops if r.module == "MLP.fc1" and r.op == "dtorch.linear.default")
    assert fc1.outputs[0].placements == (dt.Shard(0), dt.Shard(1))
    (reduce,) = [r for r in ex.ops if r.redistributions]
    (move,) = reduce.redistributions
    assert (move.kind, move.src, move.dst, move.mesh_dim) == (
        "all_reduce", (dt.Shard(0), dt.Partial("sum")), (dt.Shard(0), R), 1)
    assert move.nbytes == 3 * 5 * torch.float32.itemsize  # the global tensor, whatever the dp shards
    assert "all_reduce [S(0), P(sum)]->[S(0), R] on mesh dim 1" in str(ex)


def _line_of(snippet: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if snippet in line and "_line_of" not in line)


def test_explain_sees_every_op_on_either_path_and_backward(mesh1d, hot_path):
    ref, model = _tp_mlp(mesh1d)
    xs = torch.randn(3, 6)
    x = dt.distribute_tensor(xs, mesh1d, [R])
    runs = []
    for _ in range(2):  # the first call plans, the second hits the plan cache
        model.zero_grad(set_to_none=True)  # the same backward ops both times
        with dt.explain() as ex:
            loss = model(x).sum()
            loss.backward()
        runs.append([(r.op, r.module, r.phase, r.inputs, r.outputs, r.redistributions) for r in ex.ops])
    assert runs[0] == runs[1]
    ref(xs).sum().backward()
    assert_close(model.fc1.weight.grad.full_tensor(), ref.fc1.weight.grad)
    backward = [r for r in ex.ops if r.phase == "backward"]
    assert backward and {r.module for r in backward} >= {"MLP.fc1", "MLP.fc2"}
    (grads,) = [r for r in backward if r.module == "MLP.fc1" and r.op == "dtorch.linear_backward.default"]
    assert grads.outputs[1].placements == (dt.Shard(0),)  # fc1's weight grad stays sharded


def test_explain_nested_and_requested_moves(mesh1d, hot_path):
    a = torch.randn(7, 5)
    x = dt.distribute_tensor(a, mesh1d, [dt.Shard(0)])
    with dt.explain() as ex:
        y = x.redistribute(mesh1d, [R])
        z = (y * 2).sum()
    assert_close(z.full_tensor(), (a * 2).sum())
    first = ex.ops[0]
    assert first.requested and first.op == "redistribute" and first.module == "Global"
    assert [(m.kind, m.src, m.dst, m.nbytes) for m in first.redistributions] == [
        ("all_gather", (dt.Shard(0),), (R,), 7 * 5 * 4)]
    assert [r.op for r in ex.ops[1:] if r.depth == 0] == ["aten.mul.Tensor", "aten.sum.default"]
    assert not any(r.surprising_gather for r in ex.ops)


@pytest.mark.filterwarnings("ignore:dtorch.*no sharding rule")
def test_explain_marks_the_replicated_fallback(mesh1d, hot_path):
    a = torch.randn(6, 4)
    x = dt.distribute_tensor(a, mesh1d, [dt.Shard(0)])
    ex = dt.explain(lambda t: torch.cummax(t, 1).values * 2, x)  # cummax has no sharding rule
    assert_close(ex.result.full_tensor(), torch.cummax(a, 1).values * 2)
    (cummax,) = [r for r in ex.ops if r.op == "aten.cummax.default"]
    assert cummax.fallback and not cummax.surprising_gather
    assert [(m.kind, m.src, m.dst, m.nbytes) for m in cummax.redistributions] == [
        ("all_gather", (dt.Shard(0),), (R,), 6 * 4 * 4)]
    assert not any(r.fallback for r in ex.ops if r is not cummax)
    assert "replicated fallback" in str(ex)


def test_fused_qkv_split_warns_once_and_is_counted(mesh1d, hot_path):
    _fresh_gather_log()
    ref = FusedAttn()
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh1d, {"qkv": dt.nn.ColwiseParallel()})
    xs = torch.randn(3, 6)
    x = dt.distribute_tensor(xs, mesh1d, [R])
    before = dt.gather_counts().get("aten.split.Tensor", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [model(x) for _ in range(3)]
    for out in outs:
        assert_close(out.full_tensor(), ref(xs).detach())
    ours = [w for w in caught if "all-gathers" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    text = str(ours[0].message)
    assert "aten.split.Tensor in module FusedAttn" in text and "Shard(dim=1) to Replicate()" in text
    assert "ColwiseParallel" in text and "split before the sharded Linear" in text
    assert ours[0].filename == __file__ and ours[0].lineno == _line_of("self.qkv(x).split(5")
    assert dt.gather_counts()["aten.split.Tensor"] == before + 3
    assert dt.fallback_counts() == {}  # not a fallback: the view rule chose the gather

    ex = dt.explain(model, x)
    (split,) = [r for r in ex.ops if r.op == "aten.split.Tensor"]
    assert split.surprising_gather and split.module == "FusedAttn"
    assert [(m.kind, m.src, m.dst, m.nbytes) for m in split.redistributions] == [
        ("all_gather", (dt.Shard(1),), (R,), 3 * 15 * 4)]
    assert "SURPRISING GATHER" in str(ex) and "split.Tensor in FusedAttn" in str(ex)


PARTS = {  # view-like ops of a (3, 15) tensor whose 15 columns lie 4, 4, 4, 3 on 4 workers
    "chunk": (lambda t: t.chunk(3, -1), "aten.split.Tensor", "(3, 15)[Shard(dim=1)]"),
    "unbind": (lambda t: t.unbind(-1), "aten.unbind.int", "(3, 15)[Shard(dim=1)]"),
    "narrow": (lambda t: t.narrow(-1, 5, 5), "aten.slice.Tensor", "(3, 15)[Shard(dim=1)]"),
    "view": (lambda t: t.view(3, 3, 5), "aten.view.default", "(3, 15)[Shard(dim=1)]"),
    # a reshape that must copy: torch's _unsafe_view of the transposed (15, 3) copy
    "reshape": (lambda t: t.t().reshape(5, 9), "aten._unsafe_view.default", "(15, 3)[Shard(dim=0)]"),
}


@pytest.mark.parametrize("name", list(PARTS))
def test_view_like_ops_across_shards_warn(mesh1d, runner, name):
    _fresh_gather_log()
    fn, op, gathered = PARTS[name]
    a = torch.randn(3, 15)
    x = dt.distribute_tensor(a, mesh1d, [dt.Shard(1)])
    before = dt.gather_counts().get(op, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(x)
    expected = fn(a)
    for o, e in zip(*((v,) if isinstance(v, torch.Tensor) else v for v in (out, expected))):
        assert_close(o.full_tensor(), e)
    ours = [str(w.message) for w in caught if "all-gathers" in str(w.message)]
    assert len(ours) == 1 and ours[0].startswith(f"dtorch: {op} at ") and f"input 0 {gathered} from" in ours[0]
    assert dt.gather_counts()[op] == before + 1


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([FusedAttn(), FusedAttn()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x).repeat(1, 2)[:, :6])


def test_repeated_blocks_warn_once(mesh1d, runner):
    _fresh_gather_log()
    ref = Stack()
    plan = {f"blocks.{i}.qkv": dt.nn.ColwiseParallel() for i in range(2)}
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh1d, plan)
    xs = torch.randn(3, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(dt.distribute_tensor(xs, mesh1d, [R]))
    assert_close(out.full_tensor(), ref(xs).detach())
    ours = [str(w.message) for w in caught if "all-gathers" in str(w.message)]
    assert len(ours) == 1 and "in module Stack.blocks.0 " in ours[0], ours


def test_requested_gathers_do_not_warn(mesh1d, hot_path):
    _fresh_gather_log()
    a = torch.randn(3, 15)
    x = dt.distribute_tensor(a, mesh1d, [dt.Shard(1)])
    before = dict(dt.gather_counts())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*all-gathers")
        parts = x.redistribute(mesh1d, [R]).split(5, dim=-1)  # the user asked for the gather
        full = x.full_tensor()
    for part, expected in zip(parts, a.split(5, dim=-1)):
        assert_close(part.full_tensor(), expected)
    assert_close(full, a)
    assert dt.gather_counts() == before


def test_strict_gathers_refuse_the_split(mesh1d, hot_path):
    _fresh_gather_log()
    ref = FusedAttn()
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh1d, {"qkv": dt.nn.ColwiseParallel()})
    xs = torch.randn(3, 6)
    x = dt.distribute_tensor(xs, mesh1d, [R])
    try:
        dt.set_strict(True, gathers=False)  # refuses fallbacks only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x)
        dt.set_strict(True)  # strict mode refuses the gather too
        with pytest.raises(dt.OpError, match=r"aten\.split\.Tensor in module FusedAttn .* all-gathers input 0 "
                                             r"\(3, 15\)\[Shard\(dim=1\)\]") as info:
            model(x)
        assert "ColwiseParallel" in str(info.value) and "gathers=False" in str(info.value)
        with dt.explain() as ex, pytest.raises(dt.OpError):
            model(x)
        (split,) = [r for r in ex.ops if r.op == "aten.split.Tensor"]
        assert split.error.startswith("OpError: aten.split.Tensor in module FusedAttn")
    finally:
        dt.set_strict(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close(model(x).full_tensor(), ref(xs).detach())  # the refused plan was not kept


@pytest.mark.parametrize("switches", [(False, True), (True, False)])
def test_each_strict_switch_apart(mesh1d, switches):
    """set_strict(rules, gathers=...) refuses only what it names: a fallback op, a surprising gather."""
    rules, refuse_gathers = switches
    _fresh_gather_log()
    ref = FusedAttn()
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh1d, {"qkv": dt.nn.ColwiseParallel()})
    xs = torch.randn(3, 6)
    x = dt.distribute_tensor(xs, mesh1d, [R])
    a = torch.randn(4, 6)
    y = dt.distribute_tensor(a, mesh1d, [dt.Shard(1)])
    try:
        dt.set_strict(rules, gathers=refuse_gathers)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if refuse_gathers:
                with pytest.raises(dt.OpError, match=r"aten\.split\.Tensor .*\(refused in strict mode"):
                    model(x)
                values = torch.sort(y, dim=1).values  # no rule: runs replicated
                assert torch.equal(values.full_tensor(), torch.sort(a, dim=1).values)
            else:
                assert_close(model(x).full_tensor(), ref(xs).detach())
                with pytest.raises(dt.FallbackRefusedError):
                    torch.sort(y, dim=1)
    finally:
        dt.set_strict(False)


def test_init_strict_refuses_gathers(monkeypatch):
    """dt.init(strict=True) and DTORCH_STRICT=1 (which `dtorch run --strict` sets) refuse them too."""
    for how in ("argument", "environment"):
        if how == "environment":
            monkeypatch.setenv("DTORCH_STRICT", "1")
        dt.init(world_size=WORLD_SIZE, runner="inline", device_type=DEVICE,
                strict=True if how == "argument" else None)
        try:
            mesh = dt.init_device_mesh(DEVICE, (WORLD_SIZE,))
            model = dt.nn.parallelize_module(FusedAttn(), mesh, {"qkv": dt.nn.ColwiseParallel()})
            with pytest.raises(dt.OpError, match=r"aten\.split\.Tensor in module FusedAttn"):
                model(dt.distribute_tensor(torch.randn(3, 6), mesh, [R]))
        finally:
            dt.shutdown()


SCRIPT = """
import torch
from torch import nn
import dtorch_core as dt

dt.init()
mesh = dt.init_device_mesh({device!r}, ({world},))
model = dt.nn.parallelize_module(nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5)), mesh,
                                 {{"0": dt.nn.ColwiseParallel(), "2": dt.nn.RowwiseParallel()}})
x = dt.distribute_tensor(torch.randn(3, 6), mesh, [dt.Replicate()])
for _ in range(2):
    y = model(x)
print("sum", float(y.sum().item()))
"""


@pytest.mark.parametrize("to_file", [False, True])
def test_dtorch_run_explain(tmp_path, to_file):
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT.format(device=DEVICE, world=min(WORLD_SIZE, 2)))
    report = tmp_path / "explain.json"
    cmd = [sys.executable, "-m", "dtorch_core.cli", "run", "--runner", "inline", "--world-size",
           str(min(WORLD_SIZE, 2))]
    cmd += ["--explain-file", str(report)] if to_file else ["--explain"]
    proc = subprocess.run([*cmd, str(script)], check=False, capture_output=True, text=True, timeout=180,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sum " in proc.stdout
    if to_file:
        data = json.loads(report.read_text())
        assert data["collectives"] == {"all_reduce": {"count": 2, "bytes": 2 * 3 * 5 * 4}}
        assert {r["module"] for r in data["ops"]} >= {"Sequential.0", "Sequential.2"}
    else:
        text = proc.stderr
        assert "dt.explain:" in text and "Sequential.2:" in text
        assert f"all_reduce [P(sum)]->[R] on mesh dim 0: {3 * 5 * 4} B  requested" in text
        assert "\n  2      dtorch.linear" in text  # the two calls of the same op and line are one row
