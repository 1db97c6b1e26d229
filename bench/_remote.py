"""Sessions for benchmarks that measure two dtorch runners side by side in one run.

``BenchSession(runner, world)`` starts a session and leaves it *detached*: the next one can start
while it lives (``dt.init`` would otherwise shut it down), and rounds of both interleave. A handle
belongs to the session that made it, so ops on a detached session's tensors go to that session;
calls that take no tensor (``dt.init_device_mesh``, ``dt.distribute_tensor``, ``dt.synchronize``)
use the current one, which :meth:`BenchSession.current` sets for a block.

For ``runner="remote"`` the workers are ``dtorch worker`` subprocesses on 127.0.0.1 that the
session waits for (launcher mode, the dtorch-zmq plugin), with the key in a temporary file. They
get the priority the process runner would give its own workers on this machine, so the two
runners' workers compete for the cores alike.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile

LOOPBACK = "127.0.0.1"
REMOTE_STARTUP_S = 120.0


def require_remote() -> None:
    """Exit with a clear message when the ``remote`` runner (dtorch-zmq) is not installed."""
    try:
        import dtorch_zmq  # noqa: F401

        from dtorch_core.plugins import get_plugins

        names = [str(n) for n in get_plugins().registry("runners").names()]
    except ImportError as exc:
        raise SystemExit(f"--runner remote needs the dtorch-zmq plugin, which is not installed ({exc}); "
                         "install it with: python -m pip install -e plugins/dtorch_zmq") from None
    if "remote" not in names:
        raise SystemExit("--runner remote: dtorch_zmq is importable but registers no 'remote' runner "
                         f"(runners: {', '.join(names)}); reinstall it: python -m pip install -e plugins/dtorch_zmq")


def worker_nice(world: int) -> int:
    """The nice value the process runner gives its workers here (DTORCH_WORKER_NICE, else 19 when
    there are no more cores than workers, else 0)."""
    raw = os.environ.get("DTORCH_WORKER_NICE")
    if raw is not None:
        return int(raw)
    return 19 if (os.cpu_count() or 1) <= world else 0


def dtorch_command() -> list[str]:
    """``dtorch`` of this interpreter's environment (its console script, else ``-m``)."""
    script = os.path.join(os.path.dirname(sys.executable), "dtorch")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "dtorch_core.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class LoopbackWorkers:
    """``world`` ``dtorch worker`` processes for a controller that will listen on 127.0.0.1."""

    def __init__(self, world: int, nice: int):
        from dtorch_zmq.keys import write_key

        self._tmp = tempfile.TemporaryDirectory(prefix="dtorch-bench-remote-")
        self.key_file = os.path.join(self._tmp.name, "key")
        write_key(self.key_file)
        self.address = f"tcp://{LOOPBACK}:{_free_port()}"
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("DTORCH_WORKER_THREADS", "1")

        # the priority through nice(1): a preexec_fn is unsafe in a process with threads
        prefix = ["nice", "-n", str(nice)] if nice else []
        self.procs = [
            subprocess.Popen(prefix + dtorch_command() + ["worker", "--controller", self.address,
                                                          "--key-file", self.key_file, "--rank", str(rank)],
                             env=env, stdin=subprocess.DEVNULL)
            for rank in range(world)
        ]

    def close(self, timeout: float = 15.0) -> None:
        """Wait for the workers (they exit at the session's shutdown); kill any left after ``timeout``."""
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._tmp.cleanup()


class BenchSession:
    """One detached dtorch session (see the module docstring)."""

    def __init__(self, runner: str, world: int, **options):
        import dtorch_core as dt
        from dtorch_core.controller import session as session_mod

        self._slot = session_mod
        self.runner = runner
        self.workers = None
        self.nice = worker_nice(world)
        if runner == "remote":
            require_remote()
            self.workers = LoopbackWorkers(world, self.nice)
            options = dict(options, listen=self.workers.address, key_file=self.workers.key_file,
                           startup_timeout=REMOTE_STARTUP_S)
        previous = session_mod._session
        session_mod.set_session(None)  # dt.init would shut the previous one down
        try:
            self.session = dt.init(world_size=world, runner=runner, **options)
        except BaseException:
            session_mod.set_session(previous)
            if self.workers is not None:
                for proc in self.workers.procs:
                    proc.kill()
                self.workers.close()
            raise
        session_mod.set_session(previous)

    @contextlib.contextmanager
    def current(self):
        """Make this session the current one for the block (calls that take no tensor use it)."""
        previous = self._slot._session
        self._slot.set_session(self.session)
        try:
            yield self.session
        finally:
            self._slot.set_session(previous)

    def close(self) -> None:
        if self._slot._session is self.session:
            self._slot.set_session(None)
        try:
            self.session.close()
        finally:
            if self.workers is not None:
                self.workers.close()
