"""The ``dtorch`` command.

Every sub-command comes from the ``dtorch_register_cli_commands`` hook, the builtins below
included (this module is the builtin plugin ``dtorch.cli``). A command is any object with
``help`` (str), ``configure(parser)`` and ``run(args) -> int``; a command may also have
``info_section() -> InfoSection | None``, which ``dtorch info`` shows (how a plugin adds what it
knows, e.g. cached kernel choices, to the report).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import traceback
from typing import Any

import attrs

from .hookspecs import hookimpl
from .planner import native_dispatch
from .worker import native as worker_native

ENV_VARS = (
    "DTORCH_RUNNER",
    "DTORCH_WORLD_SIZE",
    "DTORCH_STRICT",
    "DTORCH_TIMEOUT",
    "DTORCH_DISABLE_PLUGINS",
    "DTORCH_TRACE_PLUGINS",
    "DTORCH_LOG_LEVEL",
    "DTORCH_NATIVE_DISPATCH",
    "DTORCH_NATIVE_WORKER",
)
NATIVE_MODULE = "dtorch_core._native"


# ---------------------------------------------------------------------------------------------
# dtorch info
# ---------------------------------------------------------------------------------------------
@attrs.frozen
class PluginInfo:
    name: str
    source: str  # "builtin" or the distribution that provides the entry point
    version: str | None
    hooks: tuple[str, ...]


@attrs.frozen
class InfoSection:
    """A part of ``dtorch info`` contributed by a plugin's command (see the module docstring)."""

    title: str
    lines: tuple[str, ...]
    data: dict = attrs.field(factory=dict)  # the same content for ``dtorch info --json``


@attrs.frozen
class Info:
    """What ``dtorch info`` reports."""

    version: str
    python: str
    torch: str
    platform: str
    native_extension: bool
    local_channel: str
    hot_path: str  # the controller's per-op path: "native" or "python (why)"
    worker_path: str  # the workers' per-op path: "native" or "python (why)"
    plugins: tuple[PluginInfo, ...]
    disabled_plugins: tuple[str, ...]
    runners: tuple[str, ...]
    communicators: tuple[str, ...]
    transports: tuple[str, ...]
    streams: tuple[str, ...]
    model_families: tuple[str, ...]
    cli_commands: tuple[str, ...]
    kernels: int
    ops_with_rules: int
    decompositions: int
    environment: dict
    sections: tuple[InfoSection, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _local_channel() -> str:
    """The process runner's channel backend, with the reason when it is the fallback."""
    from .transport.channel import active_backend, native_unavailable_reason

    try:
        backend = active_backend()
    except Exception as exc:  # e.g. DTORCH_CHANNEL=native without the extension
        return f"unavailable: {exc}"
    if backend == "pipe":
        reason = native_unavailable_reason()
        return f"pipe ({reason})" if reason else "pipe"
    return backend


def native_extension_active() -> bool:
    """True when the compiled extension ``dtorch_core._native`` is importable."""
    try:
        return importlib.util.find_spec(NATIVE_MODULE) is not None
    except (ImportError, ValueError):
        return False


def _entry_point_sources() -> dict[str, tuple[str, str | None]]:
    from .plugins import ENTRY_POINT_GROUP

    out = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        if dist is not None:
            out[ep.name] = (dist.metadata["Name"] or ep.value, dist.version)
        else:
            out[ep.name] = (ep.value, None)
    return out


def collect_info() -> Info:
    """Load the plugins (if not loaded yet) and describe this installation."""
    import torch

    from . import __version__
    from .plugins import BUILTIN_PLUGINS, get_plugins

    plugins = get_plugins()
    builtin_names = {name for name, _ in BUILTIN_PLUGINS}
    sources = _entry_point_sources()
    described = []
    for name, hooks in plugins.describe():
        if name in builtin_names:
            source, version = "builtin", __version__
        else:
            source, version = sources.get(name, ("?", None))
        described.append(PluginInfo(name, source, version, tuple(hooks)))

    def names(kind: str) -> tuple[str, ...]:
        return tuple(str(n) for n in plugins.registry(kind).names())

    ops = plugins.registry("ops")
    return Info(
        version=__version__,
        python=platform.python_version(),
        torch=torch.__version__,
        platform=platform.platform(),
        native_extension=native_extension_active(),
        local_channel=_local_channel(),
        hot_path=native_dispatch.active(),
        worker_path=worker_native.active(),
        plugins=tuple(described),
        disabled_plugins=tuple(plugins.disabled),
        runners=names("runners"),
        communicators=names("communicators"),
        transports=names("transports"),
        streams=names("streams"),
        model_families=names("model_families"),
        cli_commands=names("cli_commands"),
        kernels=len(plugins.registry("kernels").entries),
        ops_with_rules=len(ops.entries),
        decompositions=len(getattr(ops, "decompositions", {})),
        environment={k: os.environ[k] for k in ENV_VARS if k in os.environ},
        sections=_plugin_sections(plugins.registry("cli_commands")),
    )


def _plugin_sections(commands) -> tuple[InfoSection, ...]:
    sections = []
    for command in commands.entries.values():
        section = command.info_section() if hasattr(command, "info_section") else None
        if section is not None:
            sections.append(section)
    return tuple(sections)


def format_info(info: Info) -> str:
    def listing(values) -> str:
        return ", ".join(values) if values else "(none)"

    lines = [
        f"dtorch-core {info.version}",
        f"  python:           {info.python}",
        f"  torch:            {info.torch}",
        f"  platform:         {info.platform}",
        "  native extension: "
        + ("active" if info.native_extension else "not built (pure-Python fallback)"),
        f"  local channel:    {info.local_channel}  (process runner)",
        f"  op hot path:      {info.hot_path}  (controller, plan-cache hits)",
        f"  worker op path:   {info.worker_path}  (workers, runs of kernel calls)",
        f"  runners:          {listing(info.runners)}",
        f"  communicators:    {listing(info.communicators)}",
        f"  transports:       {listing(info.transports)}",
        f"  streams:          {listing(info.streams)}",
        f"  model families:   {listing(info.model_families)}",
        f"  commands:         {listing(info.cli_commands)}",
        f"  kernels:          {info.kernels}",
        f"  ops with rules:   {info.ops_with_rules} (+{info.decompositions} decompositions)",
        f"plugins ({len(info.plugins)} loaded):",
    ]
    for p in info.plugins:
        origin = p.source if p.version is None else f"{p.source} {p.version}"
        lines.append(f"  {p.name} [{origin}]")
        lines.append(f"      hooks: {listing(p.hooks)}")
    if info.disabled_plugins:
        lines.append(f"disabled plugins: {listing(info.disabled_plugins)}")
    if info.environment:
        lines.append("environment:")
        lines.extend(f"  {k}={v}" for k, v in info.environment.items())
    for section in info.sections:
        lines.append(f"{section.title}:")
        lines.extend(f"  {line}" for line in section.lines)
    return "\n".join(lines)


class InfoCommand:
    help = "show the version, loaded plugins and their hooks, runners and the native extension"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the report as JSON")

    def run(self, args: argparse.Namespace) -> int:
        info = collect_info()
        if args.json:
            print(json.dumps(info.to_json(), indent=2, sort_keys=True))
        else:
            print(format_info(info))
        return 0


# ---------------------------------------------------------------------------------------------
# dtorch run
# ---------------------------------------------------------------------------------------------
class RunCommand:
    help = "run an unmodified script on a runner (its own dt.init() picks the runner up)"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Run SCRIPT as `python SCRIPT ARGS...` would, with DTORCH_RUNNER and DTORCH_WORLD_SIZE "
            "set so that the script's dt.init() uses them (explicit arguments to dt.init() still "
            "win, with a warning when they differ). dt.shutdown() is called when the script ends, "
            "also on errors."
        )
        parser.add_argument("--runner", help="runner name (see `dtorch info`); sets DTORCH_RUNNER")
        parser.add_argument("--world-size", type=_positive_int, metavar="N",
                            help="number of devices; sets DTORCH_WORLD_SIZE")
        parser.add_argument("--strict", action="store_true",
                            help="ops without a sharding rule raise instead of running replicated, and so do "
                                 "surprising gathers (docs/explain.md); sets DTORCH_STRICT")
        parser.add_argument("--timeout", type=_positive_seconds, metavar="SECONDS",
                            help="how long a read waits for the workers; sets DTORCH_TIMEOUT")
        parser.add_argument("--explain", action="store_true",
                            help="write dt.explain's report of the whole script (every op's placements, "
                                 "every redistribution, by module) to stderr when it ends")
        parser.add_argument("--explain-file", metavar="FILE",
                            help="the same report to FILE instead (JSON, from Explanation.to_dict(), "
                                 "when FILE ends in .json)")
        parser.add_argument("script", help="path of the Python script to run")
        parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    def run(self, args: argparse.Namespace) -> int:
        if args.runner:
            from .plugins import get_plugins

            runners = get_plugins().registry("runners")
            if args.runner not in runners:
                print(f"dtorch run: unknown runner {args.runner!r}; known: {', '.join(runners.names())}",
                      file=sys.stderr)
                return 2
            os.environ["DTORCH_RUNNER"] = args.runner
        if args.world_size is not None:
            os.environ["DTORCH_WORLD_SIZE"] = str(args.world_size)
        if args.strict:
            os.environ["DTORCH_STRICT"] = "1"
        if args.timeout is not None:
            os.environ["DTORCH_TIMEOUT"] = str(args.timeout)
        if not os.path.isfile(args.script):
            print(f"dtorch run: no such file: {args.script}", file=sys.stderr)
            return 2
        if args.explain or args.explain_file:
            return _run_explained(args.script, list(args.args), args.explain_file)
        return run_script(args.script, list(args.args))


def _run_explained(path: str, argv: list[str], target: str | None) -> int:
    """``run_script`` under ``dt.explain``; the report goes to ``target`` (stderr if None), also
    when the script fails."""
    from .explain import Explanation

    explanation = Explanation()
    with explanation:
        status = run_script(path, argv)
    if target is None:
        sys.stderr.write(str(explanation))
        return status
    try:
        with open(target, "w") as f:
            if target.endswith(".json"):
                json.dump(explanation.to_dict(), f, indent=1)
            else:
                f.write(str(explanation))
    except OSError as exc:
        print(f"dtorch run: cannot write the explanation to {target}: {exc}", file=sys.stderr)
        return status or 1
    return status


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def run_script(path: str, argv: list[str]) -> int:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *argv]``; shut dtorch down after.

    Returns the script's exit status: 0, its ``SystemExit`` code, 1 on an exception (the
    traceback is printed from the script's own frames) or 130 on Ctrl-C.
    """
    import runpy

    path = os.path.abspath(path)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    status = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        status = 130
    except BaseException as exc:  # noqa: BLE001 - report every failure of the user's script
        _print_user_traceback(exc, path)
        status = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        status = _shutdown(status)
    return status


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _shutdown(status: int) -> int:
    import dtorch_core as dt

    try:
        dt.shutdown()
    except BaseException as exc:  # noqa: BLE001
        print(f"dtorch run: shutdown failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return status or 1
    return status


def _print_user_traceback(exc: BaseException, path: str) -> None:
    """Print the traceback without the frames of this command and runpy above the script."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)


# ---------------------------------------------------------------------------------------------
# the command itself
# ---------------------------------------------------------------------------------------------
@hookimpl
def dtorch_register_cli_commands(registry) -> None:
    registry.add("info", InfoCommand())
    registry.add("run", RunCommand())


def build_parser(commands) -> argparse.ArgumentParser:
    """The ``dtorch`` parser with one sub-parser per registered command."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dtorch",
        description="dtorch: single-controller distributed tensors for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"dtorch-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands.names():
        command = commands.get(name)
        help_text = getattr(command, "help", None) or ""
        child = sub.add_parser(name, help=help_text, description=help_text)
        command.configure(child)
        child.set_defaults(_dtorch_command=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dtorch`` console script."""
    from .errors import DTorchError
    from .logging import configure
    from .plugins import get_plugins

    try:
        configure()
    except ValueError as exc:
        print(f"dtorch: {exc}", file=sys.stderr)
        return 2
    try:
        commands = get_plugins().registry("cli_commands")
    except DTorchError as exc:
        print(f"dtorch: {exc}", file=sys.stderr)
        return 1
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    command = getattr(args, "_dtorch_command", None)
    if command is None:
        parser.print_help()
        return 2
    try:
        return int(command.run(args) or 0)
    except DTorchError as exc:
        print(f"dtorch {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (`dtorch info | head`): stop quietly, like other commands do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
