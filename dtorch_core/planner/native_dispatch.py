"""The controller's per-op hot path in C++ (``dtorch_core._fastpath``, native/fastpath.cpp).

:func:`install` makes the extension's ``torch_dispatch`` DTensor's ``__torch_dispatch__``. It
serves a plan-cache hit of a simple plan (no redistribution, one output) without a Python frame:
the cache key (a numbered op's floats by type, planner/numbers.py, their values into the Call),
the output handle (``_fastpath.Handle``: ``tensor.Handle`` in C, which frees its
id as that one does), the ``Call`` and its append to the session's stream, as
:meth:`DirectPlan._run_simple <dtorch_core.planner.plans.DirectPlan>` does; everything else
goes to :func:`dtorch_core.planner.dispatch.dispatch`, so results, errors and traces are the
Python path's. ``DTORCH_NATIVE_DISPATCH=0`` keeps the Python path; so does a build without the
extension (no compiler). ``dtorch info`` says which one runs.
"""

from __future__ import annotations

import os

import torch

from ..ir.instructions import Call
from ..ir.wire.encode import set_call_writer
from ..spec import TensorSpec
from ..tensor import DTensor
from . import source
from .dispatch import dispatch
from .numbers import NUMBER_KEY, number_positions
from .plans import DirectPlan

_active: str | None = None  # "native" or "python (why)"
# DTensor's own (Python) __torch_dispatch__, kept to run the Python path on demand (tests)
PYTHON_TORCH_DISPATCH = DTensor.__dict__["__torch_dispatch__"]


def install() -> str:
    """Install the native hot path where it can run; returns what runs (for ``dtorch info``)."""
    global _active
    if _active is not None:
        return _active
    if os.environ.get("DTORCH_NATIVE_DISPATCH", "1") == "0":
        _active = "python (DTORCH_NATIVE_DISPATCH=0)"
        return _active
    try:
        from .. import _fastpath
    except ImportError as exc:
        _active = f"python (dtorch_core._fastpath does not import: {exc})"
        return _active
    # a key of every kind the native key builder makes: it checks its hashes against hash() on it
    hash_sample = (torch.ops.aten.add.Tensor, ((float, 2.5), (int, -3), (bool, True), ((int, 1 << 70),), NUMBER_KEY),
                   (None, "x", torch.float32, torch.contiguous_format), ("alpha", "out"))
    _fastpath.configure(DTensor, torch.Tensor, DirectPlan, Call, torch.Tensor._make_wrapper_subclass, dispatch,
                        source._internal_code, (source._PKG_DIR, source._TORCH_DIR, "<"), TensorSpec, number_positions,
                        NUMBER_KEY, hash_sample)
    DTensor.__torch_dispatch__ = classmethod(_fastpath.torch_dispatch)
    set_call_writer(_fastpath.encode_calls, _fastpath.encode_ids)  # batches for the process and remote runners
    _active = "native"
    return _active


def active() -> str:
    """Which hot path runs: "native", or "python (the reason)"."""
    return _active or "python (not installed)"
