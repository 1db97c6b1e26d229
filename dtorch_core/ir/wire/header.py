"""The decoder's first step: a buffer as bytes, and its 16-byte header checked against it."""

from __future__ import annotations

from .codes import _HEADER, _KIND_NAMES, HEADER_SIZE, MAGIC, VERSION
from .errors import WireError, _type_name


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

