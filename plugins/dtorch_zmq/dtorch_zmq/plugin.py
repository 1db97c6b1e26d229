"""The plugin's registrations (entry point ``zmq``, group ``dtorch``)."""

from __future__ import annotations

from dtorch_core.hookspecs import hookimpl


def _remote_runner(world_size: int, **options):
    # imported on use: zmq and the transport load with a session, not with every `dtorch` command
    from .runner import RemoteRunner

    return RemoteRunner(world_size, **options)


@hookimpl
def dtorch_register_runners(registry) -> None:
    registry.add("remote", _remote_runner)


@hookimpl
def dtorch_register_transports(registry) -> None:
    registry.add("zmq", "batches go to remote workers over ZMQ (ROUTER/DEALER, HMAC on every frame)")


@hookimpl
def dtorch_register_cli_commands(registry) -> None:
    from .cli import KeygenCommand, WorkerCommand

    registry.add("keygen", KeygenCommand())
    registry.add("worker", WorkerCommand())
    try:  # the node agent (agent*.py), when this checkout has it
        from .agent import AgentCommand
    except ImportError:
        return
    registry.add("agent", AgentCommand())
