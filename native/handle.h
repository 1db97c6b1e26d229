// dtorch_core._fastpath.Handle (native/handle.cpp): owns a tensor id and frees it on the
// workers when it dies, as dtorch_core.tensor.Handle does.
#pragma once
#include <Python.h>

extern PyTypeObject *handle_type;

// Make the type (once, at module init); false with a Python error set.
bool init_handle_type();
// A new Handle of `tid` in `session`.
PyObject *new_handle(PyObject *tid, PyObject *session);
// handle.session or handle.tid (a new reference), without an attribute lookup for our own Handle.
PyObject *handle_field(PyObject *handle, bool session);
