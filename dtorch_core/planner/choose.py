"""Choosing placements for one op: strategies from its rule, cheapest valid combination first.

:func:`plan_direct` infers the op's global outputs on meta tensors, asks the rule for its
strategies, scores them per mesh dim by the cost of moving the inputs, and takes the cheapest
combination whose per-rank local call is consistent (checked on meta tensors of the local
shapes). The inputs of the search travel as one :class:`PlanRequest`.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import attrs
import torch

from ..errors import MeshMismatchError, OpError
from ..ir.instructions import Slot, fill_slots
from ..mesh import DeviceMesh, root_coordinate
from ..placement import Replicate
from ..redistribute import plan_redistribute, redistribute_cost
from ..spec import TensorSpec, contiguous_stride, shard_region
from ..tensor import DTensor, view_for
from ..worker.kernels import SEEDED_PREFIX
from .gathers import GatheringPlan, lost_shards, refuse_if_strict
from .plans import DirectPlan, kernel_plan
from .schema import LocalCall, NotLocal, OpCall, Rule, Strategy
from .trees import count_tensors, flatten_outputs, substitute


@attrs.frozen
class PlanRequest:
    """Everything the strategy search knows about one call of an op."""

    func: object  # the OpOverload
    rule: Rule
    mesh: DeviceMesh  # the inputs' root mesh
    view: DeviceMesh | None  # the sub-mesh all inputs are shown on, if they share one
    inputs: tuple  # flat tensor inputs (DTensors and plain tensors)
    specs: tuple  # their TensorSpecs (plain tensors: replicated)
    flat_out: tuple  # meta tensors of the global outputs (None kept)
    rebuild: Callable  # flat outputs -> the op's output structure
    mutated: frozenset  # input indices the op writes
    out_alias: tuple  # per output: the input index it returns (in-place ops), or None
    strategies: tuple
    nbytes: tuple  # per input: global size in bytes (the cost model's weight)
    template_args: tuple  # the op's arguments with every tensor replaced by a Slot
    template_kwargs: dict
    trusted: bool  # the local calls need no meta check (forced replication)


def common_mesh(func, inputs) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The root mesh the DTensor inputs share (raises if they differ) and their common view."""
    mesh = None
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
    return mesh, views.pop() if len(views) == 1 else None


def spec_of(x, mesh) -> TensorSpec:
    if type(x) is DTensor:
        return x._spec
    return TensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(x.shape), contiguous_stride(x.shape), x.dtype)


def describe_inputs(inputs) -> str:
    parts = []
    for x in inputs:
        if type(x) is DTensor:
            parts.append(f"{tuple(x.shape)}{list(x.placements)}")
        else:
            parts.append(f"{tuple(x.shape)}[torch.Tensor]")
    return ", ".join(parts)


def mutated_inputs(func, args, kwargs) -> tuple[set, dict]:
    """Flat input indices the op writes, and a map schema-alias-set -> first flat input index."""
    mutated = set()
    alias_first = {}
    counter = 0
    schema = func._schema
    values = list(args) + [None] * (len(schema.arguments) - len(args))
    for i, arg in enumerate(schema.arguments):
        v = kwargs[arg.name] if arg.name in kwargs else (values[i] if i < len(values) else None)
        n = count_tensors(v)
        if arg.alias_info is not None and n:
            if arg.alias_info.is_write:
                mutated.update(range(counter, counter + n))
            for s in arg.alias_info.before_set:
                alias_first.setdefault(s, counter)
        counter += n
    return mutated, alias_first


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


def global_meta(func, args, kwargs, inputs, mesh):
    """The inputs' specs and the op run on meta tensors of the global shapes."""
    specs = [spec_of(x, mesh) for x in inputs]
    metas = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in specs]
    m_args, m_kwargs = substitute(args, kwargs, lambda i: metas[i])
    if "device" in m_kwargs:
        m_kwargs["device"] = "meta"
    try:
        out = func(*m_args, **m_kwargs)
    except Exception as exc:
        raise OpError(f"{func}: invalid arguments for inputs {describe_inputs(inputs)}: {exc}") from exc
    return specs, metas, m_args, m_kwargs, out


def plan_direct(session, func, args, kwargs, inputs, rule: Rule, mesh, view, *, force_replicate=False,
                numbers: tuple = ()):
    """Choose placements for ``func`` with ``rule``; None if no strategy is valid. ``numbers``:
    the arguments each Call brings (kernel_plan)."""
    specs, metas, m_args, m_kwargs, meta_out = global_meta(func, args, kwargs, inputs, mesh)
    flat_out, rebuild = flatten_outputs(meta_out)
    n_in, n_out = len(inputs), len(flat_out)
    mutated, alias_first = mutated_inputs(func, args, kwargs)
    if force_replicate:
        strategies = [Strategy((Replicate(),) * n_in, (Replicate(),) * n_out)]
    else:
        strategies = rule.strategies(OpCall(func, m_args, m_kwargs, tuple(metas), tuple(flat_out), tuple(specs)))
    for s in strategies:
        if len(s.inputs) != n_in or len(s.outputs) != n_out:
            raise OpError(f"rule for {func} returned {s} for {n_in} inputs and {n_out} outputs")
    template_args, template_kwargs = substitute(args, kwargs, Slot)
    request = PlanRequest(
        func, rule, mesh, view, tuple(inputs), tuple(specs), tuple(flat_out), rebuild, frozenset(mutated),
        _out_alias(func, n_out, alias_first), tuple(strategies),
        tuple(max(1, s.dtype.itemsize) * math.prod(s.shape) for s in specs), template_args, template_kwargs,
        force_replicate)
    plan = _choose(session, request, keep_mutated=True, numbers=numbers)
    if plan is None and mutated and not force_replicate:
        # no strategy keeps the written inputs where they are (e.g. add_(scalar) on a Partial):
        # redistribute them and let their handles follow
        plan = _choose(session, request, keep_mutated=False, numbers=numbers)
    return plan


def _ranked_combinations(req: PlanRequest, keep_mutated: bool) -> list:
    """Per mesh dim the valid strategies scored by input movement; combinations, cheapest first."""
    per_dim = []
    for m in range(req.mesh.ndim):
        scored = []
        for s in req.strategies:
            if keep_mutated and any(s.inputs[i] != req.specs[i].placements[m] for i in req.mutated):
                continue
            if any(a is not None and s.outputs[k] != s.inputs[a] for k, a in enumerate(req.out_alias)):
                continue
            cost = sum(redistribute_cost(sp.placements[m], s.inputs[i], req.nbytes[i])
                       for i, sp in enumerate(req.specs))
            scored.append((cost, s))
        scored.sort(key=lambda cs: cs[0])
        seen = set()
        per_dim.append([(cost, s) for cost, s in scored if not (s in seen or seen.add(s))])
    return sorted(itertools.product(*per_dim), key=lambda c: sum(cs[0] for cs in c))[:64]


def _choose(session, req: PlanRequest, keep_mutated: bool, numbers: tuple = ()) -> DirectPlan | None:
    func, rule, mesh, inputs = req.func, req.rule, req.mesh, req.inputs
    n_in = len(req.specs)
    for combo in _ranked_combinations(req, keep_mutated):
        chosen = [cs[1] for cs in combo]
        in_pl = [tuple(c.inputs[i] for c in chosen) for i in range(n_in)]
        in_specs = [attrs.evolve(req.specs[i], placements=in_pl[i]) for i in range(n_in)]
        out_specs = [
            None if o is None
            else TensorSpec(mesh, tuple(c.outputs[k] for c in chosen), tuple(o.shape), tuple(o.stride()), o.dtype)
            for k, o in enumerate(req.flat_out)
        ]
        per_rank = _localize_all(req, in_specs, out_specs)
        if per_rank is None:
            continue
        moves = tuple(plan_redistribute(req.specs[i].placements, in_pl[i]) for i in range(n_in))
        rebind = tuple((i, in_specs[i]) for i in sorted(req.mutated) if moves[i])
        final_specs = tuple(in_specs[a] if a is not None else s for s, a in zip(out_specs, req.out_alias))
        returns = func._schema.returns
        view_kind = 0
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            view_kind = 2 if moves and moves[0] else 1
        writes = tuple(i for i in sorted(req.mutated) if type(inputs[i]) is DTensor)
        simple = (
            n_in > 0 and not rebind and not writes and not view_kind
            and all(not m for m in moves)
            and all(a is None for a in req.out_alias)
            and all(s is not None for s in final_specs)
            and all(type(x) is DTensor for x in inputs)
        )
        seeded = bool(rule.kernel and session.kernel_is_seeded(rule.kernel))
        returns_view = any(r.alias_info is not None for r in returns)
        lost = () if req.trusted else lost_shards(func, inputs, req.specs, in_pl, final_specs)
        if lost:
            refuse_if_strict(session, str(func), lost, mesh)
        plan = kernel_plan(
            session, mesh, rule.kernel or func.name(), per_rank, op_name=str(func), seeded=seeded,
            # only aten ops and seeded aten ops: a plugin kernel may have effects we cannot see
            pure=not req.mutated and not returns_view and (rule.kernel is None or rule.kernel.startswith(SEEDED_PREFIX)),
            moves=moves, out_specs=final_specs,
            out_views=tuple(None if s is None else view_for(s, req.view) for s in out_specs),
            out_alias=req.out_alias, rebuild=req.rebuild, writes=writes,
            simple=simple, rebind=rebind, view_kind=view_kind, numbers=numbers,
        )
        return GatheringPlan(plan, str(func), lost, mesh) if lost else plan
    return None


def _localize_all(req: PlanRequest, in_specs, out_specs) -> dict | None:
    """Per-rank ``(args, kwargs)``, checked on meta tensors of the local shapes; None if inconsistent."""
    rule, mesh = req.rule, req.mesh
    results = {}
    checked = {}
    for rank in mesh.ranks:
        coord = root_coordinate(mesh, rank)
        in_regions = tuple(shard_region(s.shape, s.placements, mesh.shape, coord) for s in in_specs)
        out_regions = tuple(
            None if s is None else shard_region(s.shape, s.placements, mesh.shape, coord) for s in out_specs
        )
        if rule.localize is not None:
            try:
                a, kw = rule.localize(LocalCall(req.template_args, dict(req.template_kwargs), in_regions,
                                                out_regions, tuple(in_specs), tuple(out_specs), coord))
            except NotLocal:
                return None
        else:
            a, kw = req.template_args, req.template_kwargs
        results[rank] = (a, kw)
        if req.trusted or rule.kernel is not None or not rule.check_local:
            continue
        local_in = tuple(tuple(n for _, n in r) for r in in_regions)
        # the arguments hold Slots and scalars only (tensors are slots): repr identifies them
        ck = (local_in, repr(a), repr(kw))
        if ck not in checked:
            expected = [None if r is None else tuple(n for _, n in r) for r in out_regions]
            checked[ck] = _check_local(req.func, a, kw, in_specs, local_in, expected)
        if not checked[ck]:
            return None
    return results


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
    return all((o is None) == (e is None) and (o is None or tuple(o.shape) == e) for o, e in zip(flat, expected))
