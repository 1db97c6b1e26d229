"""The decoder's bounds: nesting exactly as deep as the encoder writes, and no message that
inflates far beyond its own size (docs/wire-format.md, Limits)."""

from __future__ import annotations

import struct
import time
import tracemalloc

import pytest
import torch

from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Call, DefinePlan, Slot
from dtorch_core.ir.wire import MAX_DEPTH, WireError, decode, encode
from dtorch_core.ir.wire.codes import CONTAINER_ALLOWANCE, CONTAINER_BYTES


def message(body: bytes, data: bytes = b"", kind: int = wire.KIND_VALUE) -> bytes:
    return struct.pack("<2sBBIQ", wire.MAGIC, wire.VERSION, kind, len(body), len(data)) + body + data


def nested(inner, levels: int = MAX_DEPTH):
    for _ in range(levels):
        inner = [inner]
    return inner


# ---------------------------------------------------------------------------------------------
# depth: what the encoder writes at its deepest decodes; one level more is refused
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("inner", [5, 300, "s", None, 1.5, [], (), {}], ids=repr)
def test_the_deepest_value_the_encoder_writes_decodes(inner):
    v = nested(inner)  # 64 non-empty lists, the innermost holding a value that is not a container
    assert decode(encode(v)) == v
    with pytest.raises(WireError, match="deeper than 64"):
        encode([v])


@pytest.mark.parametrize("inner", [(5,), (5, 300), (1 << 40,), [5], {"k": 1}, slice(1, 2, None),
                                   torch.Size([2]), DefinePlan(1, 1, "t", (), {}, None, "op")],
                         ids=repr)
def test_one_level_more_than_the_encoder_writes_is_refused(inner):
    with pytest.raises(WireError, match="deeper than 64"):
        encode(nested(inner))
    # the same bytes by hand: the encoding of the innermost value in place of the int 5
    body = encode(nested(5))[wire.HEADER_SIZE:]
    assert body == b"\x91" * MAX_DEPTH + b"\x05"
    inner_body = encode(inner)[wire.HEADER_SIZE:]
    with pytest.raises(WireError, match="nests deeper than 64 levels"):
        decode(message(b"\x91" * MAX_DEPTH + inner_body))


@pytest.mark.parametrize(
    "inner",
    [b"\x81\x05", b"\xda\x01" + struct.pack("<i", 5), b"\xdb\x01" + struct.pack("<q", 5),
     b"\x82\x05\xc5\x00\x01"],
    ids=["short tuple of small ints", "int32 tuple", "int64 tuple", "short tuple"],
)
def test_tuples_at_the_deepest_level_are_refused(inner):
    # each of these is a non-empty tuple, which the encoder never writes at depth 64
    with pytest.raises(WireError, match="nests deeper than 64 levels"):
        decode(message(b"\x91" * MAX_DEPTH + inner))
    # nor as the field of an object at depth 63 (the decoder's inline field loop)
    slot_at_63 = b"\x91" * (MAX_DEPTH - 1) + b"\xf0\x01" + inner
    with pytest.raises(WireError, match="nests deeper than 64 levels"):
        decode(message(slot_at_63))
    assert decode(message(b"\x91" * (MAX_DEPTH - 1) + inner)) is not None  # one level up: fine


def test_objects_at_the_deepest_level_keep_their_plain_fields():
    call = Call(1, (2, 3), (4,), ("f.py", 1), None)
    v = nested(call, MAX_DEPTH - 1)  # the Call at depth 63, its fields at 64
    with pytest.raises(WireError, match="deeper than 64"):
        encode(v)  # its id tuples would be at depth 64
    w = nested(Slot(5), MAX_DEPTH - 1)
    assert decode(encode(w)) == w


# ---------------------------------------------------------------------------------------------
# inflation: a message decodes to at most ~one container per CONTAINER_BYTES bytes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("filler", [b"\x90", b"\xe0", b"\x81\x01", b"\x91\x00", b"\xa2ab"],
                         ids=["empty lists", "empty dicts", "1-tuples", "1-lists", "strings"])
def test_inflation_is_refused_quickly(filler):
    def flood(nbytes):
        n = nbytes // len(filler)
        return message(b"\xcf" + struct.pack("<I", n) + filler * n)

    data = flood(4 << 20)  # 4 MiB: the unbounded decoder took ~6 s and ~300 MiB for empty lists
    t0 = time.monotonic()
    with pytest.raises(WireError, match="containers .* would inflate in memory"):
        decode(data)
    assert time.monotonic() - t0 < 10
    data = flood(256 << 10)  # memory, traced (slow: a smaller message)
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="containers .* would inflate in memory"):
            decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * len(data), f"{peak} bytes decoded from {len(data)}"


def test_the_container_limit_leaves_real_messages_alone():
    # many instructions: one container (the Call) per ~20 bytes
    batch = [Call(i, (1000 + i, 2000 + i), (3000 + i,), ("model.py", i % 7), None) for i in range(50_000)]
    assert decode(encode(batch)) == batch
    # an op with very many tensor arguments: Slots are not counted
    plan = DefinePlan(1, 1, "aten.cat.default", ([Slot(i) for i in range(100_000)],), {}, None, "cat")
    assert decode(encode([plan])) == [plan]
    # dense lists: up to one container per CONTAINER_BYTES bytes, plus the allowance
    n = CONTAINER_ALLOWANCE * 2
    ok = [[i % 100, i % 100, i % 100] for i in range(n)]  # 4 bytes each
    assert decode(encode(ok)) == ok
    small = [[]] * (CONTAINER_ALLOWANCE - 1)  # small messages: the allowance covers anything
    assert decode(encode(small)) == small
    assert CONTAINER_BYTES == 4
