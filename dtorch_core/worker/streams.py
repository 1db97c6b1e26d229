"""Worker streams: where a worker's work runs on its device and how communication is ordered.

The streams registry (hook ``dtorch_register_streams``) maps a device type to a subclass of
:class:`WorkerStreams`. Runners make one per worker with :func:`make_streams`; the worker then

- runs every batch inside ``run`` (the runner wraps its batch loop in it),
- runs every communicating collective inside ``communicate``,
- calls ``join_reads`` before a kernel or local step reads tensors, while ``outstanding``,
- takes the controller's tensors through ``to_device`` and hands it ``to_host`` copies,
- merges ``memory_stats`` into its statistics, after ``synchronize``.

The base class is the CPU behaviour: everything runs in order on the worker's own thread, so
there is nothing to order, join or copy. A device plugin (``dtorch_nccl`` for ``cuda``)
overrides the methods to run compute and communication on separate device streams.
"""

from __future__ import annotations

import torch

from ..errors import DeviceError


class WorkerStreams:
    """The streams of one worker's device. Subclass it to support a device type."""

    # True while communication may still use tensors that compute has not waited for; the
    # worker only calls ``join_reads`` then, so the CPU path costs one attribute read per op.
    outstanding: bool = False

    @classmethod
    def device_for(cls, device_type: str, rank: int) -> torch.device:
        """The device that worker ``rank`` drives (the base: the device type itself)."""
        return torch.device(device_type)

    def __init__(self, device: torch.device):
        self.device = device

    def claim_process(self) -> None:
        """Called once in a worker process that drives only this device, before it joins its
        process group: make the device the process's default."""

    def run(self, fn):
        """Run ``fn()`` (a batch of instructions) with this worker's compute context current."""
        return fn()

    def communicate(self, fn, value):
        """Run ``fn()`` (one collective that reads ``value``) ordered after the compute issued so
        far, and return its result. Compute that later reads ``value`` or the result must call
        ``join_reads`` first."""
        return fn()

    def join_reads(self, values) -> None:
        """Make compute wait for outstanding communication that uses any of ``values``."""

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor the controller sent (``Put``), on this device and safe to use in compute."""
        return value.to(self.device) if value.device != self.device else value

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of ``value`` the controller may read from another thread or process."""
        return value

    # whether the device runs work asynchronously and ``drained`` says when it has caught up:
    # then an idle worker tells the controller so (runners/process.py, flush on drain)
    reports_drain: bool = False

    def drained(self) -> bool:
        """Whether the device has finished every batch run so far (no host sync)."""
        return True

    # whether ``capture`` can record device work into a graph (see worker/graphs.py)
    can_capture: bool = False

    def capture(self, fn):
        """Record the device work ``fn()`` issues into a graph without running it, and return
        an object whose ``replay()`` runs it; only called when ``can_capture``."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until every piece of work issued on this worker's device has finished."""

    def memory_stats(self) -> dict:
        """Device memory counters merged into the worker's ``dt.memory_stats()`` entry."""
        return {}


def streams_class(registry, device_type: str) -> type[WorkerStreams]:
    """The streams ``registry`` holds for ``device_type``; raises DeviceError when no plugin has any."""
    if device_type not in registry:
        raise DeviceError(
            f"no plugin supports device type {device_type!r} (streams are registered for "
            f"{registry.names()}); install its plugin, e.g. `pip install dtorch-nccl` for 'cuda'"
        )
    return registry.get(device_type)


def make_streams(registry, device_type: str, rank: int) -> WorkerStreams:
    """The streams of worker ``rank`` for ``device_type``, on the device the registry's class picks."""
    cls = streams_class(registry, device_type)
    return cls(cls.device_for(device_type, rank))
