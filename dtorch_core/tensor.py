"""DTensor: the controller's handle of a distributed tensor (a wrapper subclass with no data)."""

from __future__ import annotations

from typing import Callable

import attrs
import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._guards import TracingContext

from .errors import (
    TORCH_COMPILE_ADVICE,
    DTorchError,
    TorchCompileError,
    torch_compile_refusal,
)
from .mesh import DeviceMesh
from .placement import Partial, Replicate, Shard, normalize_placements
from .spec import _CANONICAL_SPECS, TensorSpec, canonical_spec


_NO_KWARGS: dict = {}


@attrs.frozen
class TensorMethods:
    """What a DTensor needs from the layers above it: the dispatcher and the data movement.

    ``dtorch_core`` installs one at import (:func:`install`); this module imports none of them.
    """

    dispatch: Callable  # (func, args, kwargs) -> result, for every aten op on a DTensor
    redistribute: Callable  # (x, device_mesh, placements) -> DTensor, differentiable
    full_tensor: Callable  # (x) -> torch.Tensor, differentiable
    to_local: Callable  # (x, rank) -> torch.Tensor
    local_shards: Callable  # (x) -> {rank: torch.Tensor}
    from_local: Callable  # (local, device_mesh, placements, shape=...) -> DTensor


def _not_installed(*args, **kwargs):
    raise DTorchError("DTensor has no dispatcher: import dtorch_core (it installs one) before using DTensors")


_dispatch: Callable = _not_installed
_methods: TensorMethods | None = None


def install(methods: TensorMethods) -> None:
    """Give DTensor its dispatcher and movement functions (called once, by dtorch_core)."""
    global _dispatch, _methods
    _methods = methods
    _dispatch = methods.dispatch


class Handle:
    """Owns a tensor id; tells the session to free it on the workers when the handle dies."""

    __slots__ = ("tid", "session", "__weakref__")

    def __init__(self, tid: int, session):
        self.tid = tid
        self.session = session

    def __del__(self):
        try:
            self.session.release(self.tid)
        except Exception:  # interpreter shutdown: nothing left to free
            pass


_make_wrapper = torch.Tensor._make_wrapper_subclass
_HANDLE_DEVICES: dict = {}


def handle_device(device_type: str) -> torch.device:
    """The device a DTensor handle reports: the mesh's device type, with index 0 for an
    accelerator (torch's autograd engine routes a backward by device index, and an index-less
    ``cuda`` fails its checks). The workers' own devices are the runner's business."""
    dev = _HANDLE_DEVICES.get(device_type)
    if dev is None:
        dev = _HANDLE_DEVICES[device_type] = torch.device(device_type) if device_type == "cpu" else torch.device(
            device_type, 0)
    return dev


class DTensor(torch.Tensor):
    """A tensor whose shards live on the workers of a :class:`DeviceMesh`.

    Torch ops on it return at once with new handles; reading data (``full_tensor()``,
    ``item()``, ``to_local()``) waits for the workers.
    """

    _spec: TensorSpec
    _view: DeviceMesh
    _handle: Handle

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def _make(spec: TensorSpec, view: DeviceMesh, tid: int, session, requires_grad: bool = False) -> "DTensor":
        spec = _CANONICAL_SPECS.get(spec) or canonical_spec(spec)
        r = _make_wrapper(
            DTensor,
            spec.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=handle_device(spec.mesh.device_type),
            requires_grad=requires_grad,
        )
        r._spec = spec
        r._view = view
        r._handle = Handle(tid, session)
        return r

    @property
    def _tid(self) -> int:
        return self._handle.tid

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or _NO_KWARGS)

    # -- metadata (no round trip) ------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._view

    @property
    def placements(self) -> tuple:
        return tuple(self._spec.placements[d] for d in self._view.dims_in_root)

    def __repr__(self, *, tensor_contents=None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"DTensor(shape={tuple(self.shape)}, dtype={self.dtype}, mesh={self._view!r}, "
            f"placements={self.placements}{grad})"
        )

    # -- movement ------------------------------------------------------------------------------
    def redistribute(self, device_mesh: DeviceMesh | None = None, placements=None) -> "DTensor":
        """Return this tensor with new placements (differentiable)."""
        return _methods.redistribute(self, device_mesh, placements)

    def full_tensor(self) -> torch.Tensor:
        """Gather the global value onto the controller (a sync point, differentiable)."""
        return _methods.full_tensor(self)

    def to_local(self, rank: int | None = None) -> torch.Tensor:
        """The local shard held by ``rank`` (the mesh's first rank if omitted): a sync point."""
        return _methods.to_local(self, rank)

    def local_shards(self) -> dict[int, torch.Tensor]:
        """Every rank's local shard, keyed by rank (a sync point)."""
        return _methods.local_shards(self)

    # -- reads: the full value on the controller, as torch gives it for a plain tensor --------
    # (``item()``, ``bool``/``int``/``float``/``complex`` and ``__index__`` reach the dispatcher
    # as aten ops that read; these torch refuses for any subclass before dispatch)
    def _read(self) -> torch.Tensor:
        with torch.no_grad():
            return _methods.full_tensor(self)

    def tolist(self):
        """The values as (nested) Python numbers: a read (waits for the workers)."""
        return self._read().tolist()

    def numpy(self, *, force: bool = False):
        """A NumPy copy of the full value: a read. Like torch, refuses a tensor that requires grad
        unless ``force``; unlike torch the array never shares memory with the tensor."""
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return self._read().numpy()

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:  # torch formats a 0-d tensor as its value (a read here)
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    # -- torch.compile ------------------------------------------------------------------------
    @property
    def __tensor_flatten__(self):
        # torch.compile asks this of every tensor subclass it meets while it traces (through
        # is_traceable_wrapper_subclass); eager code asks it only off the per-op path. A DTensor
        # has no inner tensors to trace, so tracing refuses here, before anything runs.
        if _dynamo_tracing():
            raise torch_compile_refusal(self)
        raise AttributeError("__tensor_flatten__")

    def __deepcopy__(self, memo):
        out = self.detach().clone()
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        raise DTorchError(
            "a DTensor has no data on the controller to pickle; save t.full_tensor() or use a "
            "sharded checkpoint instead"
        )

    @staticmethod
    def from_local(local, device_mesh: DeviceMesh, placements, *, shape=None) -> "DTensor":
        return _methods.from_local(local, device_mesh, placements, shape=shape)


def _dynamo_tracing() -> bool:
    return TracingContext.try_get() is not None


def refuse_inside_torch_compile() -> None:
    """Raise :class:`TorchCompileError` where a torch.compile'd function reaches dtorch with
    plain tensors (e.g. a parallelized module's input hook distributing its input), before it
    meets any DTensor. Tracing breaks its graph here; the call then runs for real with dynamo's
    frame callback installed, which no eager call has, and raises."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=TORCH_COMPILE_ADVICE.format(what="a dtorch call inside the compiled function"))
    if get_eval_frame_callback() is not None:
        raise TorchCompileError(TORCH_COMPILE_ADVICE.format(what="a dtorch call inside the compiled function"))


def root_placements(mesh: DeviceMesh, placements, ndim: int) -> tuple:
    """Placements over the root mesh for ``placements`` given on ``mesh`` (maybe a sub-mesh)."""
    placements = normalize_placements(placements, ndim, mesh.ndim)
    if mesh.is_root:
        return placements
    full = [Replicate()] * mesh.root.ndim
    for p, d in zip(placements, mesh.dims_in_root):
        full[d] = p
    return tuple(full)


def view_for(spec: TensorSpec, preferred: DeviceMesh | None) -> DeviceMesh:
    """The mesh a result is shown on: the inputs' sub-mesh when the placements fit on it."""
    if preferred is None or preferred.is_root:
        return spec.mesh
    dims = set(preferred.dims_in_root)
    if all(isinstance(p, Replicate) for d, p in enumerate(spec.placements) if d not in dims):
        return preferred
    return spec.mesh


__all__ = ["DTensor", "Shard", "Replicate", "Partial"]
