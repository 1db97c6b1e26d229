"""Frame authentication: replays, reflections, other connections and strangers are refused."""

from __future__ import annotations

import secrets
import time

import pytest
import zmq
from dtorch_zmq import frames as fr
from dtorch_zmq.controller import ControllerEndpoint
from dtorch_zmq.runner import place_ranks

from dtorch_core.errors import ConfigError

KEY = b"k" * 32


def test_a_frame_opens_once_in_order_on_its_connection_and_direction():
    nonce = secrets.token_bytes(16)
    msg = fr.seal(KEY, fr.TO_CONTROLLER, fr.REPLY, 0, nonce, [b"abc", b"d" * 100])
    kind, parts = fr.open_message(KEY, fr.TO_CONTROLLER, msg, 0, nonce)
    assert kind == fr.REPLY and bytes(fr.joined(parts)) == b"abc" + b"d" * 100
    with pytest.raises(fr.FrameError, match="sequence number 0, expected 1"):  # a replay
        fr.open_message(KEY, fr.TO_CONTROLLER, msg, 1, nonce)
    with pytest.raises(fr.FrameError, match="HMAC"):  # reflected back the other way
        fr.open_message(KEY, fr.TO_WORKER, msg, 0, nonce)
    with pytest.raises(fr.FrameError, match="another connection"):
        fr.open_message(KEY, fr.TO_CONTROLLER, msg, 0, secrets.token_bytes(16))
    with pytest.raises(fr.FrameError, match="HMAC"):  # another key
        fr.open_message(b"x" * 32, fr.TO_CONTROLLER, msg, 0, nonce)
    resplit = [msg[0], b"abcd", b"d" * 99, msg[-1]]  # same bytes, other part boundaries
    with pytest.raises(fr.FrameError, match="HMAC"):
        fr.open_message(KEY, fr.TO_CONTROLLER, resplit, 0, nonce)


def test_small_parts_are_joined_and_large_ones_kept_as_they_are():
    big = bytearray(fr.ZERO_COPY_BYTES)
    parts = fr.payload_parts([b"a", b"b", big, b"c"])
    assert parts[0] == b"ab" and parts[1] is big and parts[2] == b"c"


def test_a_client_without_the_key_is_refused_and_named():
    refused = []
    endpoint = ControllerEndpoint("tcp://127.0.0.1:0", KEY, 1, on_hello=refused.append, on_reply=None,
                                  on_lost=None, on_refused=lambda peer, why: refused.append((peer, why)))
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    try:
        stranger.connect(endpoint.address)
        stranger.send_multipart([b"GET / HTTP/1.0", b"\r\n"])  # no key at all: not even our format
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused and refused[0][0] == "127.0.0.1" and "not a dtorch message" in refused[0][1]
        assert stranger.poll(5000)
        answer = stranger.recv_multipart()
        assert fr.peek(answer)[0] == fr.REFUSED  # told why, instead of ZMQ's silent non-connect
    finally:
        stranger.close()
        ctx.term()
        endpoint.close()


def test_ranks_fill_the_agents_devices_in_order():
    assert place_ranks(5, [2, 4], ["a", "b"]) == [[0, 1], [2, 3, 4]]
    assert place_ranks(2, [4, 4], ["a", "b"]) == [[0, 1], []]
    with pytest.raises(ConfigError, match="a: 1, b: 1"):
        place_ranks(3, [1, 1], ["a", "b"])
