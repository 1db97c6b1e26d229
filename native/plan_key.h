// The plan-cache keys of dtorch_core._fastpath (the code is native/plan_key.cpp).
#pragma once
#include <Python.h>

#include "number_key.h"

// The cache key of `x` (dispatch.py's _key_of) and its hash in `*hash` (-1: unhashable);
// Key::python for a plain tensor (the Python dispatcher handles it).
Key key_of(PyObject *x, PyObject *inputs, PyObject **out, Py_hash_t *hash);
// session.plans[key] (borrowed) or nullptr (a miss, or an unhashable key: no error set).
PyObject *plan_for(PyObject *plans, PyObject *key, Py_hash_t hash);
