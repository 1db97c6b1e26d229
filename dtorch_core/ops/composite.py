"""Ops torch defines by composing other ops (a CompositeImplicitAutograd kernel, e.g. ``to``,
``type_as``): expanded the way torch expands them.

Called from user code, torch expands them before a distributed tensor sees them. A decomposition
that runs inside dispatch (torch's own ``_fused_rms_norm`` decomposition, which ``F.rms_norm``
reaches on CUDA) calls them on distributed tensors directly, and torch versions differ in which
of those reach ``__torch_dispatch__`` unexpanded (2.11 hands over ``to.dtype`` and ``type_as``).
This family registers last: an op with its own rule or decomposition keeps it.
"""

from __future__ import annotations

import torch

from .pointwise import all_aten_overloads


def register(registry) -> None:
    has_composite = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in all_aten_overloads():
        if registry.rule_for(op) is not None or registry.decomposition_for(op) is not None:
            continue
        try:
            composite = has_composite(op.name(), "CompositeImplicitAutograd")
        except RuntimeError:  # a TorchScript builtin, not a dispatcher op
            continue
        if composite:
            registry.add_decomposition(op, op.decompose)
