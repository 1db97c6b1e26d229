"""The decoder: one message back into its value, checking every length, count, code and size
against the bytes it was given before it allocates anything (see docs/wire-format.md)."""

from __future__ import annotations

import collections
import itertools
import os
import struct

import attrs
import torch

from .. import instructions as _ins
from .codes import (
    _CLASS_BY_CODE,
    _CLASSES,
    _DTYPE_BY_CODE,
    _FLAT_TYPES,
    _FORMAT_BY_CODE,
    _INSTRUCTION_TYPES,
    _LAYOUT_BY_CODE,
    CONTAINER_ALLOWANCE,
    CONTAINER_BYTES,
    HEADER_SIZE,
    KIND_BATCH,
    KIND_REPLY,
    MAX_DEPTH,
    VERSION,
)
from .errors import WireError, _short_repr, _type_name
from .header import _byte_view, _read_header
from .tensors import _read_tensor

_unpack_b = struct.Struct("<b").unpack_from
_unpack_h = struct.Struct("<h").unpack_from
_unpack_i = struct.Struct("<i").unpack_from
_unpack_q = struct.Struct("<q").unpack_from
_unpack_d = struct.Struct("<d").unpack_from
_unpack_dd = struct.Struct("<dd").unpack_from
_unpack_u16 = struct.Struct("<H").unpack_from
_unpack_u32 = struct.Struct("<I").unpack_from
_UNPACK_I32 = [struct.Struct(f"<{n}i").unpack_from for n in range(256)]
_UNPACK_I64 = [struct.Struct(f"<{n}q").unpack_from for n in range(256)]
_CALL_TAG = 0xF0 | _CLASSES[_ins.Call].code  # the one-byte object tag of a Call


def _native_call_reader():
    """``dtorch_core._workerpath.read_calls`` (runs of Call records in C++, docs/wire-format.md), or
    None: not built, or turned off with the rest of the worker's native path (DTORCH_NATIVE_WORKER=0)."""
    if os.environ.get("DTORCH_NATIVE_WORKER", "1") == "0":
        return None
    try:
        from ... import _workerpath
    except ImportError:
        return None
    _workerpath.configure_calls(_ins.Call)
    return _workerpath.read_calls


# It reads only well-formed Calls in the encoder's forms and stops at anything else, leaving the
# memo and the container allowance as they were at that record: the Python code below then
# decodes (or rejects) it, so results and errors do not depend on it.
_read_calls = _native_call_reader()


# The objects a step's messages hold besides Calls, with their fields' kinds for the C++ reader:
# "i" an int, "T" a tuple of ints (tensor ids, ranks), "b" a bool, "n" None. The Reply is read
# only as a reply message, and only without a value or an error (a sync point's answer).
_FLAT_RECORDS = {
    _ins.Delete: "T",
    _ins.Stats: "ib",
    _ins.Fetch: "iiTb",
    _ins.RunProgram: "iTTii",
    _ins.Reply: "iinn",
}


def _native_message_reader():
    """``dtorch_core._workerpath.read_message`` (a whole batch of Calls and the instructions of
    ``_FLAT_RECORDS``, or a bare Reply, in C++), configured; the caller checks that the extension
    is to be used."""
    from ... import _workerpath

    _workerpath.configure_calls(_ins.Call)
    records = [(cls, _CLASSES[cls].code, kinds, tuple(f.name for f in attrs.fields(cls)))
               for cls, kinds in _FLAT_RECORDS.items()]
    _workerpath.configure_messages(VERSION, KIND_BATCH, KIND_REPLY, _CLASSES[_ins.Reply].code, CONTAINER_BYTES,
                                   CONTAINER_ALLOWANCE, records)
    return _workerpath.read_message


# A step's frames are Calls, the Deletes of what the controller dropped and a sync point's
# request (or a replay's RunProgram), and the sync's answer a bare Reply: read whole in C++, with
# no Python between the header and the value. A frame's decoding is mostly cache misses after
# the batch before it ran its kernels (bench/RESULTS.md, 2026-12-07), and a reply reaches a
# thread that slept: the fewer Python objects and frames they touch, the less they wait.
# Anything else (or anything malformed) returns None and is read below, which raises every error.
_read_message = _native_message_reader() if _read_calls is not None else None


def _consume(iterator, n: int) -> None:
    """Skip ``n`` items of ``iterator`` (at C speed)."""
    collections.deque(itertools.islice(iterator, n), maxlen=0)


def decode(data: bytes | bytearray | memoryview):
    """The value that ``encode`` turned into ``data``; WireError on anything malformed.

    Each tensor's bytes are copied once, into a tensor torch allocated, so ``data`` may be
    reused as soon as this returns.
    """
    if _read_message is not None:
        value = _read_message(data)
        if value is not None:
            return value
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
    # containers still allowed (see CONTAINER_BYTES): a message of empty lists cannot inflate
    room = end // CONTAINER_BYTES + CONTAINER_ALLOWANCE
    classes = _CLASS_BY_CODE
    unpack_h = _unpack_h
    unpack_i = _unpack_i

    def fail(msg, pos):
        raise WireError(f"{msg} at offset {HEADER_SIZE + pos}")

    def too_many(pos):
        fail(
            f"the message decodes to more than {end // CONTAINER_BYTES + CONTAINER_ALLOWANCE} containers "
            f"(at most one per {CONTAINER_BYTES} body bytes plus {CONTAINER_ALLOWANCE}; the body has {end} "
            f"bytes): it would inflate in memory, so it is refused",
            pos,
        )

    def truncated(pos):
        if pos >= end:
            fail(f"the body ends early (a value expected; the body has {end} bytes)", pos)
        fail(f"value (tag 0x{body[pos]:02x}) runs past the end of the body ({end} bytes)", pos)

    # ``items`` and the object branch of ``dec`` read small ints, int16/32, id tuples, references
    # and None inline: one call per container instead of one per value keeps decoding near
    # pickle's speed.
    def items(p, n, depth, what, pos):
        """``n`` values from ``p``, as a list."""
        nonlocal room
        if n > end - p:  # every value takes a byte at least: a larger count is a lie
            fail(f"{what} of {n} values runs past the end of the body ({end - p} bytes left)", pos)
        if n and depth >= MAX_DEPTH:
            fail(f"{what} nests deeper than {MAX_DEPTH} levels", pos)
        room -= 1
        if room < 0:
            too_many(pos)
        out = []
        add = out.append
        d1 = depth + 1
        if d1 >= MAX_DEPTH:  # the values are at the deepest level: dec checks each one
            for _ in range(n):
                v, p = dec(p, d1)
                add(v)
            return out, p
        todo = iter(range(n))
        for _ in todo:
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
            elif b == _CALL_TAG and _read_calls is not None and d1 + 3 < MAX_DEPTH:
                p, room, k = _read_calls(body, p, n - len(out), memo, room, out)
                if k:
                    _consume(todo, k - 1)  # this one and k - 1 more values are read
                else:
                    v, p = dec(p, d1)
                    add(v)
            else:
                v, p = dec(p, d1)
                add(v)
        return out, p

    def dec(pos, depth):
        nonlocal room
        try:
            b = body[pos]
            if b < 0x80:
                return b, pos + 1
            if b < 0x90:  # short tuple
                n = b & 0x0F
                if not n:
                    return (), pos + 1
                p = pos + 1
                chunk = body[p : p + n]
                if chunk.isascii() and len(chunk) == n and depth < MAX_DEPTH:  # small ints only
                    room -= 1
                    if room < 0:
                        too_many(pos)
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
                if n and depth >= MAX_DEPTH:
                    fail(f"tuple nests deeper than {MAX_DEPTH} levels", pos)
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
            if code:  # a Slot (3 bytes) is not counted: its inflation is bounded by its size
                room -= 1
                if room < 0:
                    too_many(pos)
            values = []
            add = values.append
            d1 = depth + 1
            for _ in range(count if d1 < MAX_DEPTH else 0):
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
            if d1 >= MAX_DEPTH:  # the fields are at the deepest level: dec checks each one
                for _ in range(count):
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
        nonlocal data_pos, room
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
                if n and depth >= MAX_DEPTH:
                    fail(f"tuple nests deeper than {MAX_DEPTH} levels", pos)
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
            if b == 0xD8:  # a tensor record: its bytes are the next ones of the data section
                room -= 1
                if room < 0:
                    too_many(pos)
                t, p, data_pos = _read_tensor(body, pos, blob, data_pos, fail)
                return t, p
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
                room -= 1
                if room < 0:
                    too_many(pos)
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
                room -= 1
                if room < 0:
                    too_many(pos)
                start, p = dec(pos + 1, depth + 1)
                stop, p = dec(p, depth + 1)
                step, p = dec(p, depth + 1)
                return slice(start, stop, step), p
            if b == 0xD4:
                room -= 1
                if room < 0:
                    too_many(pos)
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
        nonlocal room
        if n > end - p:
            fail(f"string of {n} bytes runs past the end of the body ({end - p} bytes left)", p)
        room -= 1
        if room < 0:
            too_many(p)
        try:
            s = body[p : p + n].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            fail(f"invalid UTF-8 in a string ({exc.reason})", p + exc.start)
        memo.append(s)
        return s, p + n

    def mapping(p, n, depth, pos):
        nonlocal room
        if 2 * n > end - p:
            fail(f"dict of {n} entries runs past the end of the body ({end - p} bytes left)", pos)
        if n and depth >= MAX_DEPTH:
            fail(f"dict nests deeper than {MAX_DEPTH} levels", pos)
        room -= 1
        if room < 0:
            too_many(pos)
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

    value, pos = dec(0, 0)
    if pos != end:
        fail(f"{end - pos} bytes of trailing garbage after the value", pos)
    if data_pos != len(blob):
        raise WireError(
            f"{len(blob) - data_pos} bytes of tensor data at offset {HEADER_SIZE + end + data_pos} "
            f"belong to no tensor"
        )
    return value
