"""The operator registry: placement signatures and controller-side decompositions per op.

A placement signature (``rule``) receives an :class:`OpCall` (the op with meta tensors of the
global shapes) and returns the valid one-mesh-dim :class:`Strategy` choices. The dispatcher
applies them to each mesh dim, picks the cheapest combination, and checks it by running the op
on meta tensors of every rank's local shapes.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from ..errors import PluginError
from ..registry import Registry


@attrs.frozen
class Strategy:
    """One valid choice for one mesh dim: a placement per tensor input and per tensor output."""

    inputs: tuple
    outputs: tuple


@attrs.frozen
class OpCall:
    """What a rule sees: the op, its arguments with meta tensors, and the meta outputs."""

    op: Any
    args: tuple
    kwargs: dict
    inputs: tuple  # meta tensors of the tensor inputs, in flattening order
    outputs: tuple  # meta tensors (or None) of the outputs, in flattening order
    specs: tuple = ()  # TensorSpecs of the tensor inputs as they are placed now (plain: replicated)


@attrs.frozen
class LocalCall:
    """What ``localize`` sees for one rank: local shapes and the shard regions."""

    args: tuple
    kwargs: dict
    in_regions: tuple  # per tensor input: ((offset, length), ...) of the local shard, or None
    out_regions: tuple
    in_specs: tuple
    out_specs: tuple
    coord: tuple


class NotLocal(Exception):
    """Raised by a rule's ``localize`` when a combination of strategies gives this rank a local
    result that is not its region of the output: the dispatcher tries the next combination."""


@attrs.frozen
class Rule:
    """A placement signature plus how to run it locally.

    ``strategies(call) -> list[Strategy]`` (one mesh dim). ``localize(local) -> (args, kwargs)``
    rewrites static arguments per rank (e.g. view sizes of uneven shards). ``kernel`` names a
    worker kernel to run instead of the aten op. ``check_local=False``: the strategies give
    consistent local shapes by construction, so the per-rank meta check is skipped (it costs a
    meta call of the op, which for an op over hundreds of tensors takes milliseconds).
    """

    strategies: Callable
    localize: Callable | None = None
    kernel: str | None = None
    check_local: bool = True


@attrs.define
class OpRegistry(Registry):
    """Rules keyed by ``OpOverload`` (or by ``OpOverloadPacket`` for every overload)."""

    decompositions: dict = attrs.field(factory=dict)

    def add(self, op, rule=None, *, localize=None, kernel=None, replace: bool = False) -> None:  # noqa: D417
        """Register ``rule`` (a strategies function or a :class:`Rule`) for ``op``."""
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            raise PluginError(f"{self.calling_plugin()}: ops registry takes aten/custom ops, got {op!r}")
        if not isinstance(rule, Rule):
            rule = Rule(rule, localize, kernel)
        super().add(op, rule, replace=replace)

    def add_decomposition(self, op, fn: Callable, *, replace: bool = False) -> None:
        """Run ``fn(*args, **kwargs)`` on the controller instead of planning ``op`` directly.

        ``fn`` receives distributed tensors and calls ordinary torch ops on them (which are
        planned as usual); it may call :func:`dtorch_core.planner.dispatch.dispatch_direct` to plan the
        op itself with its rule.
        """
        if op in self.decompositions and not replace:
            raise PluginError(f"decomposition for {op} registered twice")
        self.decompositions[op] = fn

    def rule_for(self, op) -> Rule | None:
        rule = self.entries.get(op)
        if rule is None:
            rule = self.entries.get(op.overloadpacket)
        return rule

    def decomposition_for(self, op):
        fn = self.decompositions.get(op)
        if fn is None:
            fn = self.decompositions.get(op.overloadpacket)
        return fn
