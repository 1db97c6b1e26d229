"""Parallel styles: how one module's parameters, inputs and outputs are placed on a mesh.

Names and defaults follow ``torch.distributed.tensor.parallel``. On a single controller every
tensor's layout is known, so a style's ``input_layouts`` (how inputs arrive, in torch) is accepted
for compatibility but not needed: inputs are redistributed to the layout the style computes with
(Replicate for colwise, Shard(-1) for rowwise Linear, the sequence shard for SequenceParallel).
A plain tensor holds the global value and is distributed in that layout. Layouts may be given
with torch.distributed.tensor's placements too (converted by ``placement.as_layout``); torch's
style objects themselves are translated by ``nn/torch_styles.py``.
"""

from __future__ import annotations

import weakref

import attrs
import torch
from torch import nn

from ..errors import PlacementError
from ..mesh import DeviceMesh
from ..placement import Replicate, Shard, as_layout, as_placement
from ..tensor import DTensor


def to_layout(x, mesh: DeviceMesh, layout):
    """``x`` (a DTensor or a plain tensor holding the global value) with ``layout`` on ``mesh``."""
    from ..api import distribute_tensor

    if layout is None or not isinstance(x, torch.Tensor):
        return x
    placements = [layout] * mesh.ndim if not isinstance(layout, (list, tuple)) else list(layout)
    placements = [as_placement(p) for p in placements]
    if isinstance(x, DTensor):
        if tuple(x.placements) == tuple(_normalized(placements, x.ndim)) and x.device_mesh == mesh:
            return x
        return x.redistribute(mesh, placements)
    return distribute_tensor(x, mesh, placements)


def _normalized(placements, ndim):
    return [Shard(p.dim % ndim) if isinstance(p, Shard) and ndim else p for p in map(as_placement, placements)]


# id(original Parameter) -> (weak reference to it, its distributed replacement), so that a
# parameter shared by several modules (tied embeddings) stays one parameter. Keyed by identity:
# tensors compare by value.
_replaced: dict = {}


def distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placements) -> None:
    """Replace ``module.<name>`` by a distributed Parameter (no-op if it is missing or already one).

    A parameter tied to one already replaced gets the same replacement; asking for another
    layout of it raises.
    """
    from ..api import distribute_tensor
    from ..tensor import root_placements

    p = getattr(module, name, None)
    if p is None or isinstance(p, DTensor):
        return
    ref, dist = _replaced.get(id(p), (None, None))
    if ref is not None and ref() is p:
        wanted = root_placements(mesh, placements, p.ndim)
        if dist._spec.mesh != mesh.root or tuple(dist._spec.placements) != tuple(wanted):
            raise PlacementError(
                f"{type(module).__name__}.{name} is tied to a parameter already laid out as "
                f"{list(dist.placements)} on {dist.device_mesh!r}; a tied parameter has one layout, so give "
                f"both modules styles that agree (asked here: {list(placements)})"
            )
    else:
        dist = nn.Parameter(distribute_tensor(p.detach(), mesh, placements), requires_grad=p.requires_grad)
        key = id(p)
        _replaced[key] = (weakref.ref(p, lambda _r, key=key: _replaced.pop(key, None)), dist)
    setattr(module, name, dist)


def _map_inputs(args, mesh, layouts):
    if layouts is None:
        return args
    if not isinstance(layouts, (list, tuple)):
        layouts = (layouts,) + (None,) * (len(args) - 1)
    return tuple(to_layout(a, mesh, l) for a, l in zip(args, layouts)) + tuple(args[len(layouts):])


def _map_kwargs(kwargs, mesh, layouts):
    return {name: to_layout(value, mesh, layouts.get(name)) for name, value in kwargs.items()}


def _kwarg_layouts(layouts):
    """A ``{kwarg name: placement}`` argument with torch's placements converted."""
    return None if layouts is None else {name: as_layout(p) for name, p in dict(layouts).items()}


def _map_outputs(out, mesh, layouts, use_local):
    if isinstance(out, torch.Tensor):
        layout = layouts[0] if isinstance(layouts, (list, tuple)) else layouts
        out = to_layout(out, mesh, layout)
        return out.to_local() if use_local and isinstance(out, DTensor) else out
    if isinstance(out, tuple):
        if not isinstance(layouts, (list, tuple)):
            layouts = (layouts,) * len(out)
        layouts = tuple(layouts) + (None,) * (len(out) - len(layouts))  # outputs past them: left alone
        return tuple(_map_outputs(o, mesh, l, use_local) for o, l in zip(out, layouts))
    return out


def where_given(given, desired):
    """The desired layouts, except that (as in torch) an input or output whose entry in the
    given layouts is None is left alone; without given layouts, the desired ones."""
    if given is None or desired is None or not (isinstance(given, tuple) or isinstance(desired, tuple)):
        return desired
    if not isinstance(given, tuple):
        given = (given,)
    if not isinstance(desired, tuple):
        desired = (desired,)
    return tuple(d if g is not None else None for g, d in zip(given, desired))


class ParallelStyle:
    """Base class: ``apply(module, mesh)`` distributes the module's parameters and installs
    hooks that put its inputs and outputs in the style's layouts."""

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError

    def _hooks(self, module, mesh, input_layouts, output_layouts, use_local_output=False, kwarg_layouts=None):
        if kwarg_layouts:
            module.register_forward_pre_hook(
                lambda m, args, kwargs: (_map_inputs(args, mesh, input_layouts),
                                         _map_kwargs(kwargs, mesh, kwarg_layouts)),
                with_kwargs=True)
        elif input_layouts is not None:
            module.register_forward_pre_hook(lambda m, args: _map_inputs(args, mesh, input_layouts))
        if output_layouts is not None:
            module.register_forward_hook(lambda m, args, out: _map_outputs(out, mesh, output_layouts,
                                                                           use_local_output))


def _check_1d(style, mesh):
    if mesh.ndim != 1:
        raise PlacementError(f"{type(style).__name__} needs a 1-D mesh (e.g. mesh['tp']), got {mesh!r}")


@attrs.define
class ColwiseParallel(ParallelStyle):
    """Shard a Linear's output features (weight and bias on dim 0) or an Embedding's columns.

    Inputs are made Replicate; the output is redistributed to ``output_layouts`` (Shard(-1),
    the features, by default: no communication).
    """

    input_layouts: object = attrs.field(factory=Replicate, converter=as_layout)
    output_layouts: object = attrs.field(factory=lambda: Shard(-1), converter=as_layout)
    use_local_output: bool = False

    def apply(self, module, mesh):
        _check_1d(self, mesh)
        if isinstance(module, nn.Linear):
            distribute_parameter(module, "weight", mesh, [Shard(0)])
            distribute_parameter(module, "bias", mesh, [Shard(0)])
        elif isinstance(module, nn.Embedding):
            distribute_parameter(module, "weight", mesh, [Shard(1)])
        else:
            raise PlacementError(f"ColwiseParallel supports nn.Linear and nn.Embedding, not {type(module).__name__}")
        self._hooks(module, mesh, Replicate(), self.output_layouts, self.use_local_output)
        return module


@attrs.define
class RowwiseParallel(ParallelStyle):
    """Shard a Linear's input features (weight on dim 1, bias replicated) or an Embedding's
    vocabulary (weight on dim 0; lookups give Partial sums).

    Inputs are made Shard(-1) (Linear) or Replicate (Embedding); the Partial output is reduced to
    ``output_layouts``: Replicate (all-reduce) by default, Shard(1) (reduce-scatter) for sequence
    parallelism.
    """

    input_layouts: object = attrs.field(default=None, converter=as_layout)
    output_layouts: object = attrs.field(factory=Replicate, converter=as_layout)
    use_local_output: bool = False

    def apply(self, module, mesh):
        _check_1d(self, mesh)
        if isinstance(module, nn.Linear):
            distribute_parameter(module, "weight", mesh, [Shard(1)])
            distribute_parameter(module, "bias", mesh, [Replicate()])
            inputs = Shard(-1)
        elif isinstance(module, nn.Embedding):
            distribute_parameter(module, "weight", mesh, [Shard(0)])
            inputs = Replicate()
        else:
            raise PlacementError(f"RowwiseParallel supports nn.Linear and nn.Embedding, not {type(module).__name__}")
        self._hooks(module, mesh, inputs, self.output_layouts, self.use_local_output)
        return module


@attrs.define
class SequenceParallel(ParallelStyle):
    """Run a norm/dropout-like module on activations sharded along ``sequence_dim``; its
    parameters are replicated."""

    sequence_dim: int = 1
    use_local_output: bool = False

    def apply(self, module, mesh):
        _check_1d(self, mesh)
        for name, _ in list(module.named_parameters(recurse=False)):
            distribute_parameter(module, name, mesh, [Replicate()])
        layout = Shard(self.sequence_dim)
        self._hooks(module, mesh, layout, layout, self.use_local_output)
        return module


@attrs.define
class PrepareModuleInput(ParallelStyle):
    """Redistribute a module's positional inputs to ``desired_input_layouts`` (one per input;
    None leaves an input alone) and its keyword inputs to ``desired_input_kwarg_layouts``
    (``{name: placement}``). On a single controller a tensor's layout is known already, so
    ``input_layouts`` and ``input_kwarg_layouts`` are optional; where given, as in torch, an input
    whose entry there is None (or missing) is left alone."""

    input_layouts: object = attrs.field(default=None, converter=as_layout)
    desired_input_layouts: object = attrs.field(default=None, converter=as_layout)
    input_kwarg_layouts: dict | None = attrs.field(default=None, converter=_kwarg_layouts)
    desired_input_kwarg_layouts: dict | None = attrs.field(default=None, converter=_kwarg_layouts)

    def apply(self, module, mesh):
        kwargs = self.desired_input_kwarg_layouts
        if kwargs and self.input_kwarg_layouts is not None:
            kwargs = {k: d for k, d in kwargs.items() if self.input_kwarg_layouts.get(k) is not None}
        self._hooks(module, mesh, where_given(self.input_layouts, self.desired_input_layouts), None,
                    kwarg_layouts=kwargs)
        return module


@attrs.define
class PrepareModuleOutput(ParallelStyle):
    """Redistribute a module's outputs to ``desired_output_layouts`` (one per output of a
    tuple; None leaves an output alone)."""

    output_layouts: object = attrs.field(default=None, converter=as_layout)
    desired_output_layouts: object = attrs.field(default=None, converter=as_layout)
    use_local_output: bool = False

    def apply(self, module, mesh):
        self._hooks(module, mesh, None, where_given(self.output_layouts, self.desired_output_layouts),
                    self.use_local_output)
        return module


@attrs.define
class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module."""

    input_layouts: object = attrs.field(default=None, converter=as_layout)
    desired_input_layouts: object = attrs.field(default=None, converter=as_layout)
    input_kwarg_layouts: dict | None = attrs.field(default=None, converter=_kwarg_layouts)
    desired_input_kwarg_layouts: dict | None = attrs.field(default=None, converter=_kwarg_layouts)
    output_layouts: object = attrs.field(default=None, converter=as_layout)
    desired_output_layouts: object = attrs.field(default=None, converter=as_layout)
    use_local_output: bool = False

    def apply(self, module, mesh):
        PrepareModuleInput(self.input_layouts, self.desired_input_layouts, self.input_kwarg_layouts,
                           self.desired_input_kwarg_layouts).apply(module, mesh)
        PrepareModuleOutput(self.output_layouts, self.desired_output_layouts, self.use_local_output).apply(module, mesh)
        return module
