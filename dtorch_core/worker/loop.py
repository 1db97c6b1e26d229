"""The worker: executes the instruction stream for one device rank.

It keeps a TensorStore (tensor id -> local tensor, or a WorkerFailure that records why the
tensor is missing). A failing kernel marks its outputs failed and the worker keeps serving; the
failure travels with the data (every op that uses a failed tensor fails the same way) and is
reported when the controller reads an affected tensor. An invalid instruction (``validate.py``:
checked before it runs, or failing with an error of bad data while it runs) is skipped, its
outputs marked failed and reported to the controller as a protocol error; the worker keeps
serving.

Collective instructions are in ``collectives.py``, programs (define, expand a replay) in
``programs.py``: :class:`Worker` takes their methods from the mixins there.
"""

from __future__ import annotations

import gc

import attrs
import structlog
import torch

from ..ir.instructions import (
    Call,
    Collective,
    DefineMesh,
    DefinePlan,
    DefineProgram,
    Delete,
    DropPlans,
    DropProgram,
    Fetch,
    MergedAllReduce,
    Number,
    Put,
    Reply,
    RunProgram,
    Slot,
    Stats,
    WorkerFailure,
)
from ..mesh import DeviceMesh, root_coordinate
from . import native
from .collectives import CollectiveStep, WorkerCollectives  # noqa: F401  (CollectiveStep: still importable from here)
from .fused import FusedSegment, build_graph, compile_segment, unalias
from .graphs import replay_graphed
from .programs import BindInputs, BoundConstant, NameOutputs, WorkerPrograms
from .streams import WorkerStreams
from .validate import CHECKED, INVALID, PROTOCOL, describe, outputs_of, problem

log = structlog.get_logger(__name__)


@attrs.frozen
class MeshView:
    """This rank's place on a mesh: per mesh dim (group index, index in group, group size)."""

    ranks: tuple
    groups: tuple


@attrs.define
class LocalPlan:
    fn: object
    bind: object
    op_name: str
    seeded: bool
    overload: object = None  # the OpOverload behind ``fn`` when it is a plain op (fused segments trace it)
    native: object = None  # the call for the native per-op path (worker/native.py), when it can take it


def on_device(x, device: torch.device):
    """``x`` with every torch.device of ``device``'s type (in tuples and lists too) made ``device``."""
    if type(x) is torch.device:
        return device if x.type == device.type else x
    if type(x) is tuple or type(x) is list:
        return type(x)(on_device(a, device) for a in x)
    return x


def _binder(args, kwargs):
    """A function (vals, numbers) -> (args, kwargs) with each Slot replaced by its input and each
    Number by the Call's number; fast for flat argument lists."""
    nested = any(type(a) in (tuple, list) and native.holds_placeholder(a) for a in (*args, *kwargs.values())) or any(
        type(v) is Slot for v in kwargs.values()
    )
    if not nested:
        positions = [(i, a.index) for i, a in enumerate(args) if type(a) is Slot]
        numbered = [(i, a.index) for i, a in enumerate(args) if type(a) is Number]
        named = [(k, v.index) for k, v in kwargs.items() if type(v) is Number]
        base = list(args)

        def bind(vals, numbers=()):
            a = base.copy()
            for i, j in positions:
                a[i] = vals[j]
            if not numbered and not named:
                return a, dict(kwargs) if kwargs else {}
            for i, j in numbered:
                a[i] = numbers[j]
            kw = dict(kwargs)
            for k, j in named:
                kw[k] = numbers[j]
            return a, kw

        return bind
    # lists of tensors, and of numbers (a foreach call's, ops/foreach_plan.py)
    return lambda vals, numbers=(): (_fill(args, vals, numbers), {k: _fill(v, vals, numbers) for k, v in kwargs.items()})


def _fill(x, vals, numbers):
    t = type(x)
    if t is Slot:
        return vals[x.index]
    if t is Number:
        return numbers[x.index]
    if t is tuple or t is list:
        return t([_fill(a, vals, numbers) for a in x])
    return x


class Worker(WorkerCollectives, WorkerPrograms):
    def __init__(self, rank: int, device: torch.device, kernels, exchange, reply, streams=None,
                 world_size: int | None = None, native_path: bool | None = None):
        self.rank = rank
        self.world_size = world_size  # when known: DefineMesh ranks are checked against it
        self.device = device
        self.kernels = kernels
        self.exchange = exchange
        self.reply = reply
        self.store: dict = {}
        self.plans: dict = {}
        self.programs: dict = {}
        self.graphs: dict = {}  # program id -> GraphState (devices whose streams capture graphs)
        self.meshes: dict = {}
        self.seq: dict = {}
        self.pending: list = []
        self.log = log.bind(rank=rank)
        # the device's compute/communication streams; the runner runs each batch in streams.run
        self.streams = streams if streams is not None else WorkerStreams(device)
        # fused segments (dt.compile(fuse_local=True)): made, run compiled, given up on
        self.fused_segments = 0
        self.fused_runs = 0
        self.fused_fallbacks = 0
        # runs of Calls in C++ (worker/native.py); None: every instruction takes the Python path
        self.run_calls = native.runner(LocalPlan, native_path)

    # -- stream ---------------------------------------------------------------------------
    def run_batch(self, batch) -> None:
        run_calls = self.run_calls
        if run_calls is None or type(batch) is not list:
            for ins in batch:
                self._run_one(ins)
            return
        i, n = 0, len(batch)
        while i < n:
            i, raised, in_kernel = run_calls(batch, i, self.store, self.plans, self.streams)
            if i >= n:
                return
            ins = batch[i]
            i += 1
            if raised is None:
                self._run_one(ins)
            elif in_kernel:
                self._kernel_failed(ins, self.plans[ins.plan_id], raised)
            elif isinstance(raised, INVALID):  # from join_reads: what _run_one does with it
                self.reject(ins, describe(ins, raised))
            else:
                raise raised

    def _run_one(self, ins) -> None:
        """Run one instruction of a batch; an invalid one is rejected, the worker keeps serving."""
        try:
            t = type(ins)
            if t in CHECKED:
                bad = problem(self, ins)
                if bad is not None:
                    self.reject(ins, describe(ins, message=bad))
                    return
            if t is RunProgram:
                if self.streams.can_capture and replay_graphed(self, ins):
                    return
                self._run_steps(self.expand_program(ins))
            else:
                self.execute(ins)
        except INVALID as exc:  # decodable but invalid: skip it, report it, keep serving
            self.reject(ins, describe(ins, exc))

    def _run_steps(self, steps: list) -> None:
        """A replay's steps, in order (their runs of Calls native where it is on)."""
        run_calls = self.run_calls
        if run_calls is None:
            for step in steps:
                self.execute(step)
            return
        i, n = 0, len(steps)
        while i < n:
            i, raised, in_kernel = run_calls(steps, i, self.store, self.plans, self.streams)
            if i >= n:
                return
            step = steps[i]
            i += 1
            if raised is None:
                self.execute(step)
            elif in_kernel:
                self._kernel_failed(step, self.plans[step.plan_id], raised)
            else:
                raise raised  # from join_reads: the replay fails as it does on the Python path

    def reject(self, ins, message: str) -> None:
        """Skip ``ins``: its outputs fail with ``message``, which also goes to the controller."""
        self.log.warning("rejected an instruction", instruction=type(ins).__name__, problem=message)
        source = getattr(ins, "source", None)  # a Call's (file, line) in the user's code
        if type(source) not in (tuple, str):
            source = None
        failure = WorkerFailure(self.rank, f"rejected {type(ins).__name__}", source, message)
        self._fail(outputs_of(ins), failure)
        self.reply(Reply(PROTOCOL, self.rank, error=failure))

    def execute(self, ins) -> None:
        t = type(ins)
        if t is Call:
            self._call(ins)
        elif t is Collective:
            self._collective(ins)
        elif t is Delete:
            pop = self.store.pop
            for tid in ins.tids:
                pop(tid, None)
        elif t is DefinePlan:
            self._define_plan(ins)
        elif t is Put:
            shard = ins.shards.get(self.rank)
            if shard is not None:
                self.store[ins.tid] = self.streams.to_device(shard)
        elif t is Fetch:
            poisoned = getattr(self.exchange, "poisoned", None)
            if poisoned is not None and (ins.everyone or self.rank in ins.ranks):
                self.reply(Reply(ins.request_id, self.rank, error=poisoned))
            elif self.rank not in ins.ranks:
                if ins.everyone:
                    self.reply(Reply(ins.request_id, self.rank))
            else:
                value = self.store.get(ins.tid)
                if value is None:
                    failure = WorkerFailure(self.rank, "fetch", None, f"tensor {ins.tid} is not on this worker")
                    self.reply(Reply(ins.request_id, self.rank, error=failure))
                elif type(value) is WorkerFailure:
                    self.reply(Reply(ins.request_id, self.rank, error=value))
                else:
                    self.reply(Reply(ins.request_id, self.rank, value=self.streams.to_host(value)))
        elif t is DefineMesh:
            self._define_mesh(ins)
        elif t is BindInputs:
            store = self.store
            for pid, tid in ins.pairs:
                value = store.get(tid)
                store[pid] = value if value is not None else self._lookup(tid)
        elif t is NameOutputs:
            store = self.store
            for pid, tid, move in ins.pairs:
                value = store.pop(pid, None) if move else store.get(pid)
                store[tid] = value if value is not None else self._lookup(pid)
            for pid in ins.drop:
                store.pop(pid, None)
        elif t is BoundConstant:
            self.store[ins.tid] = ins.value.clone() if ins.copy else ins.value
        elif t is MergedAllReduce:
            self._merged_all_reduce(ins)
        elif t is FusedSegment:
            self._fused(ins)
        elif t is DefineProgram:
            self._define_program(ins)
        elif t is DropProgram:
            self.programs.pop(ins.program_id, None)
            self.graphs.pop(ins.program_id, None)
        elif t is DropPlans:
            pop = self.plans.pop
            for plan_id in ins.plan_ids:
                pop(plan_id, None)
        elif t is Stats:
            self.streams.synchronize()  # a sync point: the device has finished what was issued
            self.reply(Reply(ins.request_id, self.rank, value=self.memory_stats() if ins.memory else None,
                             error=getattr(self.exchange, "poisoned", None)))
        else:
            raise TypeError(f"worker got an unknown instruction {ins!r}")

    # -- definitions ----------------------------------------------------------------------
    def _define_mesh(self, ins: DefineMesh) -> None:
        define = getattr(self.exchange, "define_mesh", None)
        if define is not None:  # communicators that need groups made by every rank
            define(ins.mesh_id, ins.shape, ins.ranks)
        root = DeviceMesh("worker", tuple(ins.shape), tuple(ins.ranks))
        coord = root_coordinate(root, self.rank)
        if coord is None:
            self.meshes[ins.mesh_id] = None
            return
        groups = []
        for d in range(len(ins.shape)):
            for gi, group in enumerate(root.groups(d)):
                if self.rank in group:
                    groups.append((gi, group.index(self.rank), len(group)))
                    break
        self.meshes[ins.mesh_id] = MeshView(tuple(ins.ranks), tuple(groups))

    def _define_plan(self, ins: DefinePlan) -> None:
        if self.meshes.get(ins.mesh_id) is None:
            return
        args, kwargs = ins.args, ins.kwargs
        if ins.rank_args and self.rank in ins.rank_args:
            args, kwargs = ins.rank_args[self.rank]
        if self.device.index is not None:
            # handles report the first device of their type (cuda:0); ``device=x.device`` in an op
            # means this worker's own device
            args, kwargs = on_device(args, self.device), {k: on_device(v, self.device) for k, v in kwargs.items()}
        overload = None
        try:
            fn = self.kernels.resolve(ins.target, self.device.type)
            if isinstance(fn, torch._ops.OpOverload):
                overload, fn = fn, fn._op  # the C++ callable: skips one Python frame per call
        except Exception as exc:  # an unknown kernel fails each call, not the worker
            message = f"{type(exc).__name__}: {exc}"

            def fn(*_a, **_k):
                raise RuntimeError(message)

        template = native.template(fn, args, kwargs, ins.seeded) if self.run_calls is not None else None
        self.plans[ins.plan_id] = LocalPlan(fn, _binder(args, kwargs), ins.op_name, ins.seeded, overload, template)


    # -- execution ------------------------------------------------------------------------
    def _lookup(self, tid):
        value = self.store.get(tid)
        if value is None:
            return WorkerFailure(self.rank, "?", None, f"tensor {tid} is not on this worker (deleted or never made)")
        return value

    def _call(self, ins: Call) -> None:
        plan = self.plans.get(ins.plan_id)
        if plan is None:
            return
        store = self.store
        vals = [store.get(t) for t in ins.inputs]
        for i, v in enumerate(vals):
            if v is None or type(v) is WorkerFailure:
                self._fail(ins.outputs, v if v is not None else self._lookup(ins.inputs[i]))
                return
        if self.streams.outstanding:
            self.streams.join_reads(vals)
        try:
            args, kwargs = plan.bind(vals, ins.numbers)
            if plan.seeded:
                kwargs["seed"] = ins.seed
            out = plan.fn(*args, **kwargs)
        except Exception as exc:
            self._kernel_failed(ins, plan, exc)
            return
        outs = ins.outputs
        if len(outs) == 1 and isinstance(out, torch.Tensor):
            if outs[0] >= 0:
                store[outs[0]] = out
            return
        for tid, o in zip(outs, out if isinstance(out, (list, tuple)) else (out,)):
            if tid >= 0:
                store[tid] = o

    def _kernel_failed(self, ins: Call, plan: LocalPlan, exc: Exception) -> None:
        self.log.debug("kernel failed", op=plan.op_name, source=ins.source, error=repr(exc))
        self._fail(ins.outputs, WorkerFailure(self.rank, plan.op_name, ins.source, f"{type(exc).__name__}: {exc}"))

    def _fused(self, seg: FusedSegment) -> None:
        store = self.store
        vals = [store.get(t) for t in seg.inputs]
        if seg.eager or any(v is None or type(v) is WorkerFailure for v in vals):
            for call in seg.calls:  # failures travel call by call, as in an eager step
                self._call(call)
            return
        if self.streams.outstanding:
            self.streams.join_reads(vals)
        try:
            fn = seg.fn
            if fn is None:
                module = build_graph(seg, self.plans)
                if module is None:  # not all of it is plain aten ops on this worker
                    seg.eager = True
                    for call in seg.calls:
                        self._call(call)
                    return
                fn = seg.fn = compile_segment(module)  # compiles on its first call, just below
            with torch.no_grad():  # worker tensors never need autograd; inference graphs compile faster
                outs = fn(*vals)
        except Exception as exc:
            self._fused_failed(seg, exc)
            return
        if seg.check_alias:
            outs, seg.check_alias = unalias(outs, vals)
        for tid, value in zip(seg.outputs, outs):
            store[tid] = value
        self.fused_runs += 1

    def _fused_failed(self, seg: FusedSegment, exc: Exception) -> None:
        """Run the calls one by one; if they succeed, the compiler was at fault: stop using it here."""
        for call in seg.calls:
            self._call(call)
        if any(type(self.store.get(t)) is WorkerFailure for call in seg.calls for t in call.outputs):
            return  # a kernel fails on these values (e.g. an index out of range): keep the compiled code
        seg.eager = True
        seg.fn = None
        self.fused_fallbacks += 1
        ops = [self.plans[c.plan_id].op_name for c in seg.calls if c.plan_id in self.plans]
        if self.fused_fallbacks == 1:
            self.log.warning("a fused segment could not be compiled; its ops run one by one",
                             ops=ops, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        else:
            self.log.debug("a fused segment could not be compiled", ops=ops, error=repr(exc))

    def _fail(self, outputs, failure) -> None:
        for tid in outputs:
            if tid >= 0:
                self.store[tid] = failure

    # -- statistics -----------------------------------------------------------------------
    def memory_stats(self) -> dict:
        seen = set()
        nbytes = 0
        live = 0
        for v in self.store.values():
            if isinstance(v, torch.Tensor):
                live += 1
                storage = v.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    nbytes += storage.nbytes()
        # frozen_objects: the objects of the worker's process that its cyclic garbage collector
        # skips (controller/heap.py)
        stats = {"rank": self.rank, "live_tensors": live, "bytes": nbytes, "plans": len(self.plans),
                 "frozen_objects": gc.get_freeze_count(), **self.streams.memory_stats()}
        if self.fused_segments:  # only sessions that fuse see these counters
            stats.update(fused_segments=self.fused_segments, fused_runs=self.fused_runs,
                         fused_fallbacks=self.fused_fallbacks)
        return stats
