"""The builtin runtime plugin: runners, communicators, the CPU stream."""

from __future__ import annotations

from ..comm.inprocess import InProcessExchange
from ..hookspecs import hookimpl
from .runners import InlineRunner, ThreadRunner


class CpuStream:
    """Runs work in order on the worker's own thread."""

    def __init__(self, device):
        self.device = device

    def run(self, fn):
        return fn()

    def synchronize(self) -> None:
        pass


def _process_runner(world_size: int, **options):
    from .process import ProcessRunner  # imported on use: it pulls in the transport and wire code

    return ProcessRunner(world_size, **options)


@hookimpl
def dtorch_register_runners(registry) -> None:
    registry.add("inline", InlineRunner)
    registry.add("thread", ThreadRunner)
    registry.add("process", _process_runner)


def _gloo_exchange(rank, device):
    from ..comm.gloo import GlooExchange

    return GlooExchange(rank, device)


@hookimpl
def dtorch_register_communicators(registry) -> None:
    registry.add("inprocess", InProcessExchange)
    registry.add("gloo", _gloo_exchange)


@hookimpl
def dtorch_register_streams(registry) -> None:
    registry.add("cpu", CpuStream)


def _local_channel(role: str, **options):
    from ..transport.channel import create_channel

    return create_channel(role, **options)


@hookimpl
def dtorch_register_transports(registry) -> None:
    registry.add("inprocess", "batches are handed over through in-process queues")
    registry.add("local", _local_channel)  # shared-memory ring (native) or pipe, per process
