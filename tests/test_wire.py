"""The wire format (ir/wire/, specified in docs/wire-format.md): exact round trips, every dtype,
and a decoder that only ever returns a value or raises WireError, whatever bytes it is given."""

from __future__ import annotations

import copy
import math
import struct
import tracemalloc
from array import array

import attrs
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch_core as dt
from dtorch_core.errors import DTorchError
from dtorch_core.ir import instructions as ins
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import (
    Call,
    Collective,
    Constant,
    DefineMesh,
    VIRTUAL_BASE,
    DefinePlan,
    DefineProgram,
    Delete,
    DropProgram,
    Fetch,
    MergedAllReduce,
    Put,
    Reply,
    RunProgram,
    Slot,
    Stats,
    WorkerFailure,
)
from dtorch_core.ir.wire import WireError, decode, encode, encode_parts
from dtorch_core.controller.session import current_session

from .helpers import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def same(a, b) -> bool:
    """Structural equality with exact types, NaN == NaN, and tensors compared bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    if type(a) in (tuple, list, torch.Size):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is slice:
        return same(a.start, b.start) and same(a.stop, b.stop) and same(a.step, b.step)
    if attrs.has(type(a)):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a)))
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    return a == b


def round_trip(value):
    data = encode(value)
    assert data == b"".join(bytes(p) for p in encode_parts(value))
    out = decode(data)
    expected = list(value) if wire._kind_of(value) == wire.KIND_BATCH else value
    assert same(out, expected), f"{value!r}\n!=\n{out!r}"
    return out


def must_reject(data, *fragments):
    """Decoding ``data`` raises WireError (never anything else); its message has ``fragments``."""
    with pytest.raises(WireError) as info:
        decode(data)
    text = str(info.value)
    assert "internal decoder error" not in text, text
    for f in fragments:
        assert f in text, text
    return text


def decodes_or_rejects(data) -> None:
    try:
        decode(data)
    except WireError as exc:
        assert "internal decoder error" not in str(exc), str(exc)


def message(body: bytes, data: bytes = b"", kind: int = wire.KIND_VALUE, version: int = wire.VERSION) -> bytes:
    """A message with a correct header around hand-made ``body`` and ``data``."""
    return struct.pack("<2sBBIQ", wire.MAGIC, version, kind, len(body), len(data)) + body + data


def body_of(data: bytes) -> tuple[bytes, bytes, int]:
    _, _, kind, blen, _ = struct.unpack_from("<2sBBIQ", data)
    return data[16 : 16 + blen], data[16 + blen :], kind


def tensor_of(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Arbitrary bits of ``dtype`` (any pattern, NaNs included); bool gets 0/1."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).view(torch.bool).reshape(shape)
    size = dtype.itemsize
    bits = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    return bits.view(dtype).reshape(shape)


TENSOR_DTYPES = [d for d, _ in wire._TENSOR_DTYPES.values()]
ALL_DTYPES = list(wire._DTYPE_CODES)


# ---------------------------------------------------------------------------------------------
# one of each instruction, with the contents dispatch gives them
# ---------------------------------------------------------------------------------------------
def realistic_instructions() -> list:
    src = ("/home/user/train.py", 42)
    shard = torch.randn(4, 8)
    return [
        DefineMesh(1, (2, 2), (0, 1, 2, 3)),
        DefinePlan(3, 1, "aten::addmm", (Slot(0), Slot(1), Slot(2)), {}, None, "aten.addmm.default"),
        DefinePlan(4, 1, "aten::slice.Tensor", (Slot(0), 1, 0, 9223372036854775807, 2), {}, None, "aten.slice.Tensor"),
        DefinePlan(5, 1, "aten::sum.dim_IntList", (Slot(0), [0, -1], True), {"dtype": torch.float64}, None, "aten.sum.dim_IntList"),
        DefinePlan(6, 1, "aten::zeros_like", (Slot(0),), {"pin_memory": False, "memory_format": torch.preserve_format}, None, "aten.zeros_like.default"),
        DefinePlan(7, 1, "aten::addcdiv_", (Slot(0), Slot(1), Slot(2)), {"value": -0.010000000000000002}, None, "aten.addcdiv_.default"),
        DefinePlan(
            8, 1, "dtorch::factory", (),
            {"kind": "full", "shape": (3, 4), "region": ((0, 3), (0, 2)), "dtype": torch.float32, "fill": float("inf"), "device": "cpu"},
            {1: ((), {"kind": "full", "shape": (3, 4), "region": ((0, 3), (2, 2)), "dtype": torch.float32, "fill": float("inf"), "device": "cpu"})},
            "dtorch.full",
        ),
        DefinePlan(9, 1, "dtorch::factory", (), {"kind": "randn", "shape": (4, 4), "region": ((0, 2), (0, 4)), "dtype": torch.bfloat16, "fill": None, "device": "cpu"}, None, "dtorch.randn", True),
        DefinePlan(10, 1, "aten::mul.Tensor", (Slot(0), 2j), {}, None, "aten.mul.Tensor"),
        DefinePlan(11, 1, "aten::index.Tensor", (Slot(0), [None, Slot(1)]), {}, {2: ((Slot(0), [Slot(1), None]), {})}, "aten.index.Tensor"),
        DefinePlan(12, 1, "aten::_to_copy", (Slot(0),), {"dtype": torch.float16, "layout": torch.strided, "device": torch.device("cpu")}, None, "aten._to_copy.default"),
        DefinePlan(13, 1, "aten::view", (Slot(0), torch.Size([3, 8])), {}, None, "aten.view.default"),
        DefinePlan(14, 1, "custom::kernel", (Slot(0), slice(None, 5, 2), Ellipsis, b"\x00\xff"), {}, None, "custom.kernel"),
        Call(3, (17, 44, 45), (46,), src),
        Call(4, (46,), (47, -1), src, None),
        Call(9, (), (48,), ("/home/user/train.py", 43), 2**62 - 1),
        Call(70000, (70001, 2**40), (2**31,), None),
        Collective("all_gather", 1, 0, 4, 5, 0),
        Collective("reduce_scatter", 1, 1, 6, 7, 1, "avg"),
        Collective("all_to_all", 1, 0, 8, 9, 1, "sum", 2),
        Collective("shift", 1, 0, 10, 11, shapes=((2, 3), (1, 3)), dtype=torch.float32, offset=-1),
        Put(20, 1, {0: shard, 1: shard + 1, 2: torch.ones(0, 8), 3: torch.tensor(7, dtype=torch.int64)}),
        Delete(tuple(range(100, 400))),
        Fetch(20, 5, (0, 1, 2, 3)),
        Stats(6),
        DefineProgram(
            2,
            (Call(3, (VIRTUAL_BASE, 44), (45,), src, 0), Collective("all_reduce", 1, 0, 45, 46),
             Delete((45,)), Constant(47, False), Call(4, (46, 47), (VIRTUAL_BASE + (1 << 40),), src)),
            (VIRTUAL_BASE,),
            (VIRTUAL_BASE + (1 << 40),),
            (0, 4),  # the calls a worker may fuse (dt.compile(fuse_local=True))
            (Put(47, 1, {0: shard}),),  # the program's constants
        ),
        RunProgram(2, (90,), (91,), 2**61, 12),
        DropProgram(2),
        MergedAllReduce(1, 0, "sum", (45, 46, 47), (48, 49, 50)),
    ]


def realistic_replies() -> list:
    return [
        Reply(5, 0, value=torch.randn(3, 5)),
        Reply(5, 1, value=torch.arange(6, dtype=torch.int32).reshape(2, 3).t()),
        Reply(6, 2, value={"rank": 2, "live_tensors": 12, "bytes": 4096}),
        Reply(7, 3, error=WorkerFailure(3, "aten.mm.default", ("/home/user/train.py", 12), "RuntimeError: shapes differ")),
        Reply(8, 0, error=WorkerFailure(0, "fetch", None, "tensor 9 is not on this worker")),
    ]


CORPUS = (
    [encode(realistic_instructions())]
    + [encode([i]) for i in realistic_instructions()]
    + [encode(r) for r in realistic_replies()]
    + [encode(v) for v in ([1, 2.5, "x", None], {"a": (1, "a"), 2: [b"", ...]}, torch.Size([2, 3]))]
)


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------
def test_every_instruction_class_has_a_stable_code():
    classes = {
        obj for obj in vars(ins).values() if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == ins.__name__
    }
    assert classes == set(wire._CLASSES), "give every class in instructions.py a code in _CLASS_TABLE"
    expected = {
        "Slot": 0, "DefineMesh": 1, "DefinePlan": 2, "Call": 3, "Collective": 4, "Put": 5,
        "Delete": 6, "Fetch": 7, "Stats": 8, "Reply": 9, "WorkerFailure": 10,
        "DefineProgram": 11, "RunProgram": 12, "DropProgram": 13, "MergedAllReduce": 14, "Constant": 15,
        "Number": 16, "DropPlans": 17,
    }
    assert {cls.__name__: info.code for cls, info in wire._CLASSES.items()} == expected  # never renumber
    codes = [code for code, _ in wire._DTYPE_TABLE]
    assert len(codes) == len(set(codes))


def test_wire_error_is_a_dtorch_error():
    assert issubclass(WireError, DTorchError)


@pytest.mark.parametrize("instruction", realistic_instructions(), ids=lambda i: type(i).__name__)
def test_instruction_round_trip(instruction):
    out = round_trip([instruction])
    assert type(out) is list and type(out[0]) is type(instruction)
    assert wire.message_kind(encode([instruction])) == wire.KIND_BATCH


def test_batch_round_trip_and_size():
    batch = realistic_instructions()
    assert type(round_trip(tuple(batch))) is list  # a tuple batch arrives as a list
    calls = [Call(i % 40, (5000 + i, 2), (5001 + i,), ("/home/user/model.py", 20 + i % 3)) for i in range(256)]
    import pickle

    assert len(encode(calls)) < 0.6 * len(pickle.dumps(calls))  # compact: ids packed, sources interned
    round_trip(calls)


@pytest.mark.parametrize("reply", realistic_replies(), ids=lambda r: f"reply{r.request_id}-{r.rank}")
def test_reply_round_trip(reply):
    round_trip(reply)
    assert wire.message_kind(encode(reply)) == wire.KIND_REPLY


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, 127, 128, -1, -128, -129, 32767, -32768, 2**31 - 1, -(2**31), 2**31,
        2**63 - 1, -(2**63), 0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e-310,
        complex(1, -2), complex(float("nan"), float("inf")), "", "x" * 31, "y" * 32, "é€𝄞", "lone \ud800 surrogate",
        b"", b"\x00" * 300, (), [], {}, (1,), (1, 2, 300, -5, 2**40), [None, [None, [None]]],
        (2**31 - 1, -(2**31)), (2**31,), (2**63 - 1, -(2**63)), tuple(range(255)), tuple(range(256)),
        (1, True), (True, 1), (1, 2.0), (1, "a"), (1, None), (1, (2,)), ("a",) * 300,
        {1: "a", "b": 2, -7: [1.5]}, tuple(range(1000)), list(range(16)), {i: i for i in range(16)},
        torch.Size([]), torch.Size([2, 3]), torch.Size(range(20)), slice(None), slice(1, None, -2), slice("a", 2.5, None),
        Ellipsis, Slot(3), (Slot(0), [Slot(1), (Slot(2),)]), ("a", 1), [("a", 1), ("a", 1), ("a", True), ("a", 1.0)],
        [f"s{i}" for i in range(300)] * 2, torch.device("cpu"), torch.device("cuda", 3), torch.device("meta"),
        *wire._LAYOUT_CODES, *wire._FORMAT_CODES,
    ],
    ids=repr,
)
def test_value_round_trip(value):
    round_trip(value)


def test_every_dtype_value_round_trips():
    round_trip(ALL_DTYPES)
    for name in ("float8_e4m3fn", "float8_e5m2", "bfloat16", "complex32", "uint64", "qint8"):
        if hasattr(torch, name):
            assert getattr(torch, name) in wire._DTYPE_CODES, name


def test_int_and_float_subclasses_travel_as_plain_values():
    import enum

    class Color(enum.IntEnum):
        RED = 3

    import numpy as np

    assert same(decode(encode([Color.RED, np.float64(2.5)])), [3, 2.5])


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)], ids=str)
def test_tensor_round_trip(dtype, shape):
    t = tensor_of(dtype, shape, seed=len(shape))
    out = round_trip(t)
    assert out.is_contiguous() and not out.requires_grad


def test_non_contiguous_and_view_tensors():
    base = torch.randn(6, 8)
    cases = [
        base.t(),
        base[::2, 1::3],
        base[2:4],  # storage offset
        base.expand(2, 6, 8),
        torch.randn(4, 3, dtype=torch.complex64).conj(),  # lazy conjugate bit
        torch.randn(4, dtype=torch.complex128).conj().imag,  # lazy negative bit
        torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1),
        nn.Parameter(torch.randn(3)),
        torch.randn(3, requires_grad=True) * 2,
    ]
    for t in cases:
        out = decode(encode(t))
        assert type(out) is torch.Tensor
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out, t.detach().resolve_conj().resolve_neg())


def test_decoded_tensor_owns_its_memory():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = bytearray(encode(Reply(1, 0, value=t)))
    out = decode(memoryview(buf)).value
    buf[:] = bytes(len(buf))  # the transport reuses its buffer
    assert torch.equal(out, t)
    out.add_(1)  # writable, no warning about read-only buffers
    assert torch.equal(out, t + 1)
    out.resize_(5, 5)  # a normal, resizable storage (out= ops resize their outputs)


def test_encode_parts_alias_tensor_memory():
    t = torch.randn(1024)
    parts = encode_parts(Put(1, 1, {0: t, 1: t[::2]}))
    assert [p.nbytes for p in parts[1:]] == [4096, 2048]
    assert parts[1].readonly
    del t  # the parts keep the memory alive (the second one is a contiguous copy)
    import gc

    gc.collect()
    out = decode(b"".join(parts))
    assert out.shards[1].equal(out.shards[0][::2])


def test_encoding_leaves_the_tensor_resizable():
    t = torch.randn(4, 4)
    encode(Reply(1, 0, value=t))
    t.resize_(8, 8)  # a worker's stored tensor may be the out= of a later op


@pytest.mark.parametrize("as_type", [bytes, bytearray, memoryview, lambda b: memoryview(array("B", b))])
def test_decode_accepts_buffers(as_type):
    value = [Call(1, (2,), (3,))]
    assert decode(as_type(encode(value))) == value


def test_decode_of_a_non_byte_format_buffer():
    data = encode([1, 2, 3])
    assert len(data) % 4 == 0
    assert decode(memoryview(array("I", data))) == [1, 2, 3]  # read through a byte view
    padded = encode([1, 2]) + b"\x00"
    with pytest.raises(WireError, match="trailing garbage"):
        decode(memoryview(array("I", padded)))


# ---------------------------------------------------------------------------------------------
# a real instruction stream: dispatch -> wire -> workers -> wire -> controller
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d=8, heads=2, ff=12):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        # no bias: the key bias gets a zero gradient up to rounding, which AdamW turns into noise
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, ff)
        self.out = nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(x)))


@pytest.fixture
def wired_session():
    """An inline session whose every batch and reply goes through encode -> decode."""
    dt.init(world_size=2, runner="inline")
    runner = current_session().runner
    seen = {"batches": [], "replies": []}
    submit = runner.submit

    def wired_submit(batch):
        out = decode(encode(batch))
        assert same(out, list(batch))
        seen["batches"].append(out)
        submit(out)

    runner.submit = wired_submit
    for worker in runner.workers:

        def wired_reply(reply, _send=worker.reply):
            out = decode(encode(reply))
            assert same(out, reply)
            seen["replies"].append(out)
            _send(out)

        worker.reply = wired_reply
    yield seen
    dt.shutdown()


def test_real_stream_through_the_wire(wired_session):
    torch.manual_seed(0)
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    ref = Block()
    model = copy.deepcopy(ref)
    plan = {"fc.weight": [dt.Shard(0)], "fc.bias": [dt.Shard(0)], "out.weight": [dt.Shard(1)], "qkv.weight": [dt.Shard(0)]}
    for name, module in model.named_modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            setattr(module, pname, nn.Parameter(dt.distribute_tensor(p.detach(), mesh, plan.get(full, [dt.Replicate()]))))
    xs = torch.randn(4, 3, 8)
    x = dt.distribute_tensor(xs, mesh, [dt.Shard(0)])
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        for m, o, inp in ((ref, opt_ref, xs), (model, opt, x)):
            o.zero_grad()
            m(inp).pow(2).mean().backward()
            o.step()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_close(p, p_ref.detach(), rtol=1e-4, atol=1e-5, msg=name)

    # more value kinds: factories, seeded random ops, dtype casts, complex, uneven shards
    dt.manual_seed(3)
    r = dt.randn(5, 4, device_mesh=mesh, placements=[dt.Shard(0)])
    assert r.full_tensor().shape == (5, 4)
    f = dt.full((3, 5), float("inf"), device_mesh=mesh, placements=[dt.Shard(1)])
    assert torch.equal(f.full_tensor(), torch.full((3, 5), float("inf")))
    a = dt.arange(0, 11, 3, device_mesh=mesh, placements=[dt.Shard(0)])
    assert torch.equal(a.full_tensor(), torch.arange(0, 11, 3))
    c = torch.randn(5, 2, dtype=torch.complex64)
    cd = dt.distribute_tensor(c, mesh, [dt.Shard(0)]) * 2j
    assert_close(cd.full_tensor(), c * 2j)
    h = dt.distribute_tensor(xs, mesh, [dt.Shard(1)]).to(torch.bfloat16)
    assert torch.equal(h.full_tensor(), xs.to(torch.bfloat16))
    dt.synchronize()

    batches, replies = wired_session["batches"], wired_session["replies"]
    kinds = {type(i) for b in batches for i in b}
    assert {DefineMesh, DefinePlan, Call, Collective, Put, Delete, Fetch, Stats} <= kinds
    assert any(r.value is not None and isinstance(r.value, torch.Tensor) for r in replies)
    # the whole stream as one message
    round_trip([i for b in batches for i in b])


def test_worker_failure_crosses_the_wire(wired_session):
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [dt.Shard(0)])
    dt.synchronize()
    runner = current_session().runner
    for w in runner.workers:  # as if the kernel that made x had failed on the workers
        w.store[x._tid] = WorkerFailure(w.rank, "aten.mm.default", ("/home/user/x.py", 3), "boom")
    with pytest.raises(dt.WorkerError, match="boom"):
        x.full_tensor()
    assert any(r.error is not None for r in wired_session["replies"])


# ---------------------------------------------------------------------------------------------
# what cannot be encoded
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, fragment",
    [
        (2**63, "64 bits"),
        (-(2**63) - 1, "64 bits"),
        (object(), "type object"),
        ({1, 2}, "type set"),
        (frozenset(), "type frozenset"),
        (bytearray(b"x"), "type bytearray"),
        ({(1, 2): 3}, "dict key"),
        ({1.5: 3}, "dict key"),
        ({True: 3}, "dict key"),
        (lambda: 0, "function"),
        (torch.randn(3).to_sparse(), "sparse"),
        (torch.empty(2, device="meta"), "meta"),
        ([[Slot(1)], {"k": object()}], "type object"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_values_raise(value, fragment):
    with pytest.raises(WireError, match=fragment):
        encode(value)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_tensor_is_refused():
    q = torch.quantize_per_tensor(torch.randn(2), 0.1, 0, torch.qint8)
    with pytest.raises(WireError, match="quantized"):
        encode(q)


def test_tensor_subclass_is_refused_without_reading_it():
    class Handle(torch.Tensor):
        def __repr__(self):  # a DTensor's repr would fetch data
            raise AssertionError("repr called")

    with pytest.raises(WireError, match="Handle"):
        encode(torch.randn(2).as_subclass(Handle))


WRAPPERS = {
    "list": lambda x: [x],
    "tuple": lambda x: (x,),
    "dict": lambda x: {"k": x},
    "slice": lambda x: slice(x, None, None),
    "Reply": lambda x: Reply(1, 0, value=x),
    "DefinePlan": lambda x: DefinePlan(1, 1, "t", x, {}, None, "op"),
}


@pytest.mark.parametrize("kind", list(WRAPPERS))
@pytest.mark.parametrize("inner", [[0], torch.Size([2]), (0, 300), ("a", 1)], ids=repr)
def test_nesting_limit_is_the_same_on_both_sides(kind, inner):
    wrap = WRAPPERS[kind]
    if kind == "DefinePlan":
        wrap = lambda x: DefinePlan(1, 1, "t", (x,), {}, None, "op")  # noqa: E731  (two levels)
        levels = wire.MAX_DEPTH // 2 - 1
    else:
        levels = wire.MAX_DEPTH - 1
    v = inner
    for _ in range(levels):
        v = wrap(v)
    round_trip(v)  # innermost container at depth 63: accepted by both
    with pytest.raises(WireError, match="deeper than 64"):
        encode(wrap(wrap(v)))


def test_too_deep_to_encode():
    v: list = []
    for _ in range(wire.MAX_DEPTH):
        v = [v]
    encode(v)  # 64 levels of containers
    with pytest.raises(WireError, match="deeper than 64"):
        encode([v])
    w = torch.Size([1])
    for _ in range(wire.MAX_DEPTH):
        w = [w]
    with pytest.raises(WireError, match="deeper than 64"):
        encode(w)
    loop: list = []
    loop.append(loop)
    with pytest.raises(WireError, match="deeper"):
        encode(loop)


# ---------------------------------------------------------------------------------------------
# what the decoder refuses (hand-made frames)
# ---------------------------------------------------------------------------------------------
def test_header_checks():
    good = encode([Stats(1)])
    must_reject(b"", "shorter than the 16-byte header")
    must_reject(good[:10], "shorter than the 16-byte header")
    must_reject(b"PK" + good[2:], "magic")
    must_reject(good[:2] + bytes([9]) + good[3:], "version 9", f"version {wire.VERSION}")
    must_reject(good[:3] + bytes([77]) + good[4:], "unknown message kind 77")
    must_reject(good[:-1], "truncated")
    must_reject(good + b"\x00", "trailing garbage")
    must_reject(message(b""), "empty body")
    assert wire.message_kind(good) == wire.KIND_BATCH
    with pytest.raises(WireError, match=f"version {wire.VERSION + 1}"):
        wire.message_kind(good[:2] + bytes([wire.VERSION + 1]) + good[3:])
    with pytest.raises(WireError):
        decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(WireError):
        decode(None)  # type: ignore[arg-type]


def test_kind_must_match_the_content():
    must_reject(message(encode({"a": 1})[16:], kind=wire.KIND_BATCH), "batch message holds a dict")
    must_reject(message(encode([Slot(1)])[16:], kind=wire.KIND_BATCH), "batch item 0 is a Slot")
    must_reject(message(encode([Reply(1, 0)])[16:], kind=wire.KIND_BATCH), "not an instruction")
    must_reject(message(encode(5)[16:], kind=wire.KIND_REPLY), "expected a Reply")


@pytest.mark.parametrize(
    "body, fragments",
    [
        (b"\xd7", ["unknown type tag 0xd7", "offset 16"]),
        (b"\xdc", ["unknown type tag 0xdc"]),
        (b"\xdf\x00", ["unknown type tag 0xdf"]),
        (b"\xda\x03\x01\x00\x00\x00", ["runs past the end of the body"]),
        (b"\xdb\x01\x00", ["runs past the end of the body"]),
        (b"\x91\xda\x02\x00", ["runs past the end of the body"]),
        (b"\xf3\x06\x01\xda\x05\x00", ["runs past the end of the body"]),
        (b"\xdd\x05\x01", ["tuple of 5 values runs past"]),
        (b"\x92\x01\xde", ["unknown type tag 0xde", "offset 18"]),
        (b"\xcf\xff\xff\xff\xff\x00", ["list of 4294967295 values runs past"]),
        (b"\xce\x00\x00\x00\x80", ["tuple of 2147483648 values"]),
        (b"\xd0\xff\xff\xff\x7f", ["dict of 2147483647 entries"]),
        (b"\xca\xff\xff\xff\xff", ["string of 4294967295 bytes runs past"]),
        (b"\xcd\x10\x00\x00\x00abc", ["bytes of length 16 run past"]),
        (b"\xa5abc", ["string of 5 bytes runs past"]),
        (b"\xa2\xff\xfe", ["invalid UTF-8"]),
        (b"\xcb\x00", ["memo entry 0"]),
        (b"\x92\xa1a\xcb\x01", ["memo entry 1"]),
        (b"\xcc\x10\x00\x00\x00", ["memo entry 16"]),
        (b"\xc7\x01\x02", ["runs past the end"]),
        (b"\xc8\x00", ["runs past the end"]),
        (b"\x93\x01\x02", ["list of 3 values runs past"]),
        (b"\x92\x01\xc5\x00", ["runs past the end of the body"]),
        (b"\x01\x02", ["1 bytes of trailing garbage", "offset 17"]),
        (b"\xff\x03\x01\x02\x03", ["Constant with 3 fields, expected 2"]),  # code 15: every short code is taken
        (b"\xd9\x12\x00\x01\x00", ["unknown class code 18"]),
        (b"\xd9\x00\x01\x01\x00", ["unknown class code 256"]),
        (b"\xf3\x02\x01\x80", ["Call with 2 fields, expected 6"]),
        (b"\xf0\x00", ["Slot with 0 fields"]),
        (b"\xf0\x01\xa1x", ["Slot.index is a str"]),
        (b"\xf3\x06\xa1x\x80\x80\xc0\xc0\x80", ["Call.plan_id is a str"]),
        (b"\xf3\x06\x01\x80\x80\xc2\xc0\x80", ["Call.source is a bool"]),
        (b"\xf9\x04\x01\x00\xc0\x05", ["Reply.error is a int"]),
        (b"\xe2\x01\x02\x01\x03", ["duplicate dict key 1"]),
        (b"\xe1\x81\x01\x02", ["dict key of type tuple"]),
        (b"\xe1\xc2\x02", ["dict key of type bool"]),
        (b"\xd3\xee", ["unknown dtype code 238"]),
        (b"\xd5\xee", ["unknown layout code"]),
        (b"\xd6\xee", ["unknown memory format code"]),
        (b"\xd4\xa3foo\xc0", ["invalid device"]),
        (b"\xd4\x01\xc0", ["expected (str, int | None)"]),
        (b"\xd4\xa3cpu\xa1x", ["expected (str, int | None)"]),
        (b"\xd1\x01", ["torch.Size not followed by a tuple"]),
        (b"\xd1\x81\xa1x", ["torch.Size holds a str"]),
        (b"\xdd\x02\x01\x91\x01", ["memo tuple holds a list"]),
        (b"\xd2\x01\x02", ["ends early"]),
    ],
)
def test_malformed_bodies(body, fragments):
    must_reject(message(body), *fragments)


def tensor_record(code, dims, nbytes) -> bytes:
    return struct.pack(f"<BBB{len(dims)}QQ", 0xD8, code, len(dims), *dims, nbytes)


F32 = wire._DTYPE_CODES[torch.float32]


@pytest.mark.parametrize(
    "body, data, fragments",
    [
        (tensor_record(F32, (2, 3), 24), bytes(23), ["24 bytes runs past the end of the data section"]),
        (tensor_record(F32, (2, 3), 20), bytes(20), ["has 24 bytes, but its record says 20"]),
        (tensor_record(F32, (2, 3), 24), bytes(25), ["1 bytes of tensor data", "belong to no tensor"]),
        (tensor_record(F32, (2**64 - 1,), 4), bytes(4), ["int64"]),  # a negative size as int64
        (tensor_record(F32, (0, 2**40, 2**40), 0), b"", ["int64"]),
        (tensor_record(F32, (2**40,), 2**42), bytes(8), ["runs past the end of the data section"]),
        (tensor_record(200, (1,), 4), bytes(4), ["unknown dtype code 200"]),
        (tensor_record(wire._DTYPE_CODES[torch.qint8], (1,), 1), bytes(1), ["cannot travel as raw bytes"]),
        (struct.pack("<BBB", 0xD8, F32, 65) + bytes(8 * 66), b"", ["65 dims"]),
        (tensor_record(F32, (2, 3), 24)[:-3], bytes(24), ["runs past the end of the body"]),
        (tensor_record(wire._DTYPE_CODES[torch.bool], (3,), 3), b"\x00\x01\x02", ["bool tensor"]),
    ],
)
def test_malformed_tensors(body, data, fragments):
    must_reject(message(body, data), *fragments)


def test_empty_tensor_with_a_zero_dim_is_fine():
    t = decode(message(tensor_record(F32, (0, 2**20), 0)))
    assert t.shape == (0, 2**20)


def test_nesting_limit():
    ok = b"\x91" * (wire.MAX_DEPTH) + b"\x00"
    assert decode(message(ok)) is not None
    must_reject(message(b"\x91" * (wire.MAX_DEPTH + 1) + b"\x00"), "nests deeper than 64")
    for opener in (b"\x81", b"\x91", b"\xe1\x00", b"\xf0\x01", b"\xd2", b"\xdd\x01", b"\xce\x01\x00\x00\x00"):
        must_reject(message(opener * 100_000 + b"\x00"), "deeper than 64")


def test_lying_sizes_allocate_nothing_large():
    frames = [
        message(b"\xcf\xff\xff\xff\xff" + bytes(64)),
        message(b"\xd0\xff\xff\xff\xff" + bytes(64)),
        message(b"\xcd\xff\xff\xff\xff" + bytes(64)),
        message(tensor_record(F32, (2**30, 2**30), 2**62), bytes(64)),
        message(tensor_record(F32, (2**28,), 2**30), bytes(64)),
        message(b"\xd1\xce\xff\xff\xff\x7f" + bytes(64)),
    ]
    tracemalloc.start()
    try:
        for frame in frames:
            tracemalloc.reset_peak()
            with pytest.raises(WireError):
                decode(frame)
            assert tracemalloc.get_traced_memory()[1] < 256 * 1024
    finally:
        tracemalloc.stop()


def test_every_truncation_and_byte_flip_of_the_corpus():
    for data in CORPUS:
        for n in range(len(data)):
            must_reject(data[:n])
        body, blob, kind = body_of(data)
        for n in range(len(body)):  # truncated bodies inside a consistent header
            decodes_or_rejects(message(body[:n], blob, kind))
        for i in range(len(data)):
            for flip in (0x00, 0xFF, 0x80, 0x7F, data[i] ^ 0x01, data[i] ^ 0x80):
                mutated = bytearray(data)
                mutated[i] = flip
                decodes_or_rejects(bytes(mutated))


# ---------------------------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------------------------
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
small_tensors = st.builds(
    tensor_of,
    st.sampled_from(TENSOR_DTYPES),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 2**16),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    int64s,
    st.integers(-200, 200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.text(alphabet="ab", max_size=3),  # repeats: exercises string references
    st.binary(max_size=40),
    st.sampled_from(ALL_DTYPES),
    st.sampled_from(list(wire._LAYOUT_CODES) + list(wire._FORMAT_CODES)),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"), torch.device("cpu", 0)]),
    st.just(Ellipsis),
    st.builds(Slot, st.integers(0, 2**20)),
    st.lists(st.integers(0, 2**40), max_size=5).map(torch.Size),
    small_tensors,
)
sources = st.one_of(st.none(), st.tuples(st.sampled_from(["/a/model.py", "/b/train.py"]), st.integers(0, 5000)))
tids = st.lists(st.integers(-1, 2**40), max_size=6).map(tuple)
names = st.sampled_from(["aten::mm", "aten::add.Tensor", "dtorch::factory", "sum"])


def instructions(children):
    return st.one_of(
        st.builds(Call, st.integers(0, 2**31), tids, tids, sources, st.none() | int64s),
        st.builds(
            DefinePlan, st.integers(0, 2**20), st.integers(0, 9), names,
            st.lists(children, max_size=4).map(tuple), st.dictionaries(st.text(max_size=5), children, max_size=3),
            st.none() | st.dictionaries(st.integers(0, 7), st.tuples(st.lists(children, max_size=2).map(tuple), st.just({}))),
            names, st.booleans(),
        ),
        st.builds(Collective, st.sampled_from(ins.COLLECTIVE_KINDS), st.integers(0, 3), st.integers(0, 2), st.integers(0, 2**33), st.integers(0, 2**33), st.integers(-4, 4), st.sampled_from(["sum", "avg", "max"]), st.integers(-4, 4)),
        st.builds(Put, st.integers(0, 2**33), st.integers(0, 3), st.dictionaries(st.integers(0, 7), small_tensors, max_size=3)),
        st.builds(Delete, tids),
        st.builds(Fetch, st.integers(0, 2**33), st.integers(0, 2**33), tids),
        st.builds(Stats, st.integers(0, 2**33)),
        st.builds(DefineMesh, st.integers(0, 9), st.lists(st.integers(1, 4), max_size=3).map(tuple), tids),
        st.builds(Reply, st.integers(0, 99), st.integers(0, 7), children, st.none() | st.builds(WorkerFailure, st.integers(0, 7), names, sources, st.text(max_size=20))),
    )


values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.lists(children, max_size=20).map(tuple),
        st.dictionaries(st.one_of(int64s, st.text(max_size=8)), children, max_size=6),
        st.builds(slice, children, children, children),
        instructions(children),
        st.tuples(st.sampled_from(["/a/model.py", "x"]), st.integers(0, 99)),  # memoised tuples
    ),
    max_leaves=30,
)


@SETTINGS
@given(values)
def test_property_round_trip(value):
    round_trip(value)


@SETTINGS
@given(st.lists(instructions(leaves), max_size=20))
def test_property_batch_round_trip(batch):
    round_trip(batch)


@settings(SETTINGS, max_examples=300)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    decodes_or_rejects(data)


@settings(SETTINGS, max_examples=1000)
@given(st.binary(min_size=1, max_size=200), st.binary(max_size=40), st.sampled_from(sorted(wire._KIND_NAMES)))
def test_fuzz_random_bodies(body, data, kind):
    decodes_or_rejects(message(body, data, kind))


@settings(SETTINGS, max_examples=300)
@given(values, st.data())
def test_fuzz_mutations_of_valid_messages(value, data):
    msg = bytearray(encode(value))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(msg) - 1))
        msg[i] = data.draw(st.integers(0, 255))
    decodes_or_rejects(bytes(msg))
    cut = data.draw(st.integers(0, len(msg) - 1))
    must_reject(bytes(msg[:cut]))
    body, blob, kind = body_of(bytes(encode(value)))
    decodes_or_rejects(message(body[: data.draw(st.integers(0, len(body)))], blob, kind))


@settings(SETTINGS, max_examples=300)
@given(st.sampled_from(CORPUS), st.data())
def test_fuzz_mutations_of_realistic_messages(msg, data):
    msg = bytearray(msg)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(16, len(msg) - 1))
        msg[i] = data.draw(st.integers(0, 255))
    decodes_or_rejects(bytes(msg))
