"""Plans: what the dispatcher stores per cache key and runs on every call with that key.

A :class:`DirectPlan` redistributes the inputs, emits one ``Call`` and wraps fresh output
handles; a :class:`FunctionPlan` runs Python on the controller (decompositions, fallbacks,
reads). :func:`kernel_plan` is the one way to define a worker call: the ``DefinePlan`` with the
arguments that differ per rank, and the ``DirectPlan`` that runs it.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from ..errors import OpError, SessionError
from ..ir.instructions import Call, DefinePlan, Number
from ..mesh import DeviceMesh
from ..placement import Replicate
from ..spec import TensorSpec, canonical_spec, contiguous_stride
from ..tensor import DTensor, Handle, handle_device
from .emit import emit_steps
from .source import user_source
from .trees import Rebuild, first_output, same_arguments


@attrs.define
class DirectPlan:
    """Redistribute inputs, run one local call per rank, wrap the outputs."""

    plan_id: int
    mesh: DeviceMesh
    moves: tuple  # per input: tuple of redistribute Steps
    out_specs: tuple  # per flat output: TensorSpec or None
    out_views: tuple
    out_alias: tuple  # per flat output: input index it returns (in-place), or None
    rebuild: Callable
    seeded: bool
    mesh_id: int

    simple: bool = False  # no moves, no plain inputs, no aliases, no None outputs
    # where each Call's numbers come from (planner/numbers.py), in the order of the definition's
    # Number placeholders: an int is a positional argument, a str a keyword
    number_at: tuple = ()
    rebind: tuple = ()  # (input index, spec): written inputs that had to move; their handles follow
    writes: tuple = ()  # input indices the op writes
    view_kind: int = 0  # 0: not a view op; 1: outputs alias input 0; 2: they alias a moved copy
    op_name: str = ""
    # what the native hot path (planner/native_dispatch.py) needs, unpacked once, of a plan that
    # moves nothing, writes nothing and returns no input (simple, a view of input 0, or with None
    # outputs), whose outputs are one tensor or a tuple/list (trees.Rebuild):
    # (plan_id, outs, seeded, view_kind, structure); per flat output in outs
    # (spec, view, shape, stride, dtype, device), None (a None output) or (size,) (a size the
    # controller knows); structure 0: the one tensor, 1: a tuple, 2: a list
    fast: tuple | None = attrs.field(default=None, init=False, eq=False, repr=False)
    moving: bool = attrs.field(default=False, init=False, eq=False, repr=False)  # any input redistributed

    def __attrs_post_init__(self):
        self.out_specs = tuple(None if s is None else canonical_spec(s) for s in self.out_specs)
        self.moving = any(self.moves)
        self.fast = self._fast_form()

    def _fast_form(self) -> tuple | None:
        if self.writes or self.rebind or self.view_kind not in (0, 1) or self.moving or not self.moves \
                or any(a is not None for a in self.out_alias):
            return None
        if self.rebuild is first_output:
            if len(self.out_specs) != 1 or self.out_specs[0] is None:
                return None
            structure, sizes = 0, {}
        elif type(self.rebuild) is Rebuild and self.rebuild.kind in (tuple, list):
            structure, sizes = (1 if self.rebuild.kind is tuple else 2), dict(self.rebuild.sizes)
        else:
            return None
        outs = []
        for k, (spec, view) in enumerate(zip(self.out_specs, self.out_views)):
            if k in sizes:
                outs.append((sizes[k],))
            elif spec is None:
                outs.append(None)
            else:
                outs.append((spec, view, spec.shape, spec.stride, spec.dtype, handle_device(spec.mesh.device_type)))
        return (self.plan_id, tuple(outs), self.seeded, self.view_kind, structure)

    def run(self, session, args, kwargs, inputs):
        numbers = tuple([args[p] if type(p) is int else kwargs[p] for p in self.number_at]) if self.number_at else ()
        if self.simple:
            return self._run_simple(session, inputs, numbers)
        if self.writes and not self.rebind and not self.moving:
            out = self._run_writes_in_place(session, inputs, numbers)
            if out is not _GENERAL:
                return out
        for x in inputs:
            if type(x) is DTensor and x._handle.session is not session:
                raise mixed_sessions(self.op_name)
        for i in self.writes:
            x = inputs[i]
            self._check_writable(x, i in dict(self.rebind))
            x.__dict__.pop("_moved", None)  # its redistributed copies are stale now
            if getattr(x, "_view_state", 0):
                session.view_writes += 1  # a base it views may have copies too
        tids = []
        temps = []
        keep = []
        for i, (x, steps) in enumerate(zip(inputs, self.moves)):
            if type(x) is DTensor:
                tid = x._tid
            else:
                tid, owner = plain_input(session, x, self.mesh)
                if owner is None:
                    temps.append(tid)
                else:
                    keep.append(owner)  # frees the id when this call returns, after the Call
            if steps and steps[0].kind in _REDUCING and type(x) is DTensor and i not in self.writes \
                    and not getattr(x, "_view_state", 0):
                tid = _moved_copy(session, x, tid, steps, self.mesh_id, self.op_name)
                steps = ()
            if steps:
                made = emit_steps(session, self.mesh_id, tid, steps, x._spec if type(x) is DTensor else None,
                                  self.op_name)
                temps.extend(made)
                tid = made[-1]
            tids.append(tid)
        for i, spec in self.rebind:
            # the op writes the redistributed copy; the user's handle now names that copy
            x = inputs[i]
            temps.remove(tids[i])
            x._handle = Handle(tids[i], session)
            x._spec = spec
        outs = self._call(session, inputs, tids, numbers)
        if temps:
            session.release_many(temps)
        return self.rebuild(outs)

    def _check_writable(self, x, moves: bool) -> None:
        # a write must reach every tensor that shares the written memory: refuse the cases where
        # the view is really a copy (its input had to be redistributed), or where the written
        # view itself must be redistributed
        state = getattr(x, "_view_state", 0)
        if state == 2 or (state == 1 and moves):
            why = "was made from a redistributed copy of its base" if state == 2 else (
                "would have to be redistributed first")
            raise OpError(
                f"{self.op_name} writes in place to a view that {why}, so the write would not reach "
                f"the tensor it views ({tuple(x.shape)} {list(x.placements)}); clone() the view to "
                "write to a copy, or redistribute the base so the view needs no data movement"
            )

    def _run_writes_in_place(self, session, inputs, numbers):
        # a write that moves nothing (torch.optim's foreach steps over every parameter): the
        # general path's checks and outputs in one pass per input; _GENERAL where an input is
        # no DTensor of this session (the general path sends plain ones and names the error)
        tids = [h.tid for x in inputs if type(x) is DTensor and (h := x._handle).session is session]
        if len(tids) != len(inputs):
            return _GENERAL
        for i in self.writes:
            attributes = inputs[i].__dict__
            if attributes.get("_view_state", 0):
                self._check_writable(inputs[i], False)
                session.view_writes += 1  # a base it views may have copies too
            attributes.pop("_moved", None)  # its redistributed copies are stale now
        return self.rebuild(self._call(session, inputs, tids, numbers))

    def _call(self, session, inputs, tids, numbers) -> list:
        """Emit the Call on input ids ``tids``; returns the flat outputs (inputs where aliased)."""
        outs = []
        out_tids = []
        for spec, view, alias in zip(self.out_specs, self.out_views, self.out_alias):
            if alias is not None:
                outs.append(inputs[alias])
                out_tids.append(tids[alias])
            elif spec is None:
                outs.append(None)
                out_tids.append(-1)
            else:
                tid = session.new_tid()
                outs.append(DTensor._make(spec, view, tid, session))
                out_tids.append(tid)
        if self.view_kind:
            for o in outs:
                if o is not None:
                    o._view_state = self.view_kind
        session.emit(Call(self.plan_id, tuple(tids), tuple(out_tids),
                          user_source() if session.track_source else None,
                          session.next_seed() if self.seeded else None, numbers))
        return outs

    def _run_simple(self, session, inputs, numbers):
        tids = tuple([h.tid for x in inputs if (h := x._handle).session is session])
        if len(tids) != len(inputs):
            raise mixed_sessions(self.op_name)
        outs = []
        out_tids = []
        new_tid = session.new_tid
        make = DTensor._make
        for spec, view in zip(self.out_specs, self.out_views):
            tid = new_tid()
            outs.append(make(spec, view, tid, session))
            out_tids.append(tid)
        session.emit(
            Call(
                self.plan_id,
                tids,
                tuple(out_tids),
                user_source() if session.track_source else None,
                session.next_seed() if self.seeded else None,
                numbers,
            )
        )
        return self.rebuild(outs)


_GENERAL = object()  # DirectPlan._run_writes_in_place: the general path must run the call


def mixed_sessions(op_name: str) -> SessionError:
    return SessionError(f"{op_name}: its inputs come from different dtorch sessions; a tensor belongs to the "
                        "session that made it (dt.init starts a new one and ends the old)")


# Reductions of a Partial tensor are kept for reuse; gathers are not (a kept gathered copy of a
# sharded activation would cost the memory sharding saves).
_REDUCING = frozenset({"all_reduce", "reduce_scatter"})


def _moved_copy(session, x: DTensor, tid: int, steps, mesh_id: int, op_name: str) -> int:
    """The id of ``x`` redistributed by ``steps``, made once and reused while ``x`` is unchanged.

    An optimizer reads each (Partial) gradient several times; without this every read would
    all-reduce it again. The copy lives as long as ``x`` (or until ``x`` or any view is written).
    """
    moved = x.__dict__.get("_moved")
    if moved is None:
        moved = x._moved = {}
    key = (tid, steps)
    hit = moved.get(key)
    if hit is not None and hit[1] == session.view_writes:
        return hit[0].tid
    made = emit_steps(session, mesh_id, tid, steps, x._spec, op_name)
    src = made[-1]
    session.release_many(made[:-1])
    moved[key] = (Handle(src, session), session.view_writes)
    return src


@attrs.define
class FunctionPlan:
    """Run a Python function on the controller (decompositions, fallbacks, reads)."""

    fn: Callable
    # False: not kept in the plan cache. A decomposition whose calls carry numbers that change
    # from call to call (torch.optim's step sizes, a scheduled learning rate) and that keeps its own
    # cache without them (ops/foreach_plan.py) says so (``cache_plan = False``): keyed by those
    # numbers, the cache would gain an entry on every optimizer step for the life of the session
    cached: bool = True

    def run(self, session, args, kwargs, inputs):
        return self.fn(*args, **kwargs)


def plain_input(session, x, mesh: DeviceMesh) -> tuple:
    """(id, owner) of a plain tensor meeting DTensors in an op, replicated on ``mesh``: the owner
    is the DTensor holding the id, or None where the caller must release it.

    A zero tensor is made on the workers instead of sent: autograd formulas make one with
    ``at::zeros`` for the gradient of an unused output (a chunk nobody reads), which no tensor
    subclass sees; sent as data it would cost a host copy per step and keep a captured step out
    of device graphs (a graph cannot repeat data from the controller). Inside the autograd nodes
    that make them (:data:`_ZEROS_NODES`) they are known without reading them. Elsewhere a tensor
    on an accelerator is read for zeros only while a capture records (where a zero made on the
    workers keeps the replay a device graph): in eager ``x.any()`` is a host sync of the
    controller's stream (about 0.5 ms on a GPU), so such a tensor goes as data; a CPU one is read.
    """
    plain_zeros = x.numel() and not (x.is_complex() or x.requires_grad) and (
        _autograd_zeros() or (reads_for_zeros(session, x) and not x.any()))
    if not plain_zeros:
        return session.put_replicated(x, mesh), None
    key = ("plain zeros", mesh, tuple(x.shape), x.dtype)
    plan = session.plans.get(key)
    if plan is None:
        spec = TensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape), contiguous_stride(x.shape), x.dtype)
        region = tuple((0, n) for n in x.shape)
        kwargs = {"kind": "zeros", "shape": spec.shape, "region": region, "dtype": x.dtype, "fill": None,
                  "device": mesh.device_type}
        plan = session.plans[key] = kernel_plan(
            session, mesh, "dtorch::factory", {r: ((), kwargs) for r in mesh.ranks}, op_name="dtorch.zeros",
            pure=True, out_specs=(spec,), out_views=(mesh,), rebuild=lambda outs: outs[0])
    zeros = plan.run(session, (), {}, [])
    return zeros._tid, zeros


def reads_for_zeros(session, x) -> bool:
    """Whether :func:`plain_input` may read ``x`` to find it is zeros: a CPU tensor always, one on
    an accelerator only while a capture records (the read is a host sync of its stream)."""
    return x.device.type == "cpu" or session._recorders is not None


# Autograd nodes whose formulas (torch's split/unbind backwards) fill the gradient of every output
# nobody used with ``at::zeros`` of the input's options and hand them (stack: unsqueezed), beside
# the DTensor gradients, to one ``cat``: a plain tensor that such a node passes to an op is one of
# them. (A user's tensor hook returning a plain tensor for a DTensor's chunk would be taken for
# zeros too; such a graph mixes plain and distributed gradients, which nothing else accepts.)
_ZEROS_NODES = frozenset({"SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0",
                          "UnsafeSplitWithSizesBackward0", "UnbindBackward0"})


def _autograd_zeros() -> bool:
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ in _ZEROS_NODES


def kernel_plan(session, mesh: DeviceMesh, target: str, per_rank: dict, *, op_name: str, pure: bool,
                seeded: bool = False, moves: tuple | None = None, n_inputs: int = 0, out_specs: tuple = (),
                out_views: tuple = (), out_alias: tuple | None = None, rebuild: Callable = lambda outs: None,
                writes: tuple = (), numbers: tuple = (), **plan_fields) -> DirectPlan:
    """Define worker call ``target`` on ``mesh`` (a root mesh) and return the plan that runs it.

    ``per_rank[rank] = (args, kwargs)`` for every rank of the mesh: the first rank's arguments
    are sent once, the others only where they differ (compared with :func:`same_arguments`).
    ``pure``: the call writes only its fresh outputs, so a captured step may drop it when they
    are unused. ``numbers``: the top-level arguments (index or keyword) that each Call brings
    (planner/numbers.py): the definition holds ``Number(k)`` there. The other arguments are
    :class:`DirectPlan`'s fields.
    """
    if numbers:
        per_rank = {r: _numbered(a, kw, numbers) for r, (a, kw) in per_rank.items()}
    first = mesh.ranks[0]
    base = per_rank[first]
    rank_args = {r: v for r, v in per_rank.items() if r != first and not same_arguments(v, base)}
    plan_id = session.new_plan_id()
    mesh_id = session.mesh_id(mesh)
    session.define_plan(
        DefinePlan(plan_id, mesh_id, target, base[0], base[1], rank_args or None, op_name, seeded), pure=pure)
    return DirectPlan(
        plan_id, mesh, moves if moves is not None else ((),) * n_inputs, tuple(out_specs), tuple(out_views),
        tuple(out_alias) if out_alias is not None else (None,) * len(out_specs), rebuild, seeded, mesh_id,
        writes=tuple(writes), op_name=op_name, number_at=tuple(numbers), **plan_fields)


def _numbered(args: tuple, kwargs: dict, numbers: tuple) -> tuple:
    """``(args, kwargs)`` with the k-th of ``numbers``' positions holding ``Number(k)``."""
    args, kwargs = list(args), dict(kwargs)
    for k, p in enumerate(numbers):
        if type(p) is int:
            args[p] = Number(k)
        else:
            kwargs[p] = Number(k)
    return tuple(args), kwargs
