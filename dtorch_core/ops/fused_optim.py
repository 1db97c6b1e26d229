"""torch's fused optimizer kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``): one worker
call per step over every rank's local shards.

Each kernel updates list position ``k`` of every same-shaped list (params, grads, moments,
momentum buffers) elementwise, from that position's values alone, so the lists' element ``k``
takes its param's placement on every mesh dim (a Partial param is made Replicate: the update is
not linear); the 0-d ``state_steps`` and a Tensor ``lr`` are Replicate. Uneven and empty shards
need nothing (an empty local shard is an empty tensor, which the CPU kernels update as nothing
and the CUDA multi-tensor kernels skip).

Every list is written by the kernel. A grad placed unlike its param (the Partial gradient of
data-parallel training) is made its param's placement first (:func:`fused_decomposition`): a new
tensor, so the kernel writes a copy and ``p.grad`` stays as backward left it. That matters only
where torch's kernels write grads at all (to unscale them with ``grad_scale``, refused here, and
possibly to negate them under ``maximize``): the update itself is the same. A moment or
momentum buffer (or a Partial param) placed unlike its param is state: the kernel updates a copy
in the param's placement and the copy is written back, as the plan cannot move a tensor it
writes when that tensor is a view of a mesh. ``optim_replay`` moves such buffers once before a
step is recorded, so a replayed step has no copies. ``grad_scale``/``found_inf`` (AMP's GradScaler) are refused.

torch has no meta kernel for some of these overloads (``tensor_lr``, SGD); the planner infers
outputs on meta tensors, so a no-op one (the ops return nothing) is registered where none exists.
"""

from __future__ import annotations

import torch

from ..errors import OpError
from ..placement import Partial, Replicate
from ..planner.moves import issue_redistribute
from ..planner.schema import Rule, Strategy
from ..tensor import DTensor
from .foreach_plan import NOT_PLANNED, run_foreach
from .foreach_rule import _layout

aten = torch.ops.aten

PACKETS = (aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_)
_NOT_SHARDED = frozenset({"state_steps"})  # 0-d per-param lists: Replicate
_meta_library: list = []  # the torch.library.Library holding the no-op meta kernels (kept alive)


def fused_ops():
    """Every overload of the in-place fused optimizer ops torch.optim calls."""
    for packet in PACKETS:
        for name in packet.overloads():
            yield getattr(packet, name)


def _names(op, n_args: int, kwargs) -> list:
    schema_names = [a.name for a in op._schema.arguments]
    return schema_names[:n_args] + list(kwargs)


def fused_strategies(call):
    """One strategy per mesh dim: every list element takes its param's placement."""
    R = Replicate()
    n_in = len(call.inputs)
    specs = call.specs
    lists, _ = _layout(call)
    names = _names(call.op, len(call.args), call.kwargs)
    if not specs or not lists or names[lists[0][0]] != "self":
        return []
    params = lists[0][1]
    if any(len(idx) != len(params) for _, idx in lists):
        return []
    strategies = []
    for m in range(specs[0].mesh.ndim):
        ins = [R] * n_in
        for k, i_param in enumerate(params):
            p = specs[i_param].placements[m]
            if isinstance(p, Partial):
                p = R
            for pos, idx in lists:
                ins[idx[k]] = R if names[pos] in _NOT_SHARDED else p
        strategies.append(Strategy(tuple(ins), ()))
    return strategies


def _target(param: DTensor) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in param._spec.placements)


def fused_decomposition(op, *args, **kwargs):
    """Plan ``op`` as one call: list elements placed unlike their params are moved first."""
    names = _names(op, len(args), kwargs)
    values = dict(zip(names, list(args) + list(kwargs.values())))
    if values.get("grad_scale") is not None or values.get("found_inf") is not None:
        raise OpError(f"{op}: grad_scale/found_inf (AMP's GradScaler) are not supported on DTensors; "
                      "use the optimizer with fused=False")
    params = values["self"]
    tensors = [t for n, v in values.items() if type(v) in (list, tuple) for t in v]
    tensors += [v for v in values.values() if isinstance(v, torch.Tensor)]
    if not params or not all(type(t) is DTensor and t._spec.mesh == params[0]._spec.mesh for t in tensors):
        raise OpError(f"{op}: every tensor (params, grads, state, a Tensor lr) must be a DTensor of one mesh; "
                      "distribute the optimizer's state with its params, or use fused=False")
    # every written list element placed unlike its param becomes a copy in the param's placement
    # (the plan cannot move a tensor it writes when that tensor is a view of a mesh); the
    # kernel's writes to such copies are copied back, except to grads (see the module docstring)
    write_back = []
    for name in names:
        v = values[name]
        if name in _NOT_SHARDED or type(v) not in (list, tuple) or not v:
            continue
        moved, changed = list(v), False
        for k, (p, t) in enumerate(zip(params, v)):
            target = _target(p)
            if t._spec.placements != target:
                moved[k], changed = issue_redistribute(t, target, t._view), True
                if name != "grads":
                    write_back.append((t, moved[k]))
        if changed:
            if name in names[:len(args)]:
                args = tuple(moved if n == name else a for n, a in zip(names, args))
            else:
                kwargs = dict(kwargs, **{name: moved})
    session = params[0]._handle.session
    out = run_foreach(session, op, args, kwargs, session.ops.rule_for(op))
    if out is NOT_PLANNED:
        raise OpError(f"{op}: no placement fits (lists of different lengths?); use the optimizer with fused=False")
    for t, moved in write_back:
        t.copy_(moved)


def _register_meta(op) -> None:
    name = op.name()
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return
    if not _meta_library:
        _meta_library.append(torch.library.Library("aten", "IMPL"))
    _meta_library[0].impl(name.split("::")[1], lambda *args, **kwargs: None, "Meta")


def register(registry) -> None:
    for op in fused_ops():
        _register_meta(op)
        # every list element has its param's shape: local shapes agree by construction
        registry.add(op, Rule(fused_strategies, check_local=False), replace=True)
        registry.add_decomposition(op, lambda *a, _op=op, **kw: fused_decomposition(_op, *a, **kw), replace=True)
