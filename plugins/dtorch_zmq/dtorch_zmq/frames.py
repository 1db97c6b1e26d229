"""Authenticated multipart messages: what travels on the ZMQ sockets.

A message is the frames ``[header, *parts, mac]``:

- ``header`` (29 bytes): magic ``DTZ1``, the kind (u8), the sequence number (u64) and the
  connection's nonce (16 random bytes the worker picks when it starts).
- ``parts``: the payload; for batches and replies the concatenation of the parts is one message
  of the core's wire format (``dtorch_core.ir.wire``: no pickle). Tensor bytes above
  :data:`ZERO_COPY_BYTES` are parts of their own, sent without a copy.
- ``mac``: HMAC-SHA256 with the shared key over the direction, the header and the SHA-256
  digest of the parts (each prefixed by its length, so parts cannot be re-split). The digest
  is computed once per payload: a batch sent to many nodes is hashed once, and each node's
  frame costs one HMAC over 81 bytes (:func:`payload_digest`, ``seal(digest=...)``).

Each direction of a connection numbers its messages 0, 1, 2, ...; a receiver accepts only the
next number, so a replayed, dropped or reordered frame is refused. The direction byte keeps a
controller's frame from being reflected back to it as a worker's, and the nonce keeps a frame of
one connection from being accepted on another.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"DTZ1"
HEADER = struct.Struct("<4sBQ16s")
MAC_BYTES = 32
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
KIND_NAMES = {HELLO: "hello", WELCOME: "welcome", BATCH: "batch", REPLY: "reply", CREDIT: "credit",
              PING: "ping", REFUSED: "refused", NODE_BATCH: "node batch", LOST: "lost"}

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


def mac_of(key: bytes, direction: bytes, header, parts, digest: bytes | None = None) -> bytes:
    m = hmac.new(key, direction, hashlib.sha256)
    m.update(header)
    m.update(payload_digest(parts) if digest is None else digest)
    return m.digest()


def seal(key: bytes, direction: bytes, kind: int, seq: int, nonce: bytes, parts,
         digest: bytes | None = None) -> list:
    """The frames of one message (header, parts, mac); ``digest``: ``payload_digest(parts)``
    when the caller already has it (the same payload sealed for several connections)."""
    header = HEADER.pack(MAGIC, kind, seq, nonce)
    return [header, *parts, mac_of(key, direction, header, parts, digest)]


def peek(frames) -> tuple[int, int, bytes]:
    """(kind, seq, nonce) of a message, unauthenticated; FrameError when it is not one of ours."""
    if len(frames) < 2:
        raise FrameError(f"{len(frames)} frame(s), not a dtorch message")
    header = memoryview(frames[0])
    if header.nbytes != HEADER.size:
        raise FrameError("not a dtorch message (bad header size)")
    magic, kind, seq, nonce = HEADER.unpack(header)
    if magic != MAGIC or kind not in KIND_NAMES:
        raise FrameError("not a dtorch message (bad magic or kind)")
    return kind, seq, nonce


def open_message(key: bytes, direction: bytes, frames, expect_seq: int, nonce: bytes | None):
    """(kind, parts) of an authenticated message; FrameError naming what is wrong otherwise."""
    kind, seq, their_nonce = peek(frames)
    parts = frames[1:-1]
    if not hmac.compare_digest(mac_of(key, direction, frames[0], parts), bytes(frames[-1])):
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
