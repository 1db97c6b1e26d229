"""Frame authentication: replays, reflections, other connections and strangers are refused."""

from __future__ import annotations

import hmac
import secrets
import time

import pytest
import zmq
from dtorch_zmq import frames as fr
from dtorch_zmq.controller import ControllerEndpoint
from dtorch_zmq.runner import place_ranks

from dtorch_core.errors import ConfigError

KEY = b"k" * 32
MAC = fr.Mac(KEY)


def test_a_frame_opens_once_in_order_on_its_connection_and_direction():
    nonce = secrets.token_bytes(16)
    msg = fr.seal(MAC, fr.TO_CONTROLLER, fr.REPLY, 0, nonce, [b"abc", b"d" * 100])
    kind, parts = fr.open_message(MAC, fr.TO_CONTROLLER, msg, 0, nonce)
    assert kind == fr.REPLY and bytes(fr.joined(parts)) == b"abc" + b"d" * 100
    with pytest.raises(fr.FrameError, match="sequence number 0, expected 1"):  # a replay
        fr.open_message(MAC, fr.TO_CONTROLLER, msg, 1, nonce)
    with pytest.raises(fr.FrameError, match="HMAC"):  # reflected back the other way
        fr.open_message(MAC, fr.TO_WORKER, msg, 0, nonce)
    with pytest.raises(fr.FrameError, match="another connection"):
        fr.open_message(MAC, fr.TO_CONTROLLER, msg, 0, secrets.token_bytes(16))
    with pytest.raises(fr.FrameError, match="HMAC"):  # another key
        fr.open_message(fr.Mac(b"x" * 32), fr.TO_CONTROLLER, msg, 0, nonce)
    resplit = [msg[0] + b"d", b"d" * 99]  # same bytes, other part boundaries
    with pytest.raises(fr.FrameError, match="HMAC"):
        fr.open_message(MAC, fr.TO_CONTROLLER, resplit, 0, nonce)
    flipped = [msg[0], bytes(msg[1][:-1]) + b"e"]  # one payload byte changed
    with pytest.raises(fr.FrameError, match="HMAC"):
        fr.open_message(MAC, fr.TO_CONTROLLER, flipped, 0, nonce)


def test_a_frame_of_another_version_is_refused_saying_so():
    old_layout = [fr.HEADER.pack(b"DTZ1", fr.HELLO, 0, bytes(16)), b"{}", bytes(fr.MAC_BYTES)]  # [header, *parts, mac]
    with pytest.raises(fr.FrameError, match="another dtorch_zmq version"):
        fr.peek(old_layout)


def test_a_small_message_is_one_frame_and_large_parts_stay_frames_of_their_own():
    nonce = secrets.token_bytes(16)
    small = fr.seal(MAC, fr.TO_WORKER, fr.BATCH, 3, nonce, [b"abc"])
    assert len(small) == 1 and len(small[0]) == fr.HEAD_BYTES + 3
    big = bytearray(b"x" * fr.ZERO_COPY_BYTES)
    for parts in ([big, b"tail"], [b"head", big], [b"", big], [b""], []):
        frames = fr.seal(MAC, fr.TO_WORKER, fr.BATCH, 3, nonce, parts)
        assert all(f is big for f in frames[1:] if len(f) == len(big))  # aliased, not copied
        kind, got = fr.open_message(MAC, fr.TO_WORKER, frames, 3, nonce)
        assert kind == fr.BATCH and bytes(fr.joined(got)) == b"".join(parts)


def test_one_payload_sealed_for_many_connections_opens_only_on_each_one():
    payload = fr.Payload([b"batch", bytearray(fr.ZERO_COPY_BYTES)])
    nonces = [secrets.token_bytes(16) for _ in range(3)]
    heads = [fr.head(MAC, fr.TO_WORKER, fr.BATCH, seq, n, payload) for seq, n in enumerate(nonces)]
    for seq, (n, h) in enumerate(zip(nonces, heads)):
        kind, got = fr.open_message(MAC, fr.TO_WORKER, [h, *payload.rest], seq, n)
        assert kind == fr.BATCH and bytes(fr.joined(got)) == b"batch" + bytes(fr.ZERO_COPY_BYTES)
        with pytest.raises(fr.FrameError, match="another connection"):  # spliced onto another node's stream
            fr.open_message(MAC, fr.TO_WORKER, [h, *payload.rest], seq, nonces[(seq + 1) % 3])


def test_the_mac_is_hmac_sha256_of_direction_header_and_digest():
    for key in (b"", b"k" * 32, secrets.token_bytes(64), secrets.token_bytes(65), secrets.token_bytes(200)):
        header, digest = secrets.token_bytes(fr.HEADER.size), secrets.token_bytes(32)
        assert fr.Mac(key).of(fr.TO_WORKER, header, digest) == hmac.digest(key, fr.TO_WORKER + header + digest, "sha256")


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
