"""The ``dtorch`` command: ``info`` and ``run``, and logging configured at the entry point."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import dtorch_core as dt
from dtorch_core import logging as dt_logging
from dtorch_core.cli import main
from dtorch_core.plugins import BUILTIN_PLUGINS, reset_plugins
from dtorch_core.planner import native_dispatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dt.__file__)))
BUILTIN_NAMES = [name for name, _ in BUILTIN_PLUGINS]
DTORCH_VARS = ("DTORCH_RUNNER", "DTORCH_WORLD_SIZE", "DTORCH_STRICT", "DTORCH_TIMEOUT",
               "DTORCH_DISABLE_PLUGINS", "DTORCH_TRACE_PLUGINS", "DTORCH_LOG_LEVEL")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DTORCH_VARS}
    # the checkout's package even when it is not installed
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def dtorch(*args, env=None, console_script=False, timeout=240) -> subprocess.CompletedProcess:
    if console_script:
        exe = shutil.which("dtorch", path=os.path.dirname(sys.executable))
        if exe is None:
            pytest.skip("the dtorch console script is not installed next to this Python")
        cmd = [exe, *args]
    else:
        cmd = [sys.executable, "-m", "dtorch_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), timeout=timeout)


@pytest.fixture
def clean_env(monkeypatch):
    """In-process runs of main(): env vars it sets and the session it leaves are undone."""
    saved = {name: os.environ.get(name) for name in DTORCH_VARS}
    for name in DTORCH_VARS:
        monkeypatch.delenv(name, raising=False)
    dt.shutdown()
    reset_plugins()
    yield monkeypatch
    dt.shutdown()
    monkeypatch.undo()
    for name, value in saved.items():  # main() sets some itself (`run --world-size`): undo those too
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    reset_plugins()


# ---------------------------------------------------------------------------------------------
# dtorch info
# ---------------------------------------------------------------------------------------------
def test_info_lists_builtin_plugins_runners_and_native_status():
    proc = dtorch("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"dtorch-core {dt.__version__}" in out
    assert f"torch:            {torch.__version__}" in out
    for name in BUILTIN_NAMES:
        assert name in out
    assert "dtorch_register_ops" in out and "dtorch_register_runners" in out
    assert "inline" in out and "thread" in out
    native = importlib.util.find_spec("dtorch_core._native") is not None
    assert ("native extension: active" if native else "not built (pure-Python fallback)") in out


def test_info_json_through_the_console_script():
    proc = dtorch("info", "--json", console_script=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    plugins = {p["name"]: p for p in info["plugins"]}
    for name in BUILTIN_NAMES:
        assert plugins[name]["source"] == "builtin"
        assert plugins[name]["hooks"], f"{name} implements no hook"
    assert "dtorch_register_cli_commands" in plugins["dtorch.cli"]["hooks"]
    assert {"inline", "thread"} <= set(info["runners"])
    assert {"info", "run"} <= set(info["cli_commands"])
    assert info["version"] == dt.__version__
    assert info["torch"] == torch.__version__
    assert isinstance(info["kernels"], int) and info["kernels"] >= 1
    assert isinstance(info["ops_with_rules"], int) and info["ops_with_rules"] > 50
    assert info["native_extension"] is (importlib.util.find_spec("dtorch_core._native") is not None)
    # the controller's hot path: native where dtorch_core._fastpath is built and not turned off
    assert info["hot_path"] == native_dispatch.active()


def test_info_in_process_reports_disabled_plugins(clean_env, capsys):
    clean_env.setenv("DTORCH_DISABLE_PLUGINS", "dtorch.runtime")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "dtorch.runtime" not in {p["name"] for p in info["plugins"]}
    assert info["disabled_plugins"] == ["dtorch.runtime"]
    # the builtin runners are gone; an installed plugin (dtorch_zmq: remote) still adds its own
    assert not {"inline", "thread", "process"} & set(info["runners"])
    # (the native switches are set for a whole run, as CI's second pass sets them: reported too)
    switches = ("DTORCH_NATIVE_DISPATCH", "DTORCH_NATIVE_WORKER")
    environment = {k: v for k, v in info["environment"].items() if k not in switches}
    assert environment == {"DTORCH_DISABLE_PLUGINS": "dtorch.runtime"}
    for name in switches:
        assert info["environment"].get(name) == os.environ.get(name)


def test_no_command_prints_help(clean_env, capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "info" in out and "run" in out
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert dt.__version__ in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# dtorch run
# ---------------------------------------------------------------------------------------------
USER_SCRIPT = """
    import sys

    import structlog
    import torch
    import dtorch_core as dt
    from dtorch_core.controller.session import current_session

    out_path, seed = sys.argv[1], int(sys.argv[2])
    dt.init()  # runner and world size come from `dtorch run`
    session = current_session()
    structlog.get_logger("user_script").debug("debug record from the script")
    print(f"runner={session.runner.name} world_size={session.world_size} argv={sys.argv[1:]}")
    mesh = dt.init_device_mesh("cpu", (session.world_size,), mesh_dim_names=("x",))
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(7, 5, generator=g), torch.randn(5, 3, generator=g)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    w = dt.distribute_tensor(b, mesh, [dt.Replicate()])
    y = torch.nn.functional.gelu(x @ w).sum(dim=1)
    torch.save({"y": y.full_tensor(), "placements": str(y.placements)}, out_path)
    if "--fail" in sys.argv:
        raise ValueError("failing on purpose")
    if "--exit" in sys.argv:
        sys.exit(7)
"""


@pytest.fixture
def user_script(tmp_path):
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(USER_SCRIPT))
    return path


def _expected(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(7, 5, generator=g), torch.randn(5, 3, generator=g)
    return torch.nn.functional.gelu(a @ b).sum(dim=1)


def test_run_script_on_inline_runner(user_script, tmp_path):
    out = tmp_path / "result.pt"
    proc = dtorch("run", "--runner", "inline", "--world-size", "2", str(user_script), str(out), "3")
    assert proc.returncode == 0, proc.stderr
    assert f"runner=inline world_size=2 argv=['{out}', '3']" in proc.stdout
    assert "debug record from the script" not in proc.stdout + proc.stderr  # default level: warning
    result = torch.load(out)
    torch.testing.assert_close(result["y"], _expected(3))
    assert "Shard(dim=0)" in result["placements"] or "Shard(0)" in result["placements"]


def test_run_failing_script_exits_nonzero_and_shuts_down(clean_env, user_script, tmp_path, capsys):
    status = main(["run", "--runner", "thread", "--world-size", "3", str(user_script),
                   str(tmp_path / "r.pt"), "1", "--fail"])
    assert status == 1
    err = capsys.readouterr().err
    assert "failing on purpose" in err and str(user_script) in err
    assert "runpy" not in err  # the traceback starts in the user's script
    assert not dt.is_initialized(), "dtorch run must shut the session down after an error"
    torch.testing.assert_close(torch.load(tmp_path / "r.pt")["y"], _expected(1))


def test_run_passes_the_scripts_exit_code(clean_env, user_script, tmp_path):
    status = main(["run", "--runner", "inline", "--world-size", "2", str(user_script),
                   str(tmp_path / "r.pt"), "0", "--exit"])
    assert status == 7
    assert not dt.is_initialized()


def test_run_rejects_unknown_runner_and_missing_script(clean_env, user_script, capsys):
    assert main(["run", "--runner", "no-such-runner", str(user_script)]) == 2
    assert "no-such-runner" in capsys.readouterr().err
    assert main(["run", "does/not/exist.py"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_run_warns_when_the_script_overrides_the_command_line(tmp_path):
    script = tmp_path / "override.py"
    script.write_text("import dtorch_core as dt\nsession = dt.init(world_size=4)\n"
                      "print('world_size', session.world_size)\n")
    proc = dtorch("run", "--runner", "inline", "--world-size", "2", str(script))
    assert proc.returncode == 0, proc.stderr
    assert "world_size 4" in proc.stdout  # the explicit argument still wins ...
    assert "dt.init(world_size=4) overrides DTORCH_WORLD_SIZE=2" in proc.stderr  # ... and says so
    assert "dtorch run --world-size" in proc.stderr and f"{script}:2" in proc.stderr


@pytest.mark.parametrize("args, match", [(["--timeout", "-1"], "--timeout"), (["--timeout", "abc"], "--timeout"),
                                         (["--world-size", "abc"], "--world-size"),
                                         (["--world-size", "0"], "--world-size")])
def test_run_rejects_bad_settings_naming_the_option(clean_env, user_script, capsys, args, match):
    with pytest.raises(SystemExit) as exc:
        main(["run", *args, str(user_script)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and ("> 0" in err or ">= 1" in err)


def test_run_reports_a_bad_environment_variable(user_script, tmp_path):
    proc = dtorch("run", str(user_script), str(tmp_path / "r.pt"), "0", env=_env(DTORCH_TIMEOUT="abc"))
    assert proc.returncode == 1
    assert "ConfigError" in proc.stderr and "DTORCH_TIMEOUT is 'abc'" in proc.stderr


# ---------------------------------------------------------------------------------------------
# logging
# ---------------------------------------------------------------------------------------------
def test_log_level_from_environment(monkeypatch):
    import logging

    monkeypatch.delenv("DTORCH_LOG_LEVEL", raising=False)
    assert dt_logging.level_from() == logging.WARNING
    monkeypatch.setenv("DTORCH_LOG_LEVEL", "DEBUG")
    assert dt_logging.level_from() == logging.DEBUG
    assert dt_logging.level_from("error") == logging.ERROR
    with pytest.raises(ValueError, match="DTORCH_LOG_LEVEL"):
        dt_logging.level_from("loud")


def test_configure_writes_to_the_current_stderr(capsys):
    import structlog

    was_configured, old = structlog.is_configured(), structlog.get_config()
    try:
        assert dt_logging.ensure_configured("info") is (not was_configured)
        dt_logging.configure("info")
        assert dt_logging.ensure_configured() is False  # configured now: left alone
        log = structlog.get_logger("test")
        log.info("shown", answer=42)
        log.debug("hidden")
        captured = capsys.readouterr()
        assert "shown" in captured.err and "answer=42" in captured.err
        assert "hidden" not in captured.err and captured.out == ""
    finally:
        if was_configured:
            structlog.configure(**old)
        else:
            structlog.reset_defaults()


def test_logs_go_to_stderr_at_the_chosen_level(user_script, tmp_path):
    # the default level (warning) hides the record: see test_run_script_on_inline_runner
    loud = dtorch("run", "--runner", "inline", "--world-size", "2", str(user_script), str(tmp_path / "r.pt"), "0",
                  env=_env(DTORCH_LOG_LEVEL="debug"))
    assert loud.returncode == 0, loud.stderr
    assert "debug record from the script" in loud.stderr
    assert "debug record from the script" not in loud.stdout


def test_bad_log_level_is_a_usage_error(clean_env, capsys):
    clean_env.setenv("DTORCH_LOG_LEVEL", "loud")
    assert main(["info"]) == 2
    assert "DTORCH_LOG_LEVEL" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the README's tutorial is a script that `dtorch run` runs
# ---------------------------------------------------------------------------------------------
def readme_tutorial() -> str | None:
    """The ```python blocks of README.md's tutorial section, joined into one script."""
    path = os.path.join(REPO, "README.md")
    if not os.path.exists(path):
        return None
    text = open(path, encoding="utf-8").read()
    start = text.index("## Five-minute tutorial")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return "\n".join(blocks)


def test_readme_tutorial_runs(clean_env, tmp_path, capsys):
    script = readme_tutorial()
    if script is None:
        pytest.skip("README.md is not next to the package (not a checkout)")
    path = tmp_path / "tutorial.py"
    path.write_text(script)
    status = main(["run", "--runner", "inline", str(path)])
    captured = capsys.readouterr()
    assert status == 0, captured.err[-3000:]
    assert "mesh mismatch:" in captured.out and "strict:" in captured.out
