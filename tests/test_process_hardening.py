"""Hardening of the process runner (issue 13): rendezvous, configuration, imports, stopped
workers, quiet orphans. Real processes and signals, each bounded in time."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dtorch_core as dt

from .test_process import _alive

pytestmark = pytest.mark.skipif(
    "process" not in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread,process"),
    reason="process runner deselected by DTORCH_TEST_RUNNERS",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr, port = cols[1].split(":")
                    out.append((addr, int(port, 16)))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="needs Linux /proc")
def test_nothing_listens_beyond_loopback_and_config_is_not_on_the_command_line():
    session = dt.init(world_size=2, runner="process")
    try:
        rdv = session.runner._rdv
        assert stat.S_IMODE(os.stat(rdv).st_mode) == 0o700
        names = [getattr(c, "name", "") for c in session.runner.to_workers + session.runner.from_workers]
        for proc in session.runner.procs:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                cmdline = f.read().decode()
            assert '"rank"' not in cmdline and rdv not in cmdline
            assert not any(n and n in cmdline for n in names), cmdline
            for addr, port in _listening_ports(proc.pid):
                # IPv4 127.0.0.1 is 0100007F in /proc; IPv6 ::1 ends in 01000000
                assert addr in ("0100007F", "00000000000000000000000001000000"), (addr, port)
    finally:
        dt.shutdown()
    assert not os.path.exists(rdv), "the rendezvous directory outlived the session"


def test_workers_import_the_controllers_package_whatever_the_cwd(tmp_path, monkeypatch):
    fake = tmp_path / "dtorch_core"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the wrong dtorch_core was imported')\n")
    (fake / "worker_main.py").write_text("raise ImportError('the wrong dtorch_core was imported')\n")
    monkeypatch.chdir(tmp_path)
    session = dt.init(world_size=2, runner="process", startup_timeout=60)
    try:
        mesh = dt.init_device_mesh("cpu", (2,))
        x = dt.distribute_tensor(torch.arange(4.0), mesh, [dt.Shard(0)])
        assert (x + 1).full_tensor().tolist() == [1.0, 2.0, 3.0, 4.0]
        assert session.runner.world_size == 2
    finally:
        dt.shutdown()


def test_a_stopped_worker_is_lost_within_the_timeout_and_shutdown_returns():
    timeout = 5.0
    session = dt.init(world_size=2, runner="process", timeout=timeout)
    pids = [p.pid for p in session.runner.procs]
    try:
        mesh = dt.init_device_mesh("cpu", (2,))
        x = dt.distribute_tensor(torch.randn(6, 4), mesh, [dt.Shard(0)])
        x.full_tensor()
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        big = torch.randn(512, 1024)  # 2 MiB a put: 40 of them overflow any ring
        with pytest.raises(dt.WorkerLostError, match=r"rank 1.*stopped or hung"):
            for _ in range(40):
                y = dt.distribute_tensor(big, mesh, [dt.Replicate()])
            y.full_tensor()
        assert time.monotonic() - start < timeout + 5
        start = time.monotonic()
        dt.shutdown()
        assert time.monotonic() - start < timeout + 10
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        dt.shutdown()
        for p in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass


ORPHANED = textwrap.dedent(
    """
    import sys, time, torch
    import dtorch_core as dt
    session = dt.init(world_size=2, runner="process")
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(64, 64), mesh, [dt.Shard(0)])
    (x + 1).full_tensor()
    print(" ".join(str(p.pid) for p in session.runner.procs), flush=True)
    if sys.argv[1] == "busy":  # the workers are inside collectives and replies when it dies
        while True:
            x = (x @ x.T).redistribute(mesh, [dt.Replicate()]).redistribute(mesh, [dt.Shard(0)]) * 0.001
            x.full_tensor()
    time.sleep(60)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("mode", ["idle", "busy"])
def test_workers_of_a_dead_controller_exit_quietly(tmp_path, sig, mode):
    script = tmp_path / "controller.py"
    script.write_text(ORPHANED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=err, text=True,
                            env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
        time.sleep(0.5)  # whatever the workers were still writing
        err.seek(0)
        lines = [line for line in err.read().splitlines() if line.strip()]
        assert len(lines) <= 2, "\n".join(lines)  # one line per worker at most
        assert not any("Traceback" in line or "Connection reset" in line for line in lines), "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()


def test_rendezvous_dirs_of_dead_controllers_are_removed(tmp_path, monkeypatch):
    from dtorch_core.runners import spawn

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)  # exited: its directory is stale (unless the pid was reused at once)
    stale = tmp_path / f"{spawn.RDV_PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{spawn.RDV_PREFIX}{os.getpid()}-abc"
    other = tmp_path / "dtorch-rdv-notapid"
    for d in (stale, live, other):
        d.mkdir()
    (stale / "store").write_text("")
    spawn.remove_stale_dirs(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
    monkeypatch.setattr(spawn.tempfile, "gettempdir", lambda: str(tmp_path))
    made = spawn.private_dir()
    assert os.path.basename(made).startswith(f"{spawn.RDV_PREFIX}{os.getpid()}-")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700



def test_rings_of_dead_controllers_are_removed_when_a_runner_starts():
    """A controller killed while its workers start leaves its rings' names in /dev/shm (the
    workers unlink them once they open them): the next process runner removes them."""
    from dtorch_core.runners import spawn

    if not os.path.isdir(spawn.SHM_ROOT):
        pytest.skip(f"{spawn.SHM_ROOT} does not exist on this system")  # shm names live elsewhere
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = os.path.join(spawn.SHM_ROOT, f"dtorch-{int(gone.stdout)}-0123456789abcdef")
    live = os.path.join(spawn.SHM_ROOT, f"dtorch-{os.getpid()}-fedcba9876543210")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    try:
        dt.init(world_size=2, runner="process")
        x = dt.distribute_tensor(torch.arange(4.0), dt.init_device_mesh("cpu", (2,)), [dt.Shard(0)])
        assert torch.equal((x + 1).full_tensor(), torch.arange(4.0) + 1)
        dt.shutdown()
        assert not os.path.exists(stale), "the dead controller's ring is still there"
        assert os.path.exists(live), "a ring of a live controller was removed"
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)

INTERRUPTED_FINALIZER = textwrap.dedent(
    """
    import signal, time, torch
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
    import dtorch_core as dt
    session = dt.init(world_size=2, runner="process")
    mesh = dt.init_device_mesh("cpu", (2,))
    (dt.distribute_tensor(torch.randn(4, 4), mesh, [dt.Shard(0)]) + 1).full_tensor()

    class Slow:  # stands for a DTensor handle's __del__ (it frees the tensor id)
        def __del__(self):
            print(" ".join(str(p.pid) for p in session.runner.procs), flush=True)
            time.sleep(3)  # Ctrl-C arrives now

    obj = Slow()
    del obj
    time.sleep(60)
    """
)


def test_ctrl_c_inside_a_finalizer_still_stops_the_controller(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(INTERRUPTED_FINALIZER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(30)  # before: "Exception ignored in __del__", then the 60 s sleep
        assert proc.returncode in (-signal.SIGINT, 130, 1)  # KeyboardInterrupt, delivered just after __del__
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
