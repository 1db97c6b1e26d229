"""The I/O loop: one queued message to several peers shares its large frames (zero copy, tracked)."""

from __future__ import annotations

import contextlib
import os

import torch
import zmq
from dtorch_zmq import frames as fr
from dtorch_zmq import transport as zt

MAC = fr.Mac(b"k" * 32)


def _router_and_dealers(ctx, count: int):
    router = zt.quiet_socket(ctx, zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for k in range(count):
        d = zt.quiet_socket(ctx, zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, b"peer%d" % k)
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(b"hello")  # the ROUTER routes to a peer only once it has heard from it
        dealers.append(d)
    for _ in range(count):
        assert router.poll(5000)
        router.recv_multipart()
    return router, dealers


@contextlib.contextmanager
def _io_loop_with_peers(count: int):
    """A running I/O loop on a ROUTER and ``count`` DEALER peers that said hello; closed after."""
    ctx = zt.new_context()
    router, dealers = _router_and_dealers(ctx, count)
    loop = zt.IOLoop(ctx, router, lambda frames: None, lambda now: None, "test-io").start()
    try:
        yield loop, dealers
    finally:
        loop.stop()
        for d in dealers:
            d.close(0)
        router.close(0)
        ctx.term()


def test_one_payload_to_several_peers_arrives_whole_at_each_and_is_sent_once_zmq_let_go():
    with _io_loop_with_peers(3) as (loop, dealers):
        tensor = torch.arange(3 * fr.ZERO_COPY_BYTES // 4 + 5, dtype=torch.float32)  # not a multiple of 64 KiB
        expected = bytes(tensor.numpy().tobytes())
        payload = fr.Payload([b"small head part", memoryview(tensor.numpy()).cast("B"), b"tail"])
        assert len(payload.rest) == 2  # the tensor bytes and what follows them are frames of their own
        heads = [(d.getsockopt(zmq.IDENTITY), fr.head(MAC, fr.TO_WORKER, fr.BATCH, 0, bytes(16), payload))
                 for d in dealers]
        out = loop.send(zt.Outgoing(heads, payload.rest))
        assert out.sent is not None and out.sent.wait(10)
        tensor.fill_(-1.0)  # the caller may change its memory once submit returned: nothing in flight reads it
        for d in dealers:
            assert d.poll(5000)
            frames = d.recv_multipart()
            kind, parts = fr.open_message(MAC, fr.TO_WORKER, frames, 0, bytes(16))
            assert kind == fr.BATCH
            assert bytes(fr.joined(parts)) == b"small head part" + expected + b"tail"
        small = loop.send(zt.Outgoing([(d.getsockopt(zmq.IDENTITY), fr.refusal("x")) for d in dealers]))
        assert small.sent is None  # copied when queued: nothing of the caller's to wait for
        assert all(d.poll(5000) and len(d.recv_multipart()) == 1 for d in dealers)


def test_a_gone_peer_does_not_keep_the_others_from_their_message():
    with _io_loop_with_peers(2) as (loop, dealers):
        big = os.urandom(fr.ZERO_COPY_BYTES)
        payload = fr.Payload([b"x", big])
        heads = [(b"nobody", fr.head(MAC, fr.TO_WORKER, fr.BATCH, 0, bytes(16), payload))]
        heads += [(d.getsockopt(zmq.IDENTITY), fr.head(MAC, fr.TO_WORKER, fr.BATCH, 0, bytes(16), payload))
                  for d in dealers]
        out = loop.send(zt.Outgoing(heads, payload.rest))
        assert out.sent.wait(10)
        for d in dealers:
            assert d.poll(5000)
            _, parts = fr.open_message(MAC, fr.TO_WORKER, d.recv_multipart(), 0, bytes(16))
            assert bytes(fr.joined(parts)) == b"x" + big
