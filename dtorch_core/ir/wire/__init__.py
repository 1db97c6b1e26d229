"""The wire format: instruction batches and replies as bytes, without pickle.

Workers execute what arrives, so nothing here can build an object it does not know: a closed
set of value types, and a decoder that checks every length, count, code and size against the
bytes it was given before it allocates anything. The format itself (framing, header, type
tags, tensors, instructions, versioning) is specified in docs/wire-format.md.

``encode(obj)`` / ``decode(data)`` handle one message; ``encode_parts(obj)`` gives the same
bytes as a list of buffers whose tensor parts alias the tensors' memory.

Modules: ``codes`` (version, kinds, limits, code tables), ``errors`` (WireError), ``encode``,
``tensors`` (a tensor's record and bytes, both ways), ``header`` (reading the header) and
``decode``. Imports go one way: codes <- errors <- {tensors, header} <- {encode, decode}, and
encode and decode never import each other.
"""

from __future__ import annotations

# The functions ``encode`` and ``decode`` shadow the submodules of the same name here, as the
# names importers use: ``wire.encode(...)``, ``from dtorch_core.ir.wire import decode``.
from .codes import (  # noqa: F401  (the private tables are what tests check the format against)
    _CLASSES,
    _DTYPE_CODES,
    _DTYPE_TABLE,
    _FORMAT_CODES,
    _KIND_NAMES,
    _LAYOUT_CODES,
    _TENSOR_DTYPES,
    HEADER_SIZE,
    KIND_BATCH,
    KIND_REPLY,
    KIND_VALUE,
    MAGIC,
    MAX_DEPTH,
    MAX_NDIM,
    VERSION,
)
from .errors import WireError
from .encode import _kind_of, encode, encode_parts  # noqa: F401
from .header import message_kind
from .decode import decode

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
