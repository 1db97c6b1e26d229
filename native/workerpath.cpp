// dtorch_core._workerpath: the worker's per-op path in C++.
//
// Worker.run_batch (dtorch_core/worker/loop.py) hands this module's `run_calls` a batch and a
// position; it runs the consecutive Call instructions from there as Worker._call does — inputs
// from the store dict, the arguments from the plan's precomputed Template, the kernel through
// vectorcall (an aten op's C++ callable: no Python frame per op), the outputs into the store —
// and returns at the first instruction it leaves to Python: any other instruction type, a Call
// whose input is missing or failed (Python fails its outputs), a plan without a Template (nested
// slots), odd field types (Python validates or rejects). With communication in flight it calls
// the streams' join_reads as _call does. A kernel that raises is not re-run: its exception comes
// back with its position and Python records the WorkerFailure exactly as _call does.
//
// `read_calls` is the wire decoder's (dtorch_core/ir/wire/decode.py) reader of runs of Call
// records (native/read_calls.cpp). Nothing here links libtorch, so the module builds against any
// torch.
#include <Python.h>
#include <descrobject.h>
#include <structmember.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>

#include <vector>

#include "workerpath.h"

namespace nb = nanobind;

WorkerConfig cfg;
PyObject *empty_tuple;

namespace {

PyObject *s_outstanding, *s_join_reads;

// The field at `offset` of a slotted instance (borrowed; nullptr when unset).
inline PyObject *slot(PyObject *obj, Py_ssize_t offset) {
    return *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(obj) + offset);
}

// The offset of slot `name` of `type`, or -1 with an error set.
Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *descr = PyDict_GetItemString(type->tp_dict, name);  // borrowed
    if (!descr || Py_TYPE(descr) != &PyMemberDescr_Type) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", type->tp_name, name);
        return -1;
    }
    return member->offset;
}

// The Call class and the offsets of its fields (the decoder makes Calls, run_calls reads them).
void set_call_class(nb::handle call) {
    if (!PyType_Check(call.ptr())) throw nb::type_error("the Call class expected");
    auto *call_t = (PyTypeObject *)call.ptr();
    if (cfg.call == call_t) return;
    if (cfg.call) throw nb::value_error("dtorch_core._workerpath: another Call class was configured already");
    Py_ssize_t offsets[6] = {slot_offset(call_t, "plan_id"), slot_offset(call_t, "inputs"),
                             slot_offset(call_t, "outputs"), slot_offset(call_t, "source"),
                             slot_offset(call_t, "seed"), slot_offset(call_t, "numbers")};
    for (Py_ssize_t o : offsets)
        if (o < 0) throw nb::python_error();
    Py_INCREF(call_t);
    cfg.call = call_t;
    cfg.plan_id = offsets[0]; cfg.inputs = offsets[1]; cfg.outputs = offsets[2]; cfg.source = offsets[3];
    cfg.seed = offsets[4]; cfg.numbers = offsets[5];
}

// A plan's call, ready to fill: the vectorcall arguments with a hole per tensor input (and one
// for the seed), made once when the plan is defined (worker/native.py's template()).
struct TemplateObject {
    PyObject_HEAD
    PyObject *fn;
    PyObject *argv;     // tuple: positional arguments, then keyword values
    PyObject *kwnames;  // tuple of keyword names, or nullptr
    Py_ssize_t nargs;   // positional count
    Py_ssize_t seed_at; // position of the seed keyword's value in argv, or -1
    Py_ssize_t needs;   // inputs a Call must have (1 + the largest slot index)
    std::vector<std::pair<Py_ssize_t, Py_ssize_t>> *holes;  // (argv position, input index)
    std::vector<std::pair<Py_ssize_t, Py_ssize_t>> *number_holes;  // (argv position, index in Call.numbers)
    Py_ssize_t needs_numbers;  // numbers a Call must bring (1 + the largest number index)
};
PyTypeObject *template_type = nullptr;

void template_dealloc(PyObject *self) {
    auto *t = (TemplateObject *)self;
    Py_CLEAR(t->fn);
    Py_CLEAR(t->argv);
    Py_CLEAR(t->kwnames);
    delete t->holes;
    t->holes = nullptr;
    delete t->number_holes;
    t->number_holes = nullptr;
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

// Template(fn, argv, holes, kwnames, seeded): `argv` the positional arguments then the keyword
// values (holes hold anything), `holes` a tuple of (argv position, input index) pairs (an index
// -1 - k: the Call's k-th number, planner/numbers.py), `kwnames`
// a tuple of str (may be empty); with `seeded` the seed is passed as the last keyword, `seed`.
PyObject *template_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *fn, *argv, *holes, *kwnames;
    int seeded;
    static const char *names[] = {"fn", "argv", "holes", "kwnames", "seeded", nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!p:Template", (char **)names, &fn, &PyTuple_Type, &argv,
                                     &PyTuple_Type, &holes, &PyTuple_Type, &kwnames, &seeded))
        return nullptr;
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; ++i) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(kwnames, i))) {
            PyErr_SetString(PyExc_TypeError, "Template: keyword names are str");
            return nullptr;
        }
    }
    Py_ssize_t n = PyTuple_GET_SIZE(argv);
    Py_ssize_t nargs = n - nkw - (seeded ? 1 : 0);
    if (nargs < 0) {
        PyErr_SetString(PyExc_ValueError, "Template: fewer arguments than keyword names");
        return nullptr;
    }
    auto *holes_vec = new std::vector<std::pair<Py_ssize_t, Py_ssize_t>>();
    auto *numbers_vec = new std::vector<std::pair<Py_ssize_t, Py_ssize_t>>();
    Py_ssize_t needs = 0, needs_numbers = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(holes); ++i) {
        PyObject *pair = PyTuple_GET_ITEM(holes, i);
        Py_ssize_t at = -1, index = -1;
        if (PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2) {
            at = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
            index = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
        }
        if (PyErr_Occurred() || at < 0 || at >= n || index < -PY_SSIZE_T_MAX) {
            delete holes_vec;
            delete numbers_vec;
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "Template: holes are (argv position, input index or -1 - number index) pairs");
            return nullptr;
        }
        if (index < 0) {
            numbers_vec->emplace_back(at, -1 - index);
            if (-index > needs_numbers) needs_numbers = -index;
            continue;
        }
        holes_vec->emplace_back(at, index);
        if (index + 1 > needs) needs = index + 1;
    }
    auto *t = (TemplateObject *)type->tp_alloc(type, 0);
    if (!t) { delete holes_vec; delete numbers_vec; return nullptr; }
    t->holes = holes_vec;
    t->number_holes = numbers_vec;
    t->needs_numbers = needs_numbers;
    Py_INCREF(fn); t->fn = fn;
    Py_INCREF(argv); t->argv = argv;
    PyObject *names_all = kwnames;
    Py_INCREF(names_all);
    if (seeded) {
        {
            PyObject *seed_name = PyUnicode_InternFromString("seed");
            PyObject *extended = seed_name ? PyTuple_New(nkw + 1) : nullptr;
            if (!extended) {
                Py_XDECREF(seed_name);
                Py_DECREF(names_all);
                Py_DECREF(t);
                return nullptr;
            }
            for (Py_ssize_t i = 0; i < nkw; ++i) {
                PyObject *k = PyTuple_GET_ITEM(kwnames, i);
                Py_INCREF(k);
                PyTuple_SET_ITEM(extended, i, k);
            }
            PyTuple_SET_ITEM(extended, nkw, seed_name);
            Py_DECREF(names_all);
            names_all = extended;
        }
        t->seed_at = n - 1;
    } else {
        t->seed_at = -1;
    }
    if (PyTuple_GET_SIZE(names_all)) {
        t->kwnames = names_all;
    } else {
        Py_DECREF(names_all);
        t->kwnames = nullptr;
    }
    t->nargs = nargs;
    t->needs = needs;
    return (PyObject *)t;
}

PyType_Slot template_slots[] = {
    {Py_tp_dealloc, (void *)template_dealloc},
    {Py_tp_new, (void *)template_new},
    {Py_tp_doc, (void *)"A plan's kernel call with holes for its tensor inputs (dtorch_core/worker/native.py)."},
    {0, nullptr},
};
PyType_Spec template_spec = {"dtorch_core._workerpath.Template", sizeof(TemplateObject), 0, Py_TPFLAGS_DEFAULT,
                             template_slots};

// How one Call went: done; left to Python (nothing ran); an error to raise; the kernel raised
// (failed) or joining the streams did (join_failed), the exception in *raised.
enum class Step { done, python, error, failed, join_failed };

// The pending exception into *raised (a new reference) when it is an Exception, as the Python
// path's `except Exception`; anything else (KeyboardInterrupt, SystemExit) stays raised: false.
bool take_exception(PyObject **raised) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (!value || !PyObject_TypeCheck(value, (PyTypeObject *)PyExc_Exception)) {
        PyErr_Restore(type, value, traceback);
        return false;
    }
    if (traceback) PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    *raised = value;
    return true;
}

// Whether output id `tid` (an int) is kept (>= 0; -1 marks an output nobody reads).
inline bool kept(PyObject *tid) {
    int overflow = 0;
    long id = PyLong_AsLongAndOverflow(tid, &overflow);
    return overflow ? overflow > 0 : id >= 0;
}

// Store `out` (the kernel's result) under the Call's output ids as Worker._call does: a tensor
// for one output, else the items of a list/tuple (or the value itself) paired with the ids.
bool store_outputs(PyObject *store, PyObject *outs, PyObject *out) {
    Py_ssize_t n_out = PyTuple_GET_SIZE(outs);
    if (n_out == 1) {
        int is_tensor = Py_TYPE(out) == (PyTypeObject *)cfg.tensor ? 1 : PyObject_IsInstance(out, cfg.tensor);
        if (is_tensor < 0) return false;
        if (is_tensor) {
            PyObject *tid = PyTuple_GET_ITEM(outs, 0);
            return !kept(tid) || PyDict_SetItem(store, tid, out) == 0;
        }
    }
    if (PyList_CheckExact(out) || PyTuple_CheckExact(out)) {
        PyObject **items = PySequence_Fast_ITEMS(out);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(out);
        for (Py_ssize_t i = 0; i < n_out && i < n; ++i) {
            PyObject *tid = PyTuple_GET_ITEM(outs, i);
            if (kept(tid) && PyDict_SetItem(store, tid, items[i]) < 0) return false;
        }
        return true;
    }
    int sequence = PyList_Check(out) || PyTuple_Check(out);  // subclasses (torch.return_types): zip's iteration
    PyObject *it = sequence ? PyObject_GetIter(out) : nullptr;
    if (sequence && !it) return false;
    for (Py_ssize_t i = 0; i < n_out; ++i) {
        PyObject *item;
        if (it) {
            item = PyIter_Next(it);
            if (!item) {
                Py_DECREF(it);
                return !PyErr_Occurred();
            }
        } else {
            if (i) break;
            item = out;
            Py_INCREF(item);
        }
        PyObject *tid = PyTuple_GET_ITEM(outs, i);
        bool ok = !kept(tid) || PyDict_SetItem(store, tid, item) == 0;
        Py_DECREF(item);
        if (!ok) {
            Py_XDECREF(it);
            return false;
        }
    }
    Py_XDECREF(it);
    return true;
}

// One Call.
Step run_call(PyObject *ins, PyObject *store, PyObject *plans, PyObject *streams, PyObject **raised) {
    PyObject *plan_id = slot(ins, cfg.plan_id);
    PyObject *inputs = slot(ins, cfg.inputs);
    PyObject *outputs = slot(ins, cfg.outputs);
    PyObject *seed = slot(ins, cfg.seed);
    if (!plan_id || !inputs || !outputs || !seed || !PyLong_CheckExact(plan_id) || !PyTuple_CheckExact(inputs) ||
        !PyTuple_CheckExact(outputs))
        return Step::python;
    Py_ssize_t n_out = PyTuple_GET_SIZE(outputs);
    for (Py_ssize_t i = 0; i < n_out; ++i)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(outputs, i))) return Step::python;
    PyObject *plan = PyDict_GetItemWithError(plans, plan_id);  // borrowed
    if (!plan) return PyErr_Occurred() ? Step::error : Step::done;  // not on this worker's mesh: a no-op
    if (Py_TYPE(plan) != cfg.local_plan) return Step::python;
    PyObject *native = slot(plan, cfg.native);
    if (!native || Py_TYPE(native) != template_type) return Step::python;
    auto *t = (TemplateObject *)native;
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
    if (t->needs > n_in) return Step::python;  // Python's bind raises IndexError: a kernel failure there
    PyObject *numbers = nullptr;
    if (t->needs_numbers) {
        numbers = slot(ins, cfg.numbers);
        if (!numbers || !PyTuple_CheckExact(numbers) || PyTuple_GET_SIZE(numbers) < t->needs_numbers)
            return Step::python;  // as for missing inputs
    }

    PyObject *small[16];
    std::vector<PyObject *> big;
    PyObject **vals = small;
    if (n_in > 16) {
        big.resize(n_in);
        vals = big.data();
    }
    for (Py_ssize_t i = 0; i < n_in; ++i) {
        PyObject *tid = PyTuple_GET_ITEM(inputs, i);
        if (!PyLong_CheckExact(tid)) return Step::python;
        PyObject *v = PyDict_GetItemWithError(store, tid);  // borrowed
        if (!v) return PyErr_Occurred() ? Step::error : Step::python;
        if (Py_TYPE(v) == cfg.failure) return Step::python;
        vals[i] = v;
    }
    // communication in flight (device streams): compute waits for what this call reads, as in
    // Worker._call (`if streams.outstanding: streams.join_reads(vals)`)
    PyObject *outstanding = PyObject_GetAttr(streams, s_outstanding);
    if (!outstanding) return Step::error;
    int pending = outstanding == Py_False ? 0 : PyObject_IsTrue(outstanding);
    Py_DECREF(outstanding);
    if (pending < 0) return Step::error;
    if (pending) {
        PyObject *list = PyList_New(n_in);
        if (!list) return Step::error;
        for (Py_ssize_t i = 0; i < n_in; ++i) {
            Py_INCREF(vals[i]);
            PyList_SET_ITEM(list, i, vals[i]);
        }
        PyObject *r = PyObject_CallMethodOneArg(streams, s_join_reads, list);
        Py_DECREF(list);
        if (!r) return take_exception(raised) ? Step::join_failed : Step::error;
        Py_DECREF(r);
    }
    Py_ssize_t n = PyTuple_GET_SIZE(t->argv);
    PyObject *small_argv[16];
    std::vector<PyObject *> big_argv;
    PyObject **argv = small_argv;
    if (n > 16) {
        big_argv.resize(n);
        argv = big_argv.data();
    }
    for (Py_ssize_t i = 0; i < n; ++i) argv[i] = PyTuple_GET_ITEM(t->argv, i);
    for (auto [at, index] : *t->holes) argv[at] = vals[index];
    for (auto [at, index] : *t->number_holes) argv[at] = PyTuple_GET_ITEM(numbers, index);
    if (t->seed_at >= 0) argv[t->seed_at] = seed;
    // the call holds its own references: the store keeps the inputs, the plan the template
    Py_INCREF(native);
    for (Py_ssize_t i = 0; i < n; ++i) Py_INCREF(argv[i]);
    PyObject *out = PyObject_Vectorcall(t->fn, argv, t->nargs, t->kwnames);
    for (Py_ssize_t i = 0; i < n; ++i) Py_DECREF(argv[i]);
    Py_DECREF(native);
    if (!out) return take_exception(raised) ? Step::failed : Step::error;
    bool ok = store_outputs(store, outputs, out);
    Py_DECREF(out);
    return ok ? Step::done : Step::error;
}

// run_calls(batch, start, store, plans, streams) -> (position, exception or None, in_kernel):
// runs the Calls of `batch` from `start` on; `position` is the first instruction not run
// (len(batch) at the end). With an exception, the Call at `position` raised it: in its kernel
// (in_kernel), else in streams.join_reads before the kernel.
PyObject *run_calls(PyObject *, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(argv[0]) || !PyDict_CheckExact(argv[2]) || !PyDict_CheckExact(argv[3])) {
        PyErr_SetString(PyExc_TypeError, "run_calls(batch: list, start: int, store: dict, plans: dict, streams)");
        return nullptr;
    }
    if (!cfg.ready) {
        PyErr_SetString(PyExc_RuntimeError, "dtorch_core._workerpath: configure() was not called");
        return nullptr;
    }
    PyObject *batch = argv[0], *store = argv[2], *plans = argv[3], *streams = argv[4];
    Py_ssize_t i = PyLong_AsSsize_t(argv[1]);
    if (i == -1 && PyErr_Occurred()) return nullptr;
    if (i < 0) i = 0;
    PyObject *raised = nullptr;
    bool in_kernel = false;
    for (; i < PyList_GET_SIZE(batch); ++i) {
        PyObject *ins = PyList_GET_ITEM(batch, i);
        if (Py_TYPE(ins) != cfg.call) break;
        Py_INCREF(ins);
        Step step = run_call(ins, store, plans, streams, &raised);
        Py_DECREF(ins);
        if (step == Step::done) continue;
        if (step == Step::error) return nullptr;
        in_kernel = step == Step::failed;
        break;  // Step::python, failed or join_failed
    }
    if (!raised) {
        Py_INCREF(Py_None);
        raised = Py_None;
    }
    PyObject *pos = PyLong_FromSsize_t(i);
    if (!pos) {
        Py_DECREF(raised);
        return nullptr;
    }
    PyObject *r = PyTuple_New(3);
    if (!r) {
        Py_DECREF(pos);
        Py_DECREF(raised);
        return nullptr;
    }
    PyTuple_SET_ITEM(r, 0, pos);
    PyTuple_SET_ITEM(r, 1, raised);
    PyObject *flag = in_kernel ? Py_True : Py_False;
    Py_INCREF(flag);
    PyTuple_SET_ITEM(r, 2, flag);
    return r;
}

PyMethodDef run_calls_def = {"run_calls", (PyCFunction)(void (*)(void))run_calls, METH_FASTCALL,
                             "run_calls(batch, start, store, plans, streams) -> (position, exception or None, in_kernel)"};


}  // namespace

NB_MODULE(_workerpath, m) {
    s_outstanding = PyUnicode_InternFromString("outstanding");
    s_join_reads = PyUnicode_InternFromString("join_reads");
    if (!s_outstanding || !s_join_reads) throw nb::python_error();

    empty_tuple = PyTuple_New(0);
    if (!empty_tuple) throw nb::python_error();

    m.def("configure_calls", [](nb::handle call) { set_call_class(call); },
          "Hand over the Call class (once, at import of dtorch_core.ir.wire.decode or the worker).");
    m.def("configure_messages", [](long version, long kind_batch, long kind_reply, long reply_code,
                                   long container_bytes, long container_allowance, nb::list records) {
        if (!cfg.call) throw nb::value_error("dtorch_core._workerpath: configure_calls() first");
        if (cfg.messages_ready) return;
        if (container_bytes < 1) throw nb::value_error("container_bytes must be positive");
        for (nb::handle item : records) {
            auto rec = nb::cast<nb::tuple>(item);  // (class, class code, field kinds, field names)
            nb::handle type = rec[0];
            long code = nb::cast<long>(rec[1]);
            std::string kinds = nb::cast<std::string>(rec[2]);
            auto names = nb::cast<nb::tuple>(rec[3]);
            if (!PyType_Check(type.ptr()) || code < 0 || code >= 16 || kinds.size() > 7 || kinds.size() != names.size()
                || code == 3)
                throw nb::value_error("configure_messages: (class, code below 16 but not Call's, kinds, names) expected");
            WorkerConfig::Record &r = cfg.records[code];
            for (size_t f = 0; f < kinds.size(); ++f) {
                if (!strchr("iTbn", kinds[f])) throw nb::value_error("configure_messages: field kinds are i, T, b or n");
                r.offsets[f] = slot_offset((PyTypeObject *)type.ptr(), nb::cast<std::string>(names[f]).c_str());
                if (r.offsets[f] < 0) throw nb::python_error();
                r.kinds[f] = kinds[f];
            }
            r.fields = (int)kinds.size();
            Py_INCREF(type.ptr());
            r.type = (PyTypeObject *)type.ptr();
        }
        cfg.version = version; cfg.kind_batch = kind_batch; cfg.kind_reply = kind_reply; cfg.reply_code = reply_code;
        cfg.container_bytes = container_bytes; cfg.container_allowance = container_allowance;
        cfg.messages_ready = true;
    }, "Hand over the wire constants read_message checks and the classes it reads besides Calls (the "
       "reply's at reply_code; once, at import of dtorch_core.ir.wire.decode).");
    m.def("configure", [](nb::handle call, nb::handle local_plan, nb::handle failure, nb::handle tensor) {
        for (nb::handle h : {call, local_plan, failure, tensor})
            if (!PyType_Check(h.ptr())) throw nb::type_error("configure() takes four classes");
        set_call_class(call);
        auto *plan_t = (PyTypeObject *)local_plan.ptr();
        Py_ssize_t native = slot_offset(plan_t, "native");
        if (native < 0) throw nb::python_error();
        for (nb::handle h : {local_plan, failure, tensor}) Py_INCREF(h.ptr());
        cfg.local_plan = plan_t;
        cfg.failure = (PyTypeObject *)failure.ptr();
        cfg.tensor = tensor.ptr();
        cfg.native = native;
        cfg.ready = true;
    }, "Hand over Call, LocalPlan, WorkerFailure and torch.Tensor (once, at import of dtorch_core.worker.native).");

    template_type = (PyTypeObject *)PyType_FromSpec(&template_spec);
    if (!template_type) throw nb::python_error();
    Py_INCREF(template_type);
    if (PyModule_AddObject(m.ptr(), "Template", (PyObject *)template_type) < 0) throw nb::python_error();
    PyObject *fn = PyCFunction_NewEx(&run_calls_def, nullptr, m.ptr());
    if (!fn || PyModule_AddObject(m.ptr(), "run_calls", fn) < 0) throw nb::python_error();
    PyObject *reader = PyCFunction_NewEx(&read_calls_def, nullptr, m.ptr());
    if (!reader || PyModule_AddObject(m.ptr(), "read_calls", reader) < 0) throw nb::python_error();
    PyObject *message_reader = PyCFunction_NewEx(&read_message_def, nullptr, m.ptr());
    if (!message_reader || PyModule_AddObject(m.ptr(), "read_message", message_reader) < 0) throw nb::python_error();
}
