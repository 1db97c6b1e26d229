"""torch.optim in eager on DTensors (optim_replay): Adam, AdamW and SGD left to torch's choice of
implementation, or asked for ``fused=True``, step with torch's fused kernels; an explicit
``foreach=True`` is kept. Same results as plain torch, and no new worker plans from step to step."""

from __future__ import annotations

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller.session import current_session

from .test_optim_replay import (
    OPTIMIZERS,
    SCHEDULERS,
    STEPS,
    assert_like_torch,
    loop,
    setup,
    train_step,
)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_default_optimizers_step_fused_like_torch_and_define_no_plans_per_step(mesh1d, optimizer):
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, optimizer, "cosine")
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    session = current_session()
    sizes = []

    def counting_step(*args):
        loss = train_step(*args)
        sizes.append(len(session.plans))
        return loss

    got, _ = loop(counting_step, model, opt, sched, batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    assert {g["fused"] for g in opt.param_groups} == {True}
    # the scheduler changes the lr every step and Adam's bias corrections change too: none of
    # it is a plan constant (the plain torch loop's step count is a Python number per step)
    assert sizes[2:] == [sizes[2]] * (STEPS - 2), sizes
    assert dt.fallback_counts() == {}


def test_fused_true_works_in_eager(mesh1d):
    torch.manual_seed(0)
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, "adamw", "step")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True, amsgrad=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, amsgrad=True)
    expected, _ = loop(train_step, ref, ref_opt, SCHEDULERS["step"](ref_opt), batches)
    got, _ = loop(train_step, model, opt, SCHEDULERS["step"](opt), batches, (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    state = opt.state[next(iter(model.parameters()))]
    assert type(state["step"]) is dt.DTensor and float(state["step"].full_tensor()) == STEPS
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def test_an_explicit_foreach_is_kept(mesh1d):
    ref, _, _, model, _, _, batches = setup(mesh1d, "adam", "step")
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    expected, _ = loop(train_step, ref, ref_opt, SCHEDULERS["step"](ref_opt), batches[:4])
    got, _ = loop(train_step, model, opt, SCHEDULERS["step"](opt), batches[:4], (mesh1d, [dt.Shard(0)]))
    assert_like_torch(got, expected, model, ref)
    assert [(g["foreach"], g["fused"]) for g in opt.param_groups] == [(True, None)]


def test_a_loaded_state_dict_is_converted_again(mesh1d):
    """opt.load_state_dict (a resumed run) brings torch's plain step counts back: the next step
    converts them again instead of trusting the state it converted before."""
    ref, ref_opt, ref_sched, model, opt, sched, batches = setup(mesh1d, "adamw", "step")
    expected, _ = loop(train_step, ref, ref_opt, ref_sched, batches)
    place = (mesh1d, [dt.Shard(0)])
    first, _ = loop(train_step, model, opt, sched, batches[:5], place)
    saved = opt.state_dict()
    for state in saved["state"].values():  # as a checkpoint written by plain torch holds it
        state["step"] = torch.tensor(float(state["step"].full_tensor()))
    opt.load_state_dict(saved)
    rest, _ = loop(train_step, model, opt, sched, batches[5:], place)
    assert_like_torch(torch.cat([first, rest]), expected, model, ref)
    assert all(type(s["step"]) is dt.DTensor for s in opt.state.values())
