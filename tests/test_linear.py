"""The one-op Linear (dtorch_core/nn/linear.py, ops/linear.py) against plain torch.

``dtorch::linear`` and ``dtorch::linear_backward`` must give F.linear's values and gradients on
every placement of input, weight and bias (uneven shards, Partial operands, 1-D to 4-D inputs),
keep the shards a sequence-parallel or tensor-parallel Linear has without moving data, and be
what the Linears of a distributed model run: one plan forward, one backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call
from dtorch_core.nn.linear import _Linear, linear
from dtorch_core.ops.linear import linear_backward_kernel, linear_kernel

from .helpers import P, R, S, assert_close, check_op, sample_placements

# uneven on 4 ranks: b 3 -> 1,1,1,0; m 10 -> 3,3,3,1; k 7 -> 2,2,2,1; n 5 -> 2,2,1,0
B, M, K, N = 3, 10, 7, 5

CASES = {
    "1d": [(K,), (N, K), (N,)],
    "2d": [(M, K), (N, K), (N,)],
    "2d_nobias": [(M, K), (N, K)],
    "3d": [(B, M, K), (N, K), (N,)],
    "3d_nobias": [(B, M, K), (N, K)],
    "4d": [(2, B, M, K), (N, K), (N,)],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_op_linear_matches_f_linear(mesh, name):
    ins = [torch.randn(s) for s in CASES[name]]
    for pl in sample_placements(ins, mesh, 5, seed=len(name)):
        check_op(linear, ins, pl, mesh)


# placements kept without moving any data (1-D mesh, uneven sizes), forward and backward
KEEPS = [
    # a sequence shard at batch 3: F.linear's (batch x seq) view would gather it
    ("sequence", [(B, M, K), (N, K), (N,)], [[S(1)], [R], [R]], [S(1)], [S(1), P, P]),
    ("batch", [(B, M, K), (N, K), (N,)], [[S(0)], [R], [R]], [S(0)], [S(0), P, P]),
    ("colwise", [(B, M, K), (N, K), (N,)], [[R], [S(0)], [S(0)]], [S(2)], [P, S(0), S(0)]),
    ("rowwise", [(B, M, K), (N, K)], [[S(2)], [S(1)]], [P], [S(2), S(1)]),
]


@pytest.mark.parametrize("case", KEEPS, ids=[c[0] for c in KEEPS])
def test_one_op_linear_keeps_shards(mesh1d, case):
    _, shapes, pl, out_pl, grad_pl = case
    ins = [torch.randn(s) for s in shapes]
    check_op(linear, ins, pl, mesh1d, expect_placements=out_pl)
    dins = [dt.distribute_tensor(t, mesh1d, p).requires_grad_() for t, p in zip(ins, pl)]
    with dt.debug.comm_mode() as comm:
        out = linear(*dins)
        # a Partial output's gradient arrives replicated (the style reduces the output)
        cot = dt.distribute_tensor(torch.randn(out.shape), mesh1d, [R] if out_pl == [P] else out_pl)
        grads = torch.autograd.grad(out, dins, cot)
    assert comm.counts() == {}, f"the linear moved data: {comm.counts_by_op()}"
    assert [tuple(g.placements) for g in grads] == [(p,) for p in grad_pl]


def test_kernels_give_torchs_own_values():
    """On plain tensors the kernels are torch's calls: the same bits as F.linear and its autograd."""
    torch.manual_seed(0)
    x, w, b = torch.randn(B, M, K, requires_grad=True), torch.randn(N, K, requires_grad=True), \
        torch.randn(N, requires_grad=True)
    out = F.linear(x, w, b)
    grad = torch.randn(out.shape)
    out.backward(grad)
    assert torch.equal(linear_kernel(x, w, b), out)
    gx, gw, gb = linear_backward_kernel(grad, x.detach(), w.detach(), [True, True, True])
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad) and torch.equal(gb, b.grad)
    assert gw.is_contiguous()  # the weight's own layout: its gradient accumulates without a copy
    skipped = linear_backward_kernel(grad, x.detach(), w.detach(), [False, True, False])
    assert skipped[0].numel() == 0 and skipped[2].numel() == 0


def test_double_backward_matches_torch(mesh1d):
    torch.manual_seed(0)
    x, w, b = torch.randn(B, M, K), torch.randn(N, K), torch.randn(N)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    dist = [dt.distribute_tensor(t, mesh1d, p).requires_grad_() for t, p in zip((x, w, b), ([S(1)], [R], [R]))]

    def second(fn, xs):
        gx, gw = torch.autograd.grad(fn(*xs).square().sum(), xs[:2], create_graph=True)
        return torch.autograd.grad(gx.sum() + gw.square().sum(), xs)

    for got, want in zip(second(linear, dist), second(F.linear, ref)):
        assert_close(got.full_tensor(), want, rtol=1e-4, atol=1e-4)


class _OwnForward(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 2


def _calls(rec) -> list[str]:
    session = current_session()
    return [session.plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]


def test_a_distributed_models_linears_are_one_op_each(mesh1d, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, N), _OwnForward(N, N))
    ref = nn.Sequential(nn.Linear(K, N), _OwnForward(N, N))
    ref.load_state_dict(model.state_dict())
    dmodel = dt.nn.parallelize_module(model, mesh1d, {})
    assert "forward" in vars(dmodel[0]) and "forward" not in vars(dmodel[1])  # a forward of its own stays
    x = torch.randn(B, M, K)
    dx = dt.distribute_tensor(x, mesh1d, [S(1)])
    with current_session().recording() as rec:
        out = dmodel[0](dx)
        out.backward(dt.distribute_tensor(torch.ones(out.shape), mesh1d, [S(1)]))
    calls = _calls(rec)
    assert calls.count("dtorch.linear.default") == 1 and calls.count("dtorch.linear_backward.default") == 1
    assert not any(name.startswith(("aten.addmm", "aten.mm", "aten.t.", "aten.view")) for name in calls), calls
    ref[0](x).backward(torch.ones(B, M, N))
    assert_close(dmodel[0].weight.grad.full_tensor(), ref[0].weight.grad, rtol=1e-4, atol=1e-4)
    assert_close(dmodel(dx).full_tensor(), ref(x).detach(), rtol=1e-4, atol=1e-4)

    monkeypatch.setenv("DTORCH_ONE_OP_LINEAR", "0")
    plain = dt.nn.parallelize_module(nn.Linear(K, N), mesh1d, {})
    assert "forward" not in vars(plain)


def test_plain_inputs_and_autocast_keep_f_linear(mesh1d):
    w, b = torch.randn(N, K), torch.randn(N)
    x = torch.randn(M, K)
    assert type(linear(x, w, b)) is torch.Tensor and torch.equal(linear(x, w, b), F.linear(x, w, b))
    dw, db = (dt.distribute_tensor(t, mesh1d, [R]) for t in (w, b))
    dx = dt.distribute_tensor(x, mesh1d, [R])
    with current_session().recording() as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(dx, dw, db)
    assert out.dtype == torch.bfloat16 and "dtorch.linear.default" not in _calls(rec)


def test_the_function_is_torchs_on_plain_tensors():
    """tests/test_model_ops.py runs plain torch with its Linears as this Function: same values."""
    torch.manual_seed(0)
    x, w = torch.randn(B, M, K, requires_grad=True), torch.randn(N, K, requires_grad=True)
    out = _Linear.apply(x, w)
    out.sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    F.linear(x, w).sum().backward()
    assert torch.equal(out, F.linear(x, w)) and torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
