"""torch.optim optimizers and lr schedulers under dt.compile, unchanged: same losses as plain torch,
and replays from the capture on (optim_replay)."""

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
    replayed = [r for _, r in calls]
    lrs = [lr for lr, _ in calls]
    if optimizer in ("adam", "adamw"):
        # warm-up, two recordings, then every call replays: the lr mirror follows the scheduler
        assert replayed == [False] * 3 + [True] * (STEPS - 3)
        assert step.captures == 1
    else:
        # SGD's lr is frozen into its program: a call replays when it has the lr of the two
        # calls before it (a new lr records twice: capture and verification)
        assert replayed == [i >= 3 and lrs[i] == lrs[i - 1] == lrs[i - 2] for i in range(STEPS)]
        if scheduler != "cosine":  # a cosine schedule changes the lr on every step: nothing replays
            assert step.replays > 0
    assert dt.fallback_counts() == {}


def test_sgd_step_lr_recaptures_exactly_when_the_lr_changes(mesh1d):
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, "sgd", "step")
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    step = dt.compile(train_step)
    got, calls = loop(step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    changes = [i for i in range(1, STEPS) if calls[i][0] != calls[i - 1][0]]
    assert changes == [5, 10, 15]
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
    assert step.captures == 4 and step.replays == STEPS - 3 - 2 * 3


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
