// What dtorch_core._workerpath's files share: the classes and slot offsets configure() hands
// over (native/workerpath.cpp), read by the Call reader (native/read_calls.cpp).
#pragma once
#include <Python.h>

// Objects handed over by configure(): strong references for the life of the process.
struct WorkerConfig {
    PyTypeObject *call = nullptr;        // dtorch_core.ir.instructions.Call
    PyTypeObject *local_plan = nullptr;  // dtorch_core.worker.loop.LocalPlan
    PyTypeObject *failure = nullptr;     // dtorch_core.ir.instructions.WorkerFailure
    PyObject *tensor = nullptr;          // torch.Tensor
    // byte offsets of the slotted fields read per op (attrs classes use __slots__)
    Py_ssize_t plan_id = -1, inputs = -1, outputs = -1, source = -1, seed = -1, numbers = -1, native = -1;
    bool ready = false;
    // read_message (configure_messages): the wire constants it checks, and per class code below
    // 16 the objects it reads besides Calls: fields of kinds 'i' (int), 'T' (tuple of ints), 'b'
    // (bool), 'n' (None); the one at reply_code only as a reply message, the others in batches
    long version = -1, kind_batch = -1, kind_reply = -1, reply_code = -1, container_bytes = 1,
         container_allowance = 0;
    struct Record {
        PyTypeObject *type = nullptr;
        char kinds[8] = {0};
        Py_ssize_t offsets[8] = {0};
        int fields = 0;
    } records[16];
    bool messages_ready = false;
};

extern WorkerConfig cfg;
extern PyObject *empty_tuple;  // made at module init

// read_calls(body, pos, count, memo, room, out) -> (pos, room, calls read): native/read_calls.cpp
extern PyMethodDef read_calls_def;
// read_message(data) -> list | Reply | None: native/read_calls.cpp
extern PyMethodDef read_message_def;
