"""Local channel benchmark: native shared-memory ring vs pipe fallback vs a ZMQ ipc socket.

    python bench/channel.py [--rounds 5] [--stat min|median] [--target 0.1] [--json out.json]

For 64 B, 4 KiB and 1 MiB messages, between this process and one child process per side:
  round-trip latency   send a message, the child sends the same bytes back; wall time per trip
  one-way throughput   send a batch of messages, the child counts them and acknowledges the
                       batch with one small reply; bytes (and messages) per second
Sides: ``native-shm`` (dtorch_core._native, default spin), ``pipe`` (the pure-Python fallback,
the anchor: every number is printed with its ratio to the pipe's, measured in the same run),
``zmq-ipc`` (pyzmq PAIR sockets over ipc://; skipped with a note if pyzmq is missing) and a
diagnostic ``native-shm, spin 0`` (futex wake-ups only, as on an oversubscribed machine).
Rounds of all sides interleave; ``--stat min`` (default) reports each side's least disturbed
round. Takes about 30-40 s on 2 CPU cores.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(1, REPO_ROOT)  # run from a checkout without installing dtorch-core

SIZES = ((64, "64 B"), (4096, "4 KiB"), (1 << 20, "1 MiB"))
ANCHOR = "pipe"
STATS = {"min": min, "median": statistics.median}

# Message tags (first byte): echo it back, count it, acknowledge the count, quit.
ECHO, COUNT, ACK, QUIT = b"E", b"T", b"A", b"Q"


# ---------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------
def child_main(kind: str, arg: str) -> None:
    if kind == "zmq":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(arg)
        send, recv = sock.send, sock.recv
    else:
        from dtorch_core.transport import open_channel_pair

        pair = open_channel_pair(arg)
        send, recv = pair.tx.send, pair.rx.recv
    send(b"ready")
    count = 0
    e, t, a = ECHO[0], COUNT[0], ACK[0]
    while True:
        m = recv()
        tag = m[0]
        if tag == e:
            send(m)
        elif tag == t:
            count += 1
        elif tag == a:
            send(count.to_bytes(8, "little"))
            count = 0
        else:
            break


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
class Side:
    """This process's end of one side, with its child process."""

    def __init__(self, label: str, send, recv, proc: subprocess.Popen, cleanup):
        self.label = label
        self.send = send
        self.recv = recv
        self.proc = proc
        self._cleanup = cleanup

    def close(self) -> None:
        try:
            self.send(QUIT)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def start_channel_side(label: str, backend: str, spin_us: str | None) -> Side:
    from dtorch_core.transport import channel_pair

    # this process's ends take spin_us directly; the child's ends read it from the environment
    extra = {"DTORCH_CHANNEL_SPIN_US": spin_us} if spin_us is not None else {}
    pair = channel_pair(backend=backend, spin_us=None if spin_us is None else float(spin_us))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "channel", pair.spec.encode()],
        pass_fds=pair.spec.pass_fds,
        env=child_env(extra),
    )
    pair.child_started(proc.pid)
    return Side(label, pair.tx.send, pair.rx.recv, proc, pair.close)


def start_zmq_side(tmpdir: str) -> Side:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    addr = f"ipc://{tmpdir}/bench.sock"
    sock.bind(addr)
    proc = subprocess.Popen([sys.executable, __file__, "--child", "zmq", addr], env=child_env())

    def cleanup():
        sock.close(linger=0)
        ctx.term()

    return Side("zmq-ipc", sock.send, sock.recv, proc, cleanup)


def latency_round(side: Side, msg: bytes, n: int) -> float:
    """Seconds per round trip over n trips."""
    send, recv = side.send, side.recv
    t0 = time.perf_counter()
    for _ in range(n):
        send(msg)
        recv()
    return (time.perf_counter() - t0) / n


def throughput_round(side: Side, msg: bytes, n: int) -> float:
    """Seconds for n one-way messages, until the child acknowledged all of them."""
    send = side.send
    t0 = time.perf_counter()
    for _ in range(n):
        send(msg)
    send(ACK)
    got = int.from_bytes(side.recv(), "little")
    elapsed = time.perf_counter() - t0
    if got != n:
        raise RuntimeError(f"{side.label}: the child counted {got} of {n} messages")
    return elapsed


def calibrate(fn, side: Side, msg: bytes, target: float) -> int:
    """A repeat count that makes one round of fn take about `target` seconds."""
    n = 8
    while True:
        per = fn(side, msg, n) / n if fn is throughput_round else fn(side, msg, n)
        if per * n >= target / 4 or n >= 1 << 22:
            return max(8, int(target / max(per, 1e-9)))
        n *= 4


def fmt_latency(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f} us"


def fmt_throughput(bytes_per_s: float, msgs_per_s: float) -> str:
    if bytes_per_s >= 1e9:
        rate = f"{bytes_per_s / 1e9:6.2f} GB/s"
    else:
        rate = f"{bytes_per_s / 1e6:6.0f} MB/s"
    return f"{rate} {msgs_per_s / 1e3:8.1f} k msg/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stat", choices=sorted(STATS), default="min")
    parser.add_argument("--target", type=float, default=0.1, help="seconds per timed round")
    parser.add_argument("--no-spin0", action="store_true", help="leave out the spin-0 diagnostic")
    parser.add_argument("--json", help="also write every sample and the summary here")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(*args.child)
        return 0

    from dtorch_core.transport import (
        BACKEND_NATIVE,
        BACKEND_PIPE,
        native_available,
        native_unavailable_reason,
    )

    wall0 = time.monotonic()
    notes: list[str] = []
    tmpdir = tempfile.mkdtemp(prefix="dtorch-bench-")
    sides: list[Side] = []
    try:
        if native_available():
            sides.append(start_channel_side(BACKEND_NATIVE, BACKEND_NATIVE, None))
        else:
            notes.append(f"native-shm skipped: extension not built ({native_unavailable_reason()})")
        sides.append(start_channel_side(ANCHOR, BACKEND_PIPE, None))
        try:
            import zmq  # noqa: F401
        except ImportError as exc:
            notes.append(
                f"zmq-ipc skipped: pyzmq does not import ({exc}); python -m pip install pyzmq"
            )
        else:
            sides.append(start_zmq_side(tmpdir))
        if native_available() and not args.no_spin0:
            sides.append(start_channel_side("native-shm, spin 0 (diag)", BACKEND_NATIVE, "0"))
        for side in sides:  # children import torch (via dtorch_core): wait for all of them
            if side.recv() != b"ready":
                raise RuntimeError(f"{side.label}: bad handshake")

        samples: dict[str, dict[str, dict[str, list[float]]]] = {}
        results: dict[str, dict[str, dict[str, float]]] = {}
        stat = STATS[args.stat]
        for size, size_label in SIZES:
            echo_msg = ECHO + bytes(size - 1)
            count_msg = COUNT + bytes(size - 1)
            counts = {}
            for side in sides:  # warm up and size the rounds
                lat_n = calibrate(latency_round, side, echo_msg, args.target)
                thr_n = calibrate(throughput_round, side, count_msg, args.target)
                counts[(side.label, "lat")] = lat_n
                counts[(side.label, "thr")] = thr_n
            for _ in range(args.rounds):
                for side in sides:
                    n = counts[(side.label, "lat")]
                    lat = latency_round(side, echo_msg, n)
                    n_thr = counts[(side.label, "thr")]
                    thr = throughput_round(side, count_msg, n_thr) / n_thr
                    per_size = samples.setdefault(size_label, {})
                    s = per_size.setdefault(side.label, {"lat": [], "thr": []})
                    s["lat"].append(lat)
                    s["thr"].append(thr)
            for side in sides:
                s = samples[size_label][side.label]
                results.setdefault(size_label, {})[side.label] = {
                    "latency_s": stat(s["lat"]),
                    "seconds_per_message": stat(s["thr"]),
                }
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(tmpdir, ignore_errors=True)

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(
        f"local channel benchmark: {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, "
        f"python {platform.python_version()}, {args.rounds} rounds ({args.stat}), "
        f"load avg {load:.2f}"
    )
    print("one child process per side; anchor = pipe (ratio = value / pipe's value in this run)")
    for note in notes:
        print(f"note: {note}")
    labels = [side.label for side in sides]
    width = max(len(label) for label in labels) + 2

    print("\nround-trip latency (lower is better)")
    for size_label, per_side in results.items():
        anchor = per_side[ANCHOR]["latency_s"]
        for label in labels:
            v = per_side[label]["latency_s"]
            print(f"  {size_label:>6}  {label:<{width}} {fmt_latency(v)}   {v / anchor:6.2f}x pipe")
    print("\none-way throughput (higher is better)")
    for size_label, per_side in results.items():
        size = dict((lab, sz) for sz, lab in SIZES)[size_label]
        anchor = per_side[ANCHOR]["seconds_per_message"]
        for label in labels:
            per = per_side[label]["seconds_per_message"]
            print(
                f"  {size_label:>6}  {label:<{width}} {fmt_throughput(size / per, 1 / per)}   "
                f"{anchor / per:6.2f}x pipe"
            )
    if BACKEND_NATIVE in labels:
        lat = results["64 B"][BACKEND_NATIVE]["latency_s"] / results["64 B"][ANCHOR]["latency_s"]
        thr = results["1 MiB"][ANCHOR]["seconds_per_message"] / results["1 MiB"][BACKEND_NATIVE][
            "seconds_per_message"
        ]
        print(f"\nratio native_rtt_64B/pipe = {lat:.2f} ; native_throughput_1MiB/pipe = {thr:.2f}")
    print(f"(benchmark took {time.monotonic() - wall0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "samples": samples, "notes": notes}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
