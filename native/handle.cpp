// dtorch_core._fastpath.Handle: tensor.Handle in C (native/fastpath.cpp makes the hot path's
// output handles with it).
#include "handle.h"

#include <structmember.h>

#include "ref.h"

namespace {

PyObject *s_dict, *s_append, *s_session, *s_tid;

}  // namespace

PyTypeObject *handle_type = nullptr;

// The handle of a tensor id (dtorch_core.tensor.Handle in C): when it dies it tells the session
// to free the id on the workers, as Handle.__del__ does, without a Python frame: it appends the
// id to the session's release queue, or calls the session's release where something shadows it
// on the instance (dt.compile's recording does). Errors are dropped, as Handle.__del__ drops
// them (at interpreter shutdown there is nothing left to free).
struct HandleObject {
    PyObject_HEAD
    PyObject *tid;
    PyObject *session;
    PyObject *weakrefs;
};
PyObject *s_releases, *s_release;

void release_id(PyObject *session, PyObject *tid) {
    Ref dict(PyObject_GetAttr(session, s_dict));
    PyObject *shadow = dict ? PyDict_GetItemWithError(dict.p, s_release) : nullptr;
    if (shadow) {
        Ref r(PyObject_CallOneArg(shadow, tid));
    } else if (dict && !PyErr_Occurred()) {
        Ref queue(PyObject_GetAttr(session, s_releases));
        if (queue) Ref r(PyObject_CallMethodOneArg(queue.p, s_append, tid));
    }
    PyErr_Clear();
}

void handle_dealloc(PyObject *self) {
    auto *h = (HandleObject *)self;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (h->weakrefs) PyObject_ClearWeakRefs(self);
    if (h->session && h->tid) release_id(h->session, h->tid);
    PyErr_Restore(type, value, traceback);
    Py_CLEAR(h->tid);
    Py_CLEAR(h->session);
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyObject *handle_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *tid, *session;
    static const char *names[] = {"tid", "session", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Handle", (char **)names, &tid, &session)) return nullptr;
    auto *h = (HandleObject *)type->tp_alloc(type, 0);
    if (!h) return nullptr;
    Py_INCREF(tid); h->tid = tid;
    Py_INCREF(session); h->session = session;
    return (PyObject *)h;
}

// handle.session or handle.tid (a new reference), without an attribute lookup for our own Handle
PyObject *handle_field(PyObject *handle, bool session) {
    if (Py_TYPE(handle) == handle_type) {
        PyObject *value = session ? ((HandleObject *)handle)->session : ((HandleObject *)handle)->tid;
        if (value) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(handle, session ? s_session : s_tid);
}

PyObject *new_handle(PyObject *tid, PyObject *session) {
    auto *h = (HandleObject *)handle_type->tp_alloc(handle_type, 0);
    if (!h) return nullptr;
    Py_INCREF(tid); h->tid = tid;
    Py_INCREF(session); h->session = session;
    return (PyObject *)h;
}

PyMemberDef handle_members[] = {
    {"tid", T_OBJECT_EX, offsetof(HandleObject, tid), 0, "the tensor id"},
    {"session", T_OBJECT_EX, offsetof(HandleObject, session), 0, "the session that made the id"},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(HandleObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};
PyType_Slot handle_slots[] = {
    {Py_tp_dealloc, (void *)handle_dealloc},
    {Py_tp_new, (void *)handle_new},
    {Py_tp_members, handle_members},
    {Py_tp_doc, (void *)"Owns a tensor id; frees it on the workers when it dies (dtorch_core.tensor.Handle)."},
    {0, nullptr},
};
PyType_Spec handle_spec = {"dtorch_core._fastpath.Handle", sizeof(HandleObject), 0, Py_TPFLAGS_DEFAULT, handle_slots};

bool init_handle_type() {
    struct { PyObject **name; const char *text; } names[] = {
        {&s_dict, "__dict__"}, {&s_append, "append"}, {&s_session, "session"}, {&s_tid, "tid"},
        {&s_releases, "_releases"}, {&s_release, "release"}};
    for (auto &n : names)
        if (!(*n.name = PyUnicode_InternFromString(n.text))) return false;
    handle_type = (PyTypeObject *)PyType_FromSpec(&handle_spec);
    return handle_type != nullptr;
}
