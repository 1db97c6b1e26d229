"""dtorch: single-controller distributed tensors for PyTorch.

One ordinary PyTorch program (the controller) drives one worker per device. Distributed tensors
are handles; ops on them are planned here and run asynchronously on the workers.
"""

from __future__ import annotations

from . import checkpoint, debug, errors, nn, optim, optim_replay, tensor
from .planner import native_dispatch
from .api import (
    TENSOR_METHODS,
    arange,
    device_type,
    distribute_tensor,
    empty,
    fallback_counts,
    from_local,
    full,
    gather_counts,
    init,
    init_device_mesh,
    is_initialized,
    manual_seed,
    memory_stats,
    ones,
    rand,
    randn,
    set_strict,
    shutdown,
    synchronize,
    zeros,
)
from .errors import (
    DeviceError,
    DTorchError,
    FallbackRefusedError,
    MeshMismatchError,
    OpError,
    PlacementError,
    PluginError,
    SessionError,
    TorchCompileError,
    CaptureError,
    ConfigError,
    GuardError,
    MaterializeError,
    WorkerError,
    WorkerLostError,
)
from .capture import capture, compile
from .explain import Explanation, explain
from .ir.wire import WireError
from .hookspecs import hookimpl
from .mesh import DeviceMesh
from .placement import Partial, Replicate, Shard
from .tensor import DTensor

tensor.install(TENSOR_METHODS)  # DTensor's dispatcher and movement, once, before any DTensor exists
native_dispatch.install()  # its cache hits in C++ where the extension is built (DTORCH_NATIVE_DISPATCH=0: not)
optim_replay.install()  # torch.optim step hooks that let dt.compile replay torch's optimizers

__version__ = "0.1.0"

__all__ = [
    "DTensor",
    "DeviceMesh",
    "CaptureError",
    "ConfigError",
    "DTorchError",
    "FallbackRefusedError",
    "GuardError",
    "MaterializeError",
    "MeshMismatchError",
    "OpError",
    "Partial",
    "PlacementError",
    "PluginError",
    "Replicate",
    "SessionError",
    "TorchCompileError",
    "Shard",
    "WorkerError",
    "WireError",
    "WorkerLostError",
    "DeviceError",
    "Explanation",
    "arange",
    "device_type",
    "capture",
    "checkpoint",
    "compile",
    "debug",
    "distribute_tensor",
    "empty",
    "errors",
    "explain",
    "fallback_counts",
    "from_local",
    "full",
    "gather_counts",
    "hookimpl",
    "init",
    "init_device_mesh",
    "is_initialized",
    "manual_seed",
    "memory_stats",
    "nn",
    "ones",
    "optim",
    "rand",
    "randn",
    "set_strict",
    "shutdown",
    "synchronize",
    "zeros",
]
