"""The whole-batch reader (``dtorch_core._workerpath.read_batch``, native/read_calls.cpp): a batch
of Calls and flat instructions (Delete, Stats, Fetch, RunProgram) read in C++ gives what the
Python decoder gives, anything else is left to the Python decoder, and every malformed message is
refused with the Python decoder's own WireError."""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest

from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Call, DefinePlan, Delete, Fetch, Put, RunProgram, Stats
from dtorch_core.worker import native

from .helpers import mutated_messages

decode_module = importlib.import_module("dtorch_core.ir.wire.decode")
pytestmark = pytest.mark.skipif(not native.available(), reason=f"the extension is not built: {native.active()}")


def read_batch(data):
    """The extension's batch reader (also where DTORCH_NATIVE_WORKER=0 keeps the decoder off it)."""
    return decode_module._native_batch_reader()(data)


@contextlib.contextmanager
def readers(native_on: bool):
    """The decoder with the native readers on (both) or off (the Python decoder alone)."""
    saved = decode_module._read_calls, decode_module._read_batch
    if native_on:
        from dtorch_core import _workerpath

        decode_module._read_calls = _workerpath.read_calls
        decode_module._read_batch = decode_module._native_batch_reader()
    else:
        decode_module._read_calls = decode_module._read_batch = None
    try:
        yield
    finally:
        decode_module._read_calls, decode_module._read_batch = saved


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
    assert (decode_module._read_batch is None) == off


def test_a_steps_batch_is_read_whole_and_equals_the_python_decoders():
    batch = step_batch()
    data = wire.encode(batch)
    got = read_batch(data)
    assert got is not None
    assert got == decoded(data, python=True) == batch
    assert [type(x) for x in got] == [type(x) for x in batch]
    for view in (bytearray(data), memoryview(data)):
        assert read_batch(view) == batch


@pytest.mark.parametrize("other", [
    DefinePlan(5, 1, "aten.add.Tensor", (), {}, None, "add"),
    Put(9, 1, {0: 1.5}),
    Call(1, (1,), (2,), ["a list"], None),  # a source the encoder writes in no Call form
])
def test_batches_with_anything_else_are_left_to_the_python_decoder(other):
    batch = [*step_batch()[:3], other]
    data = wire.encode(batch)
    assert read_batch(data) is None
    assert decoded(data, python=False) == decoded(data, python=True)


def test_values_that_are_not_batches_are_left_to_the_python_decoder():
    for value in ((1, 2), [1, 2], {"a": 1}, "text", Stats(1)):
        data = wire.encode(value)
        assert read_batch(data) is None
        assert decoded(data, python=False) == decoded(data, python=True) == value
    for batch in ([], [Stats(1)]):  # a list of instructions is a batch, an empty one too
        data = wire.encode(batch)
        assert read_batch(data) == decoded(data, python=True) == batch


def test_malformed_batches_raise_the_python_decoders_errors():
    """Flipped, dropped and inserted bytes, in the header too, and cut messages: the same value or
    the same WireError (message and offset) with the batch reader as without; nothing crashes."""
    for trial, where, mutated in mutated_messages(wire.encode(step_batch()), 3000, header=True):
        assert decoded(mutated, python=False) == decoded(mutated, python=True), (trial, where)
