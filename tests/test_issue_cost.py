"""The controller's issue cost in real model steps (issues 14 and 18): ops of several outputs
(norms, chunk/split/unbind, max, var_mean, None outputs of backward ops) and decompositions that plan
the op itself for whole inputs (softmax, losses) are served by the native hot path on a cache
hit, with the Python path's instructions, values, structure and errors. The value checks run on
every path (CI runs the suite again with DTORCH_NATIVE_DISPATCH=0); the native counts only where
the extension is active."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.planner import native_dispatch

from .helpers import assert_close, python_path
from .test_native_dispatch import _calls, held_instructions

NATIVE = native_dispatch.active() == "native"
aten = torch.ops.aten

# 9 rows / 7 columns on the test mesh: uneven shards (and empty ones where the mesh is large)
PLACEMENTS = [[dt.Replicate()], [dt.Shard(0)], [dt.Shard(1)]]

MULTI_OUTPUT = {
    "layer_norm": lambda x: aten.native_layer_norm.default(x, [7], None, None, 1e-5),
    "chunk": lambda x: x.chunk(3, dim=1),  # split: a list of views
    "unbind": lambda x: x.unbind(0),
    "max_dim": lambda x: torch.max(x, dim=1),
    "var_mean": lambda x: torch.var_mean(x, dim=1),
    "norm_backward_nones": lambda x: aten.native_layer_norm_backward.default(
        x, x, [7], x.mean(1, keepdim=True), x.std(1, keepdim=True), None, None, [True, False, False]),
}


def _counts():
    if not NATIVE:
        return (0, 0)
    from dtorch_core import _fastpath

    return _fastpath.counts()


def _full(out):
    if isinstance(out, (tuple, list)):
        return type(out)(_full(o) for o in out)
    if hasattr(out, "full_tensor"):
        return out.full_tensor()
    return out


def _same(got, want):
    assert type(got) is type(want)
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif want is None:
        assert got is None
    else:
        assert_close(got, want)


@pytest.mark.parametrize("placements", PLACEMENTS, ids=["R", "S0", "S1"])
@pytest.mark.parametrize("name", sorted(MULTI_OUTPUT))
def test_ops_of_several_outputs_match_torch_and_the_python_path(mesh1d, name, placements):
    fn = MULTI_OUTPUT[name]
    x = torch.randn(9, 7)
    a = dt.distribute_tensor(x, mesh1d, placements)
    want = fn(x)
    with python_path():
        fn(a)  # the plans are built by the Python path; both paths then hit the cache
    session = session_module._session
    runs = {}
    for path, ctx in (("python", python_path), ("native", contextlib.nullcontext)):
        start = session._tid
        before = _counts()
        with ctx(), held_instructions() as held:
            out = fn(a)
        after = _counts()
        moved = any(type(i).__name__ in ("Collective", "MergedAllReduce") for batch in held for i in batch)
        runs[path] = (start, _calls(held), out, (after[0] - before[0], after[1] - before[1]), moved)
    (p_start, p_calls, p_out, _, _), (n_start, n_calls, n_out, n_counts, moved) = runs["python"], runs["native"]
    _same(_full(n_out), want)
    _same(_full(p_out), want)
    assert len(n_calls) == len(p_calls)
    shift = n_start - p_start
    for p, n in zip(p_calls, n_calls):
        assert n.plan_id == p.plan_id and n.seed == p.seed and n.source == p.source
        assert n.outputs == tuple(t if t == -1 else t + shift for t in p.outputs)
    flat_p = p_out if isinstance(p_out, (tuple, list)) else (p_out,)
    flat_n = n_out if isinstance(n_out, (tuple, list)) else (n_out,)
    for p, n in zip(flat_p, flat_n):
        if p is None:
            assert n is None
            continue
        assert n._spec is p._spec and n._view == p._view
        assert getattr(n, "_view_state", 0) == getattr(p, "_view_state", 0)
    if NATIVE:
        # none to the Python dispatcher; where nothing moves, every op's Call is made in C++
        assert n_counts[1] == 0, n_counts
        if not moved:
            assert n_counts[0] == len(n_calls), n_counts


def test_a_known_size_output_is_rebuilt_in_place():
    # flash attention's max_q/max_k: sizes the controller knows, put back where the op returns them
    from dtorch_core.planner.trees import Rebuild, flatten_outputs

    flat, rebuild = flatten_outputs((torch.zeros(2), 5, None, torch.ones(1)))
    assert type(rebuild) is Rebuild and rebuild.kind is tuple and rebuild.sizes == ((1, 5),)
    assert flat[1] is None and flat[2] is None
    assert rebuild(["a", None, None, "d"]) == ("a", 5, None, "d")
    assert flatten_outputs([torch.zeros(1)])[1](["x"]) == ["x"]


@pytest.mark.parametrize("placements", PLACEMENTS, ids=["R", "S0", "S1"])
def test_decompositions_plan_the_op_itself_for_whole_inputs(mesh1d, placements):
    # softmax over an unsharded dim, losses of whole inputs: planned with the op's rule once per key
    # (so a cache hit is native); a sharded dim still decomposes; values are torch's either way
    x = torch.randn(9, 7, requires_grad=True)
    target = torch.randint(0, 7, (9,))
    y = torch.randn(9, 7)

    def step(x, target, y):
        return [F.softmax(x, dim=1), F.log_softmax(x, dim=1), F.cross_entropy(x, target),
                F.mse_loss(x, y), F.nll_loss(F.log_softmax(x, dim=1), target, reduction="sum")]

    want = step(x, target, y)
    torch.autograd.backward(want[2] + want[3] + want[4])
    a = dt.distribute_tensor(x.detach(), mesh1d, placements).requires_grad_()
    t = dt.distribute_tensor(target, mesh1d, [dt.Replicate()])
    b = dt.distribute_tensor(y, mesh1d, placements)
    for i in range(4):
        before = _counts()
        got = step(a, t, b)
        torch.autograd.backward(got[2] + got[3] + got[4])
        after = _counts()
        for g, w in zip(got, want):
            assert_close(g.full_tensor(), w.detach())
        assert_close(a.grad.full_tensor(), x.grad * (i + 1))
        if NATIVE and i >= 2 and placements == [dt.Replicate()]:
            # whole inputs: every op of the step and its backward is a native cache hit (from the
            # third step: the second one plans the accumulation of the gradient)
            assert after[1] - before[1] == 0, (before, after)


def test_the_plans_of_whole_inputs_skip_the_decomposition(mesh1d):
    # the decision is made when the plan is built: the cache holds the op's DirectPlan, not a
    # FunctionPlan that would call dispatch_direct on every call
    from dtorch_core.planner.plans import DirectPlan

    a = dt.distribute_tensor(torch.randn(9, 7), mesh1d, [dt.Replicate()])
    s = dt.distribute_tensor(torch.randn(9, 7), mesh1d, [dt.Shard(1)])
    session = session_module._session
    F.softmax(a, dim=1)
    F.softmax(s, dim=1)
    kinds = {tuple(k[1][0].placements): type(p).__name__ for k, p in session.plans.items()
             if type(k) is tuple and len(k) == 2 and k[0] is aten._softmax.default}
    assert kinds[(dt.Replicate(),)] == DirectPlan.__name__
    assert kinds[(dt.Shard(1),)] == "FunctionPlan"


def test_an_optimizer_with_a_scheduler_keeps_the_plan_cache_bounded(mesh1d):
    # torch.optim's foreach calls carry numbers that change every step (step sizes, a scheduled
    # learning rate); the dispatcher's cache must not gain an entry per step (it did: two per
    # AdamW step, more with a scheduler). Values as torch.optim's on plain tensors.
    torch.manual_seed(0)
    init = [torch.randn(9, 7), torch.randn(7), torch.randn(5, 3)]
    plain = [t.clone().requires_grad_() for t in init]
    dist = [dt.distribute_tensor(t, mesh1d, pl).requires_grad_()
            for t, pl in zip(init, ([dt.Shard(0)], [dt.Replicate()], [dt.Shard(1)]))]
    sides = []
    for params in (plain, dist):
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
        sides.append((params, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)))
    session = session_module._session
    sizes = []
    for step in range(8):
        for params, opt, sched in sides:
            sum((p * p).sum() for p in params).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        sizes.append(len(session.plans))
    for p, d in zip(plain, dist):
        assert_close(d.full_tensor(), p.detach())
    assert sizes[-1] == sizes[3], sizes
