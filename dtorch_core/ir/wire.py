"""The wire format: instruction batches and replies as bytes, without pickle.

Workers execute what arrives, so nothing here can build an object it does not know: the format
has a closed set of value types, and the decoder checks every length, count, code and size
against the bytes it was given before it allocates anything.

A message is ``header | body | data``:

- header (16 bytes, little endian): magic ``b"DW"``, format version (u8), message kind (u8;
  ``KIND_VALUE``, ``KIND_BATCH`` or ``KIND_REPLY``), body length (u32), data length (u64). The
  version stays at byte 2 in every future version, so any decoder can name both versions.
- body: one value in a msgpack-style tagged encoding (one tag byte, then a fixed layout);
  small ints, short tuples/lists/dicts/strings and the instruction classes have one-byte forms.
  Strings are interned per message: the second occurrence of a string is a 2-byte reference.
- data: the raw bytes of every tensor, in the order the tensors appear in the body. A tensor in
  the body is its dtype code, shape and byte count; its bytes are the next ``nbytes`` of data.

Tag bytes::

    00-7f  int 0..127              c0 None   c1 False   c2 True   c3 Ellipsis
    80-8f  tuple of 0..15 values   c4/c5/c6/c7 int8/16/32/64     c8 float64   c9 complex128
    90-9f  list of 0..15 values    ca str (u32 length)           cb/cc memo ref (u8/u32 index)
    a0-bf  str of 0..31 bytes      cd bytes (u32 length)         ce/cf/d0 tuple/list/dict (u32)
    e0-ef  dict of 0..15 entries   d1 torch.Size (a tuple follows)   d2 slice (3 values follow)
    f0-ff  object, class code 0-15 (u8 field count, fields follow); d9: class code u16 + u8 count
    d3 dtype (u8)  d4 device (str, int|None)  d5 layout (u8)  d6 memory format (u8)
    d8 tensor (u8 dtype, u8 ndim, ndim x u64 dims, u64 nbytes)
    da/db  tuple of int32/int64 (u8 count, then the ints)   dd memo tuple (u8 count, values)
    d7, dc, de, df reserved

Every string, and every tuple of str/int/None that starts with a str (a ``(file, line)``
source), is a memo entry: sent once per message, then named by its index (a memo ref). Tuples
of ints (tensor ids) are packed int32/int64 arrays.

Class, dtype, layout and memory-format codes live in the tables below. Codes are never reused
or renumbered: a new class or dtype takes the next free code. Changing the layout of anything
(including a field added to an instruction class) bumps ``VERSION``.

``encode(obj)`` / ``decode(data)`` handle one message. ``encode_parts(obj)`` gives the same
bytes as a list of buffers whose tensor parts alias the tensors' memory, so a transport can
write them (e.g. into shared memory) without joining them first. ``decode`` copies each tensor's
bytes once, into a tensor torch allocated, so the input buffer may be reused right after.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from typing import Any

import attrs
import torch

from ..errors import DTorchError
from . import instructions as _ins

__all__ = [
    "HEADER_SIZE",
    "KIND_BATCH",
    "KIND_REPLY",
    "KIND_VALUE",
    "MAGIC",
    "MAX_DEPTH",
    "VERSION",
    "WireError",
    "decode",
    "encode",
    "encode_parts",
    "message_kind",
]


class WireError(DTorchError):
    """A message could not be encoded (unsupported value) or decoded (malformed or foreign).

    A worker that gets one should report it and keep serving: the message is dropped whole.
    """


MAGIC = b"DW"
VERSION = 3  # 2: DefineProgram.fusable; 3: Collective/MergedAllReduce shapes and dtypes
KIND_VALUE = 0  # any supported value (control messages)
KIND_BATCH = 1  # a list of instructions
KIND_REPLY = 2  # a Reply
_KIND_NAMES = {KIND_VALUE: "value", KIND_BATCH: "batch", KIND_REPLY: "reply"}

MAX_DEPTH = 64  # nesting of containers and objects
MAX_NDIM = 64
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

_HEADER = struct.Struct("<2sBBIQ")
HEADER_SIZE = _HEADER.size  # 16

# ---------------------------------------------------------------------------------------------
# code tables (append only)
# ---------------------------------------------------------------------------------------------
_CLASS_TABLE = (
    (0, "Slot"),
    (1, "DefineMesh"),
    (2, "DefinePlan"),
    (3, "Call"),
    (4, "Collective"),
    (5, "Put"),
    (6, "Delete"),
    (7, "Fetch"),
    (8, "Stats"),
    (9, "Reply"),
    (10, "WorkerFailure"),
    (11, "DefineProgram"),
    (12, "RunProgram"),
    (13, "DropProgram"),
    (14, "MergedAllReduce"),
)

# Field types checked on decode come from each class's annotations; ``Any`` and unknown names
# are not checked.

_DTYPE_TABLE = (
    (1, "bool"),
    (2, "uint8"),
    (3, "int8"),
    (4, "int16"),
    (5, "int32"),
    (6, "int64"),
    (7, "float16"),
    (8, "bfloat16"),
    (9, "float32"),
    (10, "float64"),
    (11, "complex32"),
    (12, "complex64"),
    (13, "complex128"),
    (14, "uint16"),
    (15, "uint32"),
    (16, "uint64"),
    (17, "float8_e4m3fn"),
    (18, "float8_e5m2"),
    (19, "float8_e4m3fnuz"),
    (20, "float8_e5m2fnuz"),
    (21, "float8_e8m0fnu"),
    (22, "float4_e2m1fn_x2"),
    (23, "bits1x8"),
    (24, "bits2x4"),
    (25, "bits4x2"),
    (26, "bits8"),
    (27, "bits16"),
    (28, "int1"),
    (29, "int2"),
    (30, "int3"),
    (31, "int4"),
    (32, "int5"),
    (33, "int6"),
    (34, "int7"),
    (35, "uint1"),
    (36, "uint2"),
    (37, "uint3"),
    (38, "uint4"),
    (39, "uint5"),
    (40, "uint6"),
    (41, "uint7"),
    # quantized dtypes travel as values (an op's dtype= argument), never as tensor data: their
    # tensors carry quantizer parameters that raw bytes do not
    (64, "qint8"),
    (65, "quint8"),
    (66, "qint32"),
    (67, "quint4x2"),
    (68, "quint2x4"),
)
_LAYOUT_TABLE = (
    (0, "strided"),
    (1, "sparse_coo"),
    (2, "sparse_csr"),
    (3, "sparse_csc"),
    (4, "sparse_bsr"),
    (5, "sparse_bsc"),
    (6, "_mkldnn"),
    (7, "jagged"),
)
_MEMORY_FORMAT_TABLE = (
    (0, "contiguous_format"),
    (1, "preserve_format"),
    (2, "channels_last"),
    (3, "channels_last_3d"),
)


def _torch_table(table, kind):
    by_code, by_value = {}, {}
    for code, name in table:
        value = getattr(torch, name, None)
        if isinstance(value, kind) and value not in by_value:
            by_code[code] = value
            by_value[value] = code
    return by_code, by_value


_DTYPE_BY_CODE, _DTYPE_CODES = _torch_table(_DTYPE_TABLE, torch.dtype)
_LAYOUT_BY_CODE, _LAYOUT_CODES = _torch_table(_LAYOUT_TABLE, torch.layout)
_FORMAT_BY_CODE, _FORMAT_CODES = _torch_table(_MEMORY_FORMAT_TABLE, torch.memory_format)
# dtypes whose tensors can travel as raw bytes: a fixed itemsize and no quantizer
_TENSOR_DTYPES = {
    code: (d, d.itemsize) for code, d in _DTYPE_BY_CODE.items() if code < 64 and d.itemsize > 0
}


def _parse_annotation(cls, name: str, annotation) -> frozenset | None:
    """Allowed exact types of a field, or None when it is not checked."""
    text = annotation
    if not isinstance(text, str):
        text = getattr(text, "__name__", "Any")
    names = {
        "int": (int,),
        "bool": (bool,),
        "str": (str,),
        "float": (float,),
        "bytes": (bytes,),
        "tuple": (tuple, torch.Size),
        "dict": (dict,),
        "list": (list,),
        "None": (type(None),),
    }
    allowed: set = set()
    for part in text.split("|"):
        part = part.strip()
        if part in names:
            allowed.update(names[part])
        elif isinstance(getattr(_ins, part, None), type) and attrs.has(getattr(_ins, part)):
            allowed.add(getattr(_ins, part))
        else:
            return None  # Any, or something this table does not know: not checked
    return frozenset(allowed)


@attrs.frozen
class _ClassInfo:
    code: int
    cls: type
    names: tuple
    nfields: int
    get: Any  # operator.attrgetter of every field, in order
    prefix: bytes  # tag (+ code) + field count
    checks: tuple  # (field index, name, allowed types) for checked fields
    accepted: set  # tuples of field types already checked (a small, bounded cache)


def _class_infos():
    infos = {}
    for code, name in _CLASS_TABLE:
        cls = getattr(_ins, name)
        fields = attrs.fields(cls)
        names = tuple(f.name for f in fields)
        if code < 16:
            prefix = bytes((0xF0 | code, len(names)))
        else:
            prefix = struct.pack("<BHB", 0xD9, code, len(names))
        checks = []
        for i, f in enumerate(fields):
            allowed = _parse_annotation(cls, f.name, f.type)
            if allowed is not None:
                checks.append((i, f.name, allowed))
        get = operator.attrgetter(*names) if len(names) > 1 else (lambda o, n=names[0]: (getattr(o, n),))
        infos[cls] = _ClassInfo(code, cls, names, len(names), get, prefix, tuple(checks), set())
    return infos


_CLASSES = _class_infos()
_CLASS_BY_CODE = {info.code: info for info in _CLASSES.values()}
# what a batch may contain: every instruction class (not the reply-side ones or Slot)
_INSTRUCTION_TYPES = frozenset(c for c in _CLASSES if c not in (_ins.Slot, _ins.Reply, _ins.WorkerFailure))

# ---------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------
_pack_b = struct.Struct("<Bb").pack
_pack_h = struct.Struct("<Bh").pack
_pack_i = struct.Struct("<Bi").pack
_pack_q = struct.Struct("<Bq").pack
_pack_d = struct.Struct("<Bd").pack
_pack_dd = struct.Struct("<Bdd").pack
_pack_u32 = struct.Struct("<BI").pack
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NONE, _FALSE, _TRUE, _ELLIPSIS = 0xC0, 0xC1, 0xC2, 0xC3
_FLAT_TYPES = frozenset({str, int, type(None)})  # memoised tuples: equality never mixes types
_REFS = [bytes((0xCB, i)) for i in range(256)]
# tuples of 1..255 ints (tensor ids): one struct call each way
_PACK_I32 = [struct.Struct(f"<BB{n}i").pack for n in range(256)]
_PACK_I64 = [struct.Struct(f"<BB{n}q").pack for n in range(256)]


def _kind_of(obj) -> int:
    if type(obj) is _ins.Reply:
        return KIND_REPLY
    if type(obj) in (list, tuple) and all(type(i) in _INSTRUCTION_TYPES for i in obj):
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
                raise WireError(f"dtype {v} has no wire code; add it to _DTYPE_TABLE in ir/wire.py")
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
    try:
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


def _type_name(v) -> str:
    t = type(v)
    if t.__module__ == "builtins" or t in _CLASSES:
        return t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(v) -> str:
    if isinstance(v, torch.Tensor):  # a subclass's repr may read data (a DTensor would sync)
        return f"<{type(v).__name__} of {v.dtype}>"
    try:
        r = repr(v)
    except Exception:
        r = "<unrepresentable>"
    return r if len(r) <= 80 else r[:77] + "..."


def _tensor_record(v: torch.Tensor, data: list) -> bytes:
    if v.layout != torch.strided or v.is_quantized or v.is_nested or v.is_meta:
        raise WireError(
            f"cannot encode a {v.layout} {'quantized ' if v.is_quantized else ''}tensor of {v.dtype} on "
            f"{v.device}: only dense (strided) tensors with data travel"
        )
    code = _DTYPE_CODES.get(v.dtype)
    if code not in _TENSOR_DTYPES:
        raise WireError(f"tensors of dtype {v.dtype} cannot travel as raw bytes")
    x = v.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    if not x.is_contiguous():
        x = x.contiguous()
    shape = x.shape
    if len(shape) > MAX_NDIM:
        raise WireError(f"tensor has {len(shape)} dims; the wire format carries at most {MAX_NDIM}")
    nbytes = x.numel() * x.element_size()
    if nbytes:
        # A view of the tensor's memory. Not ``.numpy()``: that marks the storage unresizable
        # for good, and a worker's stored tensor may later be an ``out=`` that must resize.
        buf = (ctypes.c_char * nbytes).from_address(x.data_ptr())
        buf.keep = x  # the memory lives as long as the buffer
        data.append(memoryview(buf).cast("B").toreadonly())
    return struct.pack(f"<BBB{len(shape)}QQ", 0xD8, code, len(shape), *shape, nbytes)


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
_unpack_b = struct.Struct("<b").unpack_from
_unpack_h = struct.Struct("<h").unpack_from
_unpack_i = struct.Struct("<i").unpack_from
_unpack_q = struct.Struct("<q").unpack_from
_unpack_d = struct.Struct("<d").unpack_from
_unpack_dd = struct.Struct("<dd").unpack_from
_unpack_u16 = struct.Struct("<H").unpack_from
_unpack_u32 = struct.Struct("<I").unpack_from
_unpack_u64 = struct.Struct("<Q").unpack_from
_UNPACK_I32 = [struct.Struct(f"<{n}i").unpack_from for n in range(256)]
_UNPACK_I64 = [struct.Struct(f"<{n}q").unpack_from for n in range(256)]


def _read_header(mv: memoryview) -> tuple:
    size = len(mv)
    if size < 3:
        raise WireError(f"message of {size} bytes is shorter than the {HEADER_SIZE}-byte header")
    if bytes(mv[:2]) != MAGIC:
        raise WireError(f"not a dtorch wire message: magic {bytes(mv[:2])!r} at offset 0, expected {MAGIC!r}")
    version = mv[2]
    if version != VERSION:
        raise WireError(
            f"wire format version {version} in the message, but this decoder reads version {VERSION}: "
            f"the controller and the workers must run the same dtorch version"
        )
    if size < HEADER_SIZE:
        raise WireError(f"message of {size} bytes is shorter than the {HEADER_SIZE}-byte header")
    _, _, kind, body_len, data_len = _HEADER.unpack_from(mv, 0)
    if kind not in _KIND_NAMES:
        raise WireError(f"unknown message kind {kind} at offset 3")
    expected = HEADER_SIZE + body_len + data_len
    if expected > size:
        raise WireError(
            f"message truncated: the header (offset 4) declares {body_len} body + {data_len} data bytes, "
            f"{expected} bytes in all, but the message has {size}"
        )
    if expected < size:
        raise WireError(f"{size - expected} bytes of trailing garbage after the message end at offset {expected}")
    if not body_len:
        raise WireError(f"empty body at offset {HEADER_SIZE}: a message holds one value")
    return kind, body_len, data_len


def message_kind(data) -> int:
    """The kind of a message (``KIND_*``), after checking its header; the body is not read."""
    return _read_header(_byte_view(data))[0]


def _byte_view(data) -> memoryview:
    try:
        mv = memoryview(data)
        if mv.ndim != 1 or mv.itemsize != 1 or mv.format != "B":
            mv = mv.cast("B")
    except (TypeError, ValueError) as exc:
        raise WireError(f"cannot decode a {_type_name(data)}: {exc}") from None
    return mv


def decode(data: bytes | bytearray | memoryview):
    """The value that ``encode`` turned into ``data``; WireError on anything malformed.

    Each tensor's bytes are copied once, into a tensor torch allocated, so ``data`` may be
    reused as soon as this returns.
    """
    mv = _byte_view(data)
    kind, body_len, _ = _read_header(mv)
    body = bytes(mv[HEADER_SIZE : HEADER_SIZE + body_len])
    try:
        value = _decode_body(body, mv[HEADER_SIZE + body_len :])
    except WireError:
        raise
    except RecursionError:
        raise WireError(f"value nests too deeply to decode (the limit is {MAX_DEPTH} levels)") from None
    except Exception as exc:  # a gap in the checks: still reject the message, never crash the worker
        raise WireError(f"malformed message (internal decoder error {type(exc).__name__}: {exc})") from exc
    if kind == KIND_BATCH:
        if type(value) is not list:
            raise WireError(f"a batch message holds a {_type_name(value)}, expected a list of instructions")
        for i, ins in enumerate(value):
            if type(ins) not in _INSTRUCTION_TYPES:
                raise WireError(f"batch item {i} is a {_type_name(ins)}, not an instruction")
    elif kind == KIND_REPLY and type(value) is not _ins.Reply:
        raise WireError(f"a reply message holds a {_type_name(value)}, expected a Reply")
    return value


def _decode_body(body: bytes, blob: memoryview):
    """The one value in ``body``; tensor bytes come from ``blob`` in order."""
    end = len(body)
    memo: list = []  # strings and flat tuples, in the order they were defined
    data_pos = 0
    classes = _CLASS_BY_CODE
    unpack_h = _unpack_h
    unpack_i = _unpack_i

    def fail(msg, pos):
        raise WireError(f"{msg} at offset {HEADER_SIZE + pos}")

    def truncated(pos):
        if pos >= end:
            fail(f"the body ends early (a value expected; the body has {end} bytes)", pos)
        fail(f"value (tag 0x{body[pos]:02x}) runs past the end of the body ({end} bytes)", pos)

    # ``items`` and the object branch of ``dec`` read small ints, int16/32, id tuples, references
    # and None inline: one call per container instead of one per value keeps decoding near
    # pickle's speed.
    def items(p, n, depth, what, pos):
        """``n`` values from ``p``, as a list."""
        if n > end - p:  # every value takes a byte at least: a larger count is a lie
            fail(f"{what} of {n} values runs past the end of the body ({end - p} bytes left)", pos)
        if n and depth >= MAX_DEPTH:
            fail(f"{what} nests deeper than {MAX_DEPTH} levels", pos)
        out = []
        add = out.append
        d1 = depth + 1
        for _ in range(n):
            b = body[p]
            if b < 0x80:
                add(b)
                p += 1
            elif b == 0xC5:
                add(unpack_h(body, p + 1)[0])
                p += 3
            elif b == 0xCB:
                i = body[p + 1]
                if i >= len(memo):
                    fail(f"reference to memo entry {i}, but only {len(memo)} are defined", p)
                add(memo[i])
                p += 2
            elif b == 0xC0:
                add(None)
                p += 1
            elif b == 0xC6:
                add(unpack_i(body, p + 1)[0])
                p += 5
            elif b == 0xDA:
                k = body[p + 1]
                add(_UNPACK_I32[k](body, p + 2))
                p += 2 + 4 * k
            else:
                v, p = dec(p, d1)
                add(v)
        return out, p

    def dec(pos, depth):
        try:
            b = body[pos]
            if b < 0x80:
                return b, pos + 1
            if b < 0x90:  # short tuple
                n = b & 0x0F
                p = pos + 1
                chunk = body[p : p + n]
                if chunk.isascii() and len(chunk) == n:  # small ints only
                    return tuple(chunk), p + n
                out, p = items(p, n, depth, "tuple", pos)
                return tuple(out), p
            if b == 0xCB:
                i = body[pos + 1]
                if i >= len(memo):
                    fail(f"reference to memo entry {i}, but only {len(memo)} are defined", pos)
                return memo[i], pos + 2
            if b == 0xC0:
                return None, pos + 1
            if b == 0xC5:
                return unpack_h(body, pos + 1)[0], pos + 3
            if b == 0xDA:
                n = body[pos + 1]
                return _UNPACK_I32[n](body, pos + 2), pos + 2 + 4 * n
            if b >= 0xF0:
                code = b & 0x0F
                count = body[pos + 1]
                p = pos + 2
            elif b == 0xD9:
                code = _unpack_u16(body, pos + 1)[0]
                count = body[pos + 3]
                p = pos + 4
            else:
                return other(b, pos, depth)
            # an object: class code, field count, fields
            info = classes.get(code)
            if info is None:
                fail(f"unknown class code {code}", pos)
            if count != info.nfields:
                fail(f"{info.cls.__name__} with {count} fields, expected {info.nfields}", pos)
            if depth >= MAX_DEPTH:
                fail(f"{info.cls.__name__} nests deeper than {MAX_DEPTH} levels", pos)
            if count > end - p:
                fail(f"{info.cls.__name__} of {count} fields runs past the end of the body", pos)
            values = []
            add = values.append
            d1 = depth + 1
            for _ in range(count):
                b = body[p]
                if b < 0x80:
                    add(b)
                    p += 1
                elif b == 0xC0:
                    add(None)
                    p += 1
                elif b == 0xDA:  # tensor ids
                    k = body[p + 1]
                    add(_UNPACK_I32[k](body, p + 2))
                    p += 2 + 4 * k
                elif b == 0xCB:
                    i = body[p + 1]
                    if i >= len(memo):
                        fail(f"reference to memo entry {i}, but only {len(memo)} are defined", p)
                    add(memo[i])
                    p += 2
                elif b == 0xC5:
                    add(unpack_h(body, p + 1)[0])
                    p += 3
                elif b == 0xC6:
                    add(unpack_i(body, p + 1)[0])
                    p += 5
                else:
                    v, p = dec(p, d1)
                    add(v)
            types = tuple(map(type, values))
            if types not in info.accepted:
                check_fields(info, values, pos)
                info.accepted.add(types)
            return info.cls(*values), p
        except (IndexError, struct.error):
            truncated(pos)

    def check_fields(info, values, pos):
        for i, name, allowed in info.checks:
            if type(values[i]) not in allowed:
                fail(f"{info.cls.__name__}.{name} is a {_type_name(values[i])}", pos)

    def other(b, pos, depth):
        """Every tag but the hot ones in ``dec``."""
        try:
            if b < 0xA0:
                return items(pos + 1, b & 0x0F, depth, "list", pos)
            if b < 0xC0:
                return new_str(pos + 1, b & 0x1F)
            if b >= 0xE0:
                return mapping(pos + 1, b & 0x0F, depth, pos)
            if b == 0xDD:  # a flat tuple that later references may name
                out, p = items(pos + 2, body[pos + 1], depth, "tuple", pos)
                for x in out:
                    if type(x) not in _FLAT_TYPES:
                        fail(f"memo tuple holds a {_type_name(x)}", pos)
                out = tuple(out)
                memo.append(out)
                return out, p
            if b == 0xC6:
                return unpack_i(body, pos + 1)[0], pos + 5
            if b == 0xDB:
                n = body[pos + 1]
                return _UNPACK_I64[n](body, pos + 2), pos + 2 + 8 * n
            if b == 0xC4:
                return _unpack_b(body, pos + 1)[0], pos + 2
            if b == 0xC7:
                return _unpack_q(body, pos + 1)[0], pos + 9
            if b == 0xC1:
                return False, pos + 1
            if b == 0xC2:
                return True, pos + 1
            if b == 0xC8:
                return _unpack_d(body, pos + 1)[0], pos + 9
            if b == 0xC3:
                return Ellipsis, pos + 1
            if b == 0xD3:
                code = body[pos + 1]
                d = _DTYPE_BY_CODE.get(code)
                if d is None:
                    fail(f"unknown dtype code {code}", pos + 1)
                return d, pos + 2
            if b == 0xD8:
                return tensor(pos)
            if b == 0xCC:
                i = _unpack_u32(body, pos + 1)[0]
                if i >= len(memo):
                    fail(f"reference to memo entry {i}, but only {len(memo)} are defined", pos)
                return memo[i], pos + 5
            if b == 0xCA:
                return new_str(pos + 5, _unpack_u32(body, pos + 1)[0])
            if b == 0xCE:
                out, p = items(pos + 5, _unpack_u32(body, pos + 1)[0], depth, "tuple", pos)
                return tuple(out), p
            if b == 0xCF:
                return items(pos + 5, _unpack_u32(body, pos + 1)[0], depth, "list", pos)
            if b == 0xD0:
                return mapping(pos + 5, _unpack_u32(body, pos + 1)[0], depth, pos)
            if b == 0xC9:
                re, im = _unpack_dd(body, pos + 1)
                return complex(re, im), pos + 17
            if b == 0xCD:
                n = _unpack_u32(body, pos + 1)[0]
                if n > end - pos - 5:
                    fail(f"bytes of length {n} run past the end of the body ({end - pos - 5} bytes left)", pos)
                return body[pos + 5 : pos + 5 + n], pos + 5 + n
            if b == 0xD1:
                t = body[pos + 1]
                if t & 0xF0 == 0x80:
                    dims, p = items(pos + 2, t & 0x0F, depth, "torch.Size", pos)
                elif t == 0xCE:
                    dims, p = items(pos + 6, _unpack_u32(body, pos + 2)[0], depth, "torch.Size", pos)
                else:
                    fail("torch.Size not followed by a tuple", pos + 1)
                for d in dims:
                    if type(d) is not int:
                        fail(f"torch.Size holds a {_type_name(d)}", pos)
                return torch.Size(dims), p
            if b == 0xD2:
                if depth >= MAX_DEPTH:
                    fail(f"slice nests deeper than {MAX_DEPTH} levels", pos)
                start, p = dec(pos + 1, depth + 1)
                stop, p = dec(p, depth + 1)
                step, p = dec(p, depth + 1)
                return slice(start, stop, step), p
            if b == 0xD4:
                return device(pos, depth)
            if b == 0xD5:
                code = body[pos + 1]
                if code not in _LAYOUT_BY_CODE:
                    fail(f"unknown layout code {code}", pos + 1)
                return _LAYOUT_BY_CODE[code], pos + 2
            if b == 0xD6:
                code = body[pos + 1]
                if code not in _FORMAT_BY_CODE:
                    fail(f"unknown memory format code {code}", pos + 1)
                return _FORMAT_BY_CODE[code], pos + 2
            fail(f"unknown type tag 0x{b:02x}", pos)
        except (IndexError, struct.error):
            truncated(pos)

    def new_str(p, n):
        if n > end - p:
            fail(f"string of {n} bytes runs past the end of the body ({end - p} bytes left)", p)
        try:
            s = body[p : p + n].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            fail(f"invalid UTF-8 in a string ({exc.reason})", p + exc.start)
        memo.append(s)
        return s, p + n

    def mapping(p, n, depth, pos):
        if 2 * n > end - p:
            fail(f"dict of {n} entries runs past the end of the body ({end - p} bytes left)", pos)
        if n and depth >= MAX_DEPTH:
            fail(f"dict nests deeper than {MAX_DEPTH} levels", pos)
        out = {}
        for _ in range(n):
            kpos = p
            k, p = dec(p, depth + 1)
            tk = type(k)
            if tk is not int and tk is not str:
                fail(f"dict key of type {_type_name(k)}; keys are int or str", kpos)
            if k in out:
                fail(f"duplicate dict key {_short_repr(k)}", kpos)
            out[k], p = dec(p, depth + 1)
        return out, p

    def device(pos, depth):
        kind, p = dec(pos + 1, depth)
        index, p = dec(p, depth)
        if type(kind) is not str or (index is not None and type(index) is not int):
            fail(f"device of ({_type_name(kind)}, {_type_name(index)}), expected (str, int | None)", pos)
        try:
            return (torch.device(kind) if index is None else torch.device(kind, index)), p
        except Exception as exc:
            fail(f"invalid device {_short_repr(kind)}, {index!r}: {exc}", pos)

    def tensor(pos):
        nonlocal data_pos
        code = body[pos + 1]
        ndim = body[pos + 2]
        spec = _TENSOR_DTYPES.get(code)
        if spec is None:
            if code in _DTYPE_BY_CODE:
                fail(f"tensor of dtype {_DTYPE_BY_CODE[code]}, which cannot travel as raw bytes", pos + 1)
            fail(f"tensor of unknown dtype code {code}", pos + 1)
        if ndim > MAX_NDIM:
            fail(f"tensor with {ndim} dims (at most {MAX_NDIM})", pos + 2)
        p = pos + 3
        shape = struct.unpack_from(f"<{ndim}Q", body, p)
        p += 8 * ndim
        nbytes = _unpack_u64(body, p)[0]
        p += 8
        dtype, itemsize = spec
        numel = 1
        extent = 1
        for d in shape:
            numel *= d
            extent *= max(d, 1)
        if extent > _INT64_MAX:  # also bounds every dim: strides must fit in int64
            fail(f"tensor shape {shape} does not fit in int64 strides", pos + 3)
        if numel * itemsize != nbytes:
            fail(
                f"tensor of shape {shape} and dtype {dtype} has {numel * itemsize} bytes, "
                f"but its record says {nbytes}",
                pos,
            )
        left = len(blob) - data_pos
        if nbytes > left:
            fail(f"tensor of {nbytes} bytes runs past the end of the data section ({left} bytes left)", pos)
        start = data_pos
        data_pos += nbytes
        # The one copy, into memory torch allocated: the tensor is aligned, resizable (out= ops
        # may resize it) and independent of the transport's buffer.
        if not nbytes:
            return torch.empty(shape, dtype=dtype), p
        storage = torch.UntypedStorage.from_buffer(blob[start : start + nbytes], dtype=torch.uint8)
        t = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
        if dtype is torch.bool and int(t.view(torch.uint8).max()) > 1:
            fail("bool tensor holds bytes other than 0 and 1", pos)
        return t, p

    value, pos = dec(0, 0)
    if pos != end:
        fail(f"{end - pos} bytes of trailing garbage after the value", pos)
    if data_pos != len(blob):
        raise WireError(
            f"{len(blob) - data_pos} bytes of tensor data at offset {HEADER_SIZE + end + data_pos} "
            f"belong to no tensor"
        )
    return value
