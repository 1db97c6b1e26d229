"""Run a per-rank anchor script under torchrun on 127.0.0.1 and drive its timed rounds through files.

Shared by the benchmarks that measure dtorch against PyTorch's SPMD DTensor in the same run
(bench/dispatch.py with bench/_dtensor_anchor.py, bench/train_gpt.py with
bench/_dtensor_train_gpt.py), so that the DTensor rounds interleave with the other sides' and
background load on a shared machine hits every side alike.

Protocol, through files in a sync directory (rank 0 of the anchor talks to the parent; its other
ranks follow through barriers):
  the anchor writes ``ready`` after its warm-up; for each round r and name n the parent writes
  ``go-r-n``, the anchor runs the round and writes ``done-r-n.json`` (a JSON object of its
  choosing); at the end it writes ``final.json``. The parent side is :class:`TorchrunAnchor`, the
  anchor side :func:`write_json` and :func:`wait_for`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time


# ---------------------------------------------------------------------------------------------
# the anchor's side (runs in every torchrun rank)
# ---------------------------------------------------------------------------------------------
def init_rank(device_type: str):
    """Join the torchrun group on ``device_type``: ``(device, sync)``. On CUDA the payloads go
    through NCCL and ``sync()`` (device finished, then a barrier) through a gloo group on the CPU,
    so a rank waiting at a barrier holds no GPU work."""
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("cuda:nccl,cpu:gloo")
        control = dist.new_group(backend="gloo")
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        control = None
        device = torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=control)

    return device, sync


def add_anchor_options(parser, *, steps: bool = True) -> None:
    """The options every torchrun anchor takes: rounds of steps driven through ``--sync-dir``."""
    parser.add_argument("--warmup", type=int, default=3)
    if steps:
        parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-dir", default=None)
    parser.add_argument("--wait-timeout", type=float, default=300.0)


def environment() -> dict:
    """What an anchor reports about the process it ran in (inside an initialised process group)."""
    import platform

    import torch
    import torch.distributed as dist

    return {"backend": dist.get_backend(), "torch": torch.__version__, "python": platform.python_version(),
            "num_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def report_final(final: dict, rank: int, sync_dir: str | None) -> None:
    """Rank 0 hands the anchor's final JSON over (``final.json`` in ``sync_dir``, else stdout);
    then every rank leaves its process group."""
    import torch.distributed as dist

    if rank == 0:
        if sync_dir:
            write_json(os.path.join(sync_dir, "final.json"), final)
        else:
            print(json.dumps(final, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def write_json(path: str, value) -> None:
    """Write ``value`` so that the reader never sees a half-written file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


def wait_for(path: str, timeout: float) -> None:
    """Wait until ``path`` exists (the parent's ``go`` file)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"anchor: no {os.path.basename(path)} from the benchmark in {timeout:.0f}s")
        time.sleep(0.002)


# ---------------------------------------------------------------------------------------------
# the parent's side
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchrunAnchor:
    """``torchrun --nproc_per_node world <script> <args> --sync-dir D --wait-timeout T`` on 127.0.0.1.

    It starts at once (its start-up overlaps the caller's), warms up, then runs one timed round
    each time :meth:`run_round` asks for it. Every rank runs with ``OMP_NUM_THREADS=1`` and gloo
    on the loopback interface.
    """

    def __init__(self, script: str, script_args: list, world: int, timeout: float):
        self.timeout = timeout
        self.tmp = tempfile.TemporaryDirectory(prefix="dtorch-bench-")
        self.dir = self.tmp.name
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on the loopback interface
        env["MASTER_ADDR"] = "127.0.0.1"
        self.cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc_per_node", str(world),
            "--master_addr", "127.0.0.1", "--master_port", "0",
            script, *map(str, script_args),
            "--sync-dir", self.dir, "--wait-timeout", str(timeout),
        ]
        self.env = env
        self.proc = None
        self.log = None
        self.attempts = 0
        self._start()

    def _start(self) -> None:
        self._stop()
        self.attempts += 1
        self.cmd[self.cmd.index("--master_port") + 1] = str(free_port())
        self.log = open(os.path.join(self.dir, f"torchrun-{self.attempts}.log"), "w")
        # Own session, so a Ctrl-C meant for the bench reaches torchrun only through _stop.
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def _stop(self) -> None:
        """End our torchrun (it ends its ranks on SIGTERM) and close its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.log is not None:
            self.log.close()
            self.log = None

    def _log_tail(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def _wait(self, name: str) -> str:
        path = os.path.join(self.dir, name)
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"DTensor anchor exited ({self.proc.returncode}):\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"DTensor anchor: no {name} within {self.timeout:.0f}s:\n{self._log_tail()}")
            time.sleep(0.002)
        return path

    def wait_ready(self) -> None:
        try:
            self._wait("ready")
        except RuntimeError:
            if self.attempts >= 2 or self.proc.poll() is None:
                raise
            self._start()  # it exited early: most likely the probed port was taken meanwhile
            self._wait("ready")

    def run_round(self, r: int, name: str) -> dict:
        """Let the anchor run round ``r`` of ``name``; returns what it reported."""
        open(os.path.join(self.dir, f"go-{r}-{name}"), "w").close()
        with open(self._wait(f"done-{r}-{name}.json")) as f:
            return json.load(f)

    def finish(self) -> dict:
        with open(self._wait("final.json")) as f:
            final = json.load(f)
        self.proc.wait(timeout=self.timeout)
        return final

    def close(self) -> None:
        self._stop()
        self.tmp.cleanup()
