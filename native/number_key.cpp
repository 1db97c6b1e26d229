// The plan-cache keys of numbered ops for dtorch_core._fastpath (see number_key.h): a float that
// is an elementwise op's value is keyed by type (NUMBER_KEY) and its value goes to the Call, so
// one plan serves every value (dtorch_core/planner/numbers.py says which ops and arguments).
#include "number_key.h"

#include <unordered_map>

#include "key_hash.h"
#include "ref.h"

namespace {
PyObject *positions_fn = nullptr;  // planner.numbers.number_positions
PyObject *number_key = nullptr;    // planner.numbers.NUMBER_KEY
Py_hash_t number_key_hash = -1;
}  // namespace

bool configure_number_key(PyObject *fn, PyObject *key) {
    Py_INCREF(fn);
    Py_INCREF(key);
    positions_fn = fn;
    number_key = key;
    return (number_key_hash = PyObject_Hash(key)) != -1;
}

PyObject *number_positions(PyObject *func) {
    static std::unordered_map<PyObject *, PyObject *> positions;  // op -> its answer; both kept alive
    auto it = positions.find(func);
    if (it != positions.end()) return it->second;
    PyObject *found = PyObject_CallOneArg(positions_fn, func);
    if (!found) return nullptr;
    if (found != Py_None && !(PyTuple_CheckExact(found) && PyTuple_GET_SIZE(found) == 2 &&
                              PyAnySet_Check(PyTuple_GET_ITEM(found, 0)) && PyAnySet_Check(PyTuple_GET_ITEM(found, 1)))) {
        Py_DECREF(found);
        PyErr_SetString(PyExc_SystemError, "dtorch _fastpath: number_positions returned an unknown form");
        return nullptr;
    }
    Py_INCREF(func);
    positions.emplace(func, found);
    return found;
}

Key numbered_key(KeyOf key_of, PyObject *items, PyObject *names, PyObject *set, PyObject *inputs, PyObject **numbers,
                 PyObject **out, Py_hash_t *hash) {
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    Ref tuple(PyTuple_New(n));
    if (!tuple) return Key::error;
    TupleHash h;
    bool hashable = true;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *x = PyTuple_GET_ITEM(items, i);
        int by_type = 0;
        if (PyFloat_CheckExact(x)) {  // type(x) is float, as dispatch.py tests it
            Ref index(names ? nullptr : PyLong_FromSsize_t(i));
            if (!names && !index) return Key::error;
            by_type = PySet_Contains(set, names ? PyTuple_GET_ITEM(names, i) : index.p);
            if (by_type < 0) return Key::error;
        }
        PyObject *item = nullptr;
        Py_hash_t lane = -1;
        if (by_type) {
            if (!*numbers && !(*numbers = PyList_New(0))) return Key::error;
            if (PyList_Append(*numbers, x) < 0) return Key::error;
            Py_INCREF(number_key);
            item = number_key;
            lane = number_key_hash;
        } else {
            Key k = key_of(x, inputs, &item, &lane);
            if (k != Key::ok) return k;
        }
        PyTuple_SET_ITEM(tuple.p, i, item);
        if (lane == -1) hashable = false;
        else h.add(lane);
    }
    *hash = hashable ? h.done() : -1;
    *out = tuple.release();
    return Key::ok;
}
