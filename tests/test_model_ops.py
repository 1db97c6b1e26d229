"""The workers run the aten ops torch runs for real model blocks, not decompositions of them.

For each block of bench/_blocks.py (Llama, GPT-2, T5, DiT) with every tensor whole on each worker
(parameters and batch replicated), the ops of a training step that the workers are sent (the
``Call`` instructions recorded on the controller) must be the same multiset as the aten ops
plain torch runs for the same step on the same device (seen by a TorchDispatchMode): the same
norm, attention, loss and activation kernels, and no extra copies. The losses match too.
"""

from __future__ import annotations

import collections
import importlib.util
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call, DefinePlan
from dtorch_core.nn import linear as one_op

from .helpers import DEVICE, assert_close

_BLOCKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "_blocks.py")
_spec = importlib.util.spec_from_file_location("dtorch_bench_blocks", _BLOCKS)
blocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(blocks)

# dtorch kernels that run one aten op when the whole tensor is on the worker, by the op's name
KERNEL_OPS = {"dtorch::embedding": "embedding", "dtorch::embedding_backward": "embedding_dense_backward",
              "dtorch::mean": "mean.dim", "dtorch::linear": "dtorch.linear",
              "dtorch::linear_backward": "dtorch.linear_backward"}
# the same work under another name on the worker:
# - squeeze.dims: dtorch squeezes the dims that are 1 globally (a local shard may have others)
# - dtorch.zeros: the factory kernel making zeros (torch's ``at::zeros`` for the gradient of an
#   unused chunk is made on the workers, not sent)
EQUIVALENT = {"squeeze.dims": "squeeze.dim", "dtorch.zeros": "zeros"}


def _name(op_or_target: str) -> str:
    name = KERNEL_OPS.get(op_or_target, op_or_target)
    name = name.split("/")[-1].replace("aten::", "").replace("aten.", "")
    name = name[: -len(".default")] if name.endswith(".default") else name
    return EQUIVALENT.get(name, name)


class _TorchOps(TorchDispatchMode):
    """The aten ops torch runs on the model's tensors. Not counted: the optimizer's step
    counters (CPU tensors that torch.optim updates and reads on the host, on the controller in
    dtorch too), the constants it makes for them (``lift_fresh``) and profiler markers."""

    def __init__(self, opt):
        super().__init__()
        self.ops = collections.Counter()
        self.opt = opt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        steps = {id(s["step"]) for s in self.opt.state.values() if isinstance(s.get("step"), torch.Tensor)}
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        host = func.namespace == "profiler" or func is torch.ops.aten.lift_fresh.default
        if not host and not any(id(t) in steps for t in flat):
            self.ops[_name(str(func))] += 1
        return func(*args, **(kwargs or {}))


class _LinearsAsOneOp(TorchFunctionMode):
    """Plain torch with every ``F.linear`` as the one op (forward and backward) that dtorch's
    Linears run (dtorch_core/nn/linear.py; tests/test_linear.py checks those against F.linear):
    the rest of the step's ops are torch's own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.linear:
            with torch._C.DisableTorchFunction():
                return one_op._Linear.apply(*args, *(kwargs or {}).values())
        return func(*args, **(kwargs or {}))


def _worker_ops(rec, session) -> collections.Counter:
    ops = collections.Counter()
    for ins in rec.instructions:
        if type(ins) is Call:
            define = session.plan_names[ins.plan_id]
            ops[_name(define.op_name if define.target == "dtorch::factory" else define.target)] += 1
        elif type(ins) is not DefinePlan:
            ops[_name(f"<{type(ins).__name__}>")] += 1
    return ops


@pytest.mark.parametrize("family", blocks.FAMILIES)
def test_workers_run_the_ops_torch_runs(mesh1d, family):
    torch.manual_seed(0)
    model, batch_fn, loss_fn = blocks.make(family, "tiny")
    dmodel, _, _ = blocks.make(family, "tiny")
    dmodel.load_state_dict(model.state_dict())
    model = model.to(DEVICE)
    dmodel = dt.nn.parallelize_module(dmodel, mesh1d, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    dopt = torch.optim.AdamW(dmodel.parameters(), lr=1e-2, foreach=True)
    session = current_session()
    for step in range(2):  # the second step has optimizer state, as every later one
        batch = batch_fn(step)
        dbatch = tuple(dt.distribute_tensor(t, mesh1d, [dt.Replicate()]) for t in batch)
        batch = tuple(t.to(DEVICE) for t in batch)
        with _LinearsAsOneOp(), _TorchOps(opt) as seen:
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
        with session.recording() as rec:
            dloss = loss_fn(dmodel, dbatch)
            dloss.backward()
            dopt.step()
            dopt.zero_grad()
        assert_close(dloss.full_tensor().cpu(), loss.detach().cpu(), rtol=1e-4, atol=1e-5)
        sent = _worker_ops(rec, session)
        missing, extra = seen.ops - sent, sent - seen.ops
        assert not missing and not extra, (
            f"{family} step {step}: torch ran {dict(missing)} that the workers did not; the workers ran "
            f"{dict(extra)} that torch did not")
    assert dt.fallback_counts() == {}


def test_plain_zeros_are_made_on_the_workers(mesh1d):
    # the gradient of an unused chunk is an at::zeros tensor on the controller: it becomes a
    # factory call (no data sent, so a captured step can still be a device graph); other plain
    # tensors are sent as before
    x = dt.distribute_tensor(torch.randn(4, 6), mesh1d, [dt.Shard(0)])
    session = current_session()
    for plain, sent in ((torch.zeros(4, 6), 0), (torch.ones(4, 6), 1)):
        with session.recording() as rec:
            y = x + plain
        puts = sum(type(i).__name__ == "Put" for i in rec.instructions)
        assert puts == sent
        assert_close(y.full_tensor(), x.full_tensor() + plain)
    w = torch.randn(4, 12, requires_grad=True)
    dw = dt.distribute_tensor(w.detach(), mesh1d, [dt.Replicate()]).requires_grad_()
    with session.recording() as rec:
        a, _ = dw.chunk(2, dim=1)
        a.sum().backward()
    assert not any(type(i).__name__ == "Put" for i in rec.instructions)
    a, _ = w.chunk(2, dim=1)
    a.sum().backward()
    assert_close(dw.grad.full_tensor(), w.grad)


@pytest.mark.parametrize("take", ["chunk", "split_with_sizes", "unbind"])
def test_autograd_zeros_are_known_without_reading_them(mesh1d, monkeypatch, take):
    # inside autograd's split/unbind backwards the plain zeros for unused outputs are recognised
    # from the node torch is running: no Tensor.any() (a host sync on a GPU), no data sent
    pieces = {"chunk": lambda t: t.chunk(3, dim=1), "split_with_sizes": lambda t: t.split([2, 5, 2], dim=1),
              "unbind": lambda t: t.unbind(1)}[take]
    w = torch.randn(5, 9, requires_grad=True)
    dw = dt.distribute_tensor(w.detach(), mesh1d, [dt.Shard(0)]).requires_grad_()  # 5 rows: uneven
    reads = []
    real_any = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any", lambda t, *a, **k: reads.append(t.shape) or real_any(t, *a, **k))
    session = current_session()
    with session.recording() as rec:
        out = pieces(dw)
        (out[1] * 3).sum().backward()
    monkeypatch.undo()
    assert reads == []
    assert not any(type(i).__name__ == "Put" for i in rec.instructions)
    (pieces(w)[1] * 3).sum().backward()
    assert_close(dw.grad.full_tensor(), w.grad)


def test_plain_accelerator_tensors_are_read_for_zeros_only_while_a_capture_records(mesh1d):
    # in eager, Tensor.any() of a plain GPU tensor would sync the controller's stream for every
    # such input (diffusers' aranges on the ids' device): it goes as data instead
    from types import SimpleNamespace

    from dtorch_core.planner.plans import reads_for_zeros

    session = current_session()
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert reads_for_zeros(session, torch.zeros(2))
    assert not reads_for_zeros(session, on_gpu)
    with session.recording():
        assert reads_for_zeros(session, on_gpu)
