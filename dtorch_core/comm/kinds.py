"""What the communicators registry holds, and how a runner picks one for its device type."""

from __future__ import annotations

from typing import Any, Callable

import attrs

from ..errors import DeviceError, PluginError

SCOPES = ("thread", "process")


@attrs.frozen
class Communicator:
    """A registered communicator: how to make one and which runners may use it.

    ``scope`` says who shares it:
      ``"thread"``  one object shared by the worker threads of one process, made with
                    ``create(timeout=..., turn=...)`` (see ``ThreadRunner``);
      ``"process"`` one object per worker process, made with ``create(rank, device)``; the
                    workers first join a torch.distributed group with ``dist_backend``.
    ``device_types`` are the worker device types it moves tensors between.
    """

    create: Callable[..., Any]
    scope: str
    device_types: tuple[str, ...]
    dist_backend: str | None = None

    def __attrs_post_init__(self):
        if self.scope not in SCOPES:
            raise PluginError(f"communicator scope must be one of {SCOPES}, got {self.scope!r}")

    def __call__(self, *args, **kwargs):
        return self.create(*args, **kwargs)


def choose_communicator(registry, scope: str, device_type: str, name: str | None = None) -> tuple[str, Communicator]:
    """The communicator (name, entry) a runner of ``scope`` uses for workers on ``device_type``.

    ``name`` picks one explicitly (it must still fit the scope and device type); otherwise the
    one registered for them is used (the first by name if several are).
    """
    if name is not None:
        entry = registry.get(name)
        if not isinstance(entry, Communicator) or entry.scope != scope or device_type not in entry.device_types:
            raise PluginError(
                f"communicator {name!r} does not serve {scope} workers on {device_type!r}; "
                f"leave the communicator unset to get the one registered for them"
            )
        return name, entry
    fits = [
        n for n in registry.names()
        if isinstance(registry.get(n), Communicator)
        and registry.get(n).scope == scope
        and device_type in registry.get(n).device_types
    ]
    if not fits:
        raise DeviceError(
            f"no communicator for {scope} workers on device type {device_type!r}; install the plugin "
            f"for that device type (e.g. `pip install dtorch-nccl` for 'cuda') and check `dtorch info`"
        )
    return fits[0], registry.get(fits[0])
