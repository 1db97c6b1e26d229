"""The plugin contract of dtorch: every hook a plugin may implement, and nothing else.

Plugins are ordinary pluggy plugins found through the entry-point group ``dtorch``; the builtins
are registered the same way. Registration hooks receive a registry object and call
``registry.add(...)``; each is called once, when the plugin manager is first built, through
``pm.hook.<name>(registry=...)`` (so hook wrappers, ``tryfirst``/``trylast`` and
``DTORCH_TRACE_PLUGINS`` tracing apply): the builtins first, then installed plugins in
entry-point order, so a plugin may override a builtin entry with ``replace=True``. Return values
are ignored. ``dt.init`` resolves the registries once per session and hands them down (runners,
workers, the session); nothing below the frontend looks plugins up by itself.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("dtorch")
hookimpl = pluggy.HookimplMarker("dtorch")


@hookspec
def dtorch_register_ops(registry) -> None:
    """Add placement signatures (sharding rules) for operators.

    ``registry`` is a :class:`dtorch_core.planner.schema.OpRegistry`; call
    ``registry.add(op, rule)`` where ``op`` is an ``OpOverload`` or ``OpOverloadPacket`` and
    ``rule`` a function ``(OpCall) -> list[Strategy]``. Called once at start-up.
    """


@hookspec
def dtorch_register_kernels(registry) -> None:
    """Add worker kernels: ``registry.add(name, fn, device_type=None)``.

    A kernel named like an aten op (``"aten::mm"``) replaces the default (the aten op on the
    local shards) for that op, optionally only on one device type. Other names are kernels that
    sharding rules refer to. Called once per process that runs workers.
    """


@hookspec
def dtorch_register_streams(registry) -> None:
    """Add worker streams per device type: ``registry.add(device_type, cls)``.

    ``cls`` subclasses :class:`dtorch_core.worker.streams.WorkerStreams`:
    ``cls.device_for(device_type, rank)`` picks worker ``rank``'s device and ``cls(device)``
    makes its streams (``run``, ``communicate``, ``join_reads``, ``to_host``, ``synchronize``,
    ``memory_stats``; the base class documents each). A session with ``dt.init(device_type=...)``
    needs streams registered for that type. The builtin ``cpu`` streams run in order on the
    worker thread. Called once at start-up, in every process that runs workers.
    """


@hookspec
def dtorch_register_communicators(registry) -> None:
    """Add communicators: ``registry.add(name, Communicator(create, scope, device_types, dist_backend))``.

    A communicator moves tensors between the workers of a mesh dim group (all-gather,
    all-reduce, reduce-scatter, all-to-all). ``dtorch_core.comm.kinds.Communicator`` says which
    runners may use it (``scope`` "thread" or "process") on which worker device types; a runner
    takes the one registered for its scope and device type, or the one named by its
    ``communicator=`` option. Called once at start-up.
    """


@hookspec
def dtorch_register_transports(registry) -> None:
    """Add transports that carry instruction batches to workers: ``registry.add(name, factory)``."""


@hookspec
def dtorch_register_runners(registry) -> None:
    """Add runners: ``registry.add(name, factory)`` with
    ``factory(world_size, *, device_type, timeout, plugins, **options) -> Runner``.

    ``plugins`` is the session's loaded :class:`dtorch_core.plugins.Plugins` (its
    ``registry(kind)`` gives the communicators, streams, transports and kernels to use).

    The runner named by ``dt.init(runner=...)``, ``DTORCH_RUNNER`` or ``dtorch run --runner`` is
    looked up here.
    """


@hookspec
def dtorch_register_model_families(registry) -> None:
    """Add model families (parallel plans and pipelines): ``registry.add(name, family)``."""


@hookspec
def dtorch_register_cli_commands(registry) -> None:
    """Add ``dtorch`` sub-commands: ``registry.add(name, command)``.

    ``command`` has ``help`` (str), ``configure(parser)`` and ``run(args) -> int``.
    """
