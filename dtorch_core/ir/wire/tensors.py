"""Tensors on the wire: a record in the body (dtype code, shape, byte count) and the raw bytes
in the data section. ``_tensor_record`` writes one (encoder side), ``_read_tensor`` reads one
(decoder side)."""

from __future__ import annotations

import ctypes
import struct

import torch

from .codes import MAX_NDIM, _DTYPE_BY_CODE, _DTYPE_CODES, _INT64_MAX, _TENSOR_DTYPES
from .errors import WireError

_unpack_u64 = struct.Struct("<Q").unpack_from


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


def _read_tensor(body: bytes, pos: int, blob: memoryview, data_pos: int, fail):
    """The tensor whose record (tag d8) is at ``pos`` of ``body`` and whose bytes are at
    ``data_pos`` of ``blob``: (tensor, position after the record, position after its bytes).

    ``fail(message, pos)`` raises the decoder's WireError.
    """
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
        return torch.empty(shape, dtype=dtype), p, data_pos
    storage = torch.UntypedStorage.from_buffer(blob[start : start + nbytes], dtype=torch.uint8)
    t = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    if dtype is torch.bool and int(t.view(torch.uint8).max()) > 1:
        fail("bool tensor holds bytes other than 0 and 1", pos)
    return t, p, data_pos
