// The user's source line of an op (native/user_source.cpp), for dtorch_core._fastpath.
#pragma once
#include <Python.h>

// Hand over planner.source._internal_code and the path prefixes of internal code (at configure).
bool configure_user_source(PyObject *code_flags, PyObject *path_prefixes);
// (file, line) of the innermost frame outside dtorch and torch, or None; nullptr on error.
PyObject *user_source();
