"""Fused local segments: consecutive pure aten calls of a program run as one compiled function.

With ``dt.compile(fuse_local=True)`` the controller marks the calls of a program that only
compute fresh tensors from their inputs (``DefineProgram.fusable``). When a worker defines the
program, ``split`` turns each maximal run of such calls with no communication, Put or other call
in between into a :class:`FusedSegment` (Deletes inside a run move to just after it). On the
segment's first replay ``compile_segment`` builds an FX graph of the calls' aten ops and hands
it to ``torch.compile``: the compiled function takes the tensors the run reads from outside it
and returns the ones still needed after it, so the run's temporaries never reach the store and
the compiler may fuse their loops (fewer passes over memory, fewer kernel launches).

The compiler is an optimisation, never a source of failures: a segment it cannot compile runs
its calls one by one (the worker logs a warning once), and a segment whose inputs failed runs
them one by one too, so failures travel exactly as in an eager step.
"""

from __future__ import annotations

import operator
import os

import attrs
import structlog
import torch
from torch.utils import _pytree as pytree

from ..ir.instructions import Call, Delete
from ..ir.program import reads_of

log = structlog.get_logger(__name__)

MIN_CALLS = 2  # one call gains nothing from compiling and would still pay for it
# The backend torch.compile uses for segments ("aot_eager" checks the tracing without a C++
# compiler); workers started by the process runner inherit the controller's environment.
BACKEND_ENV = "DTORCH_FUSE_BACKEND"
# Segments are small: inductor's pool of compile processes would cost more than it saves, and
# every worker process would start its own.
_INDUCTOR_OPTIONS = {"compile_threads": 1}


@attrs.define(eq=False)
class FusedSegment:
    """Worker-local step of a replay: ``calls`` run as one compiled function.

    Made by ``split`` when a worker defines a program; not a wire class (it never leaves the
    worker). ``fn`` is compiled on the first run; ``eager`` is set when this worker cannot
    compile the calls, which then run one by one.
    """

    calls: tuple
    inputs: tuple  # ids the calls read from outside the segment, in first-read order
    outputs: tuple  # ids the calls write that an instruction after the segment may read
    fn: object = None
    eager: bool = False
    check_alias: bool = True  # until a run shows that the compiled outputs share no memory


def split(body: list, fusable, keep=()) -> list:
    """``body`` with every run of at least MIN_CALLS fusable calls replaced by a FusedSegment.

    ``fusable``: positions in ``body`` of the calls that may be fused. ``keep``: ids needed after
    the program whatever its Deletes say (its outputs). A Delete between two fusable calls is
    moved after the segment unless a later call of the run touches an id it deletes.
    """
    fusable = frozenset(fusable)
    last_read: dict = {}
    last_delete: dict = {}
    for i, ins in enumerate(body):
        if type(ins) is Delete:
            for tid in ins.tids:
                last_delete[tid] = i
        else:
            for tid in reads_of(ins):
                last_read[tid] = i
    keep = frozenset(keep)

    out: list = []
    run: list = []  # the run's calls and deletes, in program order
    calls: list = []
    start = 0
    deleted: set = set()
    read_outside: dict = {}  # ids read from outside the run, in first-read order (dict: an ordered set)
    written: set = set()

    def close(end: int) -> None:
        if len(calls) >= MIN_CALLS:
            outputs = []
            for call in calls:
                for tid in call.outputs:
                    if tid >= 0 and (tid in keep or last_read.get(tid, -1) >= end
                                     or last_delete.get(tid, -1) < start):
                        outputs.append(tid)
            out.append(FusedSegment(tuple(calls), tuple(read_outside), tuple(outputs)))
            out.extend(x for x in run if type(x) is Delete)
        else:
            out.extend(run)
        run.clear()
        calls.clear()
        deleted.clear()
        read_outside.clear()
        written.clear()

    for i, ins in enumerate(body):
        t = type(ins)
        if t is Call and i in fusable:
            outs = [o for o in ins.outputs if o >= 0]
            if calls and (any(x in deleted for x in ins.inputs) or any(o in deleted for o in outs)
                          or any(o in written or o in read_outside for o in outs)):
                close(i)  # the moved Deletes or a second write would change what the calls see
            if not calls:
                start = i
            for tid in ins.inputs:
                if tid not in written:
                    read_outside.setdefault(tid, None)
            written.update(outs)
            run.append(ins)
            calls.append(ins)
        elif t is Delete and calls:
            run.append(ins)
            deleted.update(ins.tids)
        else:
            close(i)
            out.append(ins)
    close(len(body))
    return out


def _returns_one_tensor(op) -> bool:
    returns = op._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


def build_graph(segment: FusedSegment, plans: dict) -> torch.fx.GraphModule | None:
    """An FX graph of the segment's aten ops (None: a call has no plain aten op on this worker).

    The graph calls each plan's OpOverload, which dynamo traces (the raw C++ callable the worker
    caches for eager calls is opaque to it). Arguments other than the tensors are the plans'
    constants, as the eager calls get them.
    """
    graph = torch.fx.Graph()
    env = {tid: graph.placeholder(f"t{k}") for k, tid in enumerate(segment.inputs)}
    for call in segment.calls:
        plan = plans.get(call.plan_id)
        if plan is None or plan.overload is None:
            return None  # not on this worker's mesh, or a kernel registered over the aten name
        args, kwargs = plan.bind([env[tid] for tid in call.inputs], call.numbers)
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs))):
            return None  # a constant tensor in the arguments: the graph's code could not spell it
        node = graph.call_function(plan.overload, tuple(args), dict(kwargs))
        if _returns_one_tensor(plan.overload):
            results = (node,)
        else:
            results = [graph.call_function(operator.getitem, (node, k)) for k in range(len(call.outputs))]
        for tid, result in zip(call.outputs, results):
            if tid >= 0:
                env[tid] = result
    graph.output(tuple(env[tid] for tid in segment.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def compile_segment(module: torch.fx.GraphModule):
    """``torch.compile`` of the segment's graph; it compiles on its first call.

    The bound ``forward`` is compiled, not the module: each GraphModule has its own generated
    code, so dynamo keeps one cache entry per segment instead of sharing (and exhausting) the
    cache of ``nn.Module.__call__`` among all segments of all workers in a process. Shapes are
    static: a program's shapes never change between replays.
    """
    backend = os.environ.get(BACKEND_ENV) or "inductor"
    options = _INDUCTOR_OPTIONS if backend == "inductor" else None
    return torch.compile(module.forward, backend=backend, dynamic=False, fullgraph=True, options=options)


def unalias(outs, inputs) -> tuple[list, bool]:
    """The outputs, each in memory of its own, and whether any had to be copied.

    The eager calls return fresh tensors; a compiler may return an input (a no-op such as
    ``mul(x, 1)`` removed) or one buffer twice (identical ops merged). State is later updated in
    place, so sharing memory that eager did not share would leak those updates.
    """
    seen = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    out = list(outs)
    copied = False
    for i, x in enumerate(out):
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            if ptr and ptr in seen:
                out[i] = x.clone()
                copied = True
            else:
                seen.add(ptr)
    return out, copied
