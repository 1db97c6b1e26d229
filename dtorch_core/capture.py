"""Capture a step once, replay it as one message: ``dt.compile`` and ``dt.capture``.

The first calls of a compiled function run eagerly (a warm-up, so that lazily made state such
as optimizer moments exists before capture), the next one runs eagerly while its instructions
are recorded, and one more is recorded to check that the step issues the same work each time
(values the controller computes in Python would otherwise be frozen into the replay unnoticed).
From then on a call sends one ``RunProgram``: explicit tensor inputs are rebound (plain tensor
arguments are replicated on the step's mesh and sent anew), outputs are fresh handles, and state
(parameters, optimizer state, ``.grad``) is updated in place on the workers, as with CUDA graphs.
torch.optim optimizers and lr schedulers work unchanged (``optim_replay``): the lr a scheduler
sets is written to the workers before each replay, other changed settings re-capture.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref

import attrs
import structlog
import torch
from torch.utils import _pytree as pytree

from . import optim_replay
from .api import distribute_tensor
from .errors import CaptureError, GuardError
from .controller.session import current_session
from .ir.instructions import Number
from .ir.program import Program, Recording, build_program, first_difference
from .placement import Replicate
from .planner.source import format_source
from .tensor import DTensor

log = structlog.get_logger(__name__)


def _refuse_reads(rec: Recording, what: str) -> None:
    if rec.reads:
        where = ", ".join(format_source(s) or "?" for s in rec.reads[:3])
        raise CaptureError(
            f"{what} reads tensor values on the controller (at {where}: item(), print, full_tensor(), "
            "comparisons in `if`, ...), so a replay could not repeat what it did. Move the read out of "
            "the captured function (return the tensor and read it after the call), or run it eagerly"
        )


def _describe(session):
    def describe(ins):
        define = session.plan_names.get(getattr(ins, "plan_id", None))
        if define is None:
            return type(ins).__name__ + (f" {ins.kind}" if hasattr(ins, "kind") else "")
        where = f" at {format_source(ins.source)}" if getattr(ins, "source", None) else ""
        return f"{define.op_name}{_args_text(define, getattr(ins, 'numbers', ()))}{where}"

    return describe


def _args_text(define, numbers: tuple = ()) -> str:
    """The definition's arguments, with the values of its Number placeholders that a Call brought."""
    def show(a):
        return repr(numbers[a.index] if type(a) is Number and a.index < len(numbers) else a)

    args = ", ".join(show(a) for a in define.args)
    kwargs = ", ".join(f"{k}={show(v)}" for k, v in define.kwargs.items())
    return f"({', '.join(x for x in (args, kwargs) if x)})"


def _define(session, program: Program) -> int:
    pid = session.define_program(program)
    log.debug("program defined", program=pid, instructions=len(program.instructions),
              recorded=program.recorded, eliminated=program.eliminated, fusable=len(program.fusable))
    return pid


def _fusable_plan(session):
    """Plans whose calls a worker may compile together: pure aten ops.

    Pure plans write only their fresh outputs, so running several of them as one function changes
    no state another instruction sees. Plugin kernels (``dtorch::...``) may do anything a
    compiler cannot trace; seeded calls are excluded by ``build_program`` (their random streams
    must match eager draws exactly).
    """
    pure, names = session.pure_plans, session.plan_names

    def fusable(plan_id) -> bool:
        define = names.get(plan_id)
        return plan_id in pure and define is not None and define.target.startswith("aten::")

    return fusable


@attrs.frozen
class _OutTensor:
    spec: object
    view: object


@attrs.define
class _Captured:
    """One program of a compiled function, for one guard key."""

    calls: int = 0
    draft: Program | None = None  # the first recording, kept to compare with the second
    draft_settings: tuple = ()  # the optimizer settings the draft froze
    program: Program | None = None
    guards: optim_replay.Guards = attrs.field(factory=lambda: optim_replay.Guards(()))  # optimizers it steps
    mesh: object = None  # where plain tensor arguments are replicated
    program_id: int = 0
    out_tree: object = None
    out_leaves: tuple = ()  # per output leaf: an _OutTensor, or the value returned
    session: object = None


class CompiledFunction:
    """``fn`` captured per input signature and replayed; see :func:`compile`."""

    def __init__(self, fn, *, warmup: int = 1, verify: bool = True, recapture: bool = True,
                 max_programs: int = 8, merge_collectives: bool = True, fuse_local: bool = False):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.warmup = warmup
        self.verify = verify
        self.recapture = recapture
        self.max_programs = max_programs
        self.merge_collectives = merge_collectives
        self.fuse_local = fuse_local
        self._captured: collections.OrderedDict = collections.OrderedDict()
        # a compiled function that is dropped frees its programs (and their constants) on the workers
        weakref.finalize(self, _drop_all, self._captured)
        self.replays = 0  # calls that ran as one RunProgram
        self.captures = 0  # programs captured (a re-capture for new inputs or settings counts too)

    # -- guards -------------------------------------------------------------------------------
    def _guard_key(self, leaves) -> tuple:
        key = []
        for i, x in enumerate(leaves):
            if type(x) is DTensor:
                key.append((x._spec, x.requires_grad))
            elif isinstance(x, torch.Tensor):
                key.append(("plain", tuple(x.shape), x.dtype))
            elif x is None or type(x) in (int, float, bool, str, torch.dtype, torch.device):
                key.append((type(x), x))
            else:
                key.append(_object_guard(x))
        return tuple(key)

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def _entry(self, session, key, leaves) -> _Captured:
        entry = self._captured.get(key)
        if entry is not None and entry.session is session:
            self._captured.move_to_end(key)
            return entry
        live = [e for e in self._captured.values() if e.program is not None and e.session is session]
        if live and not self.recapture:
            raise GuardError(
                f"{self._name} was captured for other inputs ({_explain(next(iter(self._captured)), key, leaves)}) "
                "and re-capture is off (dt.compile(..., recapture=False)); call it with inputs like the captured "
                "ones or allow re-capture"
            )
        entry = self._captured[key] = _Captured(session=session)
        while len(self._captured) > self.max_programs:
            _, old = self._captured.popitem(last=False)
            if old.program is not None and old.session is session:
                session.drop_program(old.program_id)
        return entry

    # -- calls --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        session = current_session()
        leaves, arg_tree = pytree.tree_flatten((args, kwargs))
        entry = self._entry(session, self._guard_key(leaves), leaves)
        if entry.program is not None:
            if entry.guards.ready():
                return self._replay(session, entry, self._bind(session, entry, leaves))
            self._recapture(session, entry)
        entry.calls += 1
        if entry.calls <= self.warmup:
            return self.fn(*args, **kwargs)
        leaves = self._bind(session, entry, leaves)
        args, kwargs = pytree.tree_unflatten(leaves, arg_tree)
        inputs = [x._tid for x in leaves if type(x) is DTensor]
        with optim_replay.steps_taken() as steps, session.recording() as rec:
            result = self.fn(*args, **kwargs)
        _refuse_reads(rec, self._name)
        guards = optim_replay.Guards(tuple(steps))
        out_leaves, out_tree = pytree.tree_flatten(result)
        outputs = []
        for x in out_leaves:
            if type(x) is DTensor:
                outputs.append(x._tid)
            elif isinstance(x, torch.Tensor):
                raise CaptureError(f"{self._name} returns a torch.Tensor; a replay can only return distributed "
                                   "tensors (return the DTensor and read it after the call)")
        program = build_program(rec, inputs, outputs, session.pure_plans, _describe(session),
                                merge=self.merge_collectives,
                                fusable_plan=_fusable_plan(session) if self.fuse_local else None)
        if self.verify and (entry.draft is None or entry.draft_settings != guards.settings):
            if entry.draft is not None:
                log.info("optimizer settings changed between the two recordings; recording again",
                         function=self._name)
            entry.draft, entry.draft_settings = program, guards.settings
            return result
        if self.verify:
            self._check_same(session, entry.draft, program)
            entry.draft = None
        entry.program = program
        entry.guards = guards
        entry.program_id = _define(session, program)
        self.captures += 1
        entry.out_tree = out_tree
        entry.out_leaves = tuple(_OutTensor(x._spec, x._view) if type(x) is DTensor else x for x in out_leaves)
        log.info("step captured", function=self._name, instructions=len(program.instructions),
                 recorded=program.recorded, eliminated=program.eliminated, merged=program.merged,
                 fusable=len(program.fusable))
        return result

    def _check_same(self, session, a: Program, b: Program) -> None:
        i = first_difference(a, b)
        if i is None:
            return

        def show(p):
            if i >= len(p.signature):
                return "nothing (it ended here)"
            entry = p.signature[i]
            if entry[0] == "call":
                define = session.plan_names.get(entry[1])
                where = f" at {format_source(entry[4])}" if entry[4] else ""
                return f"{define.op_name}{_args_text(define, entry[6])}{where}" if define else f"plan {entry[1]}"
            return f"{entry[0]} {entry[1]}"

        raise CaptureError(
            f"{self._name} does not issue the same work on every call, so it cannot be replayed: its "
            f"instruction {i} was {show(a)} on one call and {show(b)} on the next. Values computed on the "
            "controller (Python numbers, counters kept in plain tensors, .item() results) are frozen into a "
            "replay; keep them in distributed tensors or pass them as arguments, or run this function "
            "eagerly. (torch.optim optimizers and lr schedulers are handled: capturable ones such as "
            "Adam/AdamW keep their step count on the workers, and a changed setting re-captures)"
        )

    def _bind(self, session, entry: _Captured, leaves) -> list:
        """Leaves with each plain tensor replicated on the step's mesh, as eager would treat it."""
        if not any(isinstance(x, torch.Tensor) and type(x) is not DTensor for x in leaves):
            return leaves
        if entry.mesh is None:
            entry.mesh = _step_mesh(session, leaves, self._name)
        mesh = entry.mesh
        return [distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
                if isinstance(x, torch.Tensor) and type(x) is not DTensor else x for x in leaves]

    def _recapture(self, session, entry: _Captured) -> None:
        if not self.recapture:
            raise GuardError(
                f"{self._name} was captured with other optimizer settings ({entry.guards.changed()}) and "
                "re-capture is off (dt.compile(..., recapture=False)); keep them fixed or allow re-capture"
            )
        log.info("optimizer settings changed: capturing the step again", function=self._name,
                 change=entry.guards.changed())
        session.drop_program(entry.program_id)
        entry.program, entry.draft, entry.guards = None, None, optim_replay.Guards(())
        entry.calls = self.warmup  # the state exists already: this call records

    def _replay(self, session, entry: _Captured, leaves):
        inputs = tuple(x._tid for x in leaves if type(x) is DTensor)
        fresh = []
        out = []
        for leaf in entry.out_leaves:
            if type(leaf) is _OutTensor:
                tid = session.new_tid()
                fresh.append(tid)
                out.append(DTensor._make(leaf.spec, leaf.view, tid, session))
            else:
                out.append(leaf)
        session.run_program(entry.program_id, entry.program, inputs, tuple(fresh))
        self.replays += 1
        return pytree.tree_unflatten(out, entry.out_tree)

    def reset(self) -> None:
        """Forget every captured program (the next calls warm up and capture again)."""
        _drop_all(self._captured)


def _drop_all(captured: collections.OrderedDict) -> None:
    for entry in captured.values():
        if entry.program is not None:
            entry.session.drop_program(entry.program_id)
    captured.clear()


def _object_guard(x):
    """Objects are the same object each call; a module's train/eval mode must match too.

    (Optimizers' settings are guarded by ``optim_replay``, whether they are arguments or not.)
    """
    if isinstance(x, torch.nn.Module):
        return ("module", id(x), x.training)
    return ("object", id(x))


def _step_mesh(session, leaves, name):
    """The mesh a plain tensor argument is replicated on: that of the DTensor arguments (a module's
    parameters count), or the root of their meshes, else the session's only mesh."""
    meshes = {x.device_mesh for x in leaves if type(x) is DTensor}
    for x in leaves:
        if isinstance(x, torch.nn.Module):
            meshes.update(p.device_mesh for p in x.parameters() if type(p) is DTensor)
    if len(meshes) == 1:
        return meshes.pop()
    roots = {m.root for m in meshes} if meshes else set(session.root_meshes)
    if len(roots) == 1:
        return roots.pop()
    raise CaptureError(
        f"{name} got a plain torch.Tensor argument, and "
        + ("its DTensor arguments are on several meshes" if meshes else "no DTensor argument, and the session "
           "has several meshes") + ", so which one to replicate it on is not clear. Distribute it first "
        "(dt.distribute_tensor)"
    )


def _explain(old_key, new_key, leaves) -> str:
    if len(old_key) != len(new_key):
        return f"{len(old_key)} argument leaves captured, {len(new_key)} given"
    for i, (a, b) in enumerate(zip(old_key, new_key)):
        if a != b:
            x = leaves[i]
            if type(x) is DTensor:
                spec = a[0]
                return (f"argument {i} is {tuple(x.shape)} {x.dtype} {list(x.placements)}; captured with "
                        f"{tuple(spec.shape)} {spec.dtype} {list(spec.placements)}")
            if a[0] == "plain":
                return f"argument {i} is a tensor {tuple(x.shape)} {x.dtype}; captured with {a[1]} {a[2]}"
            if a[0] == "module":
                return f"argument {i} ({type(x).__name__}) has other settings than when captured ({a[2]!r} then)"
            return f"argument {i} is {x!r}, captured with {a[1]!r}"
    return "same inputs"


def compile(fn=None, *, warmup: int = 1, verify: bool = True, recapture: bool = True, max_programs: int = 8,
            merge_collectives: bool = True, fuse_local: bool = False):
    """Capture ``fn`` once and replay it as one message per call.

    ``warmup`` calls run eagerly first (so lazily created state exists), then one call is recorded
    and, with ``verify``, one more to check that each call issues the same work. Later calls with
    inputs of the same specs replay. Other inputs re-capture (at most ``max_programs`` kept per
    function) or, with ``recapture=False``, raise :class:`GuardError`. ``merge_collectives``
    lets the program run small all-reduces that can go together as one exchange.

    ``fuse_local`` lets each worker run consecutive pure aten calls of the program (no
    communication between them) as one ``torch.compile``d function, compiled on the first
    replay. Results equal the eager step's up to floating-point rounding (the compiler may
    reorder arithmetic), not bit for bit; a segment the compiler cannot handle runs op by op.
    """
    options = dict(warmup=warmup, verify=verify, recapture=recapture, max_programs=max_programs,
                   merge_collectives=merge_collectives, fuse_local=fuse_local)
    if fn is None:
        return functools.partial(compile, **options)
    return CompiledFunction(fn, **options)


class CapturedGraph:
    """What ``with dt.capture() as g:`` recorded; ``g.replay()`` runs it again on the workers.

    There are no explicit inputs or outputs: every tensor the block touched or made and kept is
    state, updated in place by each replay (as with ``torch.cuda.graph``).
    """

    def __init__(self):
        self.program: Program | None = None
        self.program_id = 0
        self.session = None
        self.guards = optim_replay.Guards(())

    def replay(self) -> None:
        if self.program is None:
            raise CaptureError("nothing was captured: replay() works after the `with dt.capture()` block ends")
        if not self.guards.ready():
            raise CaptureError(f"an optimizer the block stepped has other settings than when it was captured "
                               f"({self.guards.changed()}); capture the block again")
        session = self.session
        session.run_program(self.program_id, self.program, (), ())

    def reset(self) -> None:
        if self.program is not None:
            self.session.drop_program(self.program_id)
            self.program = None


@contextlib.contextmanager
def capture(*, fuse_local: bool = False):
    """Record the block (it runs eagerly too) into a graph that ``replay()`` repeats.

    ``fuse_local``: as for :func:`compile`.
    """
    session = current_session()
    graph = CapturedGraph()
    with optim_replay.steps_taken() as steps, session.recording() as rec:
        yield graph
    _refuse_reads(rec, "the captured block")
    graph.guards = optim_replay.Guards(tuple(steps))
    graph.program = build_program(rec, (), (), session.pure_plans, _describe(session),
                                  fusable_plan=_fusable_plan(session) if fuse_local else None)
    graph.session = session
    graph.program_id = _define(session, graph.program)
    weakref.finalize(graph, session.drop_program, graph.program_id)  # a dropped graph frees its program
