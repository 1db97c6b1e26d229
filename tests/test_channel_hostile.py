"""The channels do not trust their peer: corrupt positions, lengths and oversized frames close the
channel with a typed error (ChannelCorruptError, ChannelMessageTooLargeError), never a crash.

The native cases corrupt the shared header from a second process that maps the same shared
memory by name, while the end under test runs in a third process (so a regression shows up as a
signal in its exit status instead of killing the test run). Everything is bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import tracemalloc

import attrs
import pytest

from dtorch_core.transport import (
    BACKEND_NATIVE,
    BACKEND_PIPE,
    create_channel,
    local_channel,
    native_available,
    open_channel,
)
from dtorch_core.transport.base import (
    DEFAULT_MAX_MESSAGE,
    ENV_MAX_MESSAGE,
    ChannelBackendError,
    ChannelClosedError,
    ChannelCorruptError,
    ChannelError,
    ChannelMessageTooLargeError,
    max_message_bytes,
)

needs_native = pytest.mark.skipif(not native_available(), reason="native extension not built")

# The peer: maps the channel's shared memory by name and writes garbage into the header/ring.
# Header layout (native/shm_channel.cpp): writer side at offset 64 (pos u64), reader side at
# offset 128 (pos u64); the ring starts at 4096.
CORRUPTER = textwrap.dedent(
    """
    import mmap, os, struct, sys, time
    name, scenario = sys.argv[1], sys.argv[2]
    fd = os.open("/dev/shm/" + name.lstrip("/"), os.O_RDWR)
    m = mmap.mmap(fd, os.fstat(fd).st_size)
    WRITER_POS, READER_POS, RING = 64, 128, 4096
    if scenario == "reader-forged-position":
        struct.pack_into("<Q", m, WRITER_POS, 1 << 40)
    elif scenario == "reader-length-past-ring":  # a frame longer than the ring, "published" whole
        struct.pack_into("<Q", m, RING, 60000)
        struct.pack_into("<Q", m, WRITER_POS, 8 + 60000)
    elif scenario == "reader-length-over-limit":
        struct.pack_into("<Q", m, RING, 1 << 63)
        struct.pack_into("<Q", m, WRITER_POS, 8)
    elif scenario == "writer-forged-position":  # the reader claims to be far ahead of the writer
        struct.pack_into("<Q", m, READER_POS, 1 << 40)
    else:
        raise SystemExit("unknown scenario " + scenario)
    print("done", flush=True)
    time.sleep(30)  # stay alive: the end under test must notice the corruption, not a dead peer
    """
)

# The end under test: makes the channel, lets the corrupter at it, then uses it.
VICTIM = textwrap.dedent(
    """
    import subprocess, sys
    from dtorch_core.transport.channel import create_channel
    from dtorch_core.transport.base import ChannelClosedError, ChannelCorruptError
    corrupter_src, scenario = sys.argv[1], sys.argv[2]
    role = "recv" if scenario.startswith("reader") else "send"
    end, spec = create_channel(role, backend="native", capacity=4096)
    peer = subprocess.Popen([sys.executable, "-c", corrupter_src, spec.name, scenario],
                            stdout=subprocess.PIPE, text=True)
    end.child_started(peer.pid)
    try:
        assert peer.stdout.readline().strip() == "done"
        try:
            if role == "recv":
                end.recv(timeout=10)
            else:
                for _ in range(4):
                    end.send(bytes(64 * 1024), timeout=10)  # streams through the 4 KiB ring
            print("NO ERROR")
        except ChannelCorruptError as exc:
            print("CORRUPT", exc)
        assert end.closed, "a corrupt channel must be closed"
        try:
            end.recv(timeout=0.1) if role == "recv" else end.send(b"x", timeout=0.1)
        except ChannelClosedError:
            print("THEN CLOSED")
    finally:
        peer.kill()
        peer.wait(5)
    """
)


@needs_native
@pytest.mark.parametrize(
    "scenario, fragments",
    [
        ("reader-forged-position", ["writer's position 1099511627776", "ahead of this reader"]),
        ("reader-length-past-ring", ["writer's position 60008", "4096 bytes"]),
        ("reader-length-over-limit", [f"claims {1 << 63} bytes", f"limit of {DEFAULT_MAX_MESSAGE}"]),
        ("writer-forged-position", ["reader's position 1099511627776", "behind this writer"]),
    ],
)
def test_native_corrupt_header_from_another_process_closes_the_channel(scenario, fragments):
    env = {k: v for k, v in os.environ.items() if k != ENV_MAX_MESSAGE}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", VICTIM, CORRUPTER, scenario],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 0, f"the end under test died ({proc.returncode}): {proc.stderr[-3000:]}"
    out = proc.stdout
    assert "CORRUPT" in out, out + proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in out, out
    assert "THEN CLOSED" in out, out
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------------------------
# the message size limit, both backends
# ---------------------------------------------------------------------------------------------
@pytest.fixture(params=[BACKEND_NATIVE, BACKEND_PIPE])
def backend(request):
    if request.param == BACKEND_NATIVE and not native_available():
        pytest.skip("native extension not built")
    return request.param


def test_send_over_the_limit_is_refused_and_the_channel_stays_usable(backend):
    tx, rx = local_channel(backend=backend, max_message=1000)
    try:
        assert tx.max_message == rx.max_message == 1000
        tx.send(b"a" * 1000, timeout=5)
        with pytest.raises(ChannelMessageTooLargeError, match="1001 bytes is over the limit of 1000"):
            tx.send(b"b" * 1001, timeout=5)
        tx.send(b"c", timeout=5)
        assert rx.recv(5) == b"a" * 1000
        assert rx.recv(5) == b"c"
    finally:
        tx.close()
        rx.close()


def test_receiver_refuses_a_frame_over_its_limit(backend):
    # the sender allows more than the receiver: the receiver refuses before allocating
    tx, spec = create_channel("send", backend=backend, max_message=1 << 20)
    rx = open_channel(attrs.evolve(spec, max_message=100))
    if backend == BACKEND_PIPE:
        tx._disown_child_end()  # rx owns that descriptor now
    try:
        assert rx.max_message == 100
        tx.send(b"x" * 5000, timeout=5)
        with pytest.raises(ChannelCorruptError, match="claims 5000 bytes, over the limit of 100 bytes"):
            rx.recv(5)
        assert rx.closed
        with pytest.raises(ChannelClosedError):
            rx.recv(0.1)
    finally:
        tx.close()
        rx.close()


def test_pipe_frame_header_lies_allocate_nothing():
    tx, rx = local_channel(backend=BACKEND_PIPE)
    try:
        os.write(tx.fileno(), b"\xff" * 8)  # 2^64 - 1 bytes: over any limit
        tracemalloc.start()
        t0 = time.monotonic()
        with pytest.raises(ChannelCorruptError, match=f"claims {2**64 - 1} bytes"):
            rx.recv(5)
        assert time.monotonic() - t0 < 5
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
        tx.close()
        rx.close()


def test_pipe_large_frame_within_the_limit_allocates_only_what_arrives():
    tx, rx = local_channel(backend=BACKEND_PIPE)
    try:
        n = 40 << 30  # 40 GiB claimed, 1 MiB sent, then the writer goes away
        os.write(tx.fileno(), n.to_bytes(8, "little") + bytes(1 << 16))
        tx.close()
        tracemalloc.start()
        with pytest.raises(ChannelClosedError, match="in the middle of a message"):
            rx.recv(5)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
        rx.close()


def test_max_message_setting(monkeypatch):
    monkeypatch.delenv(ENV_MAX_MESSAGE, raising=False)
    assert max_message_bytes() == DEFAULT_MAX_MESSAGE == 64 << 30
    monkeypatch.setenv(ENV_MAX_MESSAGE, "12345")
    assert max_message_bytes() == 12345
    assert max_message_bytes(99) == 99
    tx, rx = local_channel(backend=BACKEND_PIPE)
    assert tx.max_message == rx.max_message == 12345
    tx.close()
    rx.close()
    for bad in ("lots", "0", str(2**47 + 1)):
        monkeypatch.setenv(ENV_MAX_MESSAGE, bad)
        with pytest.raises(ChannelBackendError, match=ENV_MAX_MESSAGE):
            max_message_bytes()
    assert issubclass(ChannelCorruptError, ChannelClosedError)
    assert issubclass(ChannelMessageTooLargeError, ChannelError)


def test_the_limit_travels_in_the_spec(backend):
    import pickle

    from dtorch_core.transport import ChannelSpec

    tx, spec = create_channel("send", backend=backend, max_message=4321)
    try:
        assert spec.max_message == 4321
        assert ChannelSpec.decode(spec.encode()) == spec
        assert pickle.loads(pickle.dumps(spec)) == spec
        rx = open_channel(spec)
        if backend == BACKEND_PIPE:
            tx._disown_child_end()
        assert rx.max_message == 4321
        rx.close()
    finally:
        tx.close()
    end, default_spec = create_channel("send", backend=backend)
    end.close()
    assert default_spec.max_message == 0  # the opening process's own setting
