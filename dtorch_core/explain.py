"""``dt.explain``: the placements every op got and the redistributions it needed, by module.

    ex = dt.explain(step, x)            # runs step(x), returns an Explanation (ex.result: its value)
    with dt.explain() as ex:            # or around a block
        loss = model(x).sum()
    print(ex)                           # a table per module, then totals per module and collective
    ex.ops                              # OpRecord per op, in the order they were issued
    ex.to_dict()                        # the same, as plain data (JSON-ready)

What is recorded, per op that reaches the dispatcher: the op, where in the user's code it was
issued, the ``nn.Module`` running (forward: the innermost module whose ``forward`` is on the
stack; backward: torch's ``ModuleTracker``), the phase, the shapes and placements of its tensor
inputs (as given) and outputs, each collective issued for it (from -> to placements, mesh dim,
kind, bytes), whether it ran the replicated fallback, and whether its plan is a *surprising
gather* (``planner/gathers.py``, ``docs/explain.md``). Ops a decomposition issues are recorded
too, one level deeper, each collective under the innermost op. Collectives issued outside an
op (``redistribute``, ``full_tensor`` of a Partial tensor, ``dt.nn.data_parallel``'s gradient
all-reduce, a ``dt.compile`` replay) are records of their own, marked ``requested``.

Bytes are the global size of the tensor each collective works on (as ``dt.debug.comm_mode``
counts them), not what crosses the wire per worker.

While explaining, ``DTensor.__torch_dispatch__`` is a recording wrapper around the dispatcher
that was installed (the native hot path included), so its plan-cache hits are seen too; it is
put back at the end. Nothing of this runs when no explanation is active.
"""

from __future__ import annotations

import threading
import weakref

import attrs
import torch
from torch.utils.module_tracker import ModuleTracker

from .controller import session as _session_mod
from .explain_format import format_bytes, format_explanation, short_placements
from .planner import gathers
from .planner.source import format_source, user_source
from .tensor import DTensor

__all__ = ["Explanation", "OpRecord", "Redistribution", "TensorInfo", "explain"]

_active: list = []  # running explanations, innermost last (dt.init attaches new sessions to them)


@attrs.frozen
class TensorInfo:
    """A tensor argument or result: its global shape (None where not known: the ends of a
    requested move) and placements (None: a plain torch.Tensor, which meets DTensors as
    replicated)."""

    shape: tuple | None
    placements: tuple | None

    def __str__(self) -> str:
        where = "torch" if self.placements is None else short_placements(self.placements)
        return where if self.shape is None else f"({','.join(map(str, self.shape))}){where}"

    def to_dict(self) -> dict:
        return {"shape": None if self.shape is None else list(self.shape),
                "placements": None if self.placements is None else [repr(p) for p in self.placements]}


@attrs.frozen
class Redistribution:
    """One collective: its kind, the placements before and after it (empty when not known, e.g.
    a merged gradient all-reduce), its mesh dim (-1: not known), and the global bytes of the
    tensor it works on."""

    kind: str
    src: tuple
    dst: tuple
    mesh_dim: int
    nbytes: int

    def __str__(self) -> str:
        moves = f" {short_placements(self.src)}->{short_placements(self.dst)}" if self.src else ""
        dim = f" on mesh dim {self.mesh_dim}" if self.mesh_dim >= 0 else ""
        return f"{self.kind}{moves}{dim}: {format_bytes(self.nbytes)}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "src": [repr(p) for p in self.src], "dst": [repr(p) for p in self.dst],
                "mesh_dim": self.mesh_dim, "bytes": self.nbytes}


@attrs.define
class OpRecord:
    """One op as the dispatcher saw it (or one collective issued outside any op: ``requested``)."""

    index: int
    op: str  # "aten.mm.default"; for requested moves the issuer: "redistribute", "full_tensor", ...
    module: str  # the nn.Module path ("Model.blocks.0.attn"), "Global" outside any module
    phase: str  # "forward" or "backward" (autograd's backward pass running)
    source: str | None  # file:line in the user's code
    depth: int = 0  # 0: issued by the user's code or autograd; 1 and more: inside a decomposition
    inputs: tuple = ()  # TensorInfo per tensor argument, as given
    outputs: tuple = ()  # TensorInfo per tensor result
    redistributions: list = attrs.field(factory=list)
    requested: bool = False  # a move the user asked for, not one planned for an op
    fallback: bool = False  # the op ran through the replicated fallback (no usable sharding rule)
    surprising_gather: bool = False  # see planner/gathers.py
    error: str | None = None  # the op raised this (e.g. refused in strict mode)

    def to_dict(self) -> dict:
        out = attrs.asdict(self, recurse=False)
        out["inputs"] = [t.to_dict() for t in self.inputs]
        out["outputs"] = [t.to_dict() for t in self.outputs]
        out["redistributions"] = [r.to_dict() for r in self.redistributions]
        return out


@attrs.define
class _Frame:
    record: OpRecord
    gathered: bool = False
    inner_fallbacks: int = 0  # fallback runs of the ops inside this one (theirs, not its own)


class Explanation:
    """What :func:`explain` saw; printable (``str()``: the tables), ``.ops``, ``.to_dict()``.

    Also a context manager: ``with dt.explain() as ex: ...`` records the block."""

    def __init__(self) -> None:
        self.ops: list[OpRecord] = []
        self.result = None  # the value fn returned (function form)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sessions: weakref.WeakSet = weakref.WeakSet()
        self._tracker: ModuleTracker | None = None
        self._saved_dispatch = None
        self._running = False
        self._infos: dict = {}  # TensorSpec -> TensorInfo

    # -- recording ----------------------------------------------------------------------------
    def __enter__(self):
        if self._running:
            raise RuntimeError("this Explanation is already recording")
        self._running = True
        self._tracker = ModuleTracker().__enter__()
        self._saved_dispatch = DTensor.__dict__["__torch_dispatch__"]
        inner = self._saved_dispatch.__get__(None, DTensor)

        def explaining_dispatch(cls, func, types, args=(), kwargs=None):
            return self._dispatch(inner, func, types, args, kwargs)

        DTensor.__torch_dispatch__ = classmethod(explaining_dispatch)
        gathers.listeners.append(self._on_gather)
        _active.append(self)
        if _session_mod._session is not None:
            self.attach(_session_mod._session)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        gathers.listeners.remove(self._on_gather)
        DTensor.__torch_dispatch__ = self._saved_dispatch
        for session in list(self._sessions):
            if self in session.comm_counters:
                session.comm_counters.remove(self)
        self._sessions = weakref.WeakSet()
        self._tracker.__exit__(*exc)
        self._tracker = None
        self._running = False

    def attach(self, session) -> None:
        """Record the collectives of ``session`` too (its ops are seen through the dispatcher)."""
        if session not in self._sessions:
            self._sessions.add(session)
            session.comm_counters.append(self)

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _where(self) -> tuple[str, str]:
        """(module, phase) now."""
        if torch._C._current_graph_task_id() != -1:
            deepest = max(self._tracker.parents, key=lambda n: (n != "Global", n.count("."), len(n)))
            return deepest, "backward"
        return gathers.module_name(gathers.module_chain()) or "Global", "forward"

    def _new_record(self, op: str, **fields) -> OpRecord:
        module, phase = self._where()
        source = format_source(user_source(2))
        with self._lock:
            record = OpRecord(len(self.ops), op, module, phase, source, **fields)
            self.ops.append(record)
        return record

    def _dispatch(self, inner, func, types, args, kwargs):
        kwargs = kwargs or {}
        leaves: list = []
        _tensors(args, leaves)
        _tensors(kwargs, leaves)
        session = next((t._handle.session for t in leaves if type(t) is DTensor), None)
        if session is not None:
            self.attach(session)
        stack = self._stack()
        record = self._new_record(str(func), depth=len(stack), inputs=tuple(self._info(t) for t in leaves))
        frame = _Frame(record)
        fallbacks = sum(session.fallback_counts.values()) if session is not None else 0
        stack.append(frame)
        try:
            out = inner(func, types, args, kwargs)
        except BaseException as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            stack.pop()
            record.surprising_gather = frame.gathered
            if session is not None:
                ran = sum(session.fallback_counts.values()) - fallbacks
                record.fallback = ran > frame.inner_fallbacks
                if stack:
                    stack[-1].inner_fallbacks += ran
        results: list = []
        _tensors(out, results)
        record.outputs = tuple(self._info(t) for t in results)
        return out

    def _info(self, t) -> TensorInfo:
        if type(t) is DTensor:
            # specs are canonical (one object per distinct spec): one TensorInfo each
            spec = t._spec
            info = self._infos.get(spec)
            if info is None:
                info = self._infos[spec] = TensorInfo(tuple(spec.shape), tuple(spec.placements))
            return info
        return TensorInfo(tuple(t.shape), None)

    def _on_gather(self, plan) -> None:
        stack = self._stack()
        if stack:
            stack[-1].gathered = True

    def record(self, event) -> None:
        """A collective issued (the session's comm-counter protocol, as dt.debug.comm_mode)."""
        move = Redistribution(event.kind, tuple(event.src), tuple(event.dst), event.mesh_dim, event.nbytes)
        stack = self._stack()
        if stack:
            stack[-1].record.redistributions.append(move)
            return
        record = self._new_record(event.op, requested=True, redistributions=[move])
        if move.src:
            record.inputs = (TensorInfo(None, move.src),)
            record.outputs = (TensorInfo(None, move.dst),)

    # -- reading ------------------------------------------------------------------------------
    def collectives(self) -> dict[str, dict[str, int]]:
        """Per collective kind: ``{"count": n, "bytes": global bytes}``."""
        out: dict = {}
        for r in self.ops:
            for move in r.redistributions:
                entry = out.setdefault(move.kind, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += move.nbytes
        return out

    def modules(self) -> dict[str, dict]:
        """Per module (first seen first): ``{"ops": n, "collectives": {kind: {"count", "bytes"}}}``;
        a collective counts for the module of the op it was issued for."""
        out: dict = {}
        for r in self.ops:
            entry = out.setdefault(r.module, {"ops": 0, "collectives": {}})
            entry["ops"] += 0 if r.requested else 1
            for move in r.redistributions:
                c = entry["collectives"].setdefault(move.kind, {"count": 0, "bytes": 0})
                c["count"] += 1
                c["bytes"] += move.nbytes
        return out

    def surprising_gathers(self) -> list[OpRecord]:
        return [r for r in self.ops if r.surprising_gather]

    def to_dict(self) -> dict:
        return {"ops": [r.to_dict() for r in self.ops], "modules": self.modules(),
                "collectives": self.collectives(),
                "bytes": "the global size of the tensor each collective works on"}

    def __str__(self) -> str:
        return format_explanation(self)

    def __repr__(self) -> str:
        moves = sum(len(r.redistributions) for r in self.ops)
        return f"<Explanation: {len(self.ops)} records, {moves} collectives>"


def _tensors(x, out: list) -> None:
    """Append the tensors in nested tuples, lists and dict values of ``x`` to ``out``."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif type(x) is tuple or type(x) is list:
        for a in x:
            _tensors(a, out)
    elif type(x) is dict:
        for a in x.values():
            _tensors(a, out)


def explain(fn=None, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return an :class:`Explanation` of what it did (its
    ``result`` is ``fn``'s value); without ``fn``, an Explanation to use as a context manager.

    See the module doc (and docs/explain.md) for what is recorded."""
    ex = Explanation()
    if fn is None:
        return ex
    with ex:
        ex.result = fn(*args, **kwargs)
    return ex


def attach_new_session(session) -> None:
    """Called by ``dt.init``: running explanations record the new session's collectives."""
    for ex in _active:
        ex.attach(session)
