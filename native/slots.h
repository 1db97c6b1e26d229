// Reading and writing the slots of a slotted Python class (an attrs class with slots) by offset,
// for the hot paths of dtorch_core._fastpath: no attribute lookup per access.
#pragma once
#include <Python.h>
#include <structmember.h>

// The byte offset of slot `name` of `type`, or -1 when it is no object slot (a plain attribute,
// a property, ...): then the caller keeps to PyObject_GetAttr.
inline Py_ssize_t slot_offset(PyObject *type, const char *name) {
    PyObject *descr = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, name);  // borrowed
    if (!descr || Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX && member->type != T_OBJECT) return -1;
    return member->offset;
}

// The slot's value (borrowed), nullptr when unset.
inline PyObject *slot_get(PyObject *obj, Py_ssize_t offset) { return *(PyObject **)((char *)obj + offset); }

// Store a new reference to `value` in the slot (the old value is released).
inline void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
    PyObject **p = (PyObject **)((char *)obj + offset);
    Py_XINCREF(value);
    Py_XSETREF(*p, value);
}
