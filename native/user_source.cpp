// user_source() for dtorch_core._fastpath (native/fastpath.cpp): planner/source.py's user_source
// in C++, for the Call of an op served without a Python frame.
#include "user_source.h"

#include <cstdint>

#include "ref.h"

namespace {

PyObject *internal_code = nullptr;  // planner.source._internal_code (code -> bool), shared with Python
PyObject *prefixes = nullptr;       // path prefixes of internal code (str.startswith)
PyObject *s_co_filename = nullptr, *s_startswith = nullptr;

// The (file, line) tuples of the last frames seen, by (code, instruction): a frame's line number
// is found by walking its code's line table from the start (for every op, in every user function
// that issues ops), and this also keeps one tuple per source line instead of one per op.
struct SourceEntry {
    PyObject *code = nullptr;  // strong references: the code's address cannot be reused
    int lasti = -1;
    PyObject *source = nullptr;
};
SourceEntry source_cache[256];

PyObject *frame_source(PyFrameObject *frame, PyObject *code) {
#if PY_VERSION_HEX >= 0x030B0000
    int lasti = PyFrame_GetLasti(frame);
    SourceEntry &entry = source_cache[(((uintptr_t)code >> 4) ^ ((uintptr_t)lasti * 2654435761u)) & 255];
    if (entry.code == code && entry.lasti == lasti) {
        Py_INCREF(entry.source);
        return entry.source;
    }
#endif
    Ref name(PyObject_GetAttr(code, s_co_filename));
    if (!name) return nullptr;
    Ref lineno(PyLong_FromLong(PyFrame_GetLineNumber(frame)));
    if (!lineno) return nullptr;
    PyObject *source = PyTuple_Pack(2, name.p, lineno.p);
#if PY_VERSION_HEX >= 0x030B0000
    if (source) {
        Py_INCREF(code);
        Py_INCREF(source);
        Py_XDECREF(entry.code);
        Py_XDECREF(entry.source);
        entry.code = code;
        entry.lasti = lasti;
        entry.source = source;
    }
#endif
    return source;
}

// Whether a code object is dtorch's, torch's or generated, by its address: the dict above is
// keyed by the code object, whose hash CPython computes anew at every lookup from its bytecode,
// names and constants (0.05 us for a small function, 0.2 us for a module's code on this
// project's CPU machine, once per frame walked for every op). Strong references: an address
// cannot be reused while its entry holds it.
struct InternalEntry {
    PyObject *code = nullptr;
    bool internal = false;
};
InternalEntry internal_cache[512];

// 1: internal, 0: the user's code, -1: an error is set
int is_internal(PyObject *code) {
    InternalEntry &entry = internal_cache[((uintptr_t)code >> 4) & 511];
    if (entry.code == code) return entry.internal;
    PyObject *flag = PyDict_GetItemWithError(internal_code, code);  // borrowed
    bool internal;
    if (flag) {
        internal = flag == Py_True;
    } else {
        if (PyErr_Occurred()) return -1;
        Ref name(PyObject_GetAttr(code, s_co_filename));
        if (!name) return -1;
        Ref starts(PyObject_CallMethodOneArg(name.p, s_startswith, prefixes));
        if (!starts) return -1;
        internal = starts.p == Py_True;
        if (PyDict_SetItem(internal_code, code, internal ? Py_True : Py_False) < 0) return -1;
    }
    Py_INCREF(code);
    Py_XDECREF(entry.code);
    entry.code = code;
    entry.internal = internal;
    return internal;
}

}  // namespace

// (file, line) of the innermost frame outside dtorch and torch (planner/source.py's
// user_source), or None.
PyObject *user_source() {
    PyFrameObject *frame = PyEval_GetFrame();  // borrowed
    Py_XINCREF(frame);
    while (frame) {
        Ref code((PyObject *)PyFrame_GetCode(frame));
        int internal = is_internal(code.p);
        if (internal < 0) { Py_DECREF(frame); return nullptr; }
        if (!internal) {
            PyObject *source = frame_source(frame, code.p);
            Py_DECREF(frame);
            return source;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);  // new reference or NULL
        Py_DECREF(frame);
        frame = back;
    }
    Py_RETURN_NONE;
}



bool configure_user_source(PyObject *code_flags, PyObject *path_prefixes) {
    Py_INCREF(code_flags);
    Py_INCREF(path_prefixes);
    internal_code = code_flags;
    prefixes = path_prefixes;
    for (InternalEntry &entry : internal_cache) {  // flags of the prefixes given before
        Py_CLEAR(entry.code);
    }
    s_co_filename = PyUnicode_InternFromString("co_filename");
    s_startswith = PyUnicode_InternFromString("startswith");
    return s_co_filename && s_startswith;
}
