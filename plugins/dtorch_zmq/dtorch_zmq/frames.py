"""Authenticated multipart messages: what travels on the ZMQ sockets.

A message is the frames ``[head, *rest]``:

- ``head``: the header (29 bytes: magic ``DTZ2``, the kind (u8), the sequence number (u64) and
  the connection's nonce, 16 random bytes the worker picks when it starts), the MAC (32 bytes),
  then the message's first part when it is small (under :data:`ZERO_COPY_BYTES`): a small
  message is one frame.
- ``rest``: the other parts, each a frame of its own (tensor bytes above
  :data:`ZERO_COPY_BYTES`, sent without a copy). For batches and replies the concatenation of
  the parts is one message of the core's wire format (``dtorch_core.ir.wire``: no pickle).
- the MAC: HMAC-SHA256 (:class:`Mac`) with the shared key over the direction, the header and the SHA-256
  digest of the parts (each prefixed by its length, so parts cannot be re-split).

A batch that goes to many nodes is prepared once (:class:`Payload`: its digest, its frames
after the head); each node's message differs only in its head (:func:`head`: one HMAC over 81
bytes and one copy of the small first part).

Each direction of a connection numbers its messages 0, 1, 2, ...; a receiver accepts only the
next number, so a replayed, dropped or reordered frame is refused. The direction byte keeps a
controller's frame from being reflected back to it as a worker's, and the nonce keeps a frame of
one connection from being accepted on another.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"DTZ3"  # DTZ2: before NODE_UP (a follower was welcomed with its leader); DTZ1: before head frames
HEADER = struct.Struct("<4sBQ16s")
MAC_BYTES = 32
HEAD_BYTES = HEADER.size + MAC_BYTES  # the head frame before its inline part
ZERO_COPY_BYTES = 64 << 10  # parts at least this large go as frames of their own, copy=False

TO_WORKER = b"C"
TO_CONTROLLER = b"W"

# kinds
HELLO = 1  # worker -> controller: JSON {rank, pid, host}
WELCOME = 2  # controller -> worker: JSON configuration (world size, rendezvous, ...)
BATCH = 3  # controller -> worker: one wire-format batch (b"" asks it to exit)
REPLY = 4  # worker -> controller: one wire-format reply
CREDIT = 5  # worker -> controller: u64 count of batches it has taken so far
PING = 6  # either way: still alive
REFUSED = 7  # controller -> worker, unauthenticated: why its frames were refused
NODE_BATCH = 8  # controller -> node leader: a batch with per-rank parts (fanout.node_frames)
LOST = 9  # node leader -> controller: JSON {rank, reason}: one of its followers is lost
NODE_UP = 10  # node leader -> controller: its followers' channels exist (the followers' WELCOMEs may go)
KIND_NAMES = {HELLO: "hello", WELCOME: "welcome", BATCH: "batch", REPLY: "reply", CREDIT: "credit",
              PING: "ping", REFUSED: "refused", NODE_BATCH: "node batch", LOST: "lost", NODE_UP: "node up"}

_LEN = struct.Struct("<Q")


class FrameError(Exception):
    """A message that is malformed or fails authentication (the text says which)."""


def payload_digest(parts) -> bytes:
    """SHA-256 of the parts, each prefixed by its length (what the MAC covers of a payload)."""
    h = hashlib.sha256()
    for p in parts:
        view = memoryview(p)
        h.update(_LEN.pack(view.nbytes))
        h.update(view)
    return h.digest()


class Payload:
    """The parts of a message, prepared once however many connections it goes to.

    ``inline``: the first part when it is small (it travels inside each head frame; an empty one
    is dropped); ``rest``: the parts that are frames of their own; ``parts``: what the receiver
    gets back (``inline`` if any, then ``rest``), which ``digest`` covers."""

    __slots__ = ("digest", "inline", "nbytes", "parts", "rest")

    def __init__(self, parts):
        parts = list(parts)
        sizes = [memoryview(p).nbytes for p in parts]
        if parts and sizes[0] < ZERO_COPY_BYTES:
            self.inline, self.rest = parts[0], parts[1:]
            if not sizes[0]:
                parts, sizes = parts[1:], sizes[1:]
        else:
            self.inline, self.rest = b"", parts
        self.parts = parts
        self.digest = payload_digest(parts)
        self.nbytes = sum(sizes)


class Mac:
    """HMAC-SHA256 (RFC 2104) under one key, its padded key blocks hashed once: a MAC is then two
    copies of a SHA-256 state and two short updates (``hmac.digest`` sets up its key on every call,
    which cost the controller twice as much per node and batch)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes):
        block = hashlib.sha256().block_size
        key = hashlib.sha256(key).digest() if len(key) > block else key
        key = key.ljust(block, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def of(self, direction: bytes, header, digest: bytes) -> bytes:
        """The MAC of a message: its direction, header and payload digest."""
        inner = self._inner.copy()
        inner.update(b"".join((direction, header, digest)))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def head(mac: Mac, direction: bytes, kind: int, seq: int, nonce: bytes, payload: Payload) -> bytes:
    """The head frame of one connection's message carrying ``payload``."""
    header = HEADER.pack(MAGIC, kind, seq, nonce)
    return b"".join((header, mac.of(direction, header, payload.digest), payload.inline))


def seal(mac: Mac, direction: bytes, kind: int, seq: int, nonce: bytes, parts) -> list:
    """The frames of one message (``[head, *rest]``) for one connection."""
    payload = Payload(parts)
    return [head(mac, direction, kind, seq, nonce, payload), *payload.rest]


def refusal(reason: str) -> bytes:
    """A ``REFUSED`` message (one frame): unauthenticated, since its peer is not trusted (a zero MAC)."""
    return HEADER.pack(MAGIC, REFUSED, 0, bytes(16)) + bytes(MAC_BYTES) + reason.encode()


def peek(frames) -> tuple[int, int, bytes]:
    """(kind, seq, nonce) of a message, unauthenticated; FrameError when it is not one of ours."""
    if len(frames) < 1:
        raise FrameError("no frame, not a dtorch message")
    first = memoryview(frames[0])
    if first.nbytes < HEADER.size:
        raise FrameError("not a dtorch message (its first frame is too short)")
    magic, kind, seq, nonce = HEADER.unpack(first[:HEADER.size])
    if magic != MAGIC and magic[:3] == MAGIC[:3]:
        raise FrameError(f"a frame of another dtorch_zmq version ({magic.decode(errors='replace')}; this end speaks "
                         f"{MAGIC.decode()}): install the same dtorch-zmq on the controller and every worker")
    if magic != MAGIC or kind not in KIND_NAMES:
        raise FrameError("not a dtorch message (bad magic or kind)")
    if first.nbytes < HEAD_BYTES:
        raise FrameError("not a dtorch message (no MAC in its first frame)")
    return kind, seq, nonce


def received_parts(frames) -> list:
    """The parts of a received message (no copy: views of its frames)."""
    inline = memoryview(frames[0])[HEAD_BYTES:]
    return ([inline] if inline.nbytes else []) + list(frames[1:])


def open_message(mac: Mac, direction: bytes, frames, expect_seq: int, nonce: bytes | None):
    """(kind, parts) of an authenticated message; FrameError naming what is wrong otherwise."""
    kind, seq, their_nonce = peek(frames)
    first = memoryview(frames[0])
    parts = received_parts(frames)
    if not hmac.compare_digest(mac.of(direction, first[:HEADER.size], payload_digest(parts)),
                               first[HEADER.size:HEAD_BYTES]):
        raise FrameError("HMAC check failed (no key or another key)")
    if nonce is not None and their_nonce != nonce:
        raise FrameError("frame of another connection")
    if seq != expect_seq:
        raise FrameError(f"sequence number {seq}, expected {expect_seq} (replayed or lost frame)")
    return kind, parts


def payload_parts(parts) -> list:
    """``wire.encode_parts`` output as frames: small pieces joined, large ones kept (aliased)."""
    out: list = []
    small: list = []
    for p in parts:
        if memoryview(p).nbytes >= ZERO_COPY_BYTES:
            if small:
                out.append(b"".join(small))
                small = []
            out.append(p)
        else:
            small.append(p)
    if small:
        out.append(b"".join(small))
    return out


def joined(parts) -> bytes | memoryview:
    """The message the parts make up (no copy when there is one part)."""
    if len(parts) == 1:
        return memoryview(parts[0])
    return b"".join(memoryview(p) for p in parts)
