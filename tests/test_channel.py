"""The local transport's message channel: native shared-memory ring and pipe fallback.

Every behavioural test runs on both backends. The native case is skipped only when the extension
is not built; set DTORCH_REQUIRE_NATIVE=1 to turn that into a failure (test_native_is_built).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from dtorch_core.transport import channel as channel_mod
from dtorch_core.transport import (
    BACKEND_NATIVE,
    BACKEND_PIPE,
    Channel,
    ChannelBackendError,
    ChannelClosedError,
    ChannelPairSpec,
    ChannelSpec,
    ChannelTimeoutError,
    active_backend,
    channel_pair,
    create_channel,
    local_channel,
    native_available,
    native_unavailable_reason,
    open_channel,
    open_channel_pair,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB = 1024
MiB = 1024 * 1024
SMALL_RING = 4096  # the native minimum; the pipe keeps its own size


@pytest.fixture(params=[BACKEND_NATIVE, BACKEND_PIPE])
def backend(request):
    if request.param == BACKEND_NATIVE and not native_available():
        pytest.skip(
            "native extension dtorch_core._native is not built "
            f"({native_unavailable_reason()}); build it with `python -m pip install -e .` or "
            "`cmake -S native -B build/native && cmake --build build/native`"
        )
    return request.param


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 1_000_003 + n).randbytes(n)


def send_in_thread(tx: Channel, messages) -> threading.Thread:
    errors: list[BaseException] = []

    def run():
        try:
            for m in messages:
                tx.send(m, timeout=30)
        except BaseException as exc:  # reported by the join below
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.errors = errors
    t.start()
    return t


def join(t: threading.Thread) -> None:
    t.join(30)
    assert not t.is_alive(), "sender thread hung"
    if t.errors:
        raise t.errors[0]


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------
def test_native_is_built_when_required():
    if os.environ.get("DTORCH_REQUIRE_NATIVE") != "1":
        pytest.skip("DTORCH_REQUIRE_NATIVE is not 1")
    assert native_available(), native_unavailable_reason()
    if not os.environ.get("DTORCH_CHANNEL"):
        assert active_backend() == BACKEND_NATIVE


def test_default_backend_follows_the_extension(monkeypatch):
    monkeypatch.delenv("DTORCH_CHANNEL", raising=False)
    assert active_backend() == (BACKEND_NATIVE if native_available() else BACKEND_PIPE)


def test_env_forces_pipe(monkeypatch):
    monkeypatch.setenv("DTORCH_CHANNEL", "pipe")
    assert active_backend() == BACKEND_PIPE
    with channel_pair() as pair:
        assert pair.tx.backend == pair.rx.backend == BACKEND_PIPE


def test_env_forcing_missing_native_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(channel_mod, "_native_state", (None, "ImportError: simulated"))
    monkeypatch.setenv("DTORCH_CHANNEL", "native")
    with pytest.raises(ChannelBackendError, match="dtorch_core._native is not available"):
        active_backend()
    monkeypatch.delenv("DTORCH_CHANNEL")
    assert active_backend() == BACKEND_PIPE


def test_env_with_an_unknown_value_is_rejected(monkeypatch):
    monkeypatch.setenv("DTORCH_CHANNEL", "carrier-pigeon")
    with pytest.raises(ChannelBackendError, match="DTORCH_CHANNEL"):
        active_backend()


def test_spec_round_trips_through_text_and_pickle():
    spec = ChannelSpec(BACKEND_NATIVE, "recv", name="/dtorch-1-ab", capacity=4096)
    assert ChannelSpec.decode(spec.encode()) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    pair_spec = ChannelPairSpec(spec, ChannelSpec(BACKEND_PIPE, "send", fd=7))
    assert ChannelPairSpec.decode(pair_spec.encode()) == pair_spec
    assert pair_spec.pass_fds == (7,)


# ---------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 64, 4 * KiB, 1 * MiB], ids=["0B", "64B", "4KiB", "1MiB"])
def test_message_sizes(backend, size):
    tx, rx = local_channel(backend=backend)
    with tx, rx:
        msg = payload(size)
        t = send_in_thread(tx, [msg])  # 1 MiB + its header does not fit the default ring
        got = rx.recv(timeout=10)
        join(t)
        assert type(got) is bytes and got == msg


def test_message_bigger_than_the_ring(backend):
    # 3 MiB + 13 through a 4 KiB ring (native) or a 1 MiB pipe: streamed in pieces.
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx, rx:
        big = payload(3 * MiB + 13, seed=1)
        t = send_in_thread(tx, [big, b"after"])
        assert rx.recv(timeout=30) == big
        assert rx.recv(timeout=30) == b"after"
        join(t)


def test_many_messages_in_a_row_keep_order(backend):
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx, rx:
        rng = random.Random(5)
        msgs = [
            i.to_bytes(4, "little") + rng.randbytes(rng.randrange(0, 300)) for i in range(20000)
        ]
        t = send_in_thread(tx, msgs)
        for m in msgs:
            assert rx.recv(timeout=30) == m
        join(t)
        assert rx.try_recv() is None


def test_wrap_around_splits_header_and_payload(backend):
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx, rx:
        # frame 1 ends 6 bytes before the end of the 4096-byte ring, so frame 2's 8-byte header
        # wraps; frame 3's payload wraps in the middle.
        first = payload(SMALL_RING - 8 - 6, seed=2)
        tx.send(first)
        assert rx.recv(timeout=5) == first
        for size in (100, 3000, 2500, 4088, 1, 0, 4000):
            m = payload(size, seed=size)
            tx.send(m, timeout=5)
            assert rx.recv(timeout=5) == m


def test_send_accepts_buffers(backend):
    tx, rx = local_channel(backend=backend)
    with tx, rx:
        tx.send(bytearray(b"abc"))
        tx.send(memoryview(b"xxdefxx")[2:5])
        import array

        tx.send(array.array("i", [1, 2]))
        assert rx.recv(1) == b"abc"
        assert rx.recv(1) == b"def"
        assert rx.recv(1) == array.array("i", [1, 2]).tobytes()
        with pytest.raises(BufferError):
            tx.send(memoryview(b"abcdef")[::2])


def test_two_sender_threads_do_not_interleave(backend):
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx, rx:
        per_thread = 2000
        streams = {
            k: [bytes([k]) * (1 + i % 700) + i.to_bytes(4, "little") for i in range(per_thread)]
            for k in (1, 2)
        }
        threads = [send_in_thread(tx, streams[k]) for k in (1, 2)]
        seen = {1: 0, 2: 0}
        for _ in range(2 * per_thread):
            m = rx.recv(timeout=30)
            k = m[0]
            assert m == streams[k][seen[k]]
            seen[k] += 1
        for t in threads:
            join(t)


# ---------------------------------------------------------------------------------------------
# timeouts, try_recv, close
# ---------------------------------------------------------------------------------------------
def test_recv_timeout(backend):
    tx, rx = local_channel(backend=backend)
    with tx, rx:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            rx.recv(timeout=0.2)
        elapsed = time.monotonic() - t0
        assert 0.15 <= elapsed < 2.0
        assert isinstance(info.value, ChannelTimeoutError)
        with pytest.raises(TimeoutError):
            rx.recv(timeout=0)
        tx.send(b"still works")
        assert rx.recv(timeout=1) == b"still works"


def test_send_timeout_when_full(backend):
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx, rx:
        msg = b"m" * 1000  # a pipe writes frames this small atomically
        sent = 0
        with pytest.raises(TimeoutError):
            for _ in range(100_000):
                tx.send(msg, timeout=0.1)
                sent += 1
        assert sent > 0
        for _ in range(sent):
            assert rx.recv(timeout=1) == msg
        assert rx.try_recv() is None
        tx.send(msg, timeout=1)  # room again
        assert rx.recv(timeout=1) == msg


def test_try_recv(backend):
    tx, rx = local_channel(backend=backend)
    with tx, rx:
        assert rx.try_recv() is None
        tx.send(b"one")
        tx.send(b"")
        assert rx.try_recv() == b"one"
        assert rx.try_recv() == b""
        assert rx.try_recv() is None
        tx.close()
        with pytest.raises(ChannelClosedError):
            rx.try_recv()


def test_close_by_writer_delivers_then_ends(backend):
    tx, rx = local_channel(backend=backend)
    with rx:
        tx.send(b"a")
        tx.send(b"b")
        tx.close()
        tx.close()  # idempotent
        assert rx.recv(timeout=1) == b"a"
        assert rx.recv(timeout=1) == b"b"
        with pytest.raises(ChannelClosedError):
            rx.recv(timeout=5)
        with pytest.raises(ChannelClosedError):
            tx.send(b"c")


def test_blocked_recv_ends_when_the_writer_closes(backend):
    tx, rx = local_channel(backend=backend)
    with rx:
        threading.Timer(0.2, tx.close).start()
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError):
            rx.recv()  # no timeout: only the close can end it
        assert time.monotonic() - t0 < 2.0


def test_blocked_recv_ends_when_this_end_closes(backend):
    tx, rx = local_channel(backend=backend)
    with tx:
        threading.Timer(0.2, rx.close).start()
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError):
            rx.recv()
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(ChannelClosedError):
            rx.recv(timeout=0)


def test_send_fails_once_the_reader_closed(backend):
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx:
        rx.close()
        with pytest.raises(ChannelClosedError):
            for _ in range(10_000):  # the pipe may not notice before it would block
                tx.send(b"x" * 1000, timeout=5)


def test_blocked_send_ends_when_the_reader_closes(backend):
    tx, rx = local_channel(backend=backend, capacity=SMALL_RING)
    with tx:
        filled = 0
        with pytest.raises(TimeoutError):
            while True:
                tx.send(b"x" * 1000, timeout=0.05)
                filled += 1
        threading.Timer(0.2, rx.close).start()
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError):
            tx.send(b"x" * 1000)
        assert time.monotonic() - t0 < 2.0


def test_signal_handler_runs_during_a_blocked_recv(backend):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    tx, rx = local_channel(backend=backend)
    old = signal.signal(signal.SIGALRM, handler)
    try:
        with tx, rx:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            t0 = time.monotonic()
            with pytest.raises(Interrupted):
                rx.recv()
            assert time.monotonic() - t0 < 2.0
            tx.send(b"ok")  # the channel is intact
            assert rx.recv(timeout=1) == b"ok"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_blocked_recv_uses_almost_no_cpu(backend):
    tx, rx = local_channel(backend=backend)
    with tx, rx:
        # this thread's CPU: other threads of a long test process (sessions of earlier tests)
        # may run meanwhile, and they are not the channel's
        cpu0 = time.thread_time()
        wall0 = time.monotonic()
        with pytest.raises(TimeoutError):
            rx.recv(timeout=0.5)
        wall = time.monotonic() - wall0
        cpu = time.thread_time() - cpu0
        assert wall >= 0.45
        assert cpu < 0.05 * wall, f"blocked recv used {cpu:.4f} s CPU in {wall:.3f} s"


def test_native_name_is_unlinked_once_both_ends_opened():
    if not native_available():
        pytest.skip("native extension dtorch_core._native is not built")
    end, spec = create_channel("send", backend=BACKEND_NATIVE)
    path = "/dev/shm" + spec.name
    assert os.path.exists(path)
    other = open_channel(spec)
    assert not os.path.exists(path)
    with pytest.raises(OSError):
        open_channel(spec)  # nobody else can attach afterwards
    end.close()
    other.close()
    # a creator whose peer never came unlinks at close
    end, spec = create_channel("recv", backend=BACKEND_NATIVE)
    assert os.path.exists("/dev/shm" + spec.name)
    end.close()
    assert not os.path.exists("/dev/shm" + spec.name)


def test_native_futex_path_without_spinning():
    # spin_us=0: every wait sleeps on the futex, so a lost wake-up would show as a stall of one
    # 50 ms liveness slice (the waiter would still recover, only slowly).
    if not native_available():
        pytest.skip("native extension dtorch_core._native is not built")
    ping_tx, ping_rx = local_channel(backend=BACKEND_NATIVE, spin_us=0)
    pong_tx, pong_rx = local_channel(backend=BACKEND_NATIVE, spin_us=0, capacity=SMALL_RING)

    def echo():
        try:
            while True:
                pong_tx.send(ping_rx.recv(timeout=30))
        except ChannelClosedError:
            pass

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    slow = 0
    for i in range(2000):
        t0 = time.monotonic()
        ping_tx.send(i.to_bytes(4, "little"))
        assert pong_rx.recv(timeout=30) == i.to_bytes(4, "little")
        slow += time.monotonic() - t0 > 0.04
    # a full ring: the writer sleeps until a quarter drains, the reader until data comes
    msgs = [payload(rng_size, seed=rng_size) for rng_size in range(0, 3000, 3)]
    sender = send_in_thread(ping_tx, msgs)
    t0 = time.monotonic()
    for m in msgs:
        assert pong_rx.recv(timeout=30) == m
    join(sender)
    ping_tx.close()
    t.join(10)
    for c in (ping_rx, pong_tx, pong_rx):
        c.close()
    assert slow <= 5, f"{slow} of 2000 round trips took > 40 ms (lost wake-ups?)"
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------------------------
# a child process on the other end
# ---------------------------------------------------------------------------------------------
ECHO_CHILD = r"""
import sys
from dtorch_core.transport import ChannelClosedError, open_channel_pair
pair = open_channel_pair(sys.argv[1])
pair.tx.send(b"ready")
while True:
    try:
        msg = pair.rx.recv()
    except ChannelClosedError:
        break
    pair.tx.send(msg)
pair.close()
"""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_echo_child(backend: str, **kw):
    pair = channel_pair(backend=backend, **kw)
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO_CHILD, pair.spec.encode()],
        pass_fds=pair.spec.pass_fds,
        env=child_env(),
    )
    pair.child_started(proc.pid)
    assert pair.rx.recv(timeout=60) == b"ready"
    return pair, proc


def test_child_process_echoes(backend):
    pair, proc = start_echo_child(backend)
    try:
        for size in (0, 64, 4 * KiB, 1 * MiB, 3 * MiB + 1):
            msg = payload(size, seed=3)
            t = send_in_thread(pair.tx, [msg])
            assert pair.rx.recv(timeout=30) == msg
            join(t)
        for i in range(2000):
            pair.tx.send(i.to_bytes(4, "little"))
            assert pair.rx.recv(timeout=30) == i.to_bytes(4, "little")
        pair.tx.close()  # the child's recv ends, it closes and exits cleanly
        assert proc.wait(30) == 0
        with pytest.raises(ChannelClosedError):
            pair.rx.recv(timeout=5)
    finally:
        pair.close()
        proc.kill()
        proc.wait()


def test_child_killed_while_idle(backend):
    pair, proc = start_echo_child(backend)
    try:
        pair.tx.send(b"hello")
        assert pair.rx.recv(timeout=30) == b"hello"
        proc.kill()  # not reaped: a zombie must count as gone too
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError):
            pair.rx.recv(timeout=10)
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(ChannelClosedError):
            for _ in range(100_000):
                pair.tx.send(b"x" * 1000, timeout=10)
        assert time.monotonic() - t0 < 6.0
    finally:
        pair.close()
        proc.kill()
        proc.wait()


def test_child_killed_in_the_middle_of_a_message(backend):
    # The child echoes 4 MiB while we do not read: it blocks with the message half sent.
    pair, proc = start_echo_child(backend)
    try:
        big = payload(4 * MiB, seed=4)
        pair.tx.send(big, timeout=30)
        time.sleep(1.0)
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError, match="middle of a message|rest of a message"):
            pair.rx.recv(timeout=10)
        assert time.monotonic() - t0 < 3.0
    finally:
        pair.close()
        proc.kill()
        proc.wait()


def test_child_that_dies_before_opening_is_noticed(backend):
    pair = channel_pair(backend=backend)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "pass"], pass_fds=pair.spec.pass_fds)
        pair.child_started(proc.pid)
        t0 = time.monotonic()
        with pytest.raises(ChannelClosedError):
            pair.rx.recv(timeout=10)
        assert time.monotonic() - t0 < 3.0
        proc.wait()
    finally:
        pair.close()


def _spawned_reverser(spec: ChannelPairSpec) -> None:
    pair = open_channel_pair(spec)
    msg = pair.rx.recv(timeout=60)
    pair.tx.send(msg[::-1])
    pair.close()


def test_multiprocessing_spawn_child(backend):
    ctx = multiprocessing.get_context("spawn")
    with channel_pair(backend=backend) as pair:
        proc = ctx.Process(target=_spawned_reverser, args=(pair.spec,))
        proc.start()
        pair.child_started(proc.pid)
        pair.tx.send(b"abc" * 1000)
        assert pair.rx.recv(timeout=60) == b"cba" * 1000
        proc.join(30)
        assert proc.exitcode == 0
