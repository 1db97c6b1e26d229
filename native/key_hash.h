// The plan-cache key's hash for dtorch_core._fastpath (native/fastpath.cpp).
#pragma once
#include <Python.h>

#include <unordered_map>

// A lookup hashes its key; Python would call OpOverload.__hash__ and TensorSpec.__hash__ (Python
// functions) for every op. The key's hash is computed here instead from the parts' hashes, with
// CPython's tuple hash (Objects/tupleobject.c, the same since 3.8; configure() checks it against
// hash() and turns this off if they differ): an op's hash is kept per op object, a spec's is the
// one attrs cached on it. The dict then compares keys as ever, so a hit is the Python path's hit.
static_assert(sizeof(Py_uhash_t) == 8, "the tuple hash below is CPython's 64-bit one");
struct TupleHash {
    Py_uhash_t acc = 2870177450012600261ULL;
    Py_ssize_t n = 0;
    void add(Py_hash_t lane) {
        acc += (Py_uhash_t)lane * 14029467366897019727ULL;
        acc = (acc << 31) | (acc >> 33);
        acc *= 11400714785074694791ULL;
        ++n;
    }
    Py_hash_t done() const {
        Py_uhash_t h = acc + ((Py_uhash_t)n ^ (2870177450012600261ULL ^ 3527539UL));
        return h == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)h;
    }
};

inline Py_hash_t op_hash(PyObject *op) {
    static std::unordered_map<PyObject *, Py_hash_t> op_hashes;  // op -> hash(op); the ops are kept alive
    auto it = op_hashes.find(op);
    if (it != op_hashes.end()) return it->second;
    Py_hash_t h = PyObject_Hash(op);
    if (h == -1) return -1;
    Py_INCREF(op);
    op_hashes.emplace(op, h);
    return h;
}

// hash(x) by the rule above, recursively through tuples (-1 on error): configure() checks it
// against hash().
inline Py_hash_t generic_hash(PyObject *x) {
    if (!PyTuple_CheckExact(x)) return PyObject_Hash(x);
    TupleHash h;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(x); ++i) {
        Py_hash_t lane = generic_hash(PyTuple_GET_ITEM(x, i));
        if (lane == -1) return -1;
        h.add(lane);
    }
    return h.done();
}
