"""``parallelize_module``: apply parallel styles to sub-modules chosen by glob patterns."""

from __future__ import annotations

import fnmatch

from torch import nn

from ..errors import PlacementError
from ..mesh import DeviceMesh
from ..placement import Replicate, refuse_torch_mesh
from ..tensor import DTensor
from .linear import one_op_linears
from .styles import ParallelStyle, distribute_parameter
from .torch_styles import from_torch_style, is_torch_style


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None, parallelize_plan=None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """Apply ``parallelize_plan`` to ``module``: a style, or ``{pattern: style or nested plan}``.

    As in ``torch.distributed.tensor.parallel.parallelize_module``, a pattern is a dotted path of
    sub-module names matched one name at a time with ``fnmatch`` (``"layers.*.attention.wq"``:
    ``*`` stands for one name, never a dotted run), the value may be a nested plan applied to
    every matched sub-module, and ``""`` names the module itself. torch's style objects are
    translated (``nn/torch_styles.py``). A pattern that matches nothing raises (torch warns and
    skips it). Every parameter and buffer no style distributed is then placed as Replicate on the
    mesh, so the model is never left half on the controller. ``src_data_rank`` is accepted for
    torch compatibility: the controller holds the one value of every tensor.
    """
    if device_mesh is None:
        raise PlacementError("parallelize_module needs device_mesh (a mesh from dt.init_device_mesh, e.g. mesh['tp'])")
    refuse_torch_mesh(device_mesh, "parallelize_module")
    if parallelize_plan is not None:
        _apply(module, device_mesh, parallelize_plan, "")
    replicate_rest(module, device_mesh)
    return module


def _apply(module: nn.Module, mesh: DeviceMesh, plan, where: str) -> None:
    if is_torch_style(plan):
        plan = from_torch_style(plan)
    if isinstance(plan, ParallelStyle):
        plan.apply(module, mesh)
        return
    if not isinstance(plan, dict):
        raise PlacementError(
            f"plan entry {where or '(the module)'!r} is {plan!r}: give a parallel style (dt.nn.ColwiseParallel(), "
            "or torch's) or a dict {sub-module pattern: style}"
        )
    for pattern, style in plan.items():
        for name, sub in matching(module, pattern):
            _apply(sub, mesh, style, f"{where}.{name}" if where and name else where or name)


def matching(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """``(dotted name, sub-module)`` of every sub-module ``pattern`` matches, in
    ``named_modules`` order; one name per dot-separated part, as torch matches plan keys."""
    if pattern == "":
        return [("", module)]
    found = [("", module)]
    tokens = pattern.split(".")
    for i, token in enumerate(tokens):
        step = [(f"{path}.{name}" if path else name, child)
                for path, parent in found for name, child in parent.named_children()
                if fnmatch.fnmatchcase(name, token)]
        if not step:
            children = sorted({name for _, parent in found for name, _ in parent.named_children()})
            within = f"the children of what {'.'.join(tokens[:i])!r} matched" if i else "the top-level children"
            raise PlacementError(
                f"parallelize plan pattern {pattern!r} matches no sub-module: its part {token!r} matches none of "
                f"{within}, {children[:8]} (a '*' stands for one name)"
            )
        found = step
    return found


def replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    """Distribute every parameter and buffer that is still a plain tensor as Replicate (and make
    the Linears one op each: nn/linear.py)."""
    from ..api import distribute_tensor

    one_op_linears(module)
    placements = [Replicate()] * mesh.ndim
    for sub in module.modules():
        for name, _ in list(sub.named_parameters(recurse=False)):
            distribute_parameter(sub, name, mesh, placements)
        for name, buf in list(sub.named_buffers(recurse=False)):
            if buf is not None and not isinstance(buf, DTensor):
                sub.register_buffer(name, distribute_tensor(buf, mesh, placements),
                                    persistent=name not in sub._non_persistent_buffers_set)
