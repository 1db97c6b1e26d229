"""Fused local segments (dt.compile(fuse_local=True)): replays with compiled segments equal eager.

The compiler (inductor by default) may reorder floating-point arithmetic inside a segment, so
fused replays are compared with eager steps with ``allclose`` (rtol 1e-5, atol 1e-6), not bit
for bit. A segment that runs op by op (compiler failure) is bit-for-bit eager again.

Compiling costs seconds per segment and worker, so the models are tiny, the shards even (every
rank compiles the same graph: inductor's cache serves all but the first), and the tests of
fallbacks and failures run on the in-process runners only (the worker code is the same).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.ir.instructions import Call, Collective, Delete
from dtorch_core.worker import fused
from dtorch_core.worker.fused import FusedSegment, split

from .test_capture import dist_batches, train_step
from .test_modules import MLP, distribute_module, tp_plan_mlp

RTOL, ATOL = 1e-5, 1e-6


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


FUSED_KEYS = ("fused_segments", "fused_runs", "fused_fallbacks")


def fused_stats(since=None) -> list[dict]:
    """Per rank: segments made, runs through the compiled code, segments given up on.

    The counters are the workers' totals (a session serves many tests): pass an earlier reading
    as ``since`` to get what happened after it.
    """
    now = [{k: s.get(k, 0) for k in FUSED_KEYS} for s in dt.memory_stats()]
    if since is None:
        return now
    return [{k: a[k] - b[k] for k in FUSED_KEYS} for a, b in zip(now, since)]


def in_process_only(runner):
    if runner in ("process", "remote"):  # workers in processes of their own
        pytest.skip("compiles once more in every worker process; the worker code is the one tested in-process")


# ---------------------------------------------------------------------------------------------
# replays equal eager
# ---------------------------------------------------------------------------------------------
def test_mlp_training_step_with_fused_segments_equals_eager(mesh1d):
    torch.manual_seed(0)
    ref = MLP()
    fused_model = distribute_module(copy.deepcopy(ref), mesh1d, tp_plan_mlp(mesh1d))
    eager_model = distribute_module(copy.deepcopy(ref), mesh1d, tp_plan_mlp(mesh1d))
    opt_f = torch.optim.SGD(fused_model.parameters(), lr=0.05, momentum=0.9)
    opt_e = torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(8, 12), torch.randn(8, 5)) for _ in range(6)]  # 2 rows per rank
    data = dist_batches(batches, mesh1d, [dt.Shard(0)])
    start = fused_stats()
    step = dt.compile(train_step, fuse_local=True)
    for x, y in data:
        got, expected = step(fused_model, opt_f, x, y).full_tensor(), train_step(eager_model, opt_e, x, y).full_tensor()
        assert close(got, expected), (got, expected)
    assert step.replays == 3
    program = next(iter(step._captured.values())).program
    assert program.fusable, "the MLP step has pure aten calls to fuse"
    for (name, a), b in zip(eager_model.named_parameters(), fused_model.parameters()):
        assert close(b.full_tensor(), a.full_tensor()), name

    stats = fused_stats(since=start)
    for s in stats:  # every rank made segments and ran each of them compiled on every replay
        assert s["fused_segments"] >= 2 and s["fused_fallbacks"] == 0, stats
        assert s["fused_runs"] == 3 * s["fused_segments"], stats
    # temporaries inside segments never reach the store, and nothing accumulates
    x, y = data[0]
    step(fused_model, opt_f, x, y)
    before = [(s["live_tensors"], s["bytes"]) for s in dt.memory_stats()]
    for _ in range(3):
        step(fused_model, opt_f, x, y)
    assert [(s["live_tensors"], s["bytes"]) for s in dt.memory_stats()] == before


def pointwise_step(x, w, b):
    d = x.shape[-1]
    h = F.layer_norm(x, (d,), w, b)
    h = F.gelu(h) * torch.sigmoid(h) + torch.tanh(h) * 0.5
    h = F.layer_norm(F.gelu(h, approximate="tanh"), (d,))
    return h.exp().sum(-1), h * 3 - 1


def test_pointwise_heavy_step_is_one_segment_and_equals_eager(mesh1d):
    torch.manual_seed(0)
    w = dt.distribute_tensor(torch.randn(16), mesh1d, [dt.Replicate()])
    b = dt.distribute_tensor(torch.randn(16), mesh1d, [dt.Replicate()])
    xs = [dt.distribute_tensor(torch.randn(8, 16), mesh1d, [dt.Shard(0)]) for _ in range(5)]
    start = fused_stats()
    step = dt.compile(pointwise_step, fuse_local=True)
    for x in xs:
        got, expected = step(x, w, b), pointwise_step(x, w, b)
        for g, e in zip(got, expected):
            assert close(g.full_tensor(), e.full_tensor()), (g.full_tensor(), e.full_tensor())
    assert step.replays == 2
    program = next(iter(step._captured.values())).program
    assert len(program.fusable) >= 10  # layer norms, gelus, sigmoid, tanh, exp, sum, ...
    # no communication: the whole step is one segment on every rank
    assert fused_stats(since=start) == [{"fused_segments": 1, "fused_runs": 2, "fused_fallbacks": 0}] * mesh1d.size()


def test_fusion_is_off_by_default(mesh1d):
    step = dt.compile(pointwise_step)
    w = dt.distribute_tensor(torch.ones(16), mesh1d, [dt.Replicate()])
    x = dt.distribute_tensor(torch.randn(8, 16), mesh1d, [dt.Shard(0)])
    start = fused_stats()
    for _ in range(4):
        step(x, w, w)
    assert next(iter(step._captured.values())).program.fusable == ()
    assert fused_stats(since=start) == [dict.fromkeys(FUSED_KEYS, 0)] * mesh1d.size()


def test_capture_block_fuses_too(runner, mesh1d):
    in_process_only(runner)
    acc = dt.distribute_tensor(torch.zeros(8, 4), mesh1d, [dt.Shard(0)])
    x = dt.distribute_tensor(torch.randn(8, 4), mesh1d, [dt.Shard(0)])
    start = fused_stats()
    with dt.capture(fuse_local=True) as graph:
        acc.add_(torch.tanh(x) * torch.sigmoid(x) + 1)  # one segment of four calls, then the in-place add
    for _ in range(3):
        graph.replay()
    xf = x.full_tensor()
    assert close(acc.full_tensor(), 4 * (torch.tanh(xf) * torch.sigmoid(xf) + 1))
    assert fused_stats(since=start) == [{"fused_segments": 1, "fused_runs": 3, "fused_fallbacks": 0}] * mesh1d.size()


# ---------------------------------------------------------------------------------------------
# the compiler never fails a step
# ---------------------------------------------------------------------------------------------
def test_a_segment_the_compiler_cannot_handle_runs_op_by_op(runner, mesh1d, monkeypatch, capsys):
    in_process_only(runner)
    monkeypatch.setenv(fused.BACKEND_ENV, "no_such_backend")  # torch.compile refuses it
    w = dt.distribute_tensor(torch.randn(16), mesh1d, [dt.Replicate()])
    xs = [dt.distribute_tensor(torch.randn(8, 16), mesh1d, [dt.Shard(0)]) for _ in range(5)]
    start = fused_stats()
    step = dt.compile(pointwise_step, fuse_local=True)
    for x in xs:
        for g, e in zip(step(x, w, w), pointwise_step(x, w, w)):
            assert torch.equal(g.full_tensor(), e.full_tensor())  # op by op: eager bit for bit
    assert fused_stats(since=start) == [{"fused_segments": 1, "fused_runs": 0, "fused_fallbacks": 1}] * mesh1d.size()
    warnings = capsys.readouterr().err.count("fused segment could not be compiled")
    assert 1 <= warnings <= mesh1d.size()  # once per worker, not once per replay


def test_failures_travel_through_a_fused_segment(runner, mesh1d):
    in_process_only(runner)

    def gather_then_pointwise(x, idx):
        a = (x.index_select(0, idx) * 2).relu()  # a bad index fails inside the compiled segment...
        b = x.index_select(0, idx).t()  # ... and its failure reaches the next one (.t(), a view, ends a run)
        return a, (b * 2).relu() + 1, (x * 3).exp().sum(0)

    x = dt.distribute_tensor(torch.randn(5, 4), mesh1d, [dt.Replicate()])
    ok = dt.distribute_tensor(torch.tensor([0, 2]), mesh1d, [dt.Replicate()])
    bad = dt.distribute_tensor(torch.tensor([0, 99]), mesh1d, [dt.Replicate()])
    start = fused_stats()
    step = dt.compile(gather_then_pointwise, fuse_local=True)
    for _ in range(4):
        step(x, ok)
    inside, after, fine = step(x, bad)
    for failed in (inside, after):
        with pytest.raises(dt.WorkerError, match=r"index_select.*test_fused.py"):
            failed.full_tensor()
    assert close(fine.full_tensor(), (x.full_tensor() * 3).exp().sum(0))  # computed despite its segment's other input
    inside, after, _ = step(x, ok)  # the worker keeps serving, still compiled
    rows = x.full_tensor()[[0, 2]]
    assert close(inside.full_tensor(), (rows * 2).relu()) and close(after.full_tensor(), (rows.t() * 2).relu() + 1)
    stats = fused_stats(since=start)
    assert all(s["fused_fallbacks"] == 0 and s["fused_runs"] > 0 for s in stats), stats


# ---------------------------------------------------------------------------------------------
# how a worker cuts a program into segments (no compiler involved)
# ---------------------------------------------------------------------------------------------
def test_split_fuses_runs_across_deletes_and_stops_at_communication():
    body = [
        Call(1, (100,), (1,)),  # 0 fusable
        Delete((100,)),  # 1 moves after the segment: nothing later in the run touches 100
        Call(1, (1, 200), (2,)),  # 2 fusable
        Call(1, (2,), (3,)),  # 3 fusable
        Delete((1, 2)),  # 4
        Collective("all_reduce", 1, 0, 3, 4),  # 5 ends the run
        Call(1, (4,), (5,)),  # 6 fusable, alone: stays a call
        Call(2, (5,), (6,)),  # 7 not fusable
        Call(1, (6,), (7,)),  # 8 fusable
        Call(1, (7,), (8, -1)),  # 9 fusable
        Delete((7,)),  # 10
    ]
    out = split(body, (0, 2, 3, 6, 8, 9), keep=(8,))
    first, *rest = out
    assert type(first) is FusedSegment
    assert first.calls == (body[0], body[2], body[3])
    assert first.inputs == (100, 200)  # read from outside, in order of first read
    assert first.outputs == (3,)  # 1 and 2 are deleted unread; 3 feeds the all-reduce
    assert rest[:4] == [Delete((100,)), Delete((1, 2)), body[5], body[6]]
    last = rest[5]
    assert rest[4] is body[7] and type(last) is FusedSegment and last.outputs == (8,)  # 8: a program output
    assert rest[6:] == [Delete((7,))]


def test_split_never_moves_a_delete_past_a_call_that_touches_its_ids():
    body = [Call(1, (100,), (1,)), Delete((1,)), Call(1, (50,), (1,)), Call(1, (1,), (2,))]
    out = split(body, (0, 2, 3))
    # call 2 writes 1 again after the Delete: the first run ends before it (too short to fuse)
    assert out[:2] == [body[0], body[1]]
    assert type(out[2]) is FusedSegment and out[2].calls == (body[2], body[3]) and out[2].inputs == (50,)
    assert out[2].outputs == (1, 2)  # never deleted again: state the step keeps
