"""Typed errors. Each says what went wrong and what to do about it."""

from __future__ import annotations


class DTorchError(RuntimeError):
    """Base class of every error dtorch raises on purpose."""


class NotInitializedError(DTorchError):
    """An API that needs a session was called before ``dt.init()``."""


class MeshMismatchError(DTorchError):
    """Distributed tensors on different device meshes met in one op."""


class PlacementError(DTorchError):
    """A placement is invalid for the tensor or mesh it was given with."""


class OpError(DTorchError):
    """An op cannot be planned on the controller (shape error, unsupported arguments, ...)."""


class FallbackRefusedError(OpError):
    """Strict mode is on and an op has no sharding rule."""


class WorkerError(DTorchError):
    """A kernel failed on a worker; raised at the next read of an affected tensor."""

    def __init__(self, message: str, *, rank: int, op: str, source: str | None):
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.source = source


class WorkerLostError(DTorchError):
    """A worker stopped answering or died."""


class PluginError(DTorchError):
    """A plugin failed to load or registered something invalid."""


class CaptureError(DTorchError):
    """A function cannot be captured and replayed (it reads values, or differs between calls)."""


class GuardError(CaptureError):
    """A captured function was called with inputs unlike the captured ones and re-capture is off."""


class DeviceError(DTorchError):
    """The device type a session asks for is not supported here (no plugin, no such device)."""


class CheckpointError(DTorchError):
    """A checkpoint could not be saved or loaded (see the subclasses for the common cases)."""


class CheckpointIncompleteError(CheckpointError):
    """The directory holds no complete checkpoint: no index (an interrupted or foreign save), or
    a file the index lists is missing or has the wrong size."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizer it is loaded into.

    ``missing``: keys the model/optimizer has and the checkpoint lacks; ``unexpected``: keys the
    checkpoint has and the model/optimizer lacks; ``mismatched``: key -> what differs (shape,
    dtype).
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=None):
        super().__init__(message)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = dict(mismatched or {})


class CheckpointIOError(CheckpointError):
    """Reading or writing a checkpoint file failed (on a worker: ``rank`` names it; on the
    controller ``rank`` is None)."""

    def __init__(self, message: str, *, rank: int | None, file: str | None):
        super().__init__(message)
        self.rank = rank
        self.file = file


class MaterializeError(DTorchError):
    """A meta-built model cannot be materialised: a tensor's initial values were never recorded,
    or its initialisation used something the workers cannot replay."""


class SessionError(DTorchError):
    """A tensor used outside the session that made it (an ended session, or mixed sessions)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's index or files are malformed or inconsistent: a damaged checkpoint, or a
    directory written by something else. ``entry`` names the key or file at fault (None when
    it is the index as a whole). Nothing has been loaded when it is raised."""

    def __init__(self, message: str, *, entry: str | None = None):
        super().__init__(message)
        self.entry = entry


class ConfigError(DTorchError, ValueError):
    """A setting (an argument of ``dt.init``, an environment variable, a command-line option)
    has a value it cannot take; the message names the setting and the values it accepts."""


class TorchCompileError(DTorchError, TypeError):
    """``torch.compile`` met a DTensor (an input, a parameter, a global) or a dtorch call that
    makes one (``distribute_tensor``, ``from_local``, a factory). Its tracer cannot see through a
    DTensor, which holds no data on the controller; ``dt.compile`` is the compiler for
    distributed steps: it captures one call on the workers and replays it as one message."""


_TORCH_COMPILE_REFUSAL: list = []

TORCH_COMPILE_ADVICE = (
    "torch.compile cannot trace dtorch ({what}): a DTensor holds no data on the controller, and "
    "its ops are sent to the workers, not traced into a graph. Use dt.compile(fn) instead: it "
    "captures one call of the step on the workers and replays it as one message per call "
    "(dt.compile(fn, fuse_local=True) also runs torch.compile on each worker's local segments). "
    "Or call the function without torch.compile")


def torch_compile_refusal(tensor) -> TorchCompileError:
    """The :class:`TorchCompileError` to raise from inside torch.compile's tracer: an instance of
    a subclass that is also dynamo's ``TorchRuntimeError``, which dynamo passes on unchanged (it
    wraps any other exception of its tracer in ``InternalTorchDynamoError``, which the user could
    not catch as a dtorch error). Built on first use: torch._dynamo is imported by then."""
    if not _TORCH_COMPILE_REFUSAL:
        from torch._dynamo.exc import TorchRuntimeError

        _TORCH_COMPILE_REFUSAL.append(type("TorchCompileError", (TorchCompileError, TorchRuntimeError),
                                           {"__module__": __name__, "__doc__": TorchCompileError.__doc__}))
    what = f"it met a DTensor of shape {tuple(tensor.shape)}, placements {tensor.placements}"
    return _TORCH_COMPILE_REFUSAL[0](TORCH_COMPILE_ADVICE.format(what=what))
