"""torch.distributed.tensor.parallel's style objects, translated into dtorch's (nn/styles.py).

A torchtitan-style plan builds torch's ``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``, ``PrepareModuleOutput`` and
``PrepareModuleInputOutput``; ``parallelize_module`` hands each to :func:`from_torch_style` and
applies the dtorch style it gets. What is translated and what differs (docs/dtensor-compat.md):

- layouts: torch's placements become dtorch's; one with no dtorch equivalent (``_StridedShard``,
  ``Partial("product")``) raises a PlacementError naming the argument.
- ``input_layouts`` says, in torch, how a *local* tensor input is to be read. Here a plain tensor
  holds the global value, and a DTensor's layout is known, so only the desired layouts matter
  (as with torch, an input whose ``input_layouts`` entry is None is left alone).
- ``use_local_output`` / ``use_local_input``: torch hands the module's code the rank's shard. On a
  single controller the code sees the global tensor, so the output stays a DTensor with its
  global shape, which is what model code written for one device expects (torchtitan's ``-1`` head
  counts give the global count). Not an error: torch's own default is True.
- ``src_data_rank``: the controller holds the one value of each tensor, so every rank's data is
  the source's; ignored.

torch's module is never imported here: a torch style object means the user imported it already.
"""

from __future__ import annotations

import sys

from ..errors import PlacementError
from ..placement import as_layout
from .styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

TORCH_STYLES = "torch.distributed.tensor.parallel.style"


def is_torch_style(obj) -> bool:
    """Whether ``obj`` is a ``torch.distributed.tensor.parallel.ParallelStyle`` (or a subclass)."""
    styles = sys.modules.get(TORCH_STYLES)
    return styles is not None and isinstance(obj, styles.ParallelStyle)


def from_torch_style(style) -> ParallelStyle:
    """The dtorch style that does what torch's ``style`` does on a single controller."""
    kind = type(style)
    translate = _TRANSLATIONS.get(kind.__name__) if kind.__module__ == TORCH_STYLES else None
    if translate is None:
        raise PlacementError(
            f"{kind.__module__}.{kind.__qualname__} is a torch ParallelStyle that dtorch cannot translate: "
            f"it translates torch's own {', '.join(_TRANSLATIONS)} (a subclass may change what they do). "
            "Write a dt.nn.ParallelStyle for it (its apply(module, mesh) distributes parameters and installs hooks)"
        )
    return translate(style)


def _layout(style, argument: str, value):
    try:
        return as_layout(value)
    except PlacementError as err:
        raise PlacementError(f"{type(style).__name__}({argument}={value!r}): {err}") from None


def _kwarg_layouts(style, argument: str, layouts: dict) -> dict:
    return {name: _layout(style, f"{argument}[{name!r}]", p) for name, p in layouts.items()}


def _colwise(style) -> ColwiseParallel:
    return ColwiseParallel(input_layouts=_layout(style, "input_layouts", style.input_layouts[0]),
                           output_layouts=_layout(style, "output_layouts", style.output_layouts[0]))


def _rowwise(style) -> RowwiseParallel:
    return RowwiseParallel(input_layouts=_layout(style, "input_layouts", style.input_layouts[0]),
                           output_layouts=_layout(style, "output_layouts", style.output_layouts[0]))


def _sequence(style) -> SequenceParallel:
    (shard,) = style.sequence_sharding
    return SequenceParallel(sequence_dim=shard.dim)


def _input_parts(style) -> dict:
    given = _layout(style, "input_layouts", style.input_layouts)
    desired = _layout(style, "desired_input_layouts", style.desired_input_layouts)
    given_kw = _kwarg_layouts(style, "input_kwarg_layouts", style.input_kwarg_layouts)
    desired_kw = _kwarg_layouts(style, "desired_input_kwarg_layouts", style.desired_input_kwarg_layouts)
    return {
        "input_layouts": given,
        # torch ignores the desired layouts where no input layouts are given
        "desired_input_layouts": None if given is None else desired,
        "input_kwarg_layouts": given_kw,
        "desired_input_kwarg_layouts": desired_kw,
    }


def _output_parts(style) -> dict:
    given = _layout(style, "output_layouts", style.output_layouts)
    desired = _layout(style, "desired_output_layouts", style.desired_output_layouts)
    return {"output_layouts": given, "desired_output_layouts": desired}


def _prepare_input(style) -> PrepareModuleInput:
    return PrepareModuleInput(**_input_parts(style))


def _prepare_output(style) -> PrepareModuleOutput:
    return PrepareModuleOutput(**_output_parts(style))


def _prepare_input_output(style) -> PrepareModuleInputOutput:
    return PrepareModuleInputOutput(**_input_parts(style.prepare_module_input),
                                    **_output_parts(style.prepare_module_output))


_TRANSLATIONS = {
    "ColwiseParallel": _colwise,
    "RowwiseParallel": _rowwise,
    "SequenceParallel": _sequence,
    "PrepareModuleInput": _prepare_input,
    "PrepareModuleOutput": _prepare_output,
    "PrepareModuleInputOutput": _prepare_input_output,
}
