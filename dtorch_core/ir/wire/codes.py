"""The wire format's constants: version, message kinds, limits, and the append-only code tables
(classes, dtypes, layouts, memory formats) with the lookups built from them.

See docs/wire-format.md. Codes are never reused or renumbered; changing the layout of anything
(including a field added to an instruction class) bumps ``VERSION``.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

import attrs
import torch

from .. import instructions as _ins

MAGIC = b"DW"
VERSION = 7  # 2: DefineProgram.fusable; 3: Collective/MergedAllReduce shapes and dtypes; 4: Collective.offset;
# 5: DefineProgram.constants and Constant; 6: Collective.consume; 7: Call.numbers, Number, DropPlans
KIND_VALUE = 0  # any supported value (control messages)
KIND_BATCH = 1  # a list of instructions
KIND_REPLY = 2  # a Reply
_KIND_NAMES = {KIND_VALUE: "value", KIND_BATCH: "batch", KIND_REPLY: "reply"}

MAX_DEPTH = 64  # nesting of containers and objects
# The decoder makes at most one container (list, non-empty tuple, dict, object, string, bytes,
# slice, device, Size) per CONTAINER_BYTES bytes of body, plus CONTAINER_ALLOWANCE: a message
# cannot inflate into more than a small multiple of its size (an empty list is one byte on the
# wire and ~70 in memory). The encoder never writes denser messages than real batches need.
CONTAINER_BYTES = 4
CONTAINER_ALLOWANCE = 4096
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
    (15, "Constant"),
    (16, "Number"),
    (17, "DropPlans"),
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

# what a memo tuple (tag dd) may hold: equality never mixes types
_FLAT_TYPES = frozenset({str, int, type(None)})


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
_INSTRUCTION_TYPES = frozenset(c for c in _CLASSES if c not in (_ins.Slot, _ins.Number, _ins.Reply, _ins.WorkerFailure))
