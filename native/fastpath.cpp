// dtorch_core._fastpath: the controller's per-op hot path in C++.
//
// DTensor.__torch_dispatch__ is this module's `torch_dispatch` (dtorch_core/planner/
// native_dispatch.py installs it). For every aten op on DTensors it builds the plan-cache key
// exactly as dtorch_core/planner/dispatch.py's _key_of does, looks the plan up in the session's
// cache and, for a DirectPlan that moves and writes nothing (no redistribution, no plain inputs,
// no aliases: DirectPlan.fast), makes the output handles (one tensor, or a tuple/list of tensors,
// None and known sizes), the Call instruction and appends it to the session's pending stream:
// the work of DirectPlan._run_simple (or of DirectPlan.run for a view or None outputs), with no
// Python frame. Any other case (a cache miss, a plan
// that moves data, plain tensors, a closed session, inputs of several sessions, a shadowed emit
// while dt.compile records) goes to the Python dispatcher, which builds, runs or raises exactly
// as before; so results, errors and traces are the Python path's. Beside it: handle.cpp (the
// Handle type), user_source.cpp (the op's source line), plan_key.cpp and key_hash.h (the key
// and its hash, the plan-cache lookup),
// number_key.cpp (the keys of ops whose floats are keyed by type, their values going with the
// Call) and encode_calls.cpp (the wire encoder's Calls and Deletes).
#include <Python.h>
#include <structmember.h>

#include <atomic>
#include <nanobind/nanobind.h>

#include "encode_calls.h"
#include "fastpath.h"
#include "handle.h"
#include "key_hash.h"
#include "number_key.h"
#include "plan_key.h"
#include "ref.h"
#include "user_source.h"
#include "slots.h"

namespace nb = nanobind;

FastpathConfig cfg;
PyObject *s_spec;

namespace {


// Interned attribute names.
PyObject *s_handle, *s_view, *s_session, *s_tid, *s_closed, *s_plans, *s_fast, *s_run,
    *s_pending, *s_flush_at, *s_flush, *s_emit, *s_track_source, *s_next_seed, *s_tid_counter,
    *s_dict, *s_append, *s_plan_id, *s_inputs, *s_outputs, *s_source, *s_seed, *s_numbers, *s_view_state,
    *s_hungry_words;

PyObject *intern(const char *name) {
    PyObject *s = PyUnicode_InternFromString(name);
    if (!s) throw nb::python_error();
    return s;
}


// A session attribute: from the instance's __dict__ (the names are interned, their hashes
// cached), else through getattr (a class attribute, a property). One generic getattr per field
// and op cost about as much as the rest of the key's lookup. New reference; nullptr: an error.
PyObject *session_attr(PyObject *session, PyObject *dict, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(dict, name);  // borrowed
    if (v) {
        Py_INCREF(v);
        return v;
    }
    if (PyErr_Occurred()) return nullptr;
    return PyObject_GetAttr(session, name);
}

// A new Call with its fields set, without running its __init__ (the frozen attrs Call's
// __init__ only stores them). It holds numbers, tuples of numbers and a source, so it can be in
// no reference cycle: it leaves the garbage collector's lists, which a long stream of pending
// Calls would otherwise make every collection walk; so do its tuples of ids.
PyObject *make_call(PyObject *const *values) {
    PyTypeObject *type = (PyTypeObject *)cfg.call;
    Ref obj(cfg.call_slotted ? type->tp_alloc(type, 0)
                             : PyBaseObject_Type.tp_new(type, cfg.empty_tuple, nullptr));
    if (!obj) return nullptr;
    static PyObject *const *names[6] = {&s_plan_id, &s_inputs, &s_outputs, &s_source, &s_seed, &s_numbers};
    for (int i = 0; i < 6; ++i) {
        if (cfg.call_slotted) slot_set(obj.p, cfg.call_slots[i], values[i]);
        else if (PyObject_GenericSetAttr(obj.p, *names[i], values[i]) < 0) return nullptr;
    }
    if (cfg.call_slotted && PyObject_GC_IsTracked(obj.p)) {
        PyObject_GC_UnTrack(obj.p);
        for (int i = 1; i < 3; ++i)
            if (PyObject_GC_IsTracked(values[i])) PyObject_GC_UnTrack(values[i]);
    }
    return obj.release();
}

// The (args, kwargs) of torch.Tensor._make_wrapper_subclass for a handle of `spec` (borrowed),
// made once per spec and kept on it (TensorSpec._native_wrapper): building the keyword arguments
// for every op cost more than the rest of the op. `strides` is left out where it is the
// contiguous one, torch's default (the same tensor, made faster); `requires_grad` is False, the
// default. nullptr with no error: the spec has no such slot.
PyObject *wrapper_args(PyObject *spec, PyObject *shape, PyObject *stride, PyObject *dtype, PyObject *device) {
    if (cfg.spec_wrapper < 0 || Py_TYPE(spec) != (PyTypeObject *)cfg.spec) return nullptr;
    PyObject *kept = slot_get(spec, cfg.spec_wrapper);
    if (kept && kept != Py_None) return kept;
    bool contiguous = PyTuple_CheckExact(shape) && PyTuple_CheckExact(stride) &&
                      PyTuple_GET_SIZE(shape) == PyTuple_GET_SIZE(stride);
    long long expected = 1;
    for (Py_ssize_t i = contiguous ? PyTuple_GET_SIZE(shape) - 1 : -1; i >= 0; --i) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        long long step = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
        if (PyErr_Occurred()) return nullptr;
        if (step != expected) contiguous = false;
        expected *= size > 1 ? size : 1;
    }
    Ref args(PyTuple_Pack(2, cfg.dtensor, shape));
    Ref kwargs(PyDict_New());
    if (!args || !kwargs) return nullptr;
    if ((!contiguous && PyDict_SetItem(kwargs.p, cfg.s_strides, stride) < 0) ||
        PyDict_SetItem(kwargs.p, cfg.s_dtype, dtype) < 0 || PyDict_SetItem(kwargs.p, cfg.s_device, device) < 0)
        return nullptr;
    Ref both(PyTuple_Pack(2, args.p, kwargs.p));
    if (!both) return nullptr;
    slot_set(spec, cfg.spec_wrapper, both.p);
    return both.p;  // the spec holds it
}

// Session._hungry_words: the addresses of the workers' hungry flags (shared-memory words of
// their channels, see native/shm_channel.h), or an empty tuple. A worker that has taken every
// batch and whose device ran dry raises its flag; the pending calls then go out at once.
bool any_hungry(PyObject *words) {
    if (!PyTuple_CheckExact(words)) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(words); ++i) {
        auto *word = static_cast<std::atomic<uint32_t> *>(PyLong_AsVoidPtr(PyTuple_GET_ITEM(words, i)));
        if (word && word->load(std::memory_order_relaxed)) return true;
    }
    PyErr_Clear();  // a malformed entry reads as "not hungry"
    return false;
}

// ops served here, and ops handed to the Python dispatcher (for tests and benchmarks)
unsigned long long native_ops = 0, python_ops = 0;

PyObject *python_path(PyObject *func, PyObject *args, PyObject *kwargs) {
    ++python_ops;
    PyObject *call_args[3] = {func, args, kwargs};
    return PyObject_Vectorcall(cfg.fallback, call_args, 3, nullptr);
}

// The simple plan's work (DirectPlan._run_simple); nullptr with no error set: take the Python path.
PyObject *run_simple(PyObject *session, PyObject *dict, PyObject *fast, PyObject *inputs, PyObject *numbers) {
    // dict: the session's __dict__
    // fast = (plan_id, outs, seeded, view_kind, structure) (DirectPlan._fast_form): per flat
    // output (spec, view, shape, stride, dtype, device), None, or (size,); structure 0: the one
    // tensor, 1: a tuple, 2: a list
    if (PyTuple_GET_SIZE(fast) != 5) return nullptr;
    PyObject *plan_id = PyTuple_GET_ITEM(fast, 0);
    PyObject *outs = PyTuple_GET_ITEM(fast, 1);
    bool seeded = PyTuple_GET_ITEM(fast, 2) == Py_True;
    PyObject *view_kind = PyTuple_GET_ITEM(fast, 3);  // 1: the outputs view input 0
    long structure = PyLong_AsLong(PyTuple_GET_ITEM(fast, 4));
    if (structure == -1 && PyErr_Occurred()) return nullptr;
    int is_view = PyObject_IsTrue(view_kind);
    if (is_view < 0) return nullptr;

    Py_ssize_t n_in = PyList_GET_SIZE(inputs);
    Ref tids(PyTuple_New(n_in));
    if (!tids) return nullptr;
    for (Py_ssize_t i = 0; i < n_in; ++i) {
        Ref handle(PyObject_GetAttr(PyList_GET_ITEM(inputs, i), s_handle));
        if (!handle) return nullptr;
        Ref owner(handle_field(handle.p, true));
        if (!owner) return nullptr;
        if (owner.p != session) return nullptr;  // inputs of several sessions: Python raises
        PyObject *tid = handle_field(handle.p, false);
        if (!tid) return nullptr;
        PyTuple_SET_ITEM(tids.p, i, tid);
    }

    Py_ssize_t n_out = PyTuple_GET_SIZE(outs);
    if (structure == 0 && n_out != 1) return nullptr;
    Ref out_tids(PyTuple_New(n_out));
    Ref results(PyList_New(n_out));
    if (!out_tids || !results) return nullptr;
    for (Py_ssize_t i = 0; i < n_out; ++i) {
        PyObject *o = PyTuple_GET_ITEM(outs, i);
        if (o == Py_None || (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 1)) {
            // no tensor here (as DirectPlan.run: id -1): None, or a size the controller knows
            PyObject *none_tid = PyLong_FromLong(-1);
            if (!none_tid) return nullptr;
            PyTuple_SET_ITEM(out_tids.p, i, none_tid);
            PyObject *value = o == Py_None ? Py_None : PyTuple_GET_ITEM(o, 0);
            Py_INCREF(value);
            PyList_SET_ITEM(results.p, i, value);
            continue;
        }
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 6) {
            PyErr_SetString(PyExc_SystemError, "dtorch _fastpath: a fast plan's output entry has an unknown form");
            return nullptr;
        }
        Ref last(session_attr(session, dict, s_tid_counter));  // session.new_tid()
        if (!last) return nullptr;
        PyObject *one = PyLong_FromLong(1);
        PyObject *tid = PyNumber_Add(last.p, one);
        Py_DECREF(one);
        if (!tid) return nullptr;
        PyTuple_SET_ITEM(out_tids.p, i, tid);
        if (PyDict_SetItem(dict, s_tid_counter, tid) < 0) return nullptr;  // a plain instance attribute

        PyObject *made = wrapper_args(PyTuple_GET_ITEM(o, 0), PyTuple_GET_ITEM(o, 2), PyTuple_GET_ITEM(o, 3),
                                      PyTuple_GET_ITEM(o, 4), PyTuple_GET_ITEM(o, 5));
        if (!made && PyErr_Occurred()) return nullptr;
        PyObject *call_args[6] = {cfg.dtensor, PyTuple_GET_ITEM(o, 2), PyTuple_GET_ITEM(o, 3),
                                  PyTuple_GET_ITEM(o, 4), PyTuple_GET_ITEM(o, 5), Py_False};
        Ref tensor(made ? PyObject_Call(cfg.make_wrapper, PyTuple_GET_ITEM(made, 0), PyTuple_GET_ITEM(made, 1))
                        : PyObject_Vectorcall(cfg.make_wrapper, call_args, 2, cfg.wrapper_kwnames));
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

    Ref track(session_attr(session, dict, s_track_source));
    if (!track) return nullptr;
    int tracking = PyObject_IsTrue(track.p);
    if (tracking < 0) return nullptr;
    Ref source(tracking ? user_source() : (Py_INCREF(Py_None), Py_None));
    if (!source) return nullptr;
    Ref seed(seeded ? PyObject_CallMethodNoArgs(session, s_next_seed) : (Py_INCREF(Py_None), Py_None));
    if (!seed) return nullptr;
    PyObject *call_values[6] = {plan_id, tids.p, out_tids.p, source.p, seed.p, numbers};
    Ref call(make_call(call_values));
    if (!call) return nullptr;

    // session.emit(call): inline unless something shadows emit on the instance (dt.compile's
    // recording does, for the length of a capture)
    PyObject *shadow = PyDict_GetItemWithError(dict, s_emit);  // borrowed
    if (shadow) {
        Ref r(PyObject_CallOneArg(shadow, call.p));
        if (!r) return nullptr;
    } else {
        if (PyErr_Occurred()) return nullptr;
        Ref pending(session_attr(session, dict, s_pending));
        if (!pending) return nullptr;
        Ref r(PyObject_CallMethodOneArg(pending.p, s_append, call.p));
        if (!r) return nullptr;
        Ref flush_at(session_attr(session, dict, s_flush_at));
        if (!flush_at) return nullptr;
        Py_ssize_t waiting = PyObject_Size(pending.p);
        if (waiting < 0) return nullptr;
        Py_ssize_t limit = PyLong_AsSsize_t(flush_at.p);
        if (limit == -1 && PyErr_Occurred()) return nullptr;
        Ref words(session_attr(session, dict, s_hungry_words));
        if (!words) return nullptr;
        if (waiting >= limit || any_hungry(words.p)) {
            Ref f(PyObject_CallMethodNoArgs(session, s_flush));
            if (!f) return nullptr;
        }
    }
    PyObject *r;
    if (structure == 0) {
        r = PyList_GET_ITEM(results.p, 0);
        Py_INCREF(r);
    } else if (structure == 1) {
        r = PyList_AsTuple(results.p);
        if (!r) return nullptr;
    } else {
        r = results.release();
    }
    ++native_ops;
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
    PyObject *positions = number_positions(func);  // borrowed: None, or where floats are keyed by type
    if (!positions) return nullptr;
    bool numbered = positions != Py_None;
    Ref numbers;  // their values, for the Call (a list made at the first one)
    PyObject *argkey = nullptr;
    Py_hash_t arghash = -1, valhash = -1, namehash = -1;
    Key k = numbered ? numbered_key(key_of, args, nullptr, PyTuple_GET_ITEM(positions, 0), inputs.p, &numbers.p,
                                    &argkey, &arghash)
                    : key_of(args, inputs.p, &argkey, &arghash);
    if (k == Key::error) return nullptr;
    if (k == Key::python) return python_path(func, args, kwargs);
    Ref argkey_ref(argkey);
    Ref key;
    TupleHash keyhash;
    Py_hash_t funchash = op_hash(func);
    if (funchash == -1) return nullptr;
    keyhash.add(funchash);
    keyhash.add(arghash);
    if (PyDict_GET_SIZE(kwargs)) {
        Ref values(PyDict_Values(kwargs));
        Ref names(PyDict_Keys(kwargs));
        if (!values || !names) return nullptr;
        Ref value_tuple(PyList_AsTuple(values.p));
        Ref name_tuple(PyList_AsTuple(names.p));
        if (!value_tuple || !name_tuple) return nullptr;
        PyObject *valkey = nullptr;
        k = numbered ? numbered_key(key_of, value_tuple.p, name_tuple.p, PyTuple_GET_ITEM(positions, 1), inputs.p,
                                    &numbers.p, &valkey, &valhash)
                    : key_of(value_tuple.p, inputs.p, &valkey, &valhash);
        if (k == Key::error) return nullptr;
        if (k == Key::python) return python_path(func, args, kwargs);
        Ref valkey_ref(valkey);
        key.p = PyTuple_Pack(4, func, argkey, valkey, name_tuple.p);
        if ((namehash = PyObject_Hash(name_tuple.p)) == -1) return nullptr;  // a tuple of str
        keyhash.add(valhash);
        keyhash.add(namehash);
    } else {
        key.p = PyTuple_Pack(2, func, argkey);
    }
    if (!key) return nullptr;
    Py_hash_t hash = (arghash == -1 || (namehash != -1 && valhash == -1)) ? -1 : keyhash.done();
    if (PyList_GET_SIZE(inputs.p) == 0) return python_path(func, args, kwargs);

    Ref handle(PyObject_GetAttr(PyList_GET_ITEM(inputs.p, 0), s_handle));
    if (!handle) return nullptr;
    Ref session(handle_field(handle.p, true));
    if (!session) return nullptr;
    Ref dict(PyObject_GetAttr(session.p, s_dict));
    if (!dict) return nullptr;
    if (!PyDict_Check(dict.p)) return python_path(func, args, kwargs);
    Ref closed(session_attr(session.p, dict.p, s_closed));
    if (!closed) return nullptr;
    if (closed.p != Py_False) return python_path(func, args, kwargs);
    Ref plans(session_attr(session.p, dict.p, s_plans));
    if (!plans) return nullptr;
    if (!PyDict_CheckExact(plans.p)) return python_path(func, args, kwargs);
    PyObject *plan = plan_for(plans.p, key.p, hash);  // borrowed
    if (!plan) return python_path(func, args, kwargs);  // the Python path builds (or raises)
    Ref plan_ref(plan);
    Py_INCREF(plan);
    PyObject *fast = nullptr;
    if ((PyObject *)Py_TYPE(plan) == cfg.direct_plan) {
        fast = PyObject_GetAttr(plan, s_fast);
        if (!fast) return nullptr;
    }
    Ref fast_ref(fast);
    if (fast && fast != Py_None) {
        Ref number_tuple(numbers ? PyList_AsTuple(numbers.p) : (Py_INCREF(cfg.empty_tuple), cfg.empty_tuple));
        if (!number_tuple) return nullptr;
        PyObject *r = run_simple(session.p, dict.p, fast, inputs.p, number_tuple.p);
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

PyMethodDef encode_calls_def = {"encode_calls", (PyCFunction)(void (*)(void))encode_calls, METH_FASTCALL,
                                "encode_calls(body, batch, start, memo, call_type, prefix) -> index of the first item "
                                "not written (native/encode_calls.cpp)"};
PyMethodDef encode_ids_def = {"encode_ids", (PyCFunction)(void (*)(void))encode_ids, METH_FASTCALL,
                              "encode_ids(body, prefix, ids) -> whether it wrote an object of one field of tensor "
                              "ids, a Delete (native/encode_calls.cpp)"};

}  // namespace

NB_MODULE(_fastpath, m) {
    s_spec = intern("_spec"); s_handle = intern("_handle"); s_view = intern("_view");
    s_session = intern("session"); s_tid = intern("tid"); s_closed = intern("closed");
    s_plans = intern("plans"); s_fast = intern("fast"); s_run = intern("run");
    s_pending = intern("_pending"); s_flush_at = intern("_flush_at"); s_flush = intern("flush");
    s_emit = intern("emit"); s_track_source = intern("track_source"); s_next_seed = intern("next_seed");
    s_tid_counter = intern("_tid"); s_dict = intern("__dict__"); s_append = intern("append");
    s_plan_id = intern("plan_id"); s_inputs = intern("inputs"); s_outputs = intern("outputs");
    s_source = intern("source"); s_seed = intern("seed"); s_numbers = intern("numbers");
    s_view_state = intern("_view_state"); s_hungry_words = intern("_hungry_words");

    m.def("configure", [](nb::object dtensor, nb::object tensor, nb::object direct_plan, nb::object call,
                          nb::object make_wrapper, nb::object fallback, nb::dict internal_code, nb::tuple prefixes,
                          nb::object spec, nb::object number_positions, nb::object number_key, nb::object hash_sample) {
        PyObject *objs[] = {dtensor.ptr(), tensor.ptr(), direct_plan.ptr(), call.ptr(), make_wrapper.ptr(),
                            fallback.ptr(), internal_code.ptr(), prefixes.ptr(), spec.ptr()};
        for (PyObject *o : objs) Py_INCREF(o);
        cfg.dtensor = objs[0]; cfg.tensor = objs[1]; cfg.direct_plan = objs[2]; cfg.call = objs[3];
        cfg.make_wrapper = objs[4]; cfg.fallback = objs[5]; cfg.internal_code = objs[6]; cfg.prefixes = objs[7];
        cfg.spec = objs[8];
        if (!configure_number_key(number_positions.ptr(), number_key.ptr())) throw nb::python_error();
        if (!configure_user_source(cfg.internal_code, cfg.prefixes)) throw nb::python_error();
        cfg.wrapper_kwnames = Py_BuildValue("(ssss)", "strides", "dtype", "device", "requires_grad");
        cfg.empty_tuple = PyTuple_New(0);
        cfg.empty_dict = PyDict_New();
        cfg.s_strides = intern("strides"); cfg.s_dtype = intern("dtype"); cfg.s_device = intern("device");
        if (!cfg.wrapper_kwnames || !cfg.empty_tuple || !cfg.empty_dict) throw nb::python_error();
        cfg.spec_hash = slot_offset(cfg.spec, "_attrs_cached_hash");
        cfg.spec_wrapper = slot_offset(cfg.spec, "_native_wrapper");
        static const char *call_fields[6] = {"plan_id", "inputs", "outputs", "source", "seed", "numbers"};
        cfg.call_slotted = true;
        for (int i = 0; i < 6; ++i)
            if ((cfg.call_slots[i] = slot_offset(cfg.call, call_fields[i])) < 0) cfg.call_slotted = false;
        // the key hash of this file against hash() on a key of every kind key_of makes
        Py_hash_t mine = generic_hash(hash_sample.ptr()), python = PyObject_Hash(hash_sample.ptr());
        if (mine == -1 || python == -1) throw nb::python_error();
        cfg.known_hash = mine == python;
        cfg.ready = true;
    }, "Hand over the classes and functions the hot path uses (once, at import of dtorch_core).");
    m.def("counts", []() { return nb::make_tuple(native_ops, python_ops); },
          "(ops served in C++, ops handed to the Python dispatcher) so far.");
    m.def("known_hash", []() { return cfg.known_hash; },
          "Whether plan-cache keys are hashed here (True) or by hash() (the check at configure failed).");

    if (!init_handle_type()) throw nb::python_error();
    Py_INCREF(handle_type);
    if (PyModule_AddObject(m.ptr(), "Handle", (PyObject *)handle_type) < 0) throw nb::python_error();
    PyObject *fn = PyCFunction_NewEx(&dispatch_def, nullptr, m.ptr());
    if (!fn || PyModule_AddObject(m.ptr(), "torch_dispatch", fn) < 0) throw nb::python_error();
    PyObject *enc = PyCFunction_NewEx(&encode_calls_def, nullptr, m.ptr());
    if (!enc || PyModule_AddObject(m.ptr(), "encode_calls", enc) < 0) throw nb::python_error();
    PyObject *ids = PyCFunction_NewEx(&encode_ids_def, nullptr, m.ptr());
    if (!ids || PyModule_AddObject(m.ptr(), "encode_ids", ids) < 0) throw nb::python_error();
}
