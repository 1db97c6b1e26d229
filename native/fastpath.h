// What dtorch_core._fastpath's files share: the classes and slot offsets configure() hands over
// (native/fastpath.cpp), and the plan-cache key of a value (native/plan_key.cpp).
#pragma once
#include <Python.h>

#include "number_key.h"

// Objects handed over by configure(): strong references for the life of the process.
struct FastpathConfig {
    PyObject *dtensor = nullptr;      // dtorch_core.tensor.DTensor
    PyObject *tensor = nullptr;       // torch.Tensor (a plain tensor input takes the Python path)
    PyObject *direct_plan = nullptr;  // dtorch_core.planner.plans.DirectPlan
    PyObject *call = nullptr;         // dtorch_core.ir.instructions.Call
    PyObject *make_wrapper = nullptr; // torch.Tensor._make_wrapper_subclass
    PyObject *fallback = nullptr;     // dtorch_core.planner.dispatch.dispatch(func, args, kwargs)
    PyObject *internal_code = nullptr;// dtorch_core.planner.source._internal_code (code -> bool)
    PyObject *prefixes = nullptr;     // tuple of path prefixes of internal code (str.startswith)
    PyObject *spec = nullptr;         // dtorch_core.spec.TensorSpec
    PyObject *wrapper_kwnames = nullptr;
    PyObject *empty_tuple = nullptr;
    PyObject *empty_dict = nullptr;
    PyObject *s_strides = nullptr, *s_dtype = nullptr, *s_device = nullptr;
    // slots read and written by offset (-1: not a slot; then the attribute path is taken)
    Py_ssize_t spec_hash = -1;        // TensorSpec._attrs_cached_hash (attrs' cache_hash)
    Py_ssize_t spec_wrapper = -1;     // TensorSpec._native_wrapper
    Py_ssize_t call_slots[6] = {-1, -1, -1, -1, -1, -1};  // Call's plan_id, inputs, outputs, source, seed, numbers
    bool call_slotted = false;
    bool known_hash = false;          // key hashes computed here equal Python's (checked at configure)
    bool ready = false;
};
extern FastpathConfig cfg;
extern PyObject *s_spec;  // "_spec", interned at module init

// TensorSpec's hash, from attrs' cache when it holds one.
Py_hash_t spec_hash(PyObject *spec);
