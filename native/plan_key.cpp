// The plan-cache keys of dtorch_core._fastpath (native/fastpath.cpp): a value's key as
// dtorch_core/planner/dispatch.py's _key_of makes it, its hash, and the cache lookup.
#include "plan_key.h"

#include "fastpath.h"
#include "key_hash.h"
#include "ref.h"
#include "slots.h"

Py_hash_t spec_hash(PyObject *spec) {
    if (cfg.spec_hash >= 0 && Py_TYPE(spec) == (PyTypeObject *)cfg.spec) {
        PyObject *cached = slot_get(spec, cfg.spec_hash);
        if (cached && PyLong_Check(cached)) {  // attrs keeps it in an int subclass
            Py_hash_t h = PyLong_AsSsize_t(cached);
            if (!(h == -1 && PyErr_Occurred())) return h == -1 ? -2 : h;  // as hash() returns it
            PyErr_Clear();
        }
    }
    return PyObject_Hash(spec);  // the first time: attrs computes and caches it
}

// The cache key of `x` (dispatch.py's _key_of): DTensor -> its spec (and `x` joins `inputs`),
// tuple/list -> tuple of keys, float/int/bool -> (type, value), any other non-tensor -> itself;
// and its hash in `*hash` (-1: unhashable, so no plan can be stored under it: the Python path
// says what it does with it). A plain tensor (or a DTensor subclass) gives Key::python: the
// Python dispatcher handles it.
Key key_of(PyObject *x, PyObject *inputs, PyObject **out, Py_hash_t *hash) {
    PyTypeObject *t = Py_TYPE(x);
    if ((PyObject *)t == cfg.dtensor) {
        if (PyList_Append(inputs, x) < 0) return Key::error;
        *out = PyObject_GetAttr(x, s_spec);
        if (!*out) return Key::error;
        if ((*hash = spec_hash(*out)) == -1) PyErr_Clear();
        return Key::ok;
    }
    if (t == &PyTuple_Type || t == &PyList_Type) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
        Ref tuple(PyTuple_New(n));
        if (!tuple) return Key::error;
        TupleHash h;
        bool hashable = true;
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject *item = nullptr;
            Py_hash_t lane = -1;
            Key k = key_of(PySequence_Fast_GET_ITEM(x, i), inputs, &item, &lane);
            if (k != Key::ok) return k;
            PyTuple_SET_ITEM(tuple.p, i, item);
            if (lane == -1) hashable = false;
            else h.add(lane);
        }
        *hash = hashable ? h.done() : -1;
        *out = tuple.release();
        return Key::ok;
    }
    if (t == &PyFloat_Type || t == &PyLong_Type || t == &PyBool_Type) {
        *out = PyTuple_Pack(2, (PyObject *)t, x);
        if (!*out) return Key::error;
        TupleHash h;
        h.add(PyObject_Hash((PyObject *)t));  // C hashes of a type and a number: they cannot fail
        h.add(PyObject_Hash(x));
        *hash = h.done();
        return Key::ok;
    }
    int is_tensor = PyObject_IsInstance(x, cfg.tensor);
    if (is_tensor < 0) return Key::error;
    if (is_tensor) return Key::python;
    Py_INCREF(x);
    *out = x;
    if ((*hash = PyObject_Hash(x)) == -1) PyErr_Clear();
    return Key::ok;
}

// session.plans[key] (borrowed) or nullptr (a miss, or an unhashable key: no error set).
PyObject *plan_for(PyObject *plans, PyObject *key, Py_hash_t hash) {
    PyObject *plan;
#if PY_VERSION_HEX < 0x030D0000
    if (cfg.known_hash) {
        if (hash == -1) return nullptr;
        plan = _PyDict_GetItem_KnownHash(plans, key, hash);
    } else
#endif
    {
        (void)hash;
        plan = PyDict_GetItemWithError(plans, key);
    }
    if (!plan) PyErr_Clear();
    return plan;
}

