"""The encoder: any supported value, batch or Reply as one message (see docs/wire-format.md)."""

from __future__ import annotations

import struct

import torch

from .. import instructions as _ins
from .codes import (
    _CLASSES,
    _DTYPE_CODES,
    _FLAT_TYPES,
    _FORMAT_CODES,
    _HEADER,
    _INSTRUCTION_TYPES,
    _INT64_MAX,
    _INT64_MIN,
    _LAYOUT_CODES,
    HEADER_SIZE,
    KIND_BATCH,
    KIND_REPLY,
    KIND_VALUE,
    MAGIC,
    MAX_DEPTH,
    VERSION,
)
from .errors import WireError, _short_repr, _type_name
from .tensors import _tensor_record

_pack_b = struct.Struct("<Bb").pack
_pack_h = struct.Struct("<Bh").pack
_pack_i = struct.Struct("<Bi").pack
_pack_q = struct.Struct("<Bq").pack
_pack_d = struct.Struct("<Bd").pack
_pack_dd = struct.Struct("<Bdd").pack
_pack_u32 = struct.Struct("<BI").pack
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NONE, _FALSE, _TRUE, _ELLIPSIS = 0xC0, 0xC1, 0xC2, 0xC3
_REFS = [bytes((0xCB, i)) for i in range(256)]
# tuples of 1..255 ints (tensor ids): one struct call each way
_PACK_I32 = [struct.Struct(f"<BB{n}i").pack for n in range(256)]
_PACK_I64 = [struct.Struct(f"<BB{n}q").pack for n in range(256)]
_CALL = _ins.Call
_CALL_PREFIX = _CLASSES[_CALL].prefix
_DELETE = _ins.Delete
_DELETE_PREFIX = _CLASSES[_DELETE].prefix

# Runs of Calls, and Deletes, are written by ``dtorch_core._fastpath.encode_calls`` and
# ``encode_ids`` (native/encode_calls.cpp) once the controller's native hot path is installed
# (planner/native_dispatch.py): the same bytes, and they leave to the Python code below every
# item or value they do not write.
_write_calls = None
_write_ids = None


# the fields the native writers know; a class that gains a field is written in Python until they do
_NATIVE_FIELDS = {_CALL: ("plan_id", "inputs", "outputs", "source", "seed", "numbers"), _DELETE: ("tids",)}


def set_call_writer(writer, ids_writer=None) -> None:
    """Write runs of Calls in batches with ``writer(body, batch, start, memo, Call, prefix) -> next
    index``, and Deletes with ``ids_writer(body, prefix, tids) -> written`` (None: in Python)."""
    global _write_calls, _write_ids
    known = {cls: _CLASSES[cls].names == names for cls, names in _NATIVE_FIELDS.items()}
    _write_calls = writer if known[_CALL] else None
    _write_ids = ids_writer if known[_DELETE] else None


def _kind_of(obj) -> int:
    if type(obj) is _ins.Reply:
        return KIND_REPLY
    if type(obj) in (list, tuple) and _INSTRUCTION_TYPES.issuperset(map(type, obj)):  # no Python loop
        return KIND_BATCH
    return KIND_VALUE


def encode_parts(obj) -> list:
    """``obj`` as a list of buffers whose concatenation is ``encode(obj)``.

    The first part is header and body (a bytearray); each further part is one tensor's bytes
    and may alias that tensor's memory: write the parts out before the tensors change. A batch
    (a list or tuple of instructions) decodes as a list.
    """
    kind = _kind_of(obj)
    body = bytearray(HEADER_SIZE)
    append = body.append
    extend = body.extend
    data: list = []
    memo: dict = {}  # str or flat tuple -> its index in the message's memo table
    classes = _CLASSES

    # The loops over tuple elements and object fields write small ints and None themselves
    # instead of calling enc: a Call is mostly tensor ids, and a call per id would dominate.
    def enc(v, depth):
        t = type(v)
        if t is int:
            if 0 <= v < 0x80:
                append(v)
            elif -0x80 <= v < 0x80:
                extend(_pack_b(0xC4, v))
            elif -0x8000 <= v < 0x8000:
                extend(_pack_h(0xC5, v))
            elif -0x80000000 <= v < 0x80000000:
                extend(_pack_i(0xC6, v))
            elif _INT64_MIN <= v <= _INT64_MAX:
                extend(_pack_q(0xC7, v))
            else:
                raise WireError(f"int {v} does not fit in 64 bits (signed); the wire format carries int64")
        elif t is tuple:
            n = len(v)
            if not n:
                append(0x80)
                return
            if depth >= MAX_DEPTH:
                _too_deep()
            if type(v[0]) is str and n < 256 and set(map(type, v)) <= _FLAT_TYPES:
                # (file, line) sources and the like repeat within a batch: send each once
                idx = memo.get(v)
                if idx is not None:
                    extend(_REFS[idx] if idx < 256 else _pack_u32(0xCC, idx))
                    return
                append(0xDD)
                append(n)
                for x in v:
                    enc(x, depth + 1)
                memo[v] = len(memo)
                return
            if n < 256 and type(v[0]) is int:
                for x in v:
                    if type(x) is not int:
                        break
                else:
                    lo = min(v)
                    hi = max(v)
                    if -0x80000000 <= lo and hi < 0x80000000:
                        extend(_PACK_I32[n](0xDA, n, *v))
                        return
                    if _INT64_MIN <= lo and hi <= _INT64_MAX:
                        extend(_PACK_I64[n](0xDB, n, *v))
                        return
            if n < 16:
                append(0x80 | n)
            else:
                extend(_pack_u32(0xCE, n))
            d1 = depth + 1
            for x in v:
                if type(x) is int and 0 <= x < 0x80:
                    append(x)
                else:
                    enc(x, d1)
        elif t is str:
            idx = memo.get(v)
            if idx is not None:
                extend(_REFS[idx] if idx < 256 else _pack_u32(0xCC, idx))
                return
            b = v.encode("utf-8", "surrogatepass")
            n = len(b)
            if n < 32:
                append(0xA0 | n)
            else:
                extend(_pack_u32(0xCA, n))
            extend(b)
            memo[v] = len(memo)
        elif v is None:
            append(_NONE)
        elif t in classes:
            if depth >= MAX_DEPTH:
                _too_deep()
            info = classes[t]
            extend(info.prefix)
            d1 = depth + 1
            for x in info.get(v):
                tx = type(x)
                if x is None:
                    append(_NONE)
                elif tx is int and 0 <= x < 0x80:
                    append(x)
                elif tx is tuple and x and d1 < MAX_DEPTH:
                    # what enc's tuple branch does for tensor ids and sources, without the call
                    n = len(x)
                    t0 = type(x[0])
                    if t0 is int and n < 256:
                        for y in x:
                            if type(y) is not int or not -0x80000000 <= y < 0x80000000:
                                enc(x, d1)
                                break
                        else:
                            extend(_PACK_I32[n](0xDA, n, *x))
                    elif t0 is str and n == 2 and type(x[1]) is int and x in memo:
                        idx = memo[x]
                        extend(_REFS[idx] if idx < 256 else _pack_u32(0xCC, idx))
                    else:
                        enc(x, d1)
                else:
                    enc(x, d1)
        elif t is bool:
            append(_TRUE if v else _FALSE)
        elif t is dict:
            n = len(v)
            if n < 16:
                append(0xE0 | n)
            else:
                extend(_pack_u32(0xD0, n))
            if n:
                if depth >= MAX_DEPTH:
                    _too_deep()
                for k, x in v.items():
                    tk = type(k)
                    if tk is not int and tk is not str:
                        raise WireError(
                            f"dict key {_short_repr(k)} of type {_type_name(k)}: only int and str keys travel"
                        )
                    enc(k, depth + 1)
                    enc(x, depth + 1)
        elif t is list:
            n = len(v)
            if n < 16:
                append(0x90 | n)
            else:
                extend(_pack_u32(0xCF, n))
            if n:
                if depth >= MAX_DEPTH:
                    _too_deep()
                for x in v:
                    enc(x, depth + 1)
        elif t is float:
            extend(_pack_d(0xC8, v))
        elif t in _TENSOR_TYPES:
            extend(_tensor_record(v, data))
        elif t is torch.dtype:
            code = _DTYPE_CODES.get(v)
            if code is None:
                raise WireError(f"dtype {v} has no wire code; add it to _DTYPE_TABLE in ir/wire/codes.py")
            append(0xD3)
            append(code)
        elif t is torch.Size:
            n = len(v)
            if n and depth >= MAX_DEPTH:
                _too_deep()
            append(0xD1)
            if n < 16:
                append(0x80 | n)
            else:
                extend(_pack_u32(0xCE, n))
            for x in v:
                enc(int(x), depth + 1)
        elif t is slice:
            if depth >= MAX_DEPTH:
                _too_deep()
            append(0xD2)
            enc(v.start, depth + 1)
            enc(v.stop, depth + 1)
            enc(v.step, depth + 1)
        elif v is Ellipsis:
            append(_ELLIPSIS)
        elif t is torch.device:
            append(0xD4)
            enc(v.type, depth)
            enc(v.index, depth)
        elif t is torch.memory_format:
            append(0xD6)
            append(_FORMAT_CODES[v])
        elif t is torch.layout:
            append(0xD5)
            append(_LAYOUT_CODES[v])
        elif t is complex:
            extend(_pack_dd(0xC9, v.real, v.imag))
        elif t is bytes:
            extend(_pack_u32(0xCD, len(v)))
            extend(v)
        elif isinstance(v, (int, float, complex, str)) and not isinstance(v, bool):
            # numpy scalars, IntEnum, ...: travel as the plain Python value
            for base in (int, float, complex, str):
                if isinstance(v, base):
                    enc(base(v), depth)
                    return
        else:
            raise WireError(
                f"cannot encode a value of type {_type_name(v)} ({_short_repr(v)}); the wire format "
                f"carries None, bool, int, float, complex, str, bytes, tuple, list, dict, slice, "
                f"Ellipsis, torch dtypes/devices/layouts/memory formats/Sizes, tensors and the "
                f"classes of ir/instructions.py"
            )

    if kind == KIND_BATCH and type(obj) is tuple:
        obj = list(obj)
    write_calls = _write_calls
    try:
        if kind == KIND_BATCH and write_calls is not None:
            # enc's list branch, with runs of Calls written natively
            n = len(obj)
            if n < 16:
                append(0x90 | n)
            else:
                extend(_pack_u32(0xCF, n))
            write_ids = _write_ids
            i = 0
            while i < n:
                item = obj[i]
                t = type(item)
                if t is _CALL:
                    i = write_calls(body, obj, i, memo, _CALL, _CALL_PREFIX)
                    if i == n:
                        break
                    item = obj[i]
                elif t is _DELETE and write_ids is not None and write_ids(body, _DELETE_PREFIX, item.tids):
                    i += 1
                    continue
                enc(item, 1)
                i += 1
        else:
            enc(obj, 0)
    except RecursionError:
        _too_deep()
    body_len = len(body) - HEADER_SIZE
    if body_len > 0xFFFFFFFF:
        raise WireError(f"message body is {body_len} bytes; the limit is 4 GiB (send tensors, not lists)")
    data_len = sum(p.nbytes for p in data)
    _HEADER.pack_into(body, 0, MAGIC, VERSION, kind, body_len, data_len)
    return [body, *data]


def encode(obj) -> bytes:
    """One message (a list of instructions, a Reply, or any supported value) as bytes."""
    parts = encode_parts(obj)
    if len(parts) == 1:
        return bytes(parts[0])
    return b"".join(parts)


def _too_deep():
    raise WireError(f"value nests deeper than {MAX_DEPTH} levels")

