// dtorch_core._fastpath: the controller's per-op hot path in C++.
//
// DTensor.__torch_dispatch__ is this module's `torch_dispatch` (dtorch_core/planner/
// native_dispatch.py installs it). For every aten op on DTensors it builds the plan-cache key
// exactly as dtorch_core/planner/dispatch.py's _key_of does, looks the plan up in the session's
// cache and, for a "simple" DirectPlan (no redistribution, no plain inputs, no aliases), makes
// the output handles, the Call instruction and appends it to the session's pending stream: the
// work of DirectPlan._run_simple (or of DirectPlan.run for a view that moves nothing), with no
// Python frame. Any other case (a cache miss, a plan
// that moves data, plain tensors, a closed session, inputs of several sessions, a shadowed emit
// while dt.compile records) goes to the Python dispatcher, which builds, runs or raises exactly
// as before; so results, errors and traces are the Python path's.
#include <Python.h>
#include <structmember.h>
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace {

// Objects handed over by configure(): strong references for the life of the process.
struct Config {
    PyObject *dtensor = nullptr;      // dtorch_core.tensor.DTensor
    PyObject *tensor = nullptr;       // torch.Tensor (a plain tensor input takes the Python path)
    PyObject *direct_plan = nullptr;  // dtorch_core.planner.plans.DirectPlan
    PyObject *call = nullptr;         // dtorch_core.ir.instructions.Call
    PyObject *make_wrapper = nullptr; // torch.Tensor._make_wrapper_subclass
    PyObject *fallback = nullptr;     // dtorch_core.planner.dispatch.dispatch(func, args, kwargs)
    PyObject *internal_code = nullptr;// dtorch_core.planner.source._internal_code (code -> bool)
    PyObject *prefixes = nullptr;     // tuple of path prefixes of internal code (str.startswith)
    PyObject *wrapper_kwnames = nullptr;
    PyObject *empty_tuple = nullptr;
    PyObject *empty_dict = nullptr;
    bool ready = false;
};
Config cfg;

// Interned attribute names.
PyObject *s_spec, *s_handle, *s_view, *s_session, *s_tid, *s_closed, *s_plans, *s_fast, *s_run,
    *s_pending, *s_flush_at, *s_flush, *s_emit, *s_track_source, *s_next_seed, *s_tid_counter,
    *s_dict, *s_append, *s_plan_id, *s_inputs, *s_outputs, *s_source, *s_seed, *s_co_filename,
    *s_startswith, *s_view_state;

PyObject *intern(const char *name) {
    PyObject *s = PyUnicode_InternFromString(name);
    if (!s) throw nb::python_error();
    return s;
}

// An owned reference that is released at scope exit.
struct Ref {
    PyObject *p;
    explicit Ref(PyObject *p = nullptr) : p(p) {}
    ~Ref() { Py_XDECREF(p); }
    Ref(const Ref &) = delete;
    Ref &operator=(const Ref &) = delete;
    PyObject *release() { PyObject *r = p; p = nullptr; return r; }
    explicit operator bool() const { return p != nullptr; }
};

enum class Key { ok, python, error };

// The cache key of `x` (dispatch.py's _key_of): DTensor -> its spec (and `x` joins `inputs`),
// tuple/list -> tuple of keys, float/int/bool -> (type, value), any other non-tensor -> itself.
// A plain tensor (or a DTensor subclass) gives Key::python: the Python dispatcher handles it.
Key key_of(PyObject *x, PyObject *inputs, PyObject **out) {
    PyTypeObject *t = Py_TYPE(x);
    if ((PyObject *)t == cfg.dtensor) {
        if (PyList_Append(inputs, x) < 0) return Key::error;
        *out = PyObject_GetAttr(x, s_spec);
        return *out ? Key::ok : Key::error;
    }
    if (t == &PyTuple_Type || t == &PyList_Type) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
        Ref tuple(PyTuple_New(n));
        if (!tuple) return Key::error;
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject *item = nullptr;
            Key k = key_of(PySequence_Fast_GET_ITEM(x, i), inputs, &item);
            if (k != Key::ok) return k;
            PyTuple_SET_ITEM(tuple.p, i, item);
        }
        *out = tuple.release();
        return Key::ok;
    }
    if (t == &PyFloat_Type || t == &PyLong_Type || t == &PyBool_Type) {
        *out = PyTuple_Pack(2, (PyObject *)t, x);
        return *out ? Key::ok : Key::error;
    }
    int is_tensor = PyObject_IsInstance(x, cfg.tensor);
    if (is_tensor < 0) return Key::error;
    if (is_tensor) return Key::python;
    Py_INCREF(x);
    *out = x;
    return Key::ok;
}

// (file, line) of the innermost frame outside dtorch and torch (planner/source.py's
// user_source), or None.
PyObject *user_source() {
    PyFrameObject *frame = PyEval_GetFrame();  // borrowed
    Py_XINCREF(frame);
    while (frame) {
        Ref code((PyObject *)PyFrame_GetCode(frame));
        PyObject *flag = PyDict_GetItemWithError(cfg.internal_code, code.p);  // borrowed
        bool internal;
        if (flag) {
            internal = flag == Py_True;
        } else {
            if (PyErr_Occurred()) { Py_DECREF(frame); return nullptr; }
            Ref name(PyObject_GetAttr(code.p, s_co_filename));
            if (!name) { Py_DECREF(frame); return nullptr; }
            Ref starts(PyObject_CallMethodOneArg(name.p, s_startswith, cfg.prefixes));
            if (!starts) { Py_DECREF(frame); return nullptr; }
            internal = starts.p == Py_True;
            if (PyDict_SetItem(cfg.internal_code, code.p, internal ? Py_True : Py_False) < 0) {
                Py_DECREF(frame);
                return nullptr;
            }
        }
        if (!internal) {
            Ref name(PyObject_GetAttr(code.p, s_co_filename));
            int line = PyFrame_GetLineNumber(frame);
            Py_DECREF(frame);
            if (!name) return nullptr;
            Ref lineno(PyLong_FromLong(line));
            if (!lineno) return nullptr;
            return PyTuple_Pack(2, name.p, lineno.p);
        }
        PyFrameObject *back = PyFrame_GetBack(frame);  // new reference or NULL
        Py_DECREF(frame);
        frame = back;
    }
    Py_RETURN_NONE;
}

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
PyTypeObject *handle_type = nullptr;

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

// A new instance of a slotted class with its slots set, without running its __init__ (the
// frozen attrs Call's __init__ only stores these fields).
PyObject *make_slotted(PyObject *type, PyObject *const *names, PyObject *const *values, int n) {
    Ref obj(PyBaseObject_Type.tp_new((PyTypeObject *)type, cfg.empty_tuple, nullptr));
    if (!obj) return nullptr;
    for (int i = 0; i < n; ++i)
        if (PyObject_GenericSetAttr(obj.p, names[i], values[i]) < 0) return nullptr;
    return obj.release();
}

PyObject *python_path(PyObject *func, PyObject *args, PyObject *kwargs) {
    PyObject *call_args[3] = {func, args, kwargs};
    return PyObject_Vectorcall(cfg.fallback, call_args, 3, nullptr);
}

// The simple plan's work (DirectPlan._run_simple); nullptr with no error set: take the Python path.
PyObject *run_simple(PyObject *session, PyObject *fast, PyObject *inputs) {
    // fast = (plan_id, outs, seeded, view_kind): outs = ((spec, view, shape, stride, dtype, device),)
    // (DirectPlan.fast is None unless the plan has one output, moves and writes nothing)
    PyObject *plan_id = PyTuple_GET_ITEM(fast, 0);
    PyObject *outs = PyTuple_GET_ITEM(fast, 1);
    bool seeded = PyTuple_GET_ITEM(fast, 2) == Py_True;
    PyObject *view_kind = PyTuple_GET_ITEM(fast, 3);  // 1: the output views input 0
    int is_view = PyObject_IsTrue(view_kind);
    if (is_view < 0) return nullptr;

    Py_ssize_t n_in = PyList_GET_SIZE(inputs);
    Ref tids(PyTuple_New(n_in));
    if (!tids) return nullptr;
    for (Py_ssize_t i = 0; i < n_in; ++i) {
        Ref handle(PyObject_GetAttr(PyList_GET_ITEM(inputs, i), s_handle));
        if (!handle) return nullptr;
        Ref owner(PyObject_GetAttr(handle.p, s_session));
        if (!owner) return nullptr;
        if (owner.p != session) return nullptr;  // inputs of several sessions: Python raises
        PyObject *tid = PyObject_GetAttr(handle.p, s_tid);
        if (!tid) return nullptr;
        PyTuple_SET_ITEM(tids.p, i, tid);
    }

    Py_ssize_t n_out = PyTuple_GET_SIZE(outs);
    Ref out_tids(PyTuple_New(n_out));
    Ref results(PyList_New(n_out));
    if (!out_tids || !results || n_out != 1) return nullptr;
    for (Py_ssize_t i = 0; i < n_out; ++i) {
        PyObject *o = PyTuple_GET_ITEM(outs, i);
        Ref last(PyObject_GetAttr(session, s_tid_counter));  // session.new_tid()
        if (!last) return nullptr;
        PyObject *one = PyLong_FromLong(1);
        PyObject *tid = PyNumber_Add(last.p, one);
        Py_DECREF(one);
        if (!tid) return nullptr;
        PyTuple_SET_ITEM(out_tids.p, i, tid);
        if (PyObject_SetAttr(session, s_tid_counter, tid) < 0) return nullptr;

        PyObject *wrapper_args[6] = {cfg.dtensor, PyTuple_GET_ITEM(o, 2), PyTuple_GET_ITEM(o, 3),
                                     PyTuple_GET_ITEM(o, 4), PyTuple_GET_ITEM(o, 5), Py_False};
        Ref tensor(PyObject_Vectorcall(cfg.make_wrapper, wrapper_args, 2, cfg.wrapper_kwnames));
        if (!tensor) return nullptr;
        Ref handle(new_handle(tid, session));
        if (!handle) return nullptr;
        if (PyObject_SetAttr(tensor.p, s_spec, PyTuple_GET_ITEM(o, 0)) < 0 ||
            PyObject_SetAttr(tensor.p, s_view, PyTuple_GET_ITEM(o, 1)) < 0 ||
            PyObject_SetAttr(tensor.p, s_handle, handle.p) < 0)
            return nullptr;
        if (is_view && PyObject_SetAttr(tensor.p, s_view_state, view_kind) < 0) return nullptr;
        PyList_SET_ITEM(results.p, i, tensor.release());
    }

    Ref track(PyObject_GetAttr(session, s_track_source));
    if (!track) return nullptr;
    int tracking = PyObject_IsTrue(track.p);
    if (tracking < 0) return nullptr;
    Ref source(tracking ? user_source() : (Py_INCREF(Py_None), Py_None));
    if (!source) return nullptr;
    Ref seed(seeded ? PyObject_CallMethodNoArgs(session, s_next_seed) : (Py_INCREF(Py_None), Py_None));
    if (!seed) return nullptr;
    PyObject *call_names[5] = {s_plan_id, s_inputs, s_outputs, s_source, s_seed};
    PyObject *call_values[5] = {plan_id, tids.p, out_tids.p, source.p, seed.p};
    Ref call(make_slotted(cfg.call, call_names, call_values, 5));
    if (!call) return nullptr;

    // session.emit(call): inline unless something shadows emit on the instance (dt.compile's
    // recording does, for the length of a capture)
    Ref dict(PyObject_GetAttr(session, s_dict));
    if (!dict) return nullptr;
    PyObject *shadow = PyDict_GetItemWithError(dict.p, s_emit);  // borrowed
    if (shadow) {
        Ref r(PyObject_CallOneArg(shadow, call.p));
        if (!r) return nullptr;
    } else {
        if (PyErr_Occurred()) return nullptr;
        Ref pending(PyObject_GetAttr(session, s_pending));
        if (!pending) return nullptr;
        Ref r(PyObject_CallMethodOneArg(pending.p, s_append, call.p));
        if (!r) return nullptr;
        Ref flush_at(PyObject_GetAttr(session, s_flush_at));
        if (!flush_at) return nullptr;
        Py_ssize_t waiting = PyObject_Size(pending.p);
        if (waiting < 0) return nullptr;
        Py_ssize_t limit = PyLong_AsSsize_t(flush_at.p);
        if (limit == -1 && PyErr_Occurred()) return nullptr;
        if (waiting >= limit) {
            Ref f(PyObject_CallMethodNoArgs(session, s_flush));
            if (!f) return nullptr;
        }
    }
    PyObject *r = PyList_GET_ITEM(results.p, 0);
    Py_INCREF(r);
    return r;
}

// __torch_dispatch__(cls, func, types, args=(), kwargs=None), installed as a classmethod.
PyObject *torch_dispatch(PyObject *, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *func = nullptr, *args = cfg.empty_tuple, *kwargs = Py_None;
    Py_ssize_t npos = nargs;
    if (npos < 3) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__(cls, func, types, args=(), kwargs=None)");
        return nullptr;
    }
    func = argv[1];
    if (npos > 3) args = argv[3];
    if (npos > 4) kwargs = argv[4];
    if (kwnames) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i) {
            const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, i));
            if (!name) return nullptr;
            if (!strcmp(name, "args")) args = argv[npos + i];
            else if (!strcmp(name, "kwargs")) kwargs = argv[npos + i];
        }
    }
    if (kwargs == Py_None) kwargs = cfg.empty_dict;
    if (!cfg.ready || !PyTuple_Check(args) || !PyDict_Check(kwargs))
        return python_path(func, args, kwargs);

    Ref inputs(PyList_New(0));
    if (!inputs) return nullptr;
    PyObject *argkey = nullptr;
    Key k = key_of(args, inputs.p, &argkey);
    if (k == Key::error) return nullptr;
    if (k == Key::python) return python_path(func, args, kwargs);
    Ref argkey_ref(argkey);
    Ref key;
    if (PyDict_GET_SIZE(kwargs)) {
        Ref values(PyDict_Values(kwargs));
        Ref names(PyDict_Keys(kwargs));
        if (!values || !names) return nullptr;
        Ref value_tuple(PyList_AsTuple(values.p));
        Ref name_tuple(PyList_AsTuple(names.p));
        if (!value_tuple || !name_tuple) return nullptr;
        PyObject *valkey = nullptr;
        k = key_of(value_tuple.p, inputs.p, &valkey);
        if (k == Key::error) return nullptr;
        if (k == Key::python) return python_path(func, args, kwargs);
        Ref valkey_ref(valkey);
        key.p = PyTuple_Pack(4, func, argkey, valkey, name_tuple.p);
    } else {
        key.p = PyTuple_Pack(2, func, argkey);
    }
    if (!key) return nullptr;
    if (PyList_GET_SIZE(inputs.p) == 0) return python_path(func, args, kwargs);

    Ref handle(PyObject_GetAttr(PyList_GET_ITEM(inputs.p, 0), s_handle));
    if (!handle) return nullptr;
    Ref session(PyObject_GetAttr(handle.p, s_session));
    if (!session) return nullptr;
    Ref closed(PyObject_GetAttr(session.p, s_closed));
    if (!closed) return nullptr;
    if (closed.p != Py_False) return python_path(func, args, kwargs);
    Ref plans(PyObject_GetAttr(session.p, s_plans));
    if (!plans) return nullptr;
    if (!PyDict_CheckExact(plans.p)) return python_path(func, args, kwargs);
    PyObject *plan = PyDict_GetItemWithError(plans.p, key.p);  // borrowed
    if (!plan) {
        PyErr_Clear();  // a miss, or an unhashable key: the Python path builds (or raises)
        return python_path(func, args, kwargs);
    }
    Ref plan_ref(plan);
    Py_INCREF(plan);
    PyObject *fast = nullptr;
    if ((PyObject *)Py_TYPE(plan) == cfg.direct_plan) {
        fast = PyObject_GetAttr(plan, s_fast);
        if (!fast) return nullptr;
    }
    Ref fast_ref(fast);
    if (fast && fast != Py_None) {
        PyObject *r = run_simple(session.p, fast, inputs.p);
        if (r || PyErr_Occurred()) return r;
        return python_path(func, args, kwargs);
    }
    // any other plan: run it as dispatch.py would, with the key and inputs made here
    PyObject *run_args[5] = {plan, session.p, args, kwargs, inputs.p};
    return PyObject_VectorcallMethod(s_run, run_args, 5, nullptr);
}

PyMethodDef dispatch_def = {"torch_dispatch", (PyCFunction)(void (*)(void))torch_dispatch,
                            METH_FASTCALL | METH_KEYWORDS,
                            "DTensor.__torch_dispatch__ in C++ (dtorch_core/planner/native_dispatch.py)"};

}  // namespace

NB_MODULE(_fastpath, m) {
    s_spec = intern("_spec"); s_handle = intern("_handle"); s_view = intern("_view");
    s_session = intern("session"); s_tid = intern("tid"); s_closed = intern("closed");
    s_plans = intern("plans"); s_fast = intern("fast"); s_run = intern("run");
    s_pending = intern("_pending"); s_flush_at = intern("_flush_at"); s_flush = intern("flush");
    s_emit = intern("emit"); s_track_source = intern("track_source"); s_next_seed = intern("next_seed");
    s_tid_counter = intern("_tid"); s_dict = intern("__dict__"); s_append = intern("append");
    s_plan_id = intern("plan_id"); s_inputs = intern("inputs"); s_outputs = intern("outputs");
    s_source = intern("source"); s_seed = intern("seed"); s_co_filename = intern("co_filename");
    s_startswith = intern("startswith"); s_view_state = intern("_view_state");

    m.def("configure", [](nb::object dtensor, nb::object tensor, nb::object direct_plan, nb::object call,
                          nb::object make_wrapper, nb::object fallback, nb::dict internal_code, nb::tuple prefixes) {
        PyObject *objs[] = {dtensor.ptr(), tensor.ptr(), direct_plan.ptr(), call.ptr(), make_wrapper.ptr(),
                            fallback.ptr(), internal_code.ptr(), prefixes.ptr()};
        for (PyObject *o : objs) Py_INCREF(o);
        cfg.dtensor = objs[0]; cfg.tensor = objs[1]; cfg.direct_plan = objs[2]; cfg.call = objs[3];
        cfg.make_wrapper = objs[4]; cfg.fallback = objs[5]; cfg.internal_code = objs[6]; cfg.prefixes = objs[7];
        cfg.wrapper_kwnames = Py_BuildValue("(ssss)", "strides", "dtype", "device", "requires_grad");
        cfg.empty_tuple = PyTuple_New(0);
        cfg.empty_dict = PyDict_New();
        if (!cfg.wrapper_kwnames || !cfg.empty_tuple || !cfg.empty_dict) throw nb::python_error();
        cfg.ready = true;
    }, "Hand over the classes and functions the hot path uses (once, at import of dtorch_core).");

    s_releases = intern("_releases"); s_release = intern("release");
    handle_type = (PyTypeObject *)PyType_FromSpec(&handle_spec);
    if (!handle_type) throw nb::python_error();
    Py_INCREF(handle_type);
    if (PyModule_AddObject(m.ptr(), "Handle", (PyObject *)handle_type) < 0) throw nb::python_error();
    PyObject *fn = PyCFunction_NewEx(&dispatch_def, nullptr, m.ptr());
    if (!fn || PyModule_AddObject(m.ptr(), "torch_dispatch", fn) < 0) throw nb::python_error();
}
