"""Kernel registry: what a worker runs for a plan's target name."""

from __future__ import annotations

import functools
import threading
from typing import Callable

import attrs
import torch

from ..errors import PluginError
from ..registry import Registry

SEEDED_PREFIX = "dtorch::seeded/"
_global_rng_lock = threading.Lock()


def resolve_op(name: str):
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``."""
    ns, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, ns), op_name)
        return getattr(packet, overload or "default")
    except AttributeError:
        raise PluginError(f"no operator {name!r} is registered in this process") from None


def seeded_call(op, *args, seed: int, **kwargs):
    """Run a random op with a generator seeded by the controller, identically on every rank."""
    if any(a.name == "generator" for a in op._schema.arguments):
        gen = torch.Generator(device=_device_of(args, kwargs)).manual_seed(seed)
        return op(*args, generator=gen, **kwargs)
    with _global_rng_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return op(*args, **kwargs)


def _device_of(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return "cpu"


@attrs.define
class KernelRegistry(Registry):
    """Kernels by name, optionally per device type; aten names fall back to the aten op."""

    seeded: set = attrs.field(factory=set)
    _cache: dict = attrs.field(factory=dict)

    def add(self, name: str, fn: Callable, *, device_type: str | None = None, seeded: bool = False,
            replace: bool = False) -> None:
        """Register ``fn`` as kernel ``name`` (for one device type if given).

        ``seeded`` kernels receive ``seed=`` (an int chosen by the controller per call).
        """
        key = name if device_type is None else f"{name}@{device_type}"
        super().add(key, fn, replace=replace)
        if seeded:
            self.seeded.add(name)

    def is_seeded(self, name: str) -> bool:
        return name in self.seeded or name.startswith(SEEDED_PREFIX)

    def resolve(self, name: str, device_type: str) -> Callable:
        key = (name, device_type)
        fn = self._cache.get(key)
        if fn is None:
            fn = self.entries.get(f"{name}@{device_type}") or self.entries.get(name)
            if fn is None:
                if name.startswith(SEEDED_PREFIX):
                    fn = functools.partial(seeded_call, resolve_op(name[len(SEEDED_PREFIX):]))
                else:
                    fn = resolve_op(name)
            self._cache[key] = fn
        return fn
