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


@hookimpl
def dtorch_register_communicators(registry) -> None:
    registry.add("inprocess", InProcessExchange)


@hookimpl
def dtorch_register_streams(registry) -> None:
    registry.add("cpu", CpuStream)


@hookimpl
def dtorch_register_transports(registry) -> None:
    registry.add("inprocess", "batches are handed over through in-process queues")
