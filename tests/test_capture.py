"""Capture and replay (dt.compile, dt.capture): replays equal eager steps bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.ir.instructions import MergedAllReduce

from .helpers import BITWISE, assert_close, bad_index_raises
from .test_modules import MLP, Block, distribute_module, tp_plan_block, tp_plan_mlp
from .test_parallelize import GPT, lm_loss, plan


def train_step(model, opt, x, y, loss_fn=F.mse_loss):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def run(step, model, opt, batches, loss_fn=F.mse_loss):
    """Losses (controller tensors) of ``step`` over ``batches``; reads happen after every call."""
    return [step(model, opt, x, y, loss_fn).full_tensor() for x, y in batches]


def dist_batches(batches, mesh, placements):
    return [(dt.distribute_tensor(x, mesh, placements), dt.distribute_tensor(y, mesh, placements)) for x, y in batches]


def assert_bitwise(a_params, b_params):
    for (name, a), b in zip(a_params, b_params):
        if BITWISE:
            assert torch.equal(a.full_tensor(), b.full_tensor()), name
        else:
            assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-5, atol=1e-6, msg=name)


OPTIMIZERS = {
    "adamw": lambda params: dt.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def eager_sgd_like_replay(params):
    """OPTIMIZERS["sgd"] as a compiled step runs it: from its first recorded call on, torch's
    fused kernel, with the lr read from a float32 tensor (optim_replay)."""
    opt = torch.optim.SGD(params, lr=torch.tensor(0.05).item(), momentum=0.9)

    def to_fused(opt, args, kwargs):
        for group in opt.param_groups:
            group["fused"], group["foreach"] = True, False

    opt.register_step_post_hook(to_fused)
    return opt


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_mlp_replay_equals_eager_bitwise_and_torch(mesh, optimizer):
    torch.manual_seed(0)
    ref = MLP()
    eager = distribute_module(copy.deepcopy(ref), mesh, tp_plan_mlp(mesh))
    replayed = distribute_module(copy.deepcopy(ref), mesh, tp_plan_mlp(mesh))
    place = [dt.Shard(0)] + [dt.Replicate()] * (mesh.ndim - 1)  # 10 rows: uneven over 4 ranks
    batches = [(torch.randn(10, 12), torch.randn(10, 5)) for _ in range(7)]
    data = dist_batches(batches, mesh, place)
    make = OPTIMIZERS[optimizer]

    step = dt.compile(train_step)
    got = run(step, replayed, make(replayed.parameters()), data)
    eager_opt = eager_sgd_like_replay(eager.parameters()) if optimizer == "sgd" else make(eager.parameters())
    expected = run(train_step, eager, eager_opt, data)
    assert step.replays == 4  # warm-up, two recordings, then replays
    assert all(torch.equal(g, e) for g, e in zip(got, expected)), (got, expected)
    assert_bitwise(eager.named_parameters(), replayed.parameters())

    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1) if optimizer == "adamw" else make(
        ref.parameters())
    plain = [train_step(ref, torch_opt, x, y) for x, y in batches]
    assert torch.stack(got).tolist() == pytest.approx(torch.stack(plain).tolist(), rel=1e-4)
    for (name, p_ref), p in zip(ref.named_parameters(), replayed.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert dt.fallback_counts() == {}


def test_transformer_block_replay_equals_eager_bitwise(mesh):
    torch.manual_seed(0)
    ref = Block()
    eager = distribute_module(copy.deepcopy(ref), mesh, tp_plan_block(mesh))
    replayed = distribute_module(copy.deepcopy(ref), mesh, tp_plan_block(mesh))
    place = [dt.Shard(0)] + [dt.Replicate()] * (mesh.ndim - 1)
    batches = [(torch.randn(3, 7, 16), torch.randn(3, 7, 16)) for _ in range(5)]
    data = dist_batches(batches, mesh, place)
    step = dt.compile(train_step)
    got = run(step, replayed, OPTIMIZERS["adamw"](replayed.parameters()), data)
    expected = run(train_step, eager, OPTIMIZERS["adamw"](eager.parameters()), data)
    assert step.replays == 2
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert_bitwise(eager.named_parameters(), replayed.parameters())
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    plain = [train_step(ref, torch_opt, x, y) for x, y in batches]
    assert torch.stack(got).tolist() == pytest.approx(torch.stack(plain).tolist(), rel=1e-4)


def test_tensor_and_data_parallel_gpt_replays_like_torch(mesh2d):
    torch.manual_seed(0)
    ref = GPT()
    model = dt.nn.parallelize_module(copy.deepcopy(ref), mesh2d["tp"], plan(False))
    model = dt.nn.data_parallel(model, mesh2d["dp"])
    # 3 sequences over 2 data-parallel ranks: uneven; gradients are Partial over dp
    batches = [(torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7))) for _ in range(5)]
    data = dist_batches(batches, mesh2d, [dt.Shard(0), dt.Replicate()])
    step = dt.compile(train_step)
    got = run(step, model, OPTIMIZERS["adamw"](model.parameters()), data, lm_loss)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    plain = [train_step(ref, torch_opt, x, y, lm_loss) for x, y in batches]
    assert step.replays == 2
    assert torch.stack(got).tolist() == pytest.approx(torch.stack(plain).tolist(), rel=1e-4)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)
    # data_parallel reduces the gradients over dp together: one merged exchange in the program
    program = next(iter(step._captured.values())).program
    assert sum(type(i) is MergedAllReduce for i in program.instructions) >= 1


def test_merged_all_reduces_equal_separate_ones_bitwise(mesh2d):
    torch.manual_seed(0)
    ref = GPT()
    # gradients left Partial (no reduction in backward): the optimizer's per-parameter all-reduces
    # are what the program merges
    models = [dt.nn.data_parallel(dt.nn.parallelize_module(copy.deepcopy(ref), mesh2d["tp"], plan(False)),
                                  mesh2d["dp"], reduce_together=False) for _ in range(2)]
    batches = [(torch.randint(0, 23, (3, 7)), torch.randint(0, 23, (3, 7))) for _ in range(5)]
    data = dist_batches(batches, mesh2d, [dt.Shard(0), dt.Replicate()])
    merged, unmerged = dt.compile(train_step), dt.compile(train_step, merge_collectives=False)
    a = run(merged, models[0], OPTIMIZERS["adamw"](models[0].parameters()), data, lm_loss)
    b = run(unmerged, models[1], OPTIMIZERS["adamw"](models[1].parameters()), data, lm_loss)
    assert next(iter(unmerged._captured.values())).program.merged == 0
    assert next(iter(merged._captured.values())).program.merged >= 10
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert_bitwise(models[0].named_parameters(), models[1].parameters())


def test_dropout_draws_fresh_numbers_on_each_replay_as_eager_does(mesh1d):
    def noisy(x):
        return F.dropout(x, 0.5, training=True) * 2

    x = dt.distribute_tensor(torch.ones(9, 6), mesh1d, [dt.Shard(0)])
    step = dt.compile(noisy)
    dt.manual_seed(5)
    got = [step(x).full_tensor() for _ in range(6)]
    dt.manual_seed(5)
    expected = [noisy(x).full_tensor() for _ in range(6)]
    assert step.replays == 3
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert not torch.equal(got[3], got[4]) and not torch.equal(got[4], got[5])


def test_memory_does_not_grow_over_replays(mesh):
    torch.manual_seed(0)
    model = distribute_module(MLP(), mesh, tp_plan_mlp(mesh))
    opt = OPTIMIZERS["adamw"](model.parameters())
    place = [dt.Shard(0)] + [dt.Replicate()] * (mesh.ndim - 1)
    x, y = dist_batches([(torch.randn(10, 12), torch.randn(10, 5))], mesh, place)[0]
    step = dt.compile(train_step)
    for _ in range(5):
        step(model, opt, x, y)
    def held():  # what the workers' stores hold (a GPU's allocator counters move with its cache)
        return [(s["live_tensors"], s["bytes"]) for s in dt.memory_stats()]

    before = held()
    for _ in range(20):
        step(model, opt, x, y)
    assert held() == before


def test_new_input_specs_recapture_and_both_programs_stay_right(mesh1d):
    lin = distribute_module(nn.Linear(6, 4), mesh1d, {"weight": [dt.Shard(0)]})

    def forward(model, x):
        return model(x).relu()

    step = dt.compile(forward)
    for shape, placement in [((5, 6), dt.Shard(0)), ((3, 6), dt.Replicate()), ((5, 6), dt.Shard(0))] * 4:
        x = torch.randn(shape)
        out = step(lin, dt.distribute_tensor(x, mesh1d, [placement]))
        with torch.no_grad():
            assert_close(out.full_tensor(), forward(lin, dt.distribute_tensor(x, mesh1d, [placement])).full_tensor())
    assert len(step._captured) == 2 and step.replays > 0


def test_guard_mismatch_raises_when_recapture_is_off(mesh1d):
    step = dt.compile(lambda x: x * 2, recapture=False, warmup=0, verify=False)
    step(dt.distribute_tensor(torch.ones(4, 3), mesh1d, [dt.Shard(0)]))
    with pytest.raises(dt.GuardError, match=r"argument 0 is \(5, 3\).*captured with \(4, 3\)"):
        step(dt.distribute_tensor(torch.ones(5, 3), mesh1d, [dt.Shard(0)]))


def test_optimizer_settings_are_guarded(mesh1d):
    torch.manual_seed(0)
    ref = MLP()
    model = distribute_module(copy.deepcopy(ref), mesh1d, tp_plan_mlp(mesh1d))
    eager = distribute_module(copy.deepcopy(ref), mesh1d, tp_plan_mlp(mesh1d))
    opt, eager_opt = OPTIMIZERS["sgd"](model.parameters()), eager_sgd_like_replay(eager.parameters())
    data = dist_batches([(torch.randn(10, 12), torch.randn(10, 5)) for _ in range(10)], mesh1d, [dt.Shard(0)])
    step = dt.compile(train_step)
    for i, (x, y) in enumerate(data):
        if i == 6:  # a new momentum (a setting frozen into the program): the step is captured again
            for o in (opt, eager_opt):
                o.param_groups[0]["momentum"] = 0.5
        assert torch.equal(step(model, opt, x, y).full_tensor(), train_step(eager, eager_opt, x, y).full_tensor())
    assert step.captures == 2 and step.replays == 10 - 3 - 2


def test_reads_inside_a_captured_function_are_refused(mesh1d):
    x = dt.distribute_tensor(torch.randn(4, 4), mesh1d, [dt.Shard(0)])

    def branchy(x):
        y = x * 2
        if y.sum() > 0:  # a value read: control flow a replay could not repeat
            return y
        return -y

    step = dt.compile(branchy, warmup=0)
    with pytest.raises(dt.CaptureError, match=r"reads tensor values.*test_capture.py"):
        step(x)


def test_plain_tensor_argument_is_replicated_on_the_steps_mesh(mesh1d):
    w = dt.distribute_tensor(torch.randn(3), mesh1d, [dt.Shard(0)])
    step = dt.compile(lambda w, x: w + x)
    for i in range(5):
        x = torch.full((3,), float(i))
        assert_close(step(w, x), w.full_tensor() + x)
    assert step.replays == 2


def test_values_computed_on_the_controller_are_refused(mesh1d):
    x = dt.distribute_tensor(torch.randn(4, 3), mesh1d, [dt.Shard(0)])
    calls = [0]

    def scaled(x):
        calls[0] += 1
        return x * calls[0]  # a Python number that changes each call: frozen into a capture

    step = dt.compile(scaled)
    step(x)
    step(x)
    with pytest.raises(dt.CaptureError, match=r"not issue the same work.*torch.optim optimizers .* are handled"):
        step(x)


def test_dead_work_is_dropped_and_results_unchanged(mesh1d):
    def wasteful(x, w):
        unused = (x @ w).exp().sum()  # noqa: F841  (nothing reads it)
        return (x * 3).relu()

    x = dt.distribute_tensor(torch.randn(6, 5), mesh1d, [dt.Shard(0)])
    w = dt.distribute_tensor(torch.randn(5, 4), mesh1d, [dt.Shard(1)])
    step = dt.compile(wasteful)
    outs = [step(x, w).full_tensor() for _ in range(4)]
    program = next(iter(step._captured.values())).program
    assert program.eliminated >= 3
    for out in outs:
        assert torch.equal(out, (x.full_tensor() * 3).relu())


def test_capture_block_updates_state_in_place_on_replay(mesh1d):
    acc = dt.distribute_tensor(torch.arange(10.0), mesh1d, [dt.Shard(0)])
    inc = dt.distribute_tensor(torch.ones(10), mesh1d, [dt.Shard(0)])
    with dt.capture() as graph:
        acc.mul_(2).add_(inc)
    assert torch.equal(acc.full_tensor(), torch.arange(10.0) * 2 + 1)
    graph.replay()
    graph.replay()
    assert torch.equal(acc.full_tensor(), ((torch.arange(10.0) * 2 + 1) * 2 + 1) * 2 + 1)


@bad_index_raises
def test_failure_inside_a_replay_names_the_op_and_line(mesh1d):
    def step(x, idx):
        return x.index_select(0, idx)

    x = dt.distribute_tensor(torch.randn(5, 3), mesh1d, [dt.Replicate()])
    ok = dt.distribute_tensor(torch.tensor([0, 2]), mesh1d, [dt.Replicate()])
    bad = dt.distribute_tensor(torch.tensor([0, 99]), mesh1d, [dt.Replicate()])
    compiled = dt.compile(step)
    for _ in range(4):
        compiled(x, ok)
    out = compiled(x, bad)
    with pytest.raises(dt.WorkerError, match=r"index_select.*test_capture.py"):
        out.full_tensor()
    assert torch.equal(compiled(x, ok).full_tensor(), x.full_tensor()[[0, 2]])  # the worker keeps serving
