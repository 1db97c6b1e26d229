"""The process runner's failure handling: dead workers, corrupt frames, controller death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module

from .helpers import assert_close

pytestmark = pytest.mark.skipif(
    "process" not in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread,process"),
    reason="process runner deselected by DTORCH_TEST_RUNNERS",
)


@pytest.fixture
def process_session():
    session = dt.init(world_size=2, runner="process")
    yield session
    dt.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between the open and the read
        return False


def test_killed_worker_raises_naming_the_rank(process_session):
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(6, 4), mesh, [dt.Shard(0)])
    assert_close(x * 2, x.full_tensor() * 2)
    victim = process_session.runner.procs[1]
    victim.send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dt.WorkerLostError, match=r"rank 1.*SIGKILL"):
        for _ in range(1000):  # a stream of ops: the next call or the read raises
            x = x + 1
        x.full_tensor()
    assert time.monotonic() - start < 10


def test_corrupt_frame_is_rejected_and_worker_stays_up(process_session):
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(5, 3), mesh, [dt.Shard(0)])
    process_session.flush()
    process_session.runner.to_workers[0].send(b"\x00garbage, not a dtorch frame")
    with pytest.raises(dt.WorkerError, match="rank 0 rejected a batch"):
        dt.synchronize()
    assert_close(x + 1, x.full_tensor() + 1)  # both workers still serve


def test_shutdown_leaves_no_worker(process_session):
    pids = [p.pid for p in process_session.runner.procs]
    assert all(_alive(p) for p in pids)
    dt.shutdown()
    assert not any(_alive(p) for p in pids)


CONTROLLER = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    # a shell that runs the tests in the background (`pytest ... &`) starts them with SIGINT
    # ignored, and Python then ignores Ctrl-C here too: Ctrl-C as in a terminal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import dtorch_core as dt
    session = dt.init(world_size=2, runner="process")
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [dt.Shard(0)])
    (x + 1).full_tensor()
    print(" ".join(str(p.pid) for p in session.runner.procs), flush=True)
    how = sys.argv[1]
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exception":
        raise RuntimeError("the user's script failed")
    if how == "sigint":
        time.sleep(60)
    """
)


@pytest.mark.parametrize("how", ["sigkill", "exception", "normal", "sigint"])
def test_workers_do_not_outlive_the_controller(tmp_path, how):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               PYTHONFAULTHANDLER="1")  # a controller that hangs shows its threads' stacks (below)
    # stderr to a file, not an unread pipe: a full pipe would block the controller (and the
    # workers, which inherit it) in a write, which is a hang of the test's own making
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
        try:
            pids = [int(p) for p in proc.stdout.readline().split()]
            assert len(pids) == 2
            if how == "sigint":
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
                proc.wait(10)
                err.seek(0)
                pytest.fail(f"the controller did not exit after {how}:\n{err.read()[-6000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"workers {pids} outlived a controller that ended by {how}"


def test_runner_reports_its_channel(process_session):
    assert process_session.runner.backend in ("native-shm", "pipe")
    assert session_module._session is process_session
