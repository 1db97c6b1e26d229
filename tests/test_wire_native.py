"""The native Call encoder (``dtorch_core._fastpath.encode_calls``, native/encode_calls.cpp)
against encode.py's Python code: the same bytes for every batch, the same errors, and messages
that decode back to the batch. The process runner's suite runs on both encoders too (CI runs the
suite again with DTORCH_NATIVE_DISPATCH=0, which leaves the Python encoder)."""

from __future__ import annotations

import contextlib
import enum
import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtorch_core.ir.instructions import Call, Delete, Fetch, Slot, Stats
from dtorch_core.ir.wire import WireError, decode, encode, encode_parts

from .test_wire import instructions, leaves, realistic_instructions, same

encode_module = importlib.import_module("dtorch_core.ir.wire.encode")
try:
    from dtorch_core import _fastpath
except ImportError:  # built without a compiler: nothing native to compare
    _fastpath = None

pytestmark = pytest.mark.skipif(_fastpath is None, reason="dtorch_core._fastpath is not built")
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def writer(native: bool):
    before = encode_module._write_calls, encode_module._write_ids
    encode_module.set_call_writer(*((_fastpath.encode_calls, _fastpath.encode_ids) if native else (None, None)))
    try:
        yield
    finally:
        encode_module.set_call_writer(*before)


def both(value) -> tuple[bytes, bytes]:
    """(Python bytes, native bytes) of ``value``; also checks encode_parts against encode."""
    out = []
    for w in (False, True):
        with writer(w):
            data = encode(value)
            assert data == b"".join(bytes(p) for p in encode_parts(value))
            out.append(data)
    return out[0], out[1]


def check(batch, decodes: bool = True) -> None:
    py, native = both(batch)
    assert native == py
    if decodes:
        assert same(decode(native), list(batch))


def test_the_controller_uses_the_native_writer():
    from dtorch_core.planner import native_dispatch

    if native_dispatch.active() == "native":
        assert (encode_module._write_calls, encode_module._write_ids) == (_fastpath.encode_calls, _fastpath.encode_ids)
    else:
        assert encode_module._write_calls is encode_module._write_ids is None


def test_realistic_batch_is_byte_identical():
    batch = realistic_instructions()
    check(batch)
    check(tuple(batch))  # a tuple batch decodes as a list
    check([i for i in batch if type(i) is Call] * 3)  # runs of Calls only, sources memoised


class Rank(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize("call", [
    Call(1, (2,), (3,), ("/a.py", 7)),
    Call(200, (), (-1, 2**31), "/a/source.py", 2**63 - 1),  # str source, int64 ids, big seed
    Call(-5, (2**31 - 1, -(2**31)), (1,) * 300, None, -(2**63)),  # 300 ids: the plain tuple form
    Call(1, tuple(range(255)), (2**40,) * 255, ("/a.py", 7, None, "x"), 0),  # a longer flat source
    Call(1, (True, 2), (3,), None),  # a bool id
    Call(1, (1, "x"), (3,), None),  # a mixed tuple
    Call(1, (), (3,), ("/a.py", 1.5)),  # a source that is not flat
    Call(1, (1,), (3,), (7, "x")),  # a tuple that starts with an int
])
def test_every_form_and_every_value_left_to_python(call):
    check([call, Stats(1), call, Call(2, (5,), (6,), ("/a.py", 7)), call])


@pytest.mark.parametrize("call", [
    Call(1, [1, 2], (3,), None),  # fields the decoder refuses: only the bytes are compared
    Call(1, None, (3,), None),
    Call(Slot(1), (1,), (3,), None),
    Call(True, (1,), (2,), None),  # a bool plan id
    Call(1, (1,), (3,), ("/a.py", 7), True),  # a bool seed
    Call(1, (Rank.ONE,), (3,), None),  # an int subclass: it travels (and decodes) as an int
])
def test_values_the_decoder_refuses_are_still_the_same_bytes(call):
    check([call, Call(2, (5,), (6,), ("/a.py", 7)), call], decodes=False)


@pytest.mark.parametrize("call", [
    Call(1, (2**64,), (3,), None),
    Call(1, (2,), (3,), None, 2**70),
    Call(2**63, (2,), (3,), None),
    Call(1, (2,), (3,), ("/a.py", 2**64)),
    Call(1, (2,), (3,), ("/a.py", {1})),
])
def test_unencodable_calls_raise_the_python_error(call):
    errors = []
    for w in (False, True):
        with writer(w), pytest.raises(WireError) as info:
            encode([Call(1, (2,), (3,), ("/a.py", 1)), call])
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_memo_beyond_256_entries_uses_u32_refs():
    # 300 sources in distinct files: each file name and each source is a memo entry, so the
    # later ones (and refs to them) take the u32 forms
    calls = [Call(i, (i,), (i + 1,), (f"/src/file{i}.py", i)) for i in range(300)]
    batch = calls + [Delete((1, 2))] + calls[::-1] + [Fetch(3, 4, (0, 1))] + calls
    check(batch)
    py, _ = both(batch)
    assert bytes((0xCC,)) in py


def test_objects_of_another_class_reset_nothing():
    # a memo entry made by a non-Call instruction is referred to by the Calls after it
    src = ("/a.py", 9)
    batch = [Fetch(1, 2, (0,)), Call(1, (2,), (3,), src)]
    check(batch)
    check([Call(1, (2,), (3,), src), Fetch(1, 2, (0,)), Call(4, (5,), (6,), src)])


@pytest.mark.parametrize("tids", [(), (5,), (-1, 2**31), tuple(range(300)), (2**63 - 1,) * 256, (True, 2),
                                  (1, "x"), None, [1, 2]])
def test_deletes(tids):
    check([Delete(tids), Call(1, (2,), (3,), None), Delete(tids)], decodes=type(tids) is tuple)


def test_non_batches_are_not_touched():
    value = [Call(1, (2,), (3,), ("/a.py", 1)), 5]  # not a batch (an int in the list)
    py, native = both(value)
    assert py == native


sources = st.one_of(
    st.none(),
    st.tuples(st.sampled_from(["/a/model.py", "/b/train.py", "é/ü.py", "\udc80"]), st.integers(-2**63, 2**63 - 1)),
    st.sampled_from(["/a/model.py", "x" * 40]),
    st.tuples(st.sampled_from(["/a.py"]), st.none() | st.integers(0, 9), st.sampled_from(["a", "b"])),
    st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
ids = st.one_of(
    st.lists(st.integers(-1, 2**40), max_size=6).map(tuple),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3).map(tuple),
    st.lists(st.integers(0, 9), min_size=250, max_size=260).map(tuple),
    st.lists(st.booleans() | st.integers(0, 3), max_size=3).map(tuple),
)
calls = st.builds(Call, st.integers(-2**40, 2**40), ids, ids, sources,
                  st.none() | st.integers(-(2**63), 2**63 - 1))


@SETTINGS
@given(st.lists(st.one_of(calls, calls, instructions(leaves)), max_size=30))
def test_property_mixed_batches(batch):
    check(batch)


def test_a_class_whose_fields_change_is_left_to_python(monkeypatch):
    # the native writers know Call's and Delete's fields; another layout must not reach them
    monkeypatch.setitem(encode_module._NATIVE_FIELDS, Call, ("plan_id", "inputs"))
    monkeypatch.setitem(encode_module._NATIVE_FIELDS, Delete, ("tids", "consume"))
    with writer(True):
        assert encode_module._write_calls is None and encode_module._write_ids is None
        batch = realistic_instructions()
        assert same(decode(encode(batch)), batch)
