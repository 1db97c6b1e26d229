"""The builtin runtime plugin: runners, communicators, the CPU streams."""

from __future__ import annotations

from ..comm.inprocess import InProcessExchange
from ..comm.kinds import Communicator
from ..hookspecs import hookimpl
from .inline import InlineRunner
from .thread import ThreadRunner
from ..worker.streams import WorkerStreams


def _process_runner(world_size: int, **options):
    from .process import ProcessRunner  # imported on use: it pulls in the transport and wire code

    return ProcessRunner(world_size, **options)


@hookimpl
def dtorch_register_runners(registry) -> None:
    registry.add("inline", InlineRunner)
    registry.add("thread", ThreadRunner)
    registry.add("process", _process_runner)


def _gloo_exchange(rank, device):
    from ..comm.dist import DistExchange

    return DistExchange(rank, device)


@hookimpl
def dtorch_register_communicators(registry) -> None:
    registry.add("inprocess", Communicator(InProcessExchange, "thread", ("cpu",)))
    registry.add("gloo", Communicator(_gloo_exchange, "process", ("cpu",), dist_backend="gloo"))


@hookimpl
def dtorch_register_streams(registry) -> None:
    registry.add("cpu", WorkerStreams)  # in order on the worker's own thread


def _local_channel(role: str, **options):
    from ..transport.channel import create_channel

    return create_channel(role, **options)


@hookimpl
def dtorch_register_transports(registry) -> None:
    registry.add("inprocess", "batches are handed over through in-process queues")
    registry.add("local", _local_channel)  # shared-memory ring (native) or pipe, per process
