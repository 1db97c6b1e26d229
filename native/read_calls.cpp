// dtorch_core._workerpath.read_calls: the wire decoder's reader of runs of Call records
// (dtorch_core/ir/wire/decode.py, docs/wire-format.md), in C++.
//
// It reads only Calls in the forms the encoder writes — `f3 06`, an int plan id, tensor-id tuples
// packed (`da`/`db`) or empty, a source that is None, a memo reference or a new memo tuple of
// str/int/None, a seed that is None or an int, numbers that are a tuple of floats — and stops at
// the first byte it does not read that way. The Python decoder then goes on from the start of that
// record, so every WireError (and its offset) is the Python decoder's own; the memo and the
// container allowance ("room") are left as they were at that record's start.
#include <Python.h>

#include <cstdint>
#include <cstring>

#include "ref.h"
#include "workerpath.h"

namespace {

struct Reader {
    const unsigned char *body;
    Py_ssize_t end;
    Py_ssize_t p;
    PyObject *memo;  // list
    Py_ssize_t room;

    bool has(Py_ssize_t n) const { return n >= 0 && p + n <= end; }

    // an int in any of its forms; nullptr (no error set) when the bytes are not an int
    PyObject *read_int() {
        if (!has(1)) return nullptr;
        unsigned char b = body[p];
        long long v;
        if (b < 0x80) {
            v = b; p += 1;
        } else if (b == 0xC4 && has(2)) {
            v = (signed char)body[p + 1]; p += 2;
        } else if (b == 0xC5 && has(3)) {
            int16_t x; memcpy(&x, body + p + 1, 2); v = x; p += 3;
        } else if (b == 0xC6 && has(5)) {
            int32_t x; memcpy(&x, body + p + 1, 4); v = x; p += 5;
        } else if (b == 0xC7 && has(9)) {
            int64_t x; memcpy(&x, body + p + 1, 8); v = x; p += 9;
        } else {
            return nullptr;
        }
        return PyLong_FromLongLong(v);
    }

    // a tuple of tensor ids: `80` (empty), `da` (int32) or `db` (int64)
    PyObject *read_ids() {
        if (!has(1)) return nullptr;
        unsigned char b = body[p];
        if (b == 0x80) {
            p += 1;
            return PyTuple_New(0);
        }
        if ((b != 0xDA && b != 0xDB) || !has(2)) return nullptr;
        Py_ssize_t k = body[p + 1], width = b == 0xDA ? 4 : 8;
        if (!has(2 + width * k)) return nullptr;
        PyObject *t = PyTuple_New(k);
        if (!t) return nullptr;
        const unsigned char *q = body + p + 2;
        for (Py_ssize_t i = 0; i < k; ++i, q += width) {
            long long v;
            if (width == 4) { int32_t x; memcpy(&x, q, 4); v = x; } else { int64_t x; memcpy(&x, q, 8); v = x; }
            PyObject *o = PyLong_FromLongLong(v);
            if (!o) { Py_DECREF(t); return nullptr; }
            PyTuple_SET_ITEM(t, i, o);
        }
        p += 2 + width * k;
        return t;
    }

    // a Delete's ids: a packed tuple (read_ids), or the plain forms (`8n`, `ce` u32 n) of a tuple of
    // ints that the encoder writes for more than 255 of them; a non-empty one is a container
    PyObject *read_id_tuple() {
        if (!has(1)) return nullptr;
        unsigned char b = body[p];
        if (b == 0x80 || b == 0xDA || b == 0xDB) {
            if (b != 0x80 && room < 1) return nullptr;
            PyObject *t = read_ids();
            if (t && b != 0x80) room -= 1;
            return t;
        }
        Py_ssize_t n, head;
        if ((b & 0xF0) == 0x80) {
            n = b & 0x0F; head = 1;
        } else if (b == 0xCE && has(5)) {
            uint32_t count; memcpy(&count, body + p + 1, 4); n = (Py_ssize_t)count; head = 5;
        } else {
            return nullptr;
        }
        if (n > end - p - head || room < 1) return nullptr;  // every int takes a byte at least
        Py_ssize_t p0 = p;
        p += head;
        PyObject *t = PyTuple_New(n);
        if (!t) return nullptr;
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject *v = read_int();
            if (!v) { Py_DECREF(t); p = p0; return nullptr; }
            PyTuple_SET_ITEM(t, i, v);
        }
        room -= 1;
        return t;
    }

    // one record of a class configure_messages listed (`f0|code`, field count, its fields), or
    // nullptr; a reply's class only where `reply` says the message is one
    PyObject *read_record(bool reply) {
        if (!has(2) || (body[p] & 0xF0) != 0xF0 || room < 1) return nullptr;
        if (((body[p] & 0x0F) == cfg.reply_code) != reply) return nullptr;
        const WorkerConfig::Record &rec = cfg.records[body[p] & 0x0F];
        if (!rec.type || body[p + 1] != rec.fields) return nullptr;
        room -= 1;
        p += 2;
        PyObject *values[8] = {nullptr};
        int f = 0;
        for (; f < rec.fields; ++f) {
            if (rec.kinds[f] == 'i') {
                values[f] = read_int();
            } else if (rec.kinds[f] == 'T') {
                values[f] = read_id_tuple();
            } else if (rec.kinds[f] == 'b' && has(1) && (body[p] == 0xC1 || body[p] == 0xC2)) {
                values[f] = body[p] == 0xC2 ? Py_True : Py_False;
                Py_INCREF(values[f]);
                p += 1;
            } else if (rec.kinds[f] == 'n' && has(1) && body[p] == 0xC0) {
                values[f] = Py_None;
                Py_INCREF(values[f]);
                p += 1;
            }
            if (!values[f]) break;
        }
        PyObject *obj = f == rec.fields ? PyBaseObject_Type.tp_new(rec.type, empty_tuple, nullptr) : nullptr;
        if (!obj) {
            for (PyObject *v : values) Py_XDECREF(v);
            return nullptr;
        }
        for (f = 0; f < rec.fields; ++f)
            *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(obj) + rec.offsets[f]) = values[f];
        return obj;
    }

    // a memo reference (`cb` u8 / `cc` u32) to an entry that exists; with `str_only`, to a str
    PyObject *read_ref(bool str_only) {
        if (!has(1)) return nullptr;
        unsigned char b = body[p];
        Py_ssize_t i, size;
        if (b == 0xCB && has(2)) {
            i = body[p + 1]; size = 2;
        } else if (b == 0xCC && has(5)) {
            uint32_t x; memcpy(&x, body + p + 1, 4); i = x; size = 5;
        } else {
            return nullptr;
        }
        if (i >= PyList_GET_SIZE(memo)) return nullptr;
        PyObject *v = PyList_GET_ITEM(memo, i);
        if (str_only && !PyUnicode_CheckExact(v)) return nullptr;
        p += size;
        Py_INCREF(v);
        return v;
    }

    // a new string (`a0|n` or `ca` u32 n): one container, a memo entry
    PyObject *read_new_str() {
        if (!has(1)) return nullptr;
        unsigned char b = body[p];
        Py_ssize_t n, at;
        if (b >= 0xA0 && b < 0xC0) {
            n = b & 0x1F; at = p + 1;
        } else if (b == 0xCA && has(5)) {
            uint32_t x; memcpy(&x, body + p + 1, 4); n = x; at = p + 5;
        } else {
            return nullptr;
        }
        if (n > end - at || room < 1) return nullptr;
        PyObject *s = PyUnicode_DecodeUTF8((const char *)body + at, n, "surrogatepass");
        if (!s) { PyErr_Clear(); return nullptr; }  // the Python decoder names the bad byte
        if (PyList_Append(memo, s) < 0) { Py_DECREF(s); return nullptr; }
        room -= 1;
        p = at + n;
        return s;
    }

    // a Call's source: None, a memo reference, or a new memo tuple (`dd` u8 n) of str/int/None
    PyObject *read_source() {
        if (!has(1)) return nullptr;
        unsigned char b = body[p];
        if (b == 0xC0) {
            p += 1;
            Py_INCREF(Py_None);
            return Py_None;
        }
        if (b == 0xCB || b == 0xCC) return read_ref(false);
        if (b != 0xDD || !has(2)) return nullptr;
        Py_ssize_t n = body[p + 1];
        if (n > end - (p + 2) || room < 1) return nullptr;
        room -= 1;
        p += 2;
        PyObject *t = PyTuple_New(n);
        if (!t) return nullptr;
        for (Py_ssize_t i = 0; i < n; ++i) {
            if (!has(1)) { Py_DECREF(t); return nullptr; }
            unsigned char c = body[p];
            PyObject *v;
            if (c == 0xC0) {
                p += 1; Py_INCREF(Py_None); v = Py_None;
            } else if (c == 0xCB || c == 0xCC) {
                v = read_ref(true);
            } else if ((c >= 0xA0 && c < 0xC0) || c == 0xCA) {
                v = read_new_str();
            } else {
                v = read_int();
            }
            if (!v) { Py_DECREF(t); return nullptr; }
            PyTuple_SET_ITEM(t, i, v);
        }
        if (PyList_Append(memo, t) < 0) { Py_DECREF(t); return nullptr; }
        return t;
    }

    // a Call's numbers: a tuple of floats (`c8` and 8 bytes each), short (`8n`, n < 16) or long
    // (`ce` + u32 n: a foreach call's, one per list element); a non-empty one is a container (room)
    PyObject *read_numbers() {
        if (!has(1)) return nullptr;
        Py_ssize_t n, head;
        if ((body[p] & 0xF0) == 0x80) {
            n = body[p] & 0x0F;
            head = 1;
        } else if (body[p] == 0xCE && has(5)) {
            uint32_t count;
            memcpy(&count, body + p + 1, 4);
            n = (Py_ssize_t)count;
            head = 5;
        } else {
            return nullptr;
        }
        if (n > (end - p) / 9 || !has(head + 9 * n) || (n && room < 1)) return nullptr;
        for (Py_ssize_t i = 0; i < n; ++i)
            if (body[p + head + 9 * i] != 0xC8) return nullptr;
        PyObject *t = PyTuple_New(n);
        if (!t) return nullptr;
        for (Py_ssize_t i = 0; i < n; ++i) {
            double v;
            memcpy(&v, body + p + head + 1 + 9 * i, 8);
            PyObject *o = PyFloat_FromDouble(v);
            if (!o) { Py_DECREF(t); return nullptr; }
            PyTuple_SET_ITEM(t, i, o);
        }
        if (n) room -= 1;
        p += head + 9 * n;
        return t;
    }

    // one Call record at p, or nullptr (p, memo and room then are whatever it reached)
    PyObject *read_call() {
        if (!has(2) || body[p] != 0xF3 || body[p + 1] != 6 || room < 1) return nullptr;
        room -= 1;
        p += 2;
        PyObject *fields[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
        fields[0] = read_int();
        if (fields[0]) fields[1] = read_ids();
        if (fields[1]) fields[2] = read_ids();
        if (fields[2]) fields[3] = read_source();
        if (fields[3]) {
            if (has(1) && body[p] == 0xC0) {
                p += 1;
                Py_INCREF(Py_None);
                fields[4] = Py_None;
            } else {
                fields[4] = read_int();
            }
        }
        if (fields[4]) fields[5] = read_numbers();
        PyObject *call = fields[5] ? PyBaseObject_Type.tp_new(cfg.call, empty_tuple, nullptr) : nullptr;
        if (!call) {
            for (PyObject *f : fields) Py_XDECREF(f);
            return nullptr;
        }
        Py_ssize_t offsets[6] = {cfg.plan_id, cfg.inputs, cfg.outputs, cfg.source, cfg.seed, cfg.numbers};
        for (int i = 0; i < 6; ++i)
            *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(call) + offsets[i]) = fields[i];
        return call;
    }
};

// read_calls(body, pos, count, memo, room, out) -> (pos, room, calls): up to `count` Call records
// from `pos` on appended to `out`; stops at the first record it does not read (see Reader).
PyObject *read_calls(PyObject *, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 6 || !PyBytes_CheckExact(argv[0]) || !PyList_CheckExact(argv[3]) || !PyList_CheckExact(argv[5])) {
        PyErr_SetString(PyExc_TypeError, "read_calls(body: bytes, pos, count, memo: list, room, out: list)");
        return nullptr;
    }
    if (!cfg.call) {
        PyErr_SetString(PyExc_RuntimeError, "dtorch_core._workerpath: configure_calls() was not called");
        return nullptr;
    }
    Reader r;
    r.body = (const unsigned char *)PyBytes_AS_STRING(argv[0]);
    r.end = PyBytes_GET_SIZE(argv[0]);
    r.p = PyLong_AsSsize_t(argv[1]);
    Py_ssize_t count = PyLong_AsSsize_t(argv[2]);
    r.memo = argv[3];
    r.room = PyLong_AsSsize_t(argv[4]);
    if (PyErr_Occurred()) return nullptr;
    if (r.p < 0) r.p = r.end;
    PyObject *out = argv[5];
    Py_ssize_t done = 0;
    while (done < count) {
        Py_ssize_t p0 = r.p, room0 = r.room, memo0 = PyList_GET_SIZE(r.memo);
        PyObject *call = r.read_call();
        if (!call) {
            if (PyErr_Occurred()) return nullptr;  // out of memory: not a message problem
            if (PyList_SetSlice(r.memo, memo0, PyList_GET_SIZE(r.memo), nullptr) < 0) return nullptr;
            r.p = p0;
            r.room = room0;
            break;
        }
        int failed = PyList_Append(out, call);
        Py_DECREF(call);
        if (failed) return nullptr;
        ++done;
    }
    return Py_BuildValue("(nnn)", r.p, r.room, done);
}

// read_message(data) -> list | Reply | None: a whole batch message read in C++ when it is only
// Calls and the flat instructions configure_messages listed (Deletes, Stats, Fetches, RunPrograms:
// a step's frames, eager or replayed), or a reply message of a Reply with neither value nor error
// (a sync point's), in the forms Reader reads, with its header checked as wire/header.py checks
// it; None (no error set) for anything else, which the Python decoder then reads from the start:
// every message it refuses, it refuses with its own WireError.
PyObject *read_message(PyObject *, PyObject *data) {
    if (!cfg.call || !cfg.messages_ready) {
        PyErr_SetString(PyExc_RuntimeError, "dtorch_core._workerpath: configure_messages() was not called");
        return nullptr;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    struct Release {
        Py_buffer *v;
        ~Release() { PyBuffer_Release(v); }
    } release{&view};
    const auto *bytes = (const unsigned char *)view.buf;
    Py_ssize_t size = view.len;
    const Py_ssize_t header = 16;  // magic "DW", version u8, kind u8, body u32, data u64
    if (size < header || bytes[0] != 'D' || bytes[1] != 'W' || bytes[2] != cfg.version
        || (bytes[3] != cfg.kind_batch && bytes[3] != cfg.kind_reply))
        Py_RETURN_NONE;
    uint32_t body_len;
    uint64_t data_len;
    memcpy(&body_len, bytes + 4, 4);
    memcpy(&data_len, bytes + 8, 8);
    if (data_len != 0 || !body_len || (uint64_t)size != header + (uint64_t)body_len) Py_RETURN_NONE;

    Reader r;
    r.body = bytes + header;
    r.end = body_len;
    r.p = 0;
    Ref memo(PyList_New(0));
    if (!memo) return nullptr;
    r.memo = memo.p;
    r.room = r.end / cfg.container_bytes + cfg.container_allowance;
    if (bytes[3] == cfg.kind_reply) {  // one Reply (of a sync point: no value, no error)
        PyObject *reply = r.read_record(true);
        if (!reply) {
            if (PyErr_Occurred()) return nullptr;
            Py_RETURN_NONE;
        }
        if (r.p != r.end) {
            Py_DECREF(reply);
            Py_RETURN_NONE;
        }
        return reply;
    }
    Py_ssize_t n;
    unsigned char b = r.body[0];
    if (b >= 0x90 && b < 0xA0) {
        n = b & 0x0F; r.p = 1;
    } else if (b == 0xCF && r.has(5)) {
        uint32_t count; memcpy(&count, r.body + 1, 4); n = (Py_ssize_t)count; r.p = 5;
    } else {
        Py_RETURN_NONE;
    }
    if (n > r.end - r.p || r.room < 1) Py_RETURN_NONE;  // every record takes a byte at least
    r.room -= 1;
    Ref out(PyList_New(n));
    if (!out) return nullptr;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *ins = r.has(1) && r.body[r.p] == 0xF3 ? r.read_call() : r.read_record(false);
        if (!ins) {
            if (PyErr_Occurred()) return nullptr;  // out of memory: not a message problem
            Py_RETURN_NONE;
        }
        PyList_SET_ITEM(out.p, i, ins);
    }
    if (r.p != r.end) Py_RETURN_NONE;  // trailing bytes: the Python decoder says what they are
    return out.release();
}

}  // namespace

PyMethodDef read_message_def = {"read_message", (PyCFunction)read_message, METH_O,
                              "read_message(data) -> list | Reply | None: a batch of Calls and flat instructions, a bare Reply, or None"};

PyMethodDef read_calls_def = {"read_calls", (PyCFunction)(void (*)(void))read_calls, METH_FASTCALL,
                              "read_calls(body, pos, count, memo, room, out) -> (pos, room, calls read)"};

