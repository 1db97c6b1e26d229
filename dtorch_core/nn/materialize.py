"""``materialize``: give a model built on the meta device its values, sharded, on the workers.

The controller never holds a full parameter: ``parallelize_module`` (or, without a plan,
``replicate_rest``) places every meta parameter and buffer as uninitialised shards on the
workers (inside ``meta_as_uninitialised()``, ``distribute_tensor`` of a meta tensor allocates
them there; elsewhere it raises), then one call of the worker kernel ``dtorch::materialize``
replays the recorded initialisation (see ``init_trace.py``) and each rank keeps its region of
every tensor.
"""

from __future__ import annotations

import attrs
import structlog
import torch
import torch.nn as nn

from ..api import meta_as_uninitialised
from ..errors import MaterializeError, PlacementError
from ..mesh import DeviceMesh
from ..placement import Partial
from ..tensor import DTensor
from .init_recording import recording
from .init_trace import InitTrace, trace_of
from .kernel_call import call_kernel
from .parallelize import parallelize_module, replicate_rest

log = structlog.get_logger(__name__)


@attrs.frozen
class _Slot:
    """One meta parameter or buffer: ``module.<name>``, known as ``qualname``."""

    qualname: str
    module: nn.Module
    name: str
    buffer: bool
    tensor: torch.Tensor


def materialize(model: nn.Module, mesh: DeviceMesh, plan=None, *, seed: int | None = None) -> nn.Module:
    """Create ``model``'s meta parameters and buffers as distributed tensors on ``mesh``, with the
    values building the model on one CPU device gives, without materialising it anywhere.

    ``plan`` is a ``parallelize_module`` plan (a style or ``{glob: style}``) that decides the
    placements and installs the styles' hooks; everything it does not shard is Replicate. With
    ``seed`` the values equal ``torch.manual_seed(seed); model = Model(...)``; without it, the
    stream starts from the state torch's CPU generator had when ``dt.nn.meta_init()`` began
    (without a recording: its state now).

    How the values are found: a model built inside ``dt.nn.meta_init()`` has its whole
    initialisation recorded (constructors, custom ``_init_weights``, buffers computed from
    ``torch.arange`` & co.) and replayed on the workers in the same order, so they draw the same
    random stream. A model built under a plain ``torch.device("meta")`` has no recording: then
    every module's ``reset_parameters()`` is recorded now, in ``model.modules()`` order, and
    replayed. That equals ``torch.manual_seed(seed)`` followed by those calls on a CPU model,
    which differs from construction when the model's ``__init__`` initialises anything itself or
    creates modules in another order; tensors that no ``reset_parameters`` sets (e.g. a buffer
    computed in ``__init__``) raise :class:`MaterializeError`.

    Parameters and buffers that are not meta are placed as they are. Tied parameters stay tied
    (the plan must give them the same placements). Each worker holds about one full tensor at a
    time while it replays (``log`` at debug level shows the peak).
    """
    slots = _meta_slots(model)
    tied: dict = {}  # id(meta tensor) -> the slots that hold it (more than one when tied)
    for s in slots:
        tied.setdefault(id(s.tensor), []).append(s)
    program = trace = None
    if slots:
        trace = _trace_for(model, slots)
        # raises before anything is sent when a tensor's values are not known
        program = trace.compile([(group[0].qualname, group[0].tensor) for group in tied.values()])
    with meta_as_uninitialised():
        if plan is not None:
            parallelize_module(model, mesh, plan)
        else:
            replicate_rest(model, mesh)
    if not slots:
        log.debug("materialize: no meta tensors", model=type(model).__name__)
        return model
    dtensors = [_tie(group) for group in tied.values()]
    rng = {"seed": int(seed)} if seed is not None else {"rng_state": trace.rng_state}
    specs = [x._spec for x in dtensors]

    def regions(rank, coord):
        return {"regions": tuple(spec.region(coord) for spec in specs)}

    call_kernel("dtorch::materialize", dtensors, writes=tuple(range(len(dtensors))),
                kwargs={**program.kernel_kwargs(), **rng}, rank_kwargs=regions, op_name="dt.nn.materialize",
                cache=False)
    log.debug("materialized", tensors=len(dtensors), peak_bytes=program.peak_bytes)
    return model


def _trace_for(model: nn.Module, slots: list) -> InitTrace:
    traces = {id(t): t for t in (trace_of(s.tensor) for s in slots) if t is not None}
    if len(traces) > 1:
        raise MaterializeError(
            "the model's tensors were recorded by more than one dt.nn.meta_init() block; build the "
            "whole model in one block so that its random stream is one sequence"
        )
    if traces:
        return traces.popitem()[1]
    return _reset_parameters_trace(model)


def _meta_slots(model: nn.Module) -> list:
    slots = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in table.items():
                if t is not None and not isinstance(t, DTensor) and t.is_meta:
                    qualname = f"{prefix}.{name}" if prefix else name
                    slots.append(_Slot(qualname, module, name, kind == "buffer", t))
    return slots


def _reset_parameters_trace(model: nn.Module) -> InitTrace:
    trace = InitTrace(torch.get_rng_state())
    with recording(trace), torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    log.debug("materialize: no meta_init recording, replaying reset_parameters()", steps=len(trace.steps))
    return trace


def _tie(group: list) -> DTensor:
    """The distributed tensor of one meta tensor, set on every module that shared it."""
    first = group[0]
    table = first.module._buffers if first.buffer else first.module._parameters
    keep = table[first.name]
    if not isinstance(keep, DTensor) or keep.is_meta:
        raise MaterializeError(f"{first.qualname} was not distributed; is it registered on the model?")
    if any(isinstance(p, Partial) for p in keep._spec.placements):
        raise PlacementError(f"{first.qualname} is {keep.placements}: parameters and buffers cannot be Partial")
    for s in group[1:]:
        table = s.module._buffers if s.buffer else s.module._parameters
        other = table[s.name]
        if other is not keep and other._spec != keep._spec:
            raise PlacementError(
                f"{s.qualname} is tied to {first.qualname}, but the plan placed them differently "
                f"({other.placements} and {keep.placements}); give tied modules styles with equal placements"
            )
        table[s.name] = keep
    return keep
