"""Controller dispatch: cache -> plan -> instructions.

``dispatch`` is called from ``DTensor.__torch_dispatch__``. The cache key is the op plus the
input specs and static arguments; a hit replays the stored plan (emit redistributions, one
``Call``, wrap fresh handles) without touching meta tensors or rules.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from typing import Any, Callable

import attrs
import structlog
import torch

from ..errors import FallbackRefusedError, MeshMismatchError, OpError
from ..ir.instructions import Call, Collective, DefinePlan, Slot, fill_slots
from ..mesh import DeviceMesh, root_coordinate
from .schema import LocalCall, OpCall, Rule, Strategy
from ..placement import Partial, Replicate, Shard
from .emit import emit_steps
from ..redistribute import plan_redistribute, redistribute_cost
from ..worker.kernels import SEEDED_PREFIX
from ..spec import TensorSpec, contiguous_stride, shard_region
from .. import tensor as _tensor_mod
from ..controller import session as _session_mod
from ..controller.session import current_session
from ..tensor import DTensor, view_for

log = structlog.get_logger(__name__)

aten = torch.ops.aten
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dtorch_core/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# ops that read values on the host in torch too; they run on the controller with the full values
# (``_linalg_check_errors`` raises torch's LinAlgError: run on the workers its error had nowhere
# to go, as the op has no output)
_SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
             aten._linalg_check_errors.default}


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def dispatch(func, args, kwargs):
    session = _session_mod._session
    if session is None:
        session = current_session()
    inputs: list = []
    if kwargs:
        key = (func, _key_of(args, inputs), _key_of(tuple(kwargs.values()), inputs), tuple(kwargs))
    else:
        key = (func, _key_of(args, inputs))
    plan = session.plans.get(key)
    if plan is None:
        plan = build_plan(session, func, args, kwargs, inputs)
        session.plans[key] = plan
    return plan.run(session, args, kwargs, inputs)


def _key_of(x, inputs):
    t = type(x)
    if t is DTensor:
        inputs.append(x)
        return x._spec
    if t is tuple or t is list:
        return tuple([_key_of(a, inputs) for a in x])
    if t is float or t is int or t is bool:
        return (t, x)
    if isinstance(x, torch.Tensor):
        inputs.append(x)
        return ("plain", tuple(x.shape), x.dtype)
    return x


_internal_code: dict = {}


def user_source():
    """(file, line) of the innermost frame outside dtorch and torch: the user's call."""
    f = sys._getframe(3)
    internal = _internal_code
    while f is not None:
        code = f.f_code
        flag = internal.get(code)
        if flag is None:
            name = code.co_filename
            flag = internal[code] = name.startswith(_PKG_DIR) or name.startswith(_TORCH_DIR) or name.startswith("<")
        if not flag:
            return (code.co_filename, f.f_lineno)
        f = f.f_back
    return None


def map_structure(x, fn):
    """Apply ``fn`` to every tensor in nested lists/tuples/dicts (dict values) of ``x``."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) is tuple or type(x) is list:
        return type(x)(map_structure(a, fn) for a in x)
    if type(x) is dict:
        return {k: map_structure(v, fn) for k, v in x.items()}
    return x


def flatten_outputs(out) -> tuple[list, Callable]:
    """Flat list of output tensors (None kept) and a function that rebuilds the structure."""
    if isinstance(out, torch.Tensor):
        return [out], lambda flat: flat[0]
    if out is None:
        return [], lambda flat: None
    if type(out) in (tuple, list):
        kind = type(out)
        flat, sizes = [], {}
        for k, o in enumerate(out):
            if o is None or isinstance(o, torch.Tensor):
                flat.append(o)
            elif isinstance(o, (int, torch.SymInt)) and not isinstance(o, bool):
                # sizes (flash attention's max_q/max_k): the controller knows them from the
                # global shapes, the workers' values are not needed
                sizes[k] = o
                flat.append(None)
            else:
                raise OpError(f"output {o!r} is not a tensor")
        if sizes:
            return flat, lambda outs: kind(sizes.get(k, o) if k in sizes else o for k, o in enumerate(outs))
        return flat, lambda outs: kind(outs)
    raise OpError(f"op returned {type(out).__name__}, which dtorch cannot distribute")


# ---------------------------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------------------------
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
    rebind: tuple = ()  # (input index, spec): written inputs that had to move; their handles follow
    writes: tuple = ()  # input indices the op writes
    view_kind: int = 0  # 0: not a view op; 1: outputs alias input 0; 2: they alias a moved copy
    op_name: str = ""

    def run(self, session, args, kwargs, inputs):
        if self.simple:
            return self._run_simple(session, inputs)
        for i in self.writes:
            x = inputs[i]
            self._check_writable(x, i in dict(self.rebind))
            x.__dict__.pop("_moved", None)  # its redistributed copies are stale now
            if getattr(x, "_view_state", 0):
                session.view_writes += 1  # a base it views may have copies too
        tids = []
        temps = []
        emit = session.emit
        for i, (x, steps) in enumerate(zip(inputs, self.moves)):
            if type(x) is DTensor:
                tid = x._tid
            else:
                tid = session.put_replicated(x, self.mesh)
                temps.append(tid)
            if steps and steps[0].kind in _REDUCING and type(x) is DTensor and i not in self.writes \
                    and not getattr(x, "_view_state", 0):
                tid = _moved_copy(session, x, tid, steps, self.mesh_id)
                steps = ()
            if steps:
                made = emit_steps(session, self.mesh_id, tid, steps, x._spec if type(x) is DTensor else None)
                temps.extend(made)
                tid = made[-1]
            tids.append(tid)
        for i, spec in self.rebind:
            # the op writes the redistributed copy; the user's handle now names that copy
            x = inputs[i]
            temps.remove(tids[i])
            x._handle = _tensor_mod._Handle(tids[i], session)
            x._spec = spec
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
        emit(
            Call(
                self.plan_id,
                tuple(tids),
                tuple(out_tids),
                user_source() if session.track_source else None,
                session.next_seed() if self.seeded else None,
            )
        )
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

    def _run_simple(self, session, inputs):
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
                tuple([x._handle.tid for x in inputs]),
                tuple(out_tids),
                user_source() if session.track_source else None,
                session.next_seed() if self.seeded else None,
            )
        )
        return self.rebuild(outs)


# Reductions of a Partial tensor are kept for reuse; gathers are not (a kept gathered copy of a
# sharded activation would cost the memory sharding saves).
_REDUCING = frozenset({"all_reduce", "reduce_scatter"})


def _moved_copy(session, x: DTensor, tid: int, steps, mesh_id: int) -> int:
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
    made = emit_steps(session, mesh_id, tid, steps, x._spec)
    src = made[-1]
    session.release_many(made[:-1])
    moved[key] = (_tensor_mod._Handle(src, session), session.view_writes)
    return src


@attrs.define
class FunctionPlan:
    """Run a Python function on the controller (decompositions, fallbacks, reads)."""

    fn: Callable

    def run(self, session, args, kwargs, inputs):
        return self.fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# planning
# ---------------------------------------------------------------------------------------------
def _common_mesh(func, inputs) -> tuple[DeviceMesh, DeviceMesh | None]:
    mesh = None
    view = None
    views = set()
    for x in inputs:
        if type(x) is DTensor:
            if mesh is None:
                mesh = x._spec.mesh
            elif x._spec.mesh != mesh:
                raise MeshMismatchError(
                    f"{func}: inputs live on different meshes ({mesh!r} and {x._spec.mesh!r}); "
                    "redistribute them onto one mesh first"
                )
            views.add(x._view)
    if len(views) == 1:
        view = views.pop()
    return mesh, view


def _spec_of(x, mesh) -> TensorSpec:
    if type(x) is DTensor:
        return x._spec
    return TensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape), contiguous_stride(x.shape), x.dtype)


def _meta(spec: TensorSpec) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")


def _replace_inputs(x, fn, counter):
    """Replace every tensor in args with ``fn(index)``, in flattening order."""
    if isinstance(x, torch.Tensor):
        i = counter[0]
        counter[0] += 1
        return fn(i)
    if type(x) is tuple or type(x) is list:
        return type(x)(_replace_inputs(a, fn, counter) for a in x)
    return x


def _substitute(args, kwargs, fn):
    counter = [0]
    new_args = _replace_inputs(tuple(args), fn, counter)
    new_kwargs = {k: _replace_inputs(v, fn, counter) for k, v in kwargs.items()}
    return new_args, new_kwargs


def describe_inputs(inputs, mesh) -> str:
    parts = []
    for x in inputs:
        if type(x) is DTensor:
            parts.append(f"{tuple(x.shape)}{list(x.placements)}")
        else:
            parts.append(f"{tuple(x.shape)}[torch.Tensor]")
    return ", ".join(parts)


def _mutated_inputs(func, args, kwargs) -> tuple[set, dict]:
    """Flat input indices the op writes, and a map schema-alias-set -> first flat input index."""
    mutated = set()
    alias_first = {}
    counter = 0
    schema = func._schema
    values = list(args) + [None] * (len(schema.arguments) - len(args))
    for i, arg in enumerate(schema.arguments):
        if arg.name in kwargs:
            v = kwargs[arg.name]
        else:
            v = values[i] if i < len(values) else None
        n = _count_tensors(v)
        if arg.alias_info is not None and n:
            if arg.alias_info.is_write:
                mutated.update(range(counter, counter + n))
            for s in arg.alias_info.before_set:
                alias_first.setdefault(s, counter)
        counter += n
    return mutated, alias_first


def _count_tensors(v) -> int:
    if isinstance(v, torch.Tensor):
        return 1
    if type(v) in (list, tuple):
        return sum(_count_tensors(a) for a in v)
    return 0


def _out_alias(func, n_out, alias_first) -> tuple:
    returns = func._schema.returns
    out = [None] * n_out
    if len(returns) == n_out:
        for k, r in enumerate(returns):
            if r.alias_info is not None and r.alias_info.is_write:
                for s in r.alias_info.before_set:
                    if s in alias_first:
                        out[k] = alias_first[s]
    return tuple(out)


def build_plan(session, func, args, kwargs, inputs):
    registry = session.ops
    if func in _SYNC_OPS:
        return FunctionPlan(lambda *a, **kw: _run_on_controller(func, a, kw))
    mesh, view = _common_mesh(func, inputs)
    decomposition = registry.decomposition_for(func)
    if decomposition is not None:
        return FunctionPlan(decomposition)
    rule = registry.rule_for(func)
    if rule is None:
        return _fallback_plan(session, func)
    plan = plan_direct(session, func, args, kwargs, inputs, rule, mesh, view)
    if plan is None:
        return _fallback_plan(session, func, "has a sharding rule, but none of its choices fits these inputs")
    return plan


def global_meta(func, args, kwargs, inputs, mesh):
    specs = [_spec_of(x, mesh) for x in inputs]
    metas = [_meta(s) for s in specs]
    m_args, m_kwargs = _substitute(args, kwargs, lambda i: metas[i])
    if "device" in m_kwargs:
        m_kwargs["device"] = "meta"
    try:
        out = func(*m_args, **m_kwargs)
    except Exception as exc:
        raise OpError(f"{func}: invalid arguments for inputs {describe_inputs(inputs, mesh)}: {exc}") from exc
    return specs, metas, m_args, m_kwargs, out


def plan_direct(session, func, args, kwargs, inputs, rule: Rule, mesh, view, *, force_replicate=False):
    """Choose placements for ``func`` with ``rule``; None if no strategy is valid."""
    specs, metas, m_args, m_kwargs, meta_out = global_meta(func, args, kwargs, inputs, mesh)
    flat_out, rebuild = flatten_outputs(meta_out)
    n_in, n_out = len(inputs), len(flat_out)
    mutated, alias_first = _mutated_inputs(func, args, kwargs)
    out_alias = _out_alias(func, n_out, alias_first)
    if force_replicate:
        strategies = [Strategy((Replicate(),) * n_in, (Replicate(),) * n_out)]
    else:
        strategies = rule.strategies(OpCall(func, m_args, m_kwargs, tuple(metas), tuple(flat_out)))
    nbytes = [max(1, s.dtype.itemsize) * _numel(s.shape) for s in specs]
    for s in strategies:
        if len(s.inputs) != n_in or len(s.outputs) != n_out:
            raise OpError(f"rule for {func} returned {s} for {n_in} inputs and {n_out} outputs")
    template_args, template_kwargs = _substitute(args, kwargs, Slot)
    plan = _choose(session, func, rule, mesh, view, specs, flat_out, rebuild, mutated, out_alias, strategies,
                   nbytes, template_args, template_kwargs, inputs, force_replicate, keep_mutated=True)
    if plan is None and mutated and not force_replicate:
        # no strategy keeps the written inputs where they are (e.g. add_(scalar) on a Partial):
        # redistribute them and let their handles follow
        plan = _choose(session, func, rule, mesh, view, specs, flat_out, rebuild, mutated, out_alias, strategies,
                       nbytes, template_args, template_kwargs, inputs, force_replicate, keep_mutated=False)
    return plan


def _choose(session, func, rule, mesh, view, specs, flat_out, rebuild, mutated, out_alias, strategies, nbytes,
            template_args, template_kwargs, inputs, force_replicate, keep_mutated):
    n_in, n_out = len(specs), len(flat_out)
    per_dim = []
    for m in range(mesh.ndim):
        scored = []
        for s in strategies:
            if keep_mutated and any(s.inputs[i] != specs[i].placements[m] for i in mutated):
                continue
            if any(a is not None and s.outputs[k] != s.inputs[a] for k, a in enumerate(out_alias)):
                continue
            cost = sum(redistribute_cost(specs[i].placements[m], s.inputs[i], nbytes[i]) for i in range(n_in))
            scored.append((cost, s))
        scored.sort(key=lambda cs: cs[0])
        per_dim.append(_dedupe(scored))
    combos = sorted(itertools.product(*per_dim), key=lambda c: sum(cs[0] for cs in c))[:64]
    for combo in combos:
        chosen = [cs[1] for cs in combo]
        in_pl = [tuple(c.inputs[i] for c in chosen) for i in range(n_in)]
        out_pl = [tuple(c.outputs[k] for c in chosen) for k in range(n_out)]
        in_specs = [attrs.evolve(specs[i], placements=in_pl[i]) for i in range(n_in)]
        out_specs = [
            None
            if o is None
            else TensorSpec(mesh, out_pl[k], tuple(o.shape), tuple(o.stride()), o.dtype)
            for k, o in enumerate(flat_out)
        ]
        local = _localize_all(func, rule, mesh, in_specs, out_specs, template_args, template_kwargs, force_replicate)
        if local is None:
            continue
        base, rank_args = local
        plan_id = session.new_plan_id()
        target = rule.kernel or func.name()
        returns_view = any(r.alias_info is not None for r in func._schema.returns)
        session.define_plan(
            DefinePlan(
                plan_id,
                session.mesh_id(mesh),
                target,
                base[0],
                base[1],
                rank_args or None,
                str(func),
                bool(rule.kernel and session.kernel_is_seeded(rule.kernel)),
            ),
            # only aten ops and seeded aten ops: a plugin kernel may have effects we cannot see
            pure=not mutated and not returns_view and (rule.kernel is None or rule.kernel.startswith(SEEDED_PREFIX)),
        )
        moves = tuple(plan_redistribute(specs[i].placements, in_pl[i]) for i in range(n_in))
        out_views = tuple(None if s is None else view_for(s, view) for s in out_specs)
        rebind = tuple((i, in_specs[i]) for i in sorted(mutated) if moves[i])
        final_specs = tuple(
            in_specs[a] if a is not None else s for s, a in zip(out_specs, out_alias)
        )
        returns = func._schema.returns
        view_kind = 0
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            view_kind = 2 if moves and moves[0] else 1
        writes = tuple(i for i in sorted(mutated) if type(inputs[i]) is DTensor)
        simple = (
            n_in > 0
            and not rebind
            and not writes
            and not view_kind
            and all(not m for m in moves)
            and all(a is None for a in out_alias)
            and all(s is not None for s in final_specs)
            and all(type(x) is DTensor for x in inputs)
        )
        return DirectPlan(
            plan_id,
            mesh,
            moves,
            final_specs,
            out_views,
            out_alias,
            rebuild,
            bool(rule.kernel and session.kernel_is_seeded(rule.kernel)),
            session.mesh_id(mesh),
            simple,
            rebind,
            writes,
            view_kind,
            str(func),
        )
    return None


def _dedupe(scored):
    seen = set()
    out = []
    for cost, s in scored:
        if s not in seen:
            seen.add(s)
            out.append((cost, s))
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _localize_all(func, rule, mesh, in_specs, out_specs, t_args, t_kwargs, trusted):
    """Per-rank arguments, checked on meta tensors of the local shapes; None if inconsistent."""
    results = {}
    checked = {}
    for rank in mesh.ranks:
        coord = root_coordinate(mesh, rank)
        in_regions = tuple(shard_region(s.shape, s.placements, mesh.shape, coord) for s in in_specs)
        out_regions = tuple(
            None if s is None else shard_region(s.shape, s.placements, mesh.shape, coord) for s in out_specs
        )
        if rule.localize is not None:
            a, kw = rule.localize(
                LocalCall(t_args, dict(t_kwargs), in_regions, out_regions, tuple(in_specs), tuple(out_specs), coord)
            )
        else:
            a, kw = t_args, t_kwargs
        results[rank] = (a, kw)
        if trusted or rule.kernel is not None:
            continue
        local_in = tuple(tuple(n for _, n in r) for r in in_regions)
        ck = (local_in, repr(a), repr(kw))
        if ck in checked:
            if not checked[ck]:
                return None
            continue
        expected = [None if r is None else tuple(n for _, n in r) for r in out_regions]
        checked[ck] = ok = _check_local(func, a, kw, in_specs, local_in, expected)
        if not ok:
            return None
    base_rank = mesh.ranks[0]
    base = results[base_rank]
    rank_args = {r: v for r, v in results.items() if r != base_rank and (repr(v) != repr(base))}
    return base, rank_args


def _check_local(func, a, kw, in_specs, local_in, expected) -> bool:
    metas = [torch.empty(shape, dtype=s.dtype, device="meta") for shape, s in zip(local_in, in_specs)]
    args = fill_slots(a, metas)
    kwargs = {k: fill_slots(v, metas) for k, v in kw.items()}
    if "device" in kwargs:
        kwargs["device"] = "meta"
    try:
        out = func(*args, **kwargs)
    except Exception:
        return False
    flat, _ = flatten_outputs(out)
    if len(flat) != len(expected):
        return False
    for o, e in zip(flat, expected):
        if (o is None) != (e is None):
            return False
        if o is not None and tuple(o.shape) != e:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# fallback and controller-side runs
# ---------------------------------------------------------------------------------------------
_REPLICATE_RULE = Rule(lambda call: [])


def _fallback_plan(session, func, reason: str = "has no sharding rule"):
    name = str(func)

    def run(*args, **kwargs):
        return replicated_fallback(session, func, args, kwargs)

    if session.strict:
        raise FallbackRefusedError(
            f"{name} {reason} and strict mode is on; register a rule "
            "(dtorch_register_ops) or turn strict mode off"
        )
    return FunctionPlan(run)


def replicated_fallback(session, func, args, kwargs):
    """Gather every input to Replicate, run the op on each rank, write mutated inputs back."""
    name = str(func)
    session.count_fallback(name)
    inputs: list = []
    _key_of((args, kwargs), inputs)
    mesh, view = _common_mesh(func, inputs)
    replicated = {}
    for x in inputs:
        if type(x) is DTensor and id(x) not in replicated:
            replicated[id(x)] = redistribute_now(x, (Replicate(),) * mesh.ndim)
    r_args, r_kwargs = _substitute(
        args, kwargs, lambda i: replicated.get(id(inputs[i]), inputs[i])
    )
    rep_inputs = [replicated.get(id(x), x) for x in inputs]
    rule = Rule(lambda call: [], kernel=SEEDED_PREFIX + func.name() if _is_random(func) else None)
    plan = plan_direct(session, func, r_args, r_kwargs, rep_inputs, rule, mesh, view, force_replicate=True)
    out = plan.run(session, r_args, r_kwargs, rep_inputs)
    mutated, _ = _mutated_inputs(func, args, kwargs)
    written = {}
    for i in sorted(mutated):
        x = inputs[i]
        if type(x) is DTensor and id(x) not in written:
            written[id(x)] = x
            with torch.no_grad():
                aten.copy_.default(x, replicated[id(x)])
    if written:
        out = map_structure(out, lambda t: written.get(id(_rep_source(t, replicated, inputs)), t))
    return out


def _rep_source(t, replicated, inputs):
    for x in inputs:
        if replicated.get(id(x)) is t:
            return x
    return t


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _run_on_controller(func, args, kwargs):
    from ..api import fetch_full

    values = []
    _key_of((args, kwargs), values)
    fulls = [fetch_full(v) if type(v) is DTensor else v for v in values]
    plain_args, plain_kwargs = _substitute(args, kwargs, lambda i: fulls[i])
    return func(*plain_args, **plain_kwargs)


# ---------------------------------------------------------------------------------------------
# redistribution on the controller (no autograd: see api for the differentiable one)
# ---------------------------------------------------------------------------------------------
def redistribute_now(x: DTensor, placements: tuple, view: DeviceMesh | None = None) -> DTensor:
    session = current_session()
    spec = x._spec
    steps = plan_redistribute(spec.placements, tuple(placements))
    new_spec = spec.with_placements(placements)
    if not steps:
        tid = session.new_tid()
        session.emit(Collective("alias", session.mesh_id(spec.mesh), 0, x._tid, tid))
        return DTensor._make(new_spec, view or view_for(new_spec, x._view), tid, session)
    mesh_id = session.mesh_id(spec.mesh)
    temps = emit_steps(session, mesh_id, x._tid, steps, spec)
    tid = temps[-1]
    session.release_many(temps[:-1])
    return DTensor._make(new_spec, view or view_for(new_spec, x._view), tid, session)


def warn_fallback_once(name: str) -> None:
    warnings.warn(
        f"dtorch: {name} has no sharding rule; it runs replicated (inputs gathered). "
        "See dt.fallback_counts(); strict mode raises instead.",
        stacklevel=4,
    )


def dispatch_direct(func, args, kwargs):
    """Plan ``func`` with its rule, skipping its decomposition (for use inside decompositions)."""
    session = current_session()
    inputs: list = []
    key = ("direct", func, _key_of(args, inputs), _key_of(tuple(kwargs.values()), inputs), tuple(kwargs))
    plan = session.plans.get(key)
    if plan is None:
        mesh, view = _common_mesh(func, inputs)
        rule = session.ops.rule_for(func)
        plan = None if rule is None else plan_direct(session, func, args, kwargs, inputs, rule, mesh, view)
        if plan is None:
            plan = _fallback_plan(session, func)
        session.plans[key] = plan
    return plan.run(session, args, kwargs, inputs)


def plan_factory(kind: str, spec: TensorSpec, view: DeviceMesh, fill):
    """Create a tensor directly on the workers (each rank makes only its own shard)."""
    session = current_session()
    key = ("factory", kind, spec, view, fill)
    plan = session.plans.get(key)
    if plan is None:
        mesh = spec.mesh
        mesh_id = session.mesh_id(mesh)
        seeded = kind in ("rand", "randn")
        per_rank = {}
        for rank in mesh.ranks:
            region = spec.region(root_coordinate(mesh, rank))
            kw = {"kind": kind, "shape": spec.shape, "region": region, "dtype": spec.dtype,
                  "fill": fill, "device": mesh.device_type}
            for m, p in enumerate(spec.placements):
                if isinstance(p, Partial) and p.reduce_op == "sum" and root_coordinate(mesh, rank)[m] != 0:
                    kw["kind"] = "zeros"
            per_rank[rank] = ((), kw)
        base = per_rank.pop(mesh.ranks[0])
        rank_args = {r: v for r, v in per_rank.items() if v != base}
        plan_id = session.new_plan_id()
        session.define_plan(DefinePlan(plan_id, mesh_id, "dtorch::factory", base[0], base[1], rank_args or None,
                                       f"dtorch.{kind}", seeded), pure=True)
        plan = DirectPlan(plan_id, mesh, (), (spec,), (view,), (None,), lambda outs: outs[0], seeded, mesh_id)
        session.plans[key] = plan
    return plan.run(session, (), {}, [])


_tensor_mod._dispatch = dispatch
