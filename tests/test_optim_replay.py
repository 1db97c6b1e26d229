"""torch.optim optimizers and lr schedulers under dt.compile, unchanged: same losses as plain torch,
and replays from the capture on (optim_replay): Adam, AdamW and SGD step with torch's fused
kernels, one worker call per param group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

import dtorch_core as dt
from dtorch_core.controller.session import current_session

from .helpers import DEVICE, WORLD_SIZE, assert_close
from .test_modules import distribute_module

STEPS = 20


class MLP(nn.Module):
    # 18 hidden units and 5 outputs: uneven shards over 4 ranks
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 18)
        self.fc2 = nn.Linear(18, 5)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def plan(mesh):
    r = [dt.Replicate()] * (mesh.ndim - 1)
    return {"fc1.weight": r + [dt.Shard(0)], "fc1.bias": r + [dt.Shard(0)], "fc2.weight": r + [dt.Shard(1)]}


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}
SCHEDULERS = {
    "step": lambda o: lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
    "lambda": lambda o: lr_scheduler.LambdaLR(o, lambda e: min(1.0, (e + 1) / 4)),  # linear warm-up
    "cosine": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
}


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def setup(mesh, optimizer, scheduler):
    torch.manual_seed(0)
    ref = MLP()
    model = distribute_module(copy.deepcopy(ref), mesh, plan(mesh))
    make, sched = OPTIMIZERS[optimizer], SCHEDULERS[scheduler]
    ref_opt, opt = make(ref.parameters()), make(model.parameters())
    batches = [(torch.randn(10, 6), torch.randn(10, 5)) for _ in range(STEPS)]
    return ref, ref_opt, sched(ref_opt), model, opt, sched(opt), batches


def loop(step, model, opt, sched, batches, place=None):
    """Losses and, per call, (lr used, whether the call replayed)."""
    losses, calls = [], []
    for x, y in batches:
        if place is not None:
            x, y = (dt.distribute_tensor(t, *place) for t in (x, y))
        before = getattr(step, "replays", 0)
        lr = opt.param_groups[0]["lr"]
        loss = step(model, opt, x, y)
        losses.append(loss.full_tensor() if isinstance(loss, dt.DTensor) else loss)
        calls.append((lr, getattr(step, "replays", 0) > before))
        sched.step()
    return torch.stack(losses), calls


def assert_like_torch(got, expected, model, ref):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_torch_optimizer_and_scheduler_replay_like_torch(mesh1d, optimizer, scheduler):
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, optimizer, scheduler)
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    step = dt.compile(train_step)
    got, calls = loop(step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    # warm-up, two recordings, then every call replays: the lr mirror follows the scheduler (SGD's
    # too: its fused kernel takes a Tensor lr)
    assert [r for _, r in calls] == [False] * 3 + [True] * (STEPS - 3)
    assert step.captures == 1
    assert {g["fused"] for g in opt.param_groups} == {True}
    assert dt.fallback_counts() == {}


class WeightDecaySteps:
    """Changes a frozen setting (weight_decay) every 5 steps, as StepLR changes the lr."""

    def __init__(self, opt):
        self.opt, self.n = opt, 0

    def step(self):
        self.n += 1
        if self.n % 5 == 0:
            for group in self.opt.param_groups:
                group["weight_decay"] = 1e-3 * self.n


def test_sgd_frozen_setting_recaptures_exactly_when_it_changes(mesh1d):
    ref, ref_opt, _, model, opt, _, batches = setup(mesh1d, "sgd", "step")
    ref_sched, sched = WeightDecaySteps(ref_opt), WeightDecaySteps(opt)
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    step = dt.compile(train_step)
    got, calls = loop(step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    changes = [5, 10, 15]
    assert step.captures == 1 + len(changes)
    recorded = [i for i, (_, r) in enumerate(calls) if not r]
    assert recorded == [0, 1, 2] + [k for c in changes for k in (c, c + 1)]


def test_optimizer_in_a_closure_is_tracked(mesh1d):
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, "sgd", "step")
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)

    @dt.compile
    def step(x, y):  # model and optimizer are closure variables, not arguments
        return train_step(model, opt, x, y)

    losses = []
    for x, y in batches:
        losses.append(step(*(dt.distribute_tensor(t, mesh1d, [dt.Shard(0)]) for t in (x, y))).full_tensor())
        sched.step()
    assert_like_torch(torch.stack(losses), expected, model, ref)
    assert step.captures == 1 and step.replays == STEPS - 3


def test_plain_tensor_batches_are_replicated_and_sent_each_call(mesh1d):
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, "adamw", "step")
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    seen = []

    def recording_step(model, opt, x, y):
        seen.append(type(x))
        return train_step(model, opt, x, y)

    step = dt.compile(recording_step)
    got, _ = loop(step, model, opt, sched, batches)  # the batches stay torch.Tensors
    assert_like_torch(got, expected, model, ref)
    assert seen == [torch.Tensor, dt.DTensor, dt.DTensor]  # warm-up unchanged, recordings replicated
    assert step.replays == STEPS - 3


def test_plain_tensor_with_no_mesh_to_choose_is_refused(runner):
    dt.init_device_mesh(DEVICE, (WORLD_SIZE,))
    dt.init_device_mesh(DEVICE, (1, WORLD_SIZE))
    step = dt.compile(lambda x: x * 2)
    step(torch.ones(3))  # the warm-up runs on the controller
    with pytest.raises(dt.CaptureError, match="several meshes.*Distribute it first"):
        step(torch.ones(3))


def test_plan_cache_does_not_grow_with_distinct_lr_values(mesh1d):
    torch.manual_seed(0)
    model = distribute_module(MLP(), mesh1d, plan(mesh1d))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    x, y = (dt.distribute_tensor(torch.randn(10, n), mesh1d, [dt.Shard(0)]) for n in (6, 5))
    step = dt.compile(train_step)
    session = current_session()
    sizes = []
    for _ in range(STEPS):
        step(model, opt, x, y).full_tensor()
        sched.step()
        sizes.append(len(session.plans))
    assert sizes[4] == sizes[-1], sizes
    assert step.replays == STEPS - 3


def test_eager_step_and_state_dict_after_compiled_steps(mesh1d):
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, "adamw", "cosine")
    extra = (torch.randn(10, 6), torch.randn(10, 5))
    loop(train_step, ref, ref_opt, ref_sched, batches)
    expected_last = train_step(ref, ref_opt, *extra)
    step = dt.compile(train_step)
    loop(step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    last = train_step(model, opt, *(dt.distribute_tensor(t, mesh1d, [dt.Shard(0)]) for t in extra))  # eager
    torch.testing.assert_close(last.full_tensor(), expected_last, rtol=1e-5, atol=0)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
    state = opt.state_dict()
    assert type(state["param_groups"][0]["lr"]) is float
    assert state["param_groups"][0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert state["state"][0]["step"].full_tensor().item() == STEPS + 1
    assert_close(state["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"], rtol=1e-4, atol=1e-6)


def program_ops(step) -> list:
    """The op of every worker call in the (one) captured program of ``step``."""
    session = current_session()
    (entry,) = step._captured.values()
    return [session.plan_names[i.plan_id].op_name for i in entry.program.instructions if type(i).__name__ == "Call"]


FUSED_OPS = {"adamw": "aten._fused_adamw_", "adam": "aten._fused_adam_", "sgd": "aten._fused_sgd_"}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_replayed_step_is_one_fused_call_per_param_group(mesh1d, optimizer):
    torch.manual_seed(0)
    model = distribute_module(MLP(), mesh1d, plan(mesh1d))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = OPTIMIZERS[optimizer]([{"params": weights}, {"params": biases, "weight_decay": 0.0}])
    sched = SCHEDULERS["cosine"](opt)
    x, y = (dt.distribute_tensor(torch.randn(10, n), mesh1d, [dt.Shard(0)]) for n in (6, 5))
    step = dt.compile(train_step)
    for _ in range(5):
        step(model, opt, x, y).full_tensor()
        sched.step()
    assert step.replays == 2
    ops = program_ops(step)
    fused = [op for op in ops if op.startswith(FUSED_OPS[optimizer] + ".")]
    assert fused == [FUSED_OPS[optimizer] + ".tensor_lr"] * 2, ops
    # no per-parameter update: besides the fused calls only the step counts' one foreach add
    # per group (Adam) and the forward and backward
    update = [op for op in ops if any(k in op for k in ("lerp", "addcdiv", "addcmul", "sqrt", "_foreach_"))]
    assert update == (["aten._foreach_add_.Scalar"] * 2 if optimizer != "sgd" else []), ops


class Narrow(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.fc1 = nn.Linear(6, 18)
        self.fc2 = nn.Linear(18, rows)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_params_with_fewer_rows_than_workers(mesh1d, optimizer):
    rows = max(1, WORLD_SIZE - 1)  # Shard(0) leaves at least one worker an empty shard (WORLD_SIZE > 1)
    torch.manual_seed(0)
    ref = Narrow(rows)
    s = [dt.Replicate()] * (mesh1d.ndim - 1) + [dt.Shard(0)]
    model = distribute_module(copy.deepcopy(ref), mesh1d, {"fc2.weight": s, "fc2.bias": s, "fc1.weight": s})
    ref_opt, opt = OPTIMIZERS[optimizer](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    ref_sched, sched = SCHEDULERS["cosine"](ref_opt), SCHEDULERS["cosine"](opt)
    batches = [(torch.randn(10, 6), torch.randn(10, rows)) for _ in range(STEPS)]
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    step = dt.compile(train_step)
    got, calls = loop(step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    assert [r for _, r in calls] == [False] * 3 + [True] * (STEPS - 3)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_data_parallel_partial_grads(mesh1d, optimizer):
    # params replicated, the batch sharded: the gradients are Partial when the optimizer steps
    torch.manual_seed(0)
    ref = MLP()
    model = distribute_module(copy.deepcopy(ref), mesh1d, {})
    ref_opt, opt = OPTIMIZERS[optimizer](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    ref_sched, sched = SCHEDULERS["cosine"](ref_opt), SCHEDULERS["cosine"](opt)
    batches = [(torch.randn(8, 6), torch.randn(8, 5)) for _ in range(STEPS)]
    grad_placements = []

    def step_fn(model, opt, x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grad_placements.append({p.grad.placements for p in model.parameters()})
        opt.step()
        return loss.detach()

    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    step = dt.compile(step_fn)
    got, calls = loop(step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    if WORLD_SIZE > 1:
        assert any(isinstance(pl, dt.Partial) for seen in grad_placements for pls in seen for pl in pls)
    assert [r for _, r in calls] == [False] * 3 + [True] * (STEPS - 3)
    for p in model.parameters():  # the state keeps the params' placement
        state = opt.state[p]
        for t in (v for k, v in state.items() if k != "step"):
            assert t.placements == p.placements
