"""Capture a step once, replay it as one message: ``dt.compile`` and ``dt.capture``.

The first calls of a compiled function run eagerly (a warm-up, so that lazily made state such
as optimizer moments exists before capture), the next one runs eagerly while its instructions
are recorded, and one more is recorded to check that the step issues the same work each time
(values the controller computes in Python, like torch.optim's bias corrections, would otherwise
be frozen into the replay unnoticed). From then on a call sends one ``RunProgram``: explicit
tensor inputs are rebound, outputs are fresh handles, and state (parameters, optimizer state,
``.grad``) is updated in place on the workers, as with CUDA graphs.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import attrs
import structlog
import torch
from torch.utils import _pytree as pytree

from .errors import CaptureError, GuardError
from .controller.session import current_session
from .ir.program import Program, Recording, build_program, first_difference
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
        return f"{define.op_name}{_args_text(define)}{where}"

    return describe


def _args_text(define) -> str:
    args = ", ".join(repr(a) for a in define.args)
    kwargs = ", ".join(f"{k}={v!r}" for k, v in define.kwargs.items())
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
    program: Program | None = None
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
        self.replays = 0

    # -- guards -------------------------------------------------------------------------------
    def _guard_key(self, leaves) -> tuple:
        key = []
        for i, x in enumerate(leaves):
            if type(x) is DTensor:
                key.append((x._spec, x.requires_grad))
            elif isinstance(x, torch.Tensor):
                raise CaptureError(
                    f"{self._name} got a torch.Tensor as argument {i} ({tuple(x.shape)}): its values would be "
                    "frozen into the captured step. Distribute it first (dt.distribute_tensor) so that each "
                    "call binds the new one"
                )
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
        leaves, _ = pytree.tree_flatten((args, kwargs))
        entry = self._entry(session, self._guard_key(leaves), leaves)
        if entry.program is not None:
            return self._replay(session, entry, leaves)
        entry.calls += 1
        if entry.calls <= self.warmup:
            return self.fn(*args, **kwargs)
        inputs = [x._tid for x in leaves if type(x) is DTensor]
        with session.recording() as rec:
            result = self.fn(*args, **kwargs)
        _refuse_reads(rec, self._name)
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
        if self.verify and entry.draft is None:
            entry.draft = program
            return result
        if self.verify:
            self._check_same(session, entry.draft, program)
            entry.draft = None
        entry.program = program
        entry.program_id = _define(session, program)
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
                return f"{define.op_name}{_args_text(define)}{where}" if define else f"plan {entry[1]}"
            return f"{entry[0]} {entry[1]}"

        raise CaptureError(
            f"{self._name} does not issue the same work on every call, so it cannot be replayed: its "
            f"instruction {i} was {show(a)} on one call and {show(b)} on the next. Values computed on the "
            "controller (Python numbers, torch.optim's step counters and bias corrections, schedulers) are "
            "frozen into a replay; keep them in distributed tensors (dt.optim.AdamW keeps Adam's step count "
            "on the workers) or pass them as tensor arguments, or run this function eagerly"
        )

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
        for entry in self._captured.values():
            if entry.program is not None:
                entry.session.drop_program(entry.program_id)
        self._captured.clear()


def _object_guard(x):
    """Objects are the same object each call; the settings a step reads from them must match too.

    An optimizer's hyper-parameters (a scheduler's new ``lr``) and a module's train/eval mode
    are Python values the captured step froze, so a change re-captures.
    """
    if isinstance(x, torch.optim.Optimizer):
        return ("optimizer", id(x), tuple(
            tuple((k, v) for k, v in group.items() if k != "params" and type(v) in (int, float, bool, str, tuple))
            for group in x.param_groups))
    if isinstance(x, torch.nn.Module):
        return ("module", id(x), x.training)
    return ("object", id(x))


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
            if a[0] in ("optimizer", "module"):
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

    def replay(self) -> None:
        if self.program is None:
            raise CaptureError("nothing was captured: replay() works after the `with dt.capture()` block ends")
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
    with session.recording() as rec:
        yield graph
    _refuse_reads(rec, "the captured block")
    graph.program = build_program(rec, (), (), session.pure_plans, _describe(session),
                                  fusable_plan=_fusable_plan(session) if fuse_local else None)
    graph.session = session
    graph.program_id = _define(session, graph.program)
