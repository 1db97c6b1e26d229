"""The worker's per-op path in C++ (``dtorch_core._workerpath``, native/workerpath.cpp).

:class:`~dtorch_core.worker.loop.Worker` runs the consecutive ``Call`` instructions of a batch
through :func:`runner`'s ``run_calls``: inputs from the store, the arguments from the plan's
:func:`template` (made once per plan), the kernel by vectorcall (an aten op's C++ callable, so no
Python frame per op), the outputs into the store; with communication in flight it calls the
streams' ``join_reads`` first, as ``Worker._call`` does. It returns to Python at every
instruction it does not run itself — any other instruction, a Call with a missing or failed
input, a plan without a template (tensor inputs nested in lists or kwargs), odd field types — and
hands a kernel's exception back so that the worker records the failure as ``Worker._call`` does:
results, failures and logs are the Python path's.

``dtorch_core.ir.wire``'s decoder uses the same extension for runs of Call records, and reads a
whole batch of Calls and flat instructions (Delete, Stats, Fetch, RunProgram: a step's frames),
or a sync point's bare Reply (on the controller), in it, with no Python between the header and
the value (``read_message``).

``DTORCH_NATIVE_WORKER=0`` keeps the Python path (the decoder's too); so does a build without the
extension (no compiler). ``dtorch info`` says which one runs.
"""

from __future__ import annotations

import os

import torch

from ..ir.instructions import Call, Number, Slot, WorkerFailure

_module = None
_import_error: str | None = None
_configured = False


def _imported():
    """The extension, or None (the reason in ``_import_error``)."""
    global _module, _import_error
    if _module is None and _import_error is None:
        try:
            from .. import _workerpath
        except ImportError as exc:
            _import_error = f"dtorch_core._workerpath does not import: {exc}"
        else:
            _module = _workerpath
    return _module


def available() -> bool:
    """Whether the extension is built and imports (whatever ``DTORCH_NATIVE_WORKER`` says)."""
    return _imported() is not None


def active() -> str:
    """Which per-op path a worker made now uses: "native", or "python (the reason)"."""
    if os.environ.get("DTORCH_NATIVE_WORKER", "1") == "0":
        return "python (DTORCH_NATIVE_WORKER=0)"
    if _imported() is None:
        return f"python ({_import_error})"
    return "native"


def runner(local_plan: type, enabled: bool | None = None):
    """``run_calls(batch, start, store, plans, streams) -> (position, exception or None,
    in_kernel)``, or None for the Python path: ``enabled=False``, or with ``enabled=None`` where :func:`active`
    says so. ``local_plan`` is the worker's plan class (its ``native`` slot holds the template)."""
    global _configured
    if enabled is False or (enabled is None and active() != "native") or _imported() is None:
        return None
    if not _configured:
        _module.configure(Call, local_plan, WorkerFailure, torch.Tensor)
        _configured = True
    return _module.run_calls


def template(fn, args, kwargs: dict, seeded: bool):
    """The native call of a plan (``fn(*args, **kwargs)`` with each top-level ``Slot`` filled,
    plus ``seed=`` when ``seeded``), or None where the Python binder must do it: a Slot among the
    keyword arguments, a Slot or Number inside a list or tuple (a foreach call's), a keyword that
    is not a str, or ``seed`` given twice. A top-level ``Number`` (positional or keyword) is
    filled from the Call's ``numbers``."""
    if _module is None:
        return None
    if type(args) not in (tuple, list) or type(kwargs) is not dict:
        return None
    if any(type(k) is not str for k in kwargs) or (seeded and "seed" in kwargs):
        return None
    argv = []
    holes = []
    for i, a in enumerate(args):
        if type(a) is Slot:
            if type(a.index) is not int or a.index < 0:
                return None
            holes.append((i, a.index))
            argv.append(None)
        elif type(a) is Number:
            if type(a.index) is not int or a.index < 0:
                return None
            holes.append((i, -1 - a.index))  # the Call's numbers[index]
            argv.append(None)
        elif holds_placeholder(a):
            return None
        else:
            argv.append(a)
    for v in kwargs.values():
        if type(v) is Slot or (type(v) is not Number and holds_placeholder(v)):
            return None
        if type(v) is Number:
            if type(v.index) is not int or v.index < 0:
                return None
            holes.append((len(argv), -1 - v.index))
            argv.append(None)
            continue
        argv.append(v)
    if seeded:
        argv.append(None)
    return _module.Template(fn, tuple(argv), tuple(holes), tuple(kwargs), seeded)


def holds_placeholder(x) -> bool:
    """Whether ``x`` is, or holds in its lists and tuples, a Slot or a Number (the worker's binder
    asks this too)."""
    if type(x) is Slot or type(x) is Number:
        return True
    if type(x) in (tuple, list):
        return any(holds_placeholder(a) for a in x)
    return False
