// The plan-cache keys of ops whose floats are keyed by type (dtorch_core/planner/numbers.py),
// for dtorch_core._fastpath (native/fastpath.cpp; the code is native/number_key.cpp).
#pragma once
#include <Python.h>

// What building a key gave: a key, "take the Python path" (a plain tensor), or an error.
enum class Key { ok, python, error };
// fastpath.cpp's key_of: the key of one value, as dispatch.py's _key_of makes it.
using KeyOf = Key (*)(PyObject *x, PyObject *inputs, PyObject **out, Py_hash_t *hash);

// Hand over planner.numbers.number_positions and NUMBER_KEY (at configure); false with an error.
bool configure_number_key(PyObject *positions_fn, PyObject *number_key);
// number_positions(func), asked once per op and kept: None or (indices, names) (borrowed);
// nullptr on error.
PyObject *number_positions(PyObject *func);
// The key of the values `items` (a tuple) of a numbered op, as dispatch.py's _numbered_key makes
// it: a float at one of `set`'s positions (its index, or its name in `names` when that is not
// null) is NUMBER_KEY and joins the list `*numbers` (made at the first, owned by the caller);
// any other value is `key_of`'s.
Key numbered_key(KeyOf key_of, PyObject *items, PyObject *names, PyObject *set, PyObject *inputs, PyObject **numbers,
                 PyObject **out, Py_hash_t *hash);
