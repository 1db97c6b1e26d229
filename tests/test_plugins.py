"""The plugin contract: hookspecs, third-party plugins from entry points, the environment switches.

The third-party plugin is a real throwaway distribution: a ``pyproject.toml`` with an entry
point in group ``dtorch`` (and a ten-line in-tree PEP 517 backend, so no build tool has to be
installed), installed by pip into a temporary directory that the test puts on ``sys.path``.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import dtorch_core as dt
from dtorch_core import hookspecs
from dtorch_core.planner.schema import Rule, Strategy
from dtorch_core.plugins import BUILTIN_PLUGINS, REGISTRATION_HOOKS, get_plugins, reset_plugins

RUNNERS = [r for r in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread").split(",") if r]
PLUGIN_NAME = "scale_rows"
PLUGIN_DIST = "dtorch-scale-rows"
PLUGIN_MODULE = "dtorch_scale_rows"
BROKEN_NAME = "broken_plugin"
BROKEN_MODULE = "dtorch_broken_plugin"

# An in-tree PEP 517 backend: builds a pure-Python wheel with the project's entry points.
BACKEND = '''
import base64, hashlib, os, tomllib, zipfile

def _project():
    with open("pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    name, version = project["name"].replace("-", "_"), project["version"]
    info = f"{name}-{version}.dist-info"
    files = {}
    for root, _, names in os.walk(name):  # the import package is named like the distribution
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(root, n)
                files[path.replace(os.sep, "/")] = open(path, "rb").read()
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\\nName: {project['name']}\\nVersion: {version}\\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\\nGenerator: throwaway\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    files[f"{info}/entry_points.txt"] = "".join(
        f"[{group}]\\n" + "".join(f"{k} = {v}\\n" for k, v in eps.items()) + "\\n"
        for group, eps in project.get("entry-points", {}).items()
    ).encode()
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    wheel = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel
'''

# The third-party plugin: a torch.library op, its placement rule, its worker kernel, and a model
# family (no builtin implements that hook, so this plugin is what exercises it).
SCALE_ROWS_PLUGIN = '''
"""A third-party dtorch plugin: mylib-style custom op ``dtorchtest::scale_rows``."""
import threading

import torch
from torch import Tensor

import dtorch_core as dt
from dtorch_core.planner.schema import Rule, Strategy

KERNEL_CALLS = []
_lock = threading.Lock()


def _row_factors(x, a, row_offset):
    shape = (-1,) + (1,) * (x.ndim - 1)
    rows = torch.arange(row_offset + 1, row_offset + x.shape[0] + 1, dtype=x.dtype, device=x.device)
    return a * rows.reshape(shape)


@torch.library.custom_op("dtorchtest::scale_rows", mutates_args=())
def scale_rows(x: Tensor, a: float) -> Tensor:
    """Row i of x times a * (i + 1): a row-dependent op, so shards need their global offset."""
    return x * _row_factors(x, a, 0)


@scale_rows.register_fake
def _scale_rows_fake(x, a):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.a = inputs[1]


def _backward(ctx, grad):
    return scale_rows(grad, ctx.a), None


scale_rows.register_autograd(_backward, setup_context=_setup_context)


def scale_rows_local(x, a, *, row_offset):
    """Worker kernel: the op on one shard whose first row is global row ``row_offset``."""
    with _lock:
        KERNEL_CALLS.append(x.shape)
    return x * _row_factors(x, a, row_offset)


def scale_rows_strategies(call):
    x = call.inputs[0]
    R = dt.Replicate()
    out = [Strategy((R,), (R,))]
    out += [Strategy((dt.Shard(d),), (dt.Shard(d),)) for d in range(x.ndim)]
    out.append(Strategy((dt.Partial("sum"),), (dt.Partial("sum"),)))  # linear in x
    return out


def scale_rows_localize(local):
    (row_offset, _), *_ = local.in_regions[0]
    return local.args, dict(local.kwargs, row_offset=row_offset)


@dt.hookimpl
def dtorch_register_ops(registry):
    registry.add(
        torch.ops.dtorchtest.scale_rows.default,
        Rule(scale_rows_strategies, scale_rows_localize, kernel="dtorchtest::scale_rows_local"),
    )


@dt.hookimpl
def dtorch_register_kernels(registry):
    registry.add("dtorchtest::scale_rows_local", scale_rows_local)


@dt.hookimpl
def dtorch_register_model_families(registry):
    registry.add("scale-rows-toy", {"plan": "nothing to shard"})
'''

BROKEN_PLUGIN = '''
raise ImportError("dtorch_broken_plugin needs libnothing.so, which is not installed")
'''


def _write_package(src, dist, module, source, entry_name):
    src.mkdir(parents=True)
    (src / "_backend.py").write_text(textwrap.dedent(BACKEND))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = []
            build-backend = "_backend"
            backend-path = ["."]

            [project]
            name = "{dist}"
            version = "0.3.0"

            [project.entry-points.dtorch]
            {entry_name} = "{module}"
            """
        )
    )
    (src / module).mkdir()
    (src / module / "__init__.py").write_text(textwrap.dedent(source))


def _pip_install(src, target):
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
        "--no-index", "--disable-pip-version-check", "--target", str(target), str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install of the throwaway plugin failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """A directory with the scale_rows plugin distribution installed into it by pip."""
    pytest.importorskip("tomllib")  # the in-tree backend reads pyproject.toml with it
    root = tmp_path_factory.mktemp("plugin")
    _write_package(root / "src", PLUGIN_DIST, PLUGIN_MODULE, SCALE_ROWS_PLUGIN, PLUGIN_NAME)
    _pip_install(root / "src", root / "site")
    return root / "site"


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    pytest.importorskip("tomllib")
    root = tmp_path_factory.mktemp("broken")
    _write_package(root / "src", "dtorch-broken-plugin", BROKEN_MODULE, BROKEN_PLUGIN, BROKEN_NAME)
    _pip_install(root / "src", root / "site")
    return root / "site"


@pytest.fixture
def fresh_plugins(monkeypatch):
    """Plugins are rebuilt for the test and again after it; no session outlives it."""
    dt.shutdown()
    monkeypatch.delenv("DTORCH_DISABLE_PLUGINS", raising=False)
    reset_plugins()
    yield monkeypatch
    dt.shutdown()
    monkeypatch.undo()
    reset_plugins()


@pytest.fixture
def with_plugin(fresh_plugins, plugin_site):
    fresh_plugins.syspath_prepend(str(plugin_site))
    reset_plugins()
    return fresh_plugins


def _hookspec_names():
    return sorted(n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("dtorch_"))


def _hooks_defined_in(source: str) -> set[str]:
    return set(re.findall(r"@dt\.hookimpl\s+def (dtorch_\w+)\(", source))


# ---------------------------------------------------------------------------------------------
# (a) the contract
# ---------------------------------------------------------------------------------------------
def test_every_hookspec_is_documented_and_exercised(fresh_plugins):
    names = _hookspec_names()
    assert names, "hookspecs.py declares no hooks"
    assert set(REGISTRATION_HOOKS.values()) <= set(names)
    for name in names:
        fn = getattr(hookspecs, name)
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 20, f"hookspec {name} needs a docstring saying when it is called"
        assert getattr(fn, "dtorch_spec", None) is not None, f"{name} is not marked @hookspec"
    builtin_names = {n for n, _ in BUILTIN_PLUGINS}
    by_builtins = {h for n, hooks in get_plugins().describe() if n in builtin_names for h in hooks}
    by_this_test = _hooks_defined_in(SCALE_ROWS_PLUGIN)
    missing = set(names) - by_builtins - by_this_test
    assert not missing, (
        f"hooks {sorted(missing)} are implemented by no builtin plugin and exercised by no test; "
        "implement them in the test plugin of tests/test_plugins.py"
    )


def test_builtins_are_ordinary_plugins(fresh_plugins):
    loaded = dict(get_plugins().describe())
    for name, _module in BUILTIN_PLUGINS:
        assert name in loaded and loaded[name], f"builtin {name} is not registered or implements no hook"
    assert {"inline", "thread"} <= set(get_plugins().registry("runners").names())
    assert {"info", "run"} <= set(get_plugins().registry("cli_commands").names())


# ---------------------------------------------------------------------------------------------
# (b) a third-party plugin adds a custom op that works on distributed tensors
# ---------------------------------------------------------------------------------------------
def test_third_party_plugin_registers_through_every_hook_it_implements(with_plugin):
    loaded = get_plugins()
    described = dict(loaded.describe())
    assert PLUGIN_NAME in described
    implemented = _hooks_defined_in(SCALE_ROWS_PLUGIN)
    assert set(described[PLUGIN_NAME]) == implemented
    kind_of = {hook: kind for kind, hook in REGISTRATION_HOOKS.items()}
    for hook in implemented:
        registry = loaded.registry(kind_of[hook])
        assert PLUGIN_NAME in registry.owners.values(), f"{hook} of the plugin added nothing to {kind_of[hook]}"
    assert "scale-rows-toy" in loaded.registry("model_families")

    from dtorch_core.cli import collect_info

    info = {p.name: p for p in collect_info().plugins}
    assert info[PLUGIN_NAME].source == PLUGIN_DIST
    assert info[PLUGIN_NAME].version == "0.3.0"


@pytest.mark.parametrize("runner", RUNNERS)
def test_third_party_custom_op_on_distributed_tensors(with_plugin, runner):
    import importlib

    plugin = importlib.import_module(PLUGIN_MODULE)
    op = torch.ops.dtorchtest.scale_rows
    dt.init(world_size=4, runner=runner)
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    calls_before = len(plugin.KERNEL_CALLS)
    torch.manual_seed(0)
    # 7 and 3 rows over 2 or 4 shards: uneven, and with (3, 2) on Shard(0)xShard(0) one is empty
    cases = [
        ((7, 5), [dt.Shard(0), dt.Shard(1)]),
        ((7, 5), [dt.Shard(0), dt.Shard(0)]),
        ((3, 2), [dt.Shard(0), dt.Shard(0)]),
        ((10, 6, 3), [dt.Replicate(), dt.Shard(0)]),
        ((5, 4), [dt.Partial("sum"), dt.Shard(0)]),
        ((5, 4), [dt.Replicate(), dt.Replicate()]),
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dtorch: .* no sharding rule")  # no fallback
        for shape, placements in cases:
            a = torch.randn(shape, requires_grad=True)
            expected = op(a, 1.5)
            expected.sin().sum().backward()

            x = dt.distribute_tensor(a.detach(), mesh, placements).requires_grad_(True)
            y = op(x, 1.5)
            assert isinstance(y, dt.DTensor)
            assert tuple(y.placements) == tuple(x.placements), f"{placements}: got {y.placements}"
            torch.testing.assert_close(y.full_tensor(), expected.detach(), msg=lambda m: f"{placements}: {m}")
            y.sin().sum().backward()
            torch.testing.assert_close(x.grad.full_tensor(), a.grad, msg=lambda m: f"grad {placements}: {m}")
    assert not any("scale_rows" in name for name in dt.fallback_counts()), dt.fallback_counts()
    assert len(plugin.KERNEL_CALLS) > calls_before, "the plugin's kernel never ran on a worker"


# ---------------------------------------------------------------------------------------------
# (c) DTORCH_DISABLE_PLUGINS
# ---------------------------------------------------------------------------------------------
def test_disable_plugins_removes_a_third_party_plugin(with_plugin):
    import importlib

    importlib.import_module(PLUGIN_MODULE)  # the op itself still exists: only the plugin is off
    with_plugin.setenv("DTORCH_DISABLE_PLUGINS", f"someotherplugin, {PLUGIN_NAME}")
    reset_plugins()
    loaded = get_plugins()
    assert PLUGIN_NAME not in dict(loaded.describe())
    assert PLUGIN_NAME in loaded.disabled
    assert loaded.registry("ops").rule_for(torch.ops.dtorchtest.scale_rows.default) is None
    assert "scale-rows-toy" not in loaded.registry("model_families")

    dt.init(world_size=2, runner="inline")
    mesh = dt.init_device_mesh("cpu", (2,))
    a = torch.randn(5, 3)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    with pytest.warns(UserWarning, match="no sharding rule"):
        y = torch.ops.dtorchtest.scale_rows(x, 2.0)
    torch.testing.assert_close(y.full_tensor(), torch.ops.dtorchtest.scale_rows(a, 2.0))
    assert any("scale_rows" in name for name in dt.fallback_counts()), dt.fallback_counts()


def test_disable_plugins_removes_a_builtin(fresh_plugins):
    fresh_plugins.setenv("DTORCH_DISABLE_PLUGINS", "dtorch.cli")
    reset_plugins()
    loaded = get_plugins()
    assert "dtorch.cli" not in dict(loaded.describe())
    # the builtin commands are gone; an installed plugin (dtorch_zmq: agent, keygen, worker) still adds its own
    assert not {"info", "run"} & set(loaded.registry("cli_commands").names())
    assert "dtorch.ops" in dict(loaded.describe())


# ---------------------------------------------------------------------------------------------
# (d) a plugin that fails to import
# ---------------------------------------------------------------------------------------------
def test_plugin_import_error_names_the_plugin(fresh_plugins, broken_site):
    fresh_plugins.syspath_prepend(str(broken_site))
    reset_plugins()
    with pytest.raises(dt.PluginError) as info:
        get_plugins()
    message = str(info.value)
    assert BROKEN_NAME in message
    assert "libnothing" in message  # the cause is kept
    assert f"DTORCH_DISABLE_PLUGINS={BROKEN_NAME}" in message  # and what to do about it

    fresh_plugins.setenv("DTORCH_DISABLE_PLUGINS", BROKEN_NAME)
    reset_plugins()
    assert BROKEN_NAME not in dict(get_plugins().describe())


def test_cli_reports_a_broken_plugin(fresh_plugins, broken_site, capsys):
    from dtorch_core.cli import main

    fresh_plugins.syspath_prepend(str(broken_site))
    reset_plugins()
    assert main(["info"]) == 1
    assert BROKEN_NAME in capsys.readouterr().err



# ---------------------------------------------------------------------------------------------
# DTORCH_TRACE_PLUGINS
# ---------------------------------------------------------------------------------------------
def test_trace_plugins_logs_every_registration_call(fresh_plugins):
    import structlog
    from structlog.testing import capture_logs

    from dtorch_core.logging import configure

    was_configured, old = structlog.is_configured(), structlog.get_config()
    fresh_plugins.setenv("DTORCH_TRACE_PLUGINS", "1")
    reset_plugins()
    configure("debug")
    try:
        with capture_logs() as records:
            get_plugins()
    finally:
        if was_configured:
            structlog.configure(**old)
        else:
            structlog.reset_defaults()
    text = repr(records)
    assert "dtorch_register_ops" in text and "dtorch_register_runners" in text
    for name, _module in BUILTIN_PLUGINS:
        assert name in text, f"the trace does not name plugin {name}"


# ---------------------------------------------------------------------------------------------
# hooks are called through pluggy: wrappers, order, attribution
# ---------------------------------------------------------------------------------------------
class _EntryPoint:
    """What importlib.metadata.entry_points yields, for a plugin object made in the test."""

    def __init__(self, name, plugin):
        self.name, self.value, self._plugin = name, f"test:{name}", plugin

    def load(self):
        return self._plugin


def _install(monkeypatch, *plugins):
    import importlib.metadata

    eps = [_EntryPoint(name, plugin) for name, plugin in plugins]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: eps if group == "dtorch" else [])
    reset_plugins()


def test_a_hook_wrapper_sees_every_registration(fresh_plugins):
    seen = []

    class Wrapper:
        @dt.hookimpl(wrapper=True)
        def dtorch_register_ops(self, registry):
            seen.append(("before", len(registry.entries)))
            result = yield
            seen.append(("after", len(registry.entries)))
            return result

    _install(fresh_plugins, ("wrapper", Wrapper()))
    ops = get_plugins().registry("ops")
    # the wrapper ran around the whole call, the builtins' registrations inside it
    assert seen[0] == ("before", 0) and seen[1][0] == "after" and seen[1][1] == len(ops.entries) > 0


def test_plugins_come_after_builtins_and_own_what_they_replace(fresh_plugins):
    mine = Rule(lambda call: [Strategy((dt.Replicate(), dt.Replicate()), (dt.Replicate(),))])

    class Override:
        @dt.hookimpl
        def dtorch_register_ops(self, registry):
            registry.add(torch.ops.aten.mm.default, mine, replace=True)

    _install(fresh_plugins, ("override", Override()))
    ops = get_plugins().registry("ops")
    assert ops.rule_for(torch.ops.aten.mm.default) is mine
    assert ops.owners[torch.ops.aten.mm.default] == "override"
    assert ops.owners[torch.ops.aten.add.Tensor] == "dtorch.ops"


def test_a_failing_hook_names_its_plugin(fresh_plugins):
    class Broken:
        @dt.hookimpl
        def dtorch_register_runners(self, registry):
            raise ValueError("no runner today")

    _install(fresh_plugins, ("broken-runner", Broken()))
    with pytest.raises(dt.PluginError, match="'broken-runner' failed in dtorch_register_runners.*no runner today"):
        get_plugins()
