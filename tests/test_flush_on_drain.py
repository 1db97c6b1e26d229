"""Flush on drain: a process-runner worker whose device has run dry raises a flag in its channel
and the session sends what it holds at once (runners/process.py, worker_main.next_frame).

On this CPU machine no worker device reports drain (CUDA does), so the session side is driven by
writing the flag word as a worker would, and the worker side runs ``next_frame`` against stand-in
streams; the values an op computes are checked against torch either way."""

from __future__ import annotations

import contextlib
import ctypes
import threading

import pytest
import torch

import dtorch_core as dt
from dtorch_core.controller import session as session_module
from dtorch_core.transport import (
    BACKEND_NATIVE,
    create_channel,
    native_available,
    open_channel,
)
from dtorch_core.worker_main import next_frame

from .helpers import python_path

needs_native = pytest.mark.skipif(not native_available(), reason="the native channel is not built")


@contextlib.contextmanager
def channel_pair():
    tx, spec = create_channel("send", backend=BACKEND_NATIVE, capacity=4096)
    rx = open_channel(spec)
    try:
        yield tx, rx
    finally:
        rx.close()
        tx.close()


@needs_native
def test_the_flag_is_raised_by_the_reader_and_cleared_by_a_send_or_a_take():
    with channel_pair() as (tx, rx):
        word = ctypes.c_uint32.from_address(tx.hungry_word())
        assert not tx.peer_hungry() and word.value == 0
        rx.set_hungry()
        assert tx.peer_hungry() and word.value == 1
        tx.send(b"batch")
        assert not tx.peer_hungry()  # a send feeds the reader
        rx.set_hungry()  # raised again before it took the message (a race): taking clears it
        assert rx.recv(1.0) == b"batch"
        assert not tx.peer_hungry()
        with pytest.raises(ValueError, match="sends"):
            tx.set_hungry()
        with pytest.raises(ValueError, match="receives"):
            rx.peer_hungry()


class StandInStreams:
    """Streams whose device catches up after ``busy_polls`` queries."""

    reports_drain = True

    def __init__(self, busy_polls: int):
        self.busy_polls = busy_polls
        self.queries = 0

    def drained(self) -> bool:
        self.queries += 1
        return self.queries > self.busy_polls


@needs_native
def test_an_idle_worker_raises_the_flag_only_once_its_device_has_caught_up():
    with channel_pair() as (tx, rx):
        streams = StandInStreams(busy_polls=5)
        got = []
        reader = threading.Thread(target=lambda: got.append(next_frame(rx, streams)))
        reader.start()
        for _ in range(2000):  # the reader polls the device, then raises the flag
            if tx.peer_hungry():
                break
            threading.Event().wait(0.001)
        assert tx.peer_hungry()
        assert streams.queries == 6  # five busy answers, then the drained one
        tx.send(b"next")
        reader.join(5)
        assert got == [b"next"] and not tx.peer_hungry()


@needs_native
def test_a_waiting_frame_is_returned_without_asking_the_device():
    with channel_pair() as (tx, rx):
        tx.send(b"ready")
        streams = StandInStreams(busy_polls=0)
        assert next_frame(rx, streams) == b"ready"
        assert streams.queries == 0 and not tx.peer_hungry()


@needs_native
@pytest.mark.parametrize("path", ["native", "python"])
def test_the_session_sends_what_it_holds_while_a_worker_is_hungry(path):
    dt.init(world_size=2, runner="process")
    try:
        session = session_module._session
        runner = session.runner
        assert session._hungry_words == ()  # CPU workers do not report drain (only CUDA streams do)
        runner._report_drain = True
        session._hungry_words = runner.hunger_words()
        assert len(session._hungry_words) == 2
        mesh = dt.init_device_mesh("cpu", (2,))
        a = torch.randn(7, 3)  # uneven shards: 4 and 3 rows
        x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
        def on_path():
            return python_path() if path == "python" else contextlib.nullcontext()

        with on_path():
            (x * 2.0) + 1.0  # the plans, defined once
        session._stop.set()  # no timer flush in the test's way
        session._flusher.join(5)
        dt.synchronize()
        session._flush_at = 1 << 20  # only the flag can make an op leave now
        with on_path():
            y = x * 2.0
            assert len(session._pending) == 1  # held: nobody is hungry
            ctypes.c_uint32.from_address(session._hungry_words[1]).value = 1  # rank 1 ran dry
            z = y + 1.0
            assert len(session._pending) == 0  # both went at once
            assert not runner.any_hungry()  # and the send fed rank 1
        torch.testing.assert_close(z.full_tensor(), a * 2.0 + 1.0)
    finally:
        dt.shutdown()
    assert session._hungry_words == ()


_SEND_WHILE_ASKING = """
import threading, time
from dtorch_core.transport import BACKEND_NATIVE, create_channel, open_channel
tx, spec = create_channel("send", backend=BACKEND_NATIVE, capacity=4096)
rx = open_channel(spec)
big = bytes(range(256)) * 64  # 16 KiB: streamed through a 4 KiB ring, so the send holds the channel
sender = threading.Thread(target=tx.send, args=(big,))
sender.start()
time.sleep(0.2)  # the send is waiting for room, holding the channel's lock (the reader has not read)
asked = [tx.peer_hungry() for _ in range(100)]  # the GIL held throughout each call
assert asked == [False] * 100, asked
assert rx.recv(5) == big
sender.join(5)
assert not sender.is_alive()
print("ok")
"""


@needs_native
def test_asking_whether_a_worker_is_hungry_never_waits_for_a_send_in_flight():
    # The deadlock seen with flush on drain: the session asked while the runner's sender thread
    # streamed a large Put; the sender held the channel's lock (and then took the GIL to check for
    # signals), the asker waited for the lock with the GIL held. Waiting for the lock at all blocks
    # here, since nothing reads until the asks are done. In a subprocess, so that a regression
    # fails instead of hanging the suite.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SEND_WHILE_ASKING], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
