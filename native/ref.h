// An owned Python reference that is released at scope exit (native/fastpath.cpp, handle.cpp).
#pragma once
#include <Python.h>

// An owned reference that is released at scope exit.
struct Ref {
    PyObject *p;
    explicit Ref(PyObject *p = nullptr) : p(p) {}
    ~Ref() { Py_XDECREF(p); }
    Ref(const Ref &) = delete;
    Ref &operator=(const Ref &) = delete;
    PyObject *release() { PyObject *r = p; p = nullptr; return r; }
    explicit operator bool() const { return p != nullptr; }
};
