"""Gathers the planner chooses that a user may not expect: warned once, counted, refusable.

A **surprising gather** is a plan, chosen by the strategy search to satisfy the sharding rule of
an op that torch runs as a view (its schema returns an alias of an input: ``split``, ``chunk``,
``unbind``, ``narrow``/``slice``, ``select``, ``view``, ``expand``, ``squeeze``, ...; also
``_unsafe_view``, ``reshape``'s copy), that all-gathers a DTensor input from ``Shard(d)`` to
``Replicate()`` on a mesh dim of more than one device while every output is ``Replicate()`` on
that mesh dim: torch moves no data for such an op, and here the shards are lost, not moved, so
every worker of that mesh dim holds the whole result. The example is
``q, k, v = qkv(x).split(n, -1)`` on a colwise-sharded fused Linear, whose chunks cross shard
boundaries.

What is not one: a gather whose output stays sharded or Partial on that mesh dim (a re-layout,
e.g. sequence-parallel activations gathered before a colwise matmul); the gathers of ops that
compute (a broadcast against a size-1 dim, a reduction that needs whole rows: the price of the
op, shown by ``dt.explain``); a redistribution the user asks for (``redistribute``,
``full_tensor``, the parallel styles' input and output layouts, which call ``redistribute``);
the replicated fallback of an op without a rule (``dt.fallback_counts()`` counts those); mesh
dims of one device (nothing moves).

Each call of such a plan is counted (``dt.gather_counts()``) and warns once per op, module and
input placements (modules that differ only in list indices, ``blocks.0.attn`` and
``blocks.1.attn``, are one module here: the warning names the first); strict mode
(``dt.set_strict(True)``, ``DTORCH_STRICT=1``, ``dtorch run --strict``) makes the planner refuse
the plan (:class:`OpError`, the warning's text).
"""

from __future__ import annotations

import collections
import sys
import warnings
import weakref

import attrs
import torch

from ..errors import OpError
from ..placement import Replicate, Shard
from ..tensor import DTensor
from .source import format_source, user_source

_CALL_IMPL = torch.nn.Module._call_impl.__code__
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_logs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> GatherLog
# called with the GatheringPlan on each of its runs (dt.explain marks the op it explains)
listeners: list = []

# ops that take parts of a tensor (torch makes them views: no data moves)
_PART_OPS = ("split", "chunk", "unbind", "narrow", "slice", "select", "tensor_split")
_SHAPE_OPS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten")


@attrs.define
class GatherLog:
    """One session's surprising gathers: calls per op, and the warnings already given."""

    counts: collections.Counter = attrs.field(factory=collections.Counter)
    warned: set = attrs.field(factory=set)  # (op, module, placements)
    refuse: bool = False  # strict mode (dt.set_strict's gathers)


@attrs.frozen
class LostShard:
    """One input all-gathered to Replicate on one mesh dim where the outputs stay replicated."""

    input_index: int
    mesh_dim: int
    shape: tuple  # the input's global shape
    placements: tuple  # the input's placements before the gather


def log_of(session) -> GatherLog:
    log = _logs.get(session)
    if log is None:
        log = _logs[session] = GatherLog()
    return log


def is_view_op(func) -> bool:
    """Whether torch runs ``func`` as a view (no data moves), or it is reshape's copy."""
    return func is _UNSAFE_VIEW or any(r.alias_info is not None and not r.alias_info.is_write
                                       for r in func._schema.returns)


def lost_shards(func, inputs, specs, in_placements, out_specs) -> tuple[LostShard, ...]:
    """The surprising gathers of a candidate plan of ``func`` (see the module doc)."""
    outs = [s for s in out_specs if s is not None]
    if not outs or not is_view_op(func):
        return ()
    found = []
    for i, spec in enumerate(specs):
        if type(inputs[i]) is not DTensor:
            continue
        for m, (src, dst) in enumerate(zip(spec.placements, in_placements[i])):
            if (isinstance(src, Shard) and isinstance(dst, Replicate) and spec.mesh.shape[m] > 1
                    and all(isinstance(o.placements[m], Replicate) for o in outs)):
                found.append(LostShard(i, m, tuple(spec.shape), tuple(spec.placements)))
    return tuple(found)


def module_chain() -> list:
    """The ``nn.Module`` objects whose ``forward`` is running, innermost first."""
    chain = []
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _CALL_IMPL:
            module = f.f_locals.get("self")
            if module is not None:
                chain.append(module)
        f = f.f_back
    return chain


def module_name(chain: list) -> str | None:
    """The innermost running module as ``RootClass.path.to.it`` (as ``dt.debug.comm_mode`` and
    torch's ModuleTracker name modules); in a backward pass, the autograd node; None outside both."""
    if not chain:
        node = torch._C._current_autograd_node()
        return None if node is None else f"backward of {node.name()}"
    inner, root = chain[0], chain[-1]
    if inner is root:
        return type(root).__name__
    for name, module in root.named_modules():
        if module is inner:
            return f"{type(root).__name__}.{name}"
    return type(inner).__name__


def advice(op: str) -> str:
    """A plan that avoids the gather, for the family of ``op``."""
    base = op.split(".")[1] if op.startswith("aten.") else op
    if base.startswith(_PART_OPS):
        return ("shard the parts separately (e.g. q, k and v as three Linear layers, each with "
                "ColwiseParallel) or lay the fused weight out so that each shard holds whole parts, "
                "take parts whose boundaries fall on shard boundaries, or split before the sharded "
                "Linear")
    if base.startswith(_SHAPE_OPS):
        return ("reshape so that the sharded dim stays whole, or becomes the leading dim of its split "
                "with each shard holding whole rows of it (e.g. (..., 3*H*D) -> (..., 3, H, D) needs "
                "shards of whole q/k/v blocks); merging a sharded dim with the dims after it keeps the "
                "shards only where they split it evenly (a batch of 3 rows on 2 workers does not: use "
                "a batch the mesh dim divides)")
    return "give the op inputs laid out as its sharding rule keeps them (dt.explain shows the plan)"


def describe(op: str, lost: tuple[LostShard, ...], mesh, module: str | None, source) -> str:
    names = mesh.mesh_dim_names
    per_input: dict = {}
    for g in lost:
        per_input.setdefault(g.input_index, []).append(g)
    parts = []
    for i, found in per_input.items():
        g = found[0]
        dims = " and ".join(f"{x.mesh_dim} ({names[x.mesh_dim]!r})" if names else str(x.mesh_dim) for x in found)
        shards = ", ".join(sorted({repr(x.placements[x.mesh_dim]) for x in found}))
        plural = "s" if len(found) > 1 else ""
        parts.append(f"input {i} {g.shape}{list(g.placements)} from {shards} to Replicate() on mesh dim{plural} {dims}")
    where = "" if not module else f" in {module}" if module.startswith("backward of") else f" in module {module}"
    at = f" at {format_source(source)}" if source is not None else ""
    return (f"dtorch: {op}{where}{at} all-gathers {'; '.join(parts)}, and its outputs stay replicated "
            "there: every worker holds and computes the whole result. To avoid it: "
            f"{advice(op)}; or redistribute yourself if you want the gather (explicit redistributions "
            "never warn). dt.gather_counts() counts these; strict mode (dt.set_strict(True)) refuses them.")


def refuse_if_strict(session, op: str, lost, mesh) -> None:
    """Raise the warning's text as an OpError where the session refuses surprising gathers."""
    if log_of(session).refuse:
        text = describe(op, lost, mesh, module_name(module_chain()), user_source(2))
        raise OpError(text.removeprefix("dtorch: ") + " (refused in strict mode; dt.set_strict(True, gathers=False) lets it run)")


@attrs.define(eq=False)
class GatheringPlan:
    """A plan with a surprising gather: counts and warns on each call, then runs ``plan``.

    Other attributes (``plan_id``, ``out_specs``, ...) are the wrapped plan's."""

    plan: object
    op: str
    lost: tuple
    mesh: object
    _warned_for: set = attrs.field(factory=set)  # ids of the innermost modules warned about

    def run(self, session, args, kwargs, inputs):
        log = log_of(session)
        log.counts[self.op] += 1
        for listener in listeners:
            listener(self)
        chain = module_chain()
        where = id(chain[0]) if chain else None
        if where not in self._warned_for:
            self._warned_for.add(where)
            module = module_name(chain)
            key = (self.op, _pattern(module), tuple(g.placements for g in self.lost))
            if key not in log.warned:
                log.warned.add(key)
                _warn(describe(self.op, self.lost, self.mesh, module, user_source(2)))
        return self.plan.run(session, args, kwargs, inputs)

    def __getattr__(self, name):
        if name == "plan":  # not set yet (copies): no recursion
            raise AttributeError(name)
        return getattr(self.plan, name)


def _pattern(module: str | None) -> str | None:
    """``module`` with list indices as ``*``: the same op in each of a model's repeated blocks
    warns once (naming the first block)."""
    if module is None:
        return None
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def _warn(message: str) -> None:
    source = user_source(3)
    if source is None:
        warnings.warn(message, stacklevel=3)
    else:
        warnings.warn_explicit(message, UserWarning, source[0], source[1])


def gather_counts(session) -> dict[str, int]:
    return dict(log_of(session).counts)


def set_refuse(session, refuse: bool) -> None:
    log_of(session).refuse = bool(refuse)
