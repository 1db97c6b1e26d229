"""The recording context: what makes the ops of :func:`meta_init` land in an :class:`InitTrace`.

While :func:`recording` is active on a thread, a ``TorchDispatchMode`` records every aten op
that touches a meta tensor (:meth:`InitTrace.record_op`), a ``TorchFunctionMode`` keeps the
values of ``torch.tensor(data)`` & co. (:meth:`InitTrace.record_constant`), and the
``torch.nn.init`` functions that return at once on meta tensors are wrapped so that each call is
recorded whole (:meth:`InitTrace.record_init`). What is recorded, and how it is compiled into
the workers' program, is described in ``init_trace.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import MaterializeError
from .init_trace import InitTrace

# torch.nn.init functions recorded as one call (attribute -> the public name replayed): they
# return at once on meta tensors, and their draws depend on the values drawn. The private
# ``_no_grad_trunc_normal_`` is wrapped rather than ``trunc_normal_`` so that code which
# imported ``trunc_normal_`` by name is recorded too.
INIT_FUNCTIONS = {
    "_no_grad_trunc_normal_": "trunc_normal_",
    "orthogonal_": "orthogonal_",
    "sparse_": "sparse_",
    "dirac_": "dirac_",
}
_DATA_CONSTRUCTORS = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)

_local = threading.local()  # .trace: the trace recording on this thread
_patch_lock = threading.Lock()
_patch_users = 0
_originals: dict = {}


class _RecordOps(TorchDispatchMode):
    def __init__(self, trace: InitTrace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.trace.paused:
            self.trace.record_op(func, args, kwargs, out)
        return out


class _KeepConstants(TorchFunctionMode):
    """Keeps the values of ``torch.tensor(data)`` & co., which the meta device drops."""

    def __init__(self, trace: InitTrace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func in _DATA_CONSTRUCTORS and not self.trace.paused and isinstance(out, torch.Tensor)
                and out.is_meta):
            try:
                with self.trace.pause():
                    value = func(*args, **{**kwargs, "device": "cpu"})
            except Exception:  # e.g. data that is itself a meta tensor: no values to keep
                return out
            self.trace.record_constant(out, value)
        return out


def _init_wrapper(replay_name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        trace = getattr(_local, "trace", None)
        if trace is None or trace.paused:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        tensor = bound.arguments.get("tensor")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return original(*args, **kwargs)
        with trace.pause():
            out = original(*args, **kwargs)  # torch's own argument checks raise here
        trace.record_init(replay_name, dict(bound.arguments))
        return out

    return wrapper


def _patch_init_functions() -> None:
    # process-wide while any thread records; the wrappers record only on a recording thread
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            for attr, replay in INIT_FUNCTIONS.items():
                original = getattr(torch.nn.init, attr, None)
                if original is not None:
                    _originals[attr] = original
                    setattr(torch.nn.init, attr, _init_wrapper(replay, original))
        _patch_users += 1


def _unpatch_init_functions() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            for attr, original in _originals.items():
                setattr(torch.nn.init, attr, original)
            _originals.clear()


@contextlib.contextmanager
def recording(trace: InitTrace):
    """Record into ``trace`` what runs inside (on this thread)."""
    if getattr(_local, "trace", None) is not None:
        raise MaterializeError("dt.nn.meta_init() is already recording on this thread; do not nest it")
    _local.trace = trace
    _patch_init_functions()
    try:
        with _KeepConstants(trace), _RecordOps(trace):
            yield trace
    finally:
        _unpatch_init_functions()
        _local.trace = None


@contextlib.contextmanager
def meta_init():
    """Build a model on the meta device and record its initialisation for ``dt.nn.materialize``.

    ::

        torch.manual_seed(0)
        with dt.nn.meta_init():
            model = GPT(cfg)                     # no memory used: parameters are meta tensors
        dt.nn.materialize(model, mesh["tp"], plan)   # the same values as GPT(cfg) on one CPU

    Every initialiser that touches a meta tensor inside the block is recorded (torch ops and
    ``torch.nn.init`` functions, custom ``_init_weights`` included) together with the state of
    torch's CPU generator at entry; ``materialize`` replays them on the workers. The
    controller's own generator is not advanced by the block (building on CPU would advance it),
    and ``torch.manual_seed`` called inside the block is not seen: seed before it, or pass
    ``seed=`` to ``materialize``. Random draws on non-meta tensors inside the block raise.
    """
    trace = InitTrace(torch.get_rng_state())
    with torch.device("meta"), recording(trace):
        yield trace
