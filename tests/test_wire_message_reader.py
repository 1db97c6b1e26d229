"""The whole-message reader (``dtorch_core._workerpath.read_message``, native/read_calls.cpp): a
batch of Calls and flat instructions (Delete, Stats, Fetch, RunProgram), or a sync point's bare
Reply, read in C++ gives what the Python decoder gives, anything else is left to the Python
decoder, and every malformed message is refused with the Python decoder's own WireError."""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest

from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Call, DefinePlan, Delete, Fetch, Put, Reply, RunProgram, Stats, WorkerFailure
from dtorch_core.worker import native

from .helpers import mutated_messages

decode_module = importlib.import_module("dtorch_core.ir.wire.decode")
pytestmark = pytest.mark.skipif(not native.available(), reason=f"the extension is not built: {native.active()}")


def read_message(data):
    """The extension's batch reader (also where DTORCH_NATIVE_WORKER=0 keeps the decoder off it)."""
    return decode_module._native_message_reader()(data)


@contextlib.contextmanager
def readers(native_on: bool):
    """The decoder with the native readers on (both) or off (the Python decoder alone)."""
    saved = decode_module._read_calls, decode_module._read_message
    if native_on:
        from dtorch_core import _workerpath

        decode_module._read_calls = _workerpath.read_calls
        decode_module._read_message = decode_module._native_message_reader()
    else:
        decode_module._read_calls = decode_module._read_message = None
    try:
        yield
    finally:
        decode_module._read_calls, decode_module._read_message = saved


def decoded(data, *, python: bool):
    """``wire.decode(data)``: the value, or the WireError's text."""
    with readers(not python):
        try:
            return wire.decode(data)
        except wire.WireError as exc:
            return f"WireError: {exc}"


def step_batch():
    """What a step's frames hold: Calls (sources new and repeated, int64 ids and seeds, numbers)
    and the flat instructions, with ids in every tuple form the encoder writes."""
    big = 1 << 40
    return [
        Call(1, (1, 2), (3,), ("model.py", 12), None),
        Call(2, (), (-1, 4), ("model.py", 12), 7, (0.5, -2.0)),
        Call(big, (big, -big), (5,), ("other.py", 3, None), -(1 << 62)),
        Delete((3, 4)),
        Delete(()),
        Delete(tuple(range(1000, 1300))),  # more than 255 ids: the plain tuple form
        Delete(tuple(range(big, big + 300))),
        Stats(17, False),
        Stats(1 << 35, True),
        Fetch(8, 3, (0, 2), True),
        Fetch(9, 4, (), False),
        RunProgram(3, (1, big), (), 1 << 50, 12),
        Call(4, (7,), (8,), ("é/ünïcode.py", 40000), None),
    ]


def test_the_decoder_reads_batches_whole_where_the_extension_is_built():
    off = os.environ.get("DTORCH_NATIVE_WORKER", "1") == "0"
    assert (decode_module._read_message is None) == off


def test_a_steps_batch_is_read_whole_and_equals_the_python_decoders():
    batch = step_batch()
    data = wire.encode(batch)
    got = read_message(data)
    assert got is not None
    assert got == decoded(data, python=True) == batch
    assert [type(x) for x in got] == [type(x) for x in batch]
    for view in (bytearray(data), memoryview(data)):
        assert read_message(view) == batch


@pytest.mark.parametrize("other", [
    DefinePlan(5, 1, "aten.add.Tensor", (), {}, None, "add"),
    Put(9, 1, {0: 1.5}),
    Call(1, (1,), (2,), ["a list"], None),  # a source the encoder writes in no Call form
])
def test_batches_with_anything_else_are_left_to_the_python_decoder(other):
    batch = [*step_batch()[:3], other]
    data = wire.encode(batch)
    assert read_message(data) is None
    assert decoded(data, python=False) == decoded(data, python=True)


def test_values_that_are_not_batches_are_left_to_the_python_decoder():
    for value in ((1, 2), [1, 2], {"a": 1}, "text", Stats(1)):
        data = wire.encode(value)
        assert read_message(data) is None
        assert decoded(data, python=False) == decoded(data, python=True) == value
    for batch in ([], [Stats(1)]):  # a list of instructions is a batch, an empty one too
        data = wire.encode(batch)
        assert read_message(data) == decoded(data, python=True) == batch


def test_malformed_batches_raise_the_python_decoders_errors():
    """Flipped, dropped and inserted bytes, in the header too, and cut messages: the same value or
    the same WireError (message and offset) with the batch reader as without; nothing crashes."""
    for trial, where, mutated in mutated_messages(wire.encode(step_batch()), 3000, header=True):
        assert decoded(mutated, python=False) == decoded(mutated, python=True), (trial, where)


def test_a_sync_points_reply_is_read_whole():
    for reply in (Reply(5, 1), Reply(-3, 0), Reply(1 << 40, 7)):  # PROTOCOL-like ids are negative
        data = wire.encode(reply)
        assert read_message(data) == decoded(data, python=True) == reply
        assert type(read_message(data)) is Reply


@pytest.mark.parametrize("reply", [
    Reply(5, 1, value=3),
    Reply(5, 1, value={"bytes": 4}),
    Reply(5, 1, error=WorkerFailure(1, "aten.add", None, "boom")),
])
def test_replies_with_a_value_or_an_error_are_left_to_the_python_decoder(reply):
    data = wire.encode(reply)
    assert read_message(data) is None
    assert decoded(data, python=False) == decoded(data, python=True) == reply


def test_a_reply_is_not_read_as_a_batch_item_nor_a_batch_as_a_reply():
    kind_batch, kind_reply = wire.encode([Stats(1)])[3], wire.encode(Reply(1, 0))[3]
    batch_with_reply = bytearray(wire.encode([Stats(1), Reply(1, 0)]))  # not a batch: a value
    batch_with_reply[3] = kind_batch
    reply_kind_batch = bytearray(wire.encode([Stats(1)]))
    reply_kind_batch[3] = kind_reply
    for data in (bytes(batch_with_reply), bytes(reply_kind_batch)):
        assert read_message(data) is None
        assert decoded(data, python=False) == decoded(data, python=True)
        assert str(decoded(data, python=True)).startswith("WireError")


def test_malformed_replies_raise_the_python_decoders_errors():
    for trial, where, mutated in mutated_messages(wire.encode(Reply(300, 2)), 1000, header=True):
        assert decoded(mutated, python=False) == decoded(mutated, python=True), (trial, where)
