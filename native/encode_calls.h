// dtorch_core._fastpath.encode_calls and encode_ids (native/encode_calls.cpp): runs of Call
// instructions, and Deletes, in the wire format, for dtorch_core/ir/wire/encode.py.
#pragma once
#include <Python.h>

PyObject *encode_calls(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *encode_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
