// dtorch_core._fastpath.encode_calls: runs of Call instructions in the wire format, in C++.
//
// dtorch_core/ir/wire/encode.py hands a batch to encode_calls at each Call; it writes the Calls
// from there on into the message body, byte for byte as encode.py's Python code would (the
// forms and the memo of docs/wire-format.md), and returns the index of the first item it did not
// write: an instruction of another class, or a Call with a value outside the forms below (a
// bool, an int subclass, an int beyond int64, a source that is no flat tuple or str, ...).
// encode.py writes that item itself and carries on, so a batch's bytes, and any WireError, do
// not depend on this code. The memo (str or flat tuple -> index) is encode.py's own dict: it is
// only added to once a Call is known to be writable, so a Call left to Python finds it as the
// Python code would have left it.
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "encode_calls.h"
#include "slots.h"

namespace {

constexpr uint8_t NONE = 0xC0, INT8 = 0xC4, INT16 = 0xC5, INT32 = 0xC6, INT64 = 0xC7, STR32 = 0xCA,
                  REF8 = 0xCB, REF32 = 0xCC, TUPLE32 = 0xCE, ARRAY_I32 = 0xDA, ARRAY_I64 = 0xDB,
                  MEMO_TUPLE = 0xDD;
constexpr uint8_t FLOAT64 = 0xC8, TUPLE = 0x80;
constexpr int CALL_FIELDS = 6;  // plan_id, inputs, outputs, source, seed, numbers (ir/instructions.py)

// The byte offsets of Call's slots, read once from its member descriptors; none when Call is not a
// slotted class (then every Call is left to Python).
PyObject *call_type = nullptr;
Py_ssize_t call_offsets[CALL_FIELDS];
bool call_slotted = false;

bool find_offsets(PyObject *type) {
    static const char *names[CALL_FIELDS] = {"plan_id", "inputs", "outputs", "source", "seed", "numbers"};
    for (int i = 0; i < CALL_FIELDS; ++i)
        if ((call_offsets[i] = slot_offset(type, names[i])) < 0) return false;
    return true;
}

template <typename T>
void put(std::string &out, uint8_t tag, T value) {
    char bytes[1 + sizeof(T)];
    bytes[0] = (char)tag;
    std::memcpy(bytes + 1, &value, sizeof(T));  // little endian (Linux on x86-64 and aarch64)
    out.append(bytes, sizeof bytes);
}

// An exact int's value in `*v`; false for anything else or one beyond int64.
bool exact_int(PyObject *x, long long *v) {
    if (!PyLong_CheckExact(x)) return false;
    int overflow = 0;
    *v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow || (*v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    return true;
}

void write_int(std::string &out, long long v) {
    if (0 <= v && v < 0x80) out.push_back((char)v);
    else if (-0x80 <= v && v < 0x80) put(out, INT8, (int8_t)v);
    else if (-0x8000 <= v && v < 0x8000) put(out, INT16, (int16_t)v);
    else if (-0x80000000LL <= v && v < 0x80000000LL) put(out, INT32, (int32_t)v);
    else put(out, INT64, (int64_t)v);
}

// Whether a tuple of tensor ids can be written here, and how: 0 no, 1 int32 array, 2 int64
// array (both for 1..255 ints), 3 the plain tuple form (256 or more ints).
int id_tuple_form(PyObject *t) {
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    bool wide = false;
    for (Py_ssize_t i = 0; i < n; ++i) {
        long long v;
        if (!exact_int(PyTuple_GET_ITEM(t, i), &v)) return 0;
        if (v < -0x80000000LL || v >= 0x80000000LL) wide = true;
    }
    if (n >= 256) return 3;
    return wide ? 2 : 1;
}

void write_id_tuple(std::string &out, PyObject *t, int form) {
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    if (n == 0) {
        out.push_back((char)0x80);
        return;
    }
    if (form == 3) {
        put(out, TUPLE32, (uint32_t)n);
        for (Py_ssize_t i = 0; i < n; ++i) write_int(out, PyLong_AsLongLong(PyTuple_GET_ITEM(t, i)));
        return;
    }
    out.push_back((char)(form == 1 ? ARRAY_I32 : ARRAY_I64));
    out.push_back((char)n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (form == 1) {
            int32_t w = (int32_t)v;
            out.append((const char *)&w, sizeof w);
        } else {
            int64_t w = (int64_t)v;
            out.append((const char *)&w, sizeof w);
        }
    }
}

void write_ref(std::string &out, Py_ssize_t index) {
    if (index < 256) {
        out.push_back((char)REF8);
        out.push_back((char)index);
    } else {
        put(out, REF32, (uint32_t)index);
    }
}

// A memo lookup: 1 found (index in *index), 0 not there, -1 error.
int memo_index(PyObject *memo, PyObject *key, Py_ssize_t *index) {
    PyObject *found = PyDict_GetItemWithError(memo, key);  // borrowed
    if (!found) return PyErr_Occurred() ? -1 : 0;
    *index = PyLong_AsSsize_t(found);
    return (*index == -1 && PyErr_Occurred()) ? -1 : 1;
}

int memo_add(PyObject *memo, PyObject *key) {
    PyObject *index = PyLong_FromSsize_t(PyDict_GET_SIZE(memo));
    if (!index) return -1;
    int r = PyDict_SetItem(memo, key, index);
    Py_DECREF(index);
    return r;
}

// A str, as a memo ref or defined (and added to the memo). -1: error.
int write_str(std::string &out, PyObject *s, PyObject *memo) {
    Py_ssize_t index;
    int found = memo_index(memo, s, &index);
    if (found < 0) return -1;
    if (found) {
        write_ref(out, index);
        return 0;
    }
    PyObject *utf8 = PyUnicode_AsEncodedString(s, "utf-8", "surrogatepass");
    if (!utf8) return -1;
    Py_ssize_t n = PyBytes_GET_SIZE(utf8);
    if (n < 32) out.push_back((char)(0xA0 | n));
    else put(out, STR32, (uint32_t)n);
    out.append(PyBytes_AS_STRING(utf8), n);
    Py_DECREF(utf8);
    return memo_add(memo, s);
}

// A source the forms here cover: None, a str, or a tuple of 1..255 values of str/int(int64)/None
// whose first is a str (a memo tuple). Anything else is left to Python.
bool source_writable(PyObject *x) {
    if (x == Py_None || PyUnicode_CheckExact(x)) return true;
    if (!PyTuple_CheckExact(x)) return false;
    Py_ssize_t n = PyTuple_GET_SIZE(x);
    if (n == 0 || n >= 256 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(x, 0))) return false;
    for (Py_ssize_t i = 1; i < n; ++i) {
        PyObject *y = PyTuple_GET_ITEM(x, i);
        long long v;
        if (y != Py_None && !PyUnicode_CheckExact(y) && !exact_int(y, &v)) return false;
    }
    return true;
}

int write_source(std::string &out, PyObject *x, PyObject *memo) {
    if (x == Py_None) {
        out.push_back((char)NONE);
        return 0;
    }
    if (PyUnicode_CheckExact(x)) return write_str(out, x, memo);
    Py_ssize_t index;
    int found = memo_index(memo, x, &index);
    if (found < 0) return -1;
    if (found) {
        write_ref(out, index);
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(x);
    out.push_back((char)MEMO_TUPLE);
    out.push_back((char)n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *y = PyTuple_GET_ITEM(x, i);
        if (y == Py_None) out.push_back((char)NONE);
        else if (PyUnicode_CheckExact(y)) {
            if (write_str(out, y, memo) < 0) return -1;
        } else write_int(out, PyLong_AsLongLong(y));
    }
    return memo_add(memo, x);  // defined after the values inside it, as encode.py numbers it
}

// One Call into `out`: 1 written, 0 left to Python (nothing written, memo untouched), -1 error.
int write_call(std::string &out, PyObject *call, PyObject *prefix, PyObject *memo) {
    PyObject *f[CALL_FIELDS];
    for (int i = 0; i < CALL_FIELDS; ++i) {
        f[i] = slot_get(call, call_offsets[i]);
        if (!f[i]) return 0;  // an unset slot: Python says what is wrong
    }
    long long plan_id, seed = 0;
    if (!exact_int(f[0], &plan_id)) return 0;
    int forms[2];
    for (int i = 0; i < 2; ++i) {
        PyObject *ids = f[1 + i];
        if (ids == Py_None) forms[i] = -1;
        else if (!PyTuple_CheckExact(ids) || !(forms[i] = id_tuple_form(ids))) return 0;
    }
    if (!source_writable(f[3])) return 0;
    if (f[4] != Py_None && !exact_int(f[4], &seed)) return 0;
    // numbers: a tuple of floats (a foreach call's may hold hundreds), as encode.py writes it:
    // `8n` (n < 16) or `ce` + u32 n, then `c8` and 8 bytes each
    if (!PyTuple_CheckExact(f[5])) return 0;
    Py_ssize_t n_numbers = PyTuple_GET_SIZE(f[5]);
    for (Py_ssize_t i = 0; i < n_numbers; ++i)
        if (!PyFloat_CheckExact(PyTuple_GET_ITEM(f[5], i))) return 0;

    out.append(PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix));
    write_int(out, plan_id);
    for (int i = 0; i < 2; ++i) {
        if (forms[i] < 0) out.push_back((char)NONE);
        else write_id_tuple(out, f[1 + i], forms[i]);
    }
    if (write_source(out, f[3], memo) < 0) return -1;
    if (f[4] == Py_None) out.push_back((char)NONE);
    else write_int(out, seed);
    if (n_numbers < 16) out.push_back((char)(TUPLE | n_numbers));
    else put(out, TUPLE32, (uint32_t)n_numbers);
    for (Py_ssize_t i = 0; i < n_numbers; ++i) put(out, FLOAT64, PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(f[5], i)));
    return 1;
}

}  // namespace

namespace {
bool append(PyObject *body, const std::string &out) {
    if (out.empty()) return true;
    Py_ssize_t old = PyByteArray_GET_SIZE(body);
    if (PyByteArray_Resize(body, old + (Py_ssize_t)out.size()) < 0) return false;
    std::memcpy(PyByteArray_AS_STRING(body) + old, out.data(), out.size());
    return true;
}
}  // namespace

// encode_ids(body: bytearray, prefix: bytes, ids) -> bool: an object whose one field is a tuple
// of tensor ids (a Delete), as encode.py writes it; False (nothing written) for any other value.
PyObject *encode_ids(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyByteArray_CheckExact(args[0]) || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "encode_ids(body: bytearray, prefix: bytes, ids)");
        return nullptr;
    }
    PyObject *ids = args[2];
    int form = PyTuple_CheckExact(ids) ? id_tuple_form(ids) : 0;
    if (!form) Py_RETURN_FALSE;
    std::string out(PyBytes_AS_STRING(args[1]), PyBytes_GET_SIZE(args[1]));
    out.reserve(out.size() + 6 + 9 * (size_t)PyTuple_GET_SIZE(ids));
    write_id_tuple(out, ids, form);
    if (!append(args[0], out)) return nullptr;
    Py_RETURN_TRUE;
}

// encode_calls(body: bytearray, batch: list, start: int, memo: dict, call_type, prefix: bytes) -> int
PyObject *encode_calls(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyByteArray_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        !PyDict_CheckExact(args[3]) || !PyType_Check(args[4]) || !PyBytes_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "encode_calls(body: bytearray, batch: list, start: int, memo: dict, call_type, prefix: bytes)");
        return nullptr;
    }
    PyObject *body = args[0], *batch = args[1], *memo = args[3], *type = args[4], *prefix = args[5];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred()) return nullptr;
    if (type != call_type) {
        Py_INCREF(type);
        Py_XDECREF(call_type);
        call_type = type;
        call_slotted = find_offsets(type);
    }
    Py_ssize_t n = PyList_GET_SIZE(batch), i = start;
    if (!call_slotted) return PyLong_FromSsize_t(i);
    std::string out;
    out.reserve(40 * (size_t)(n - start > 0 ? n - start : 0));
    for (; i < n; ++i) {
        PyObject *item = PyList_GET_ITEM(batch, i);
        if ((PyObject *)Py_TYPE(item) != type) break;
        int r = write_call(out, item, prefix, memo);
        if (r < 0) return nullptr;
        if (r == 0) break;
    }
    if (!append(body, out)) return nullptr;
    return PyLong_FromSsize_t(i);
}
