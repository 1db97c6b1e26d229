"""torch.optim steps on DTensors: fused in eager, and replayed under ``dt.compile``, with no
change to the user's code.

**Eager**: a group of ``Adam``, ``AdamW`` or ``SGD`` whose user asked for ``fused=True`` or left
the choice to torch (``foreach`` and ``fused`` both None, the defaults) steps with torch's fused
kernel, as below: one worker call per group, step counts and an lr mirror on the workers. The
for-loop and foreach paths compute bias corrections on the controller as Python numbers, new at
every step; a foreach call carries them per call (``Call.numbers``, ops/foreach_plan.py), so an
explicit ``foreach=True``, kept as asked, defines no new worker plan after its first step, but
issues more instructions than the fused call. torch's own fused path needs no change either, except that its first step's state
is made here with a DTensor step count (torch would make a plain tensor on the handle's device).

**Captured**: a non-capturable ``torch.optim.Adam`` keeps its step count in a CPU tensor and
computes the bias corrections on the controller as Python numbers, and an ``lr_scheduler`` writes
a new float ``group["lr"]`` each epoch: a captured step would freeze both. Two global optimizer
step hooks (installed once at import, see :func:`install`) act while a capture records the step
of an optimizer whose parameters are DTensors:

- groups of ``Adam``, ``AdamW`` and ``SGD`` whose params are floating DTensors of one mesh (on a
  device type torch has fused kernels for) switch to ``fused=True`` (and ``foreach=False``) for
  good: the step is one worker call of ``_fused_adam(w)_`` / ``_fused_sgd_`` per group
  (``ops/fused_optim.py``), step counts and a Tensor lr on the workers, as torch runs it under
  CUDA graphs. Each ``step`` state becomes a float32 replicated DTensor, and a moment or
  momentum buffer placed unlike its param (SGD's buffer cloned from a Partial gradient) is moved
  to the param's placement once: the kernel updates every list in the param's placement.
- other groups with a ``capturable`` setting (RMSprop, NAdam, ...) switch to ``capturable=True``
  for good, so torch itself computes the step count and corrections on the workers; each
  ``step`` state becomes a replicated DTensor.
- these conversions are made outside the recording: they are state that exists before the
  program (a replay must not reset the count).
- for the duration of a fused or capturable step, a float ``lr`` is replaced by a 0-d replicated
  DTensor *mirror* (both paths accept a Tensor lr); the user and the scheduler keep seeing the
  float. Before each replay the mirrors whose float changed are rewritten (:meth:`Guards.ready`).
- every other float setting (and the lr of optimizers with neither path, like Adagrad) is
  snapshot at capture; a replay whose optimizer settings differ is captured again instead.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import attrs
import structlog
import torch
from torch.optim import optimizer as torch_optimizer

from .api import distribute_tensor
from .placement import Partial, Replicate
from .tensor import DTensor

log = structlog.get_logger(__name__)

_SETTING_TYPES = (int, float, bool, str, tuple, type(None))
_tracked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Tracked
_watchers: list = []  # lists filled by steps_taken() blocks with (tracked, settings) per step


@attrs.define(eq=False)
class _Mirror:
    """The 0-d DTensor a group's ``lr`` reads during a captured step, and the float it holds."""

    tensor: DTensor
    value: float

    def refresh(self, value: float) -> None:
        if value != self.value:
            with torch.no_grad():  # a plain 0-d tensor: one Put and one cached copy_ plan, any value
                self.tensor.copy_(torch.tensor(value, dtype=self.tensor.dtype))
            self.value = value


@attrs.define(eq=False)
class _Tracked:
    """What the hooks keep for one optimizer whose steps were captured."""

    optimizer: weakref.ref
    session: object
    fused: set = attrs.field(factory=set)  # indices of groups switched to fused=True
    capturable: set = attrs.field(factory=set)  # indices of groups switched to capturable=True
    mirrors: dict = attrs.field(factory=dict)  # group index -> _Mirror
    # fused group index -> its param count once every param's state is in place: the eager
    # pre-hook runs each step and need not look at those params again
    settled: dict = attrs.field(factory=dict)
    floats: dict = attrs.field(factory=dict)  # during a step: group index -> the float lr to restore
    patched: list = attrs.field(factory=list)  # during a step: (module, original lookup)

    def settings(self) -> tuple:
        """The hyper-parameters a captured step froze (mirrored lrs are not frozen)."""
        opt = self.optimizer()
        return tuple(
            tuple((k, v) for k, v in group.items()
                  if k != "params" and type(v) in _SETTING_TYPES and not (k == "lr" and i in self.mirrors))
            for i, group in enumerate(opt.param_groups))

    def refresh(self) -> None:
        groups = self.optimizer().param_groups
        for i, mirror in self.mirrors.items():
            lr = groups[i]["lr"]
            if type(lr) is float:
                mirror.refresh(lr)


def _dtensor_session(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            return p._handle.session if type(p) is DTensor else None
    return None


# optimizers whose fused kernels have a sharding rule (dtorch_core/ops/fused_optim.py); AdamW is
# an Adam in recent torch, listed for the versions where it is not
_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _fused_devices() -> list:
    supported = getattr(torch_optimizer, "_get_fused_kernels_supported_devices", None)
    return supported() if supported is not None else ["cuda", "cpu"]


def _can_fuse(opt, group, params, mesh) -> bool:
    """torch's fused kernels take the group (what torch checks when ``fused=True`` is asked)."""
    return ("fused" in group and isinstance(opt, _FUSED_CLASSES) and not group.get("differentiable")
            and all(p.device_mesh == mesh and torch.is_floating_point(p) for p in params)
            and params[0].device.type in _fused_devices())


def _place_like(p: DTensor, state: dict) -> None:
    """Give the state tensors shaped like ``p`` (moments, momentum buffers) its placement.

    The fused kernel updates every list element in its param's placement; a buffer placed
    otherwise (SGD's momentum buffer is a clone of a first gradient, Partial under data
    parallelism) would be moved by each step and its handle rebound to the moved copy, which a
    replay cannot do (the program reads the tensor it freed). Moving it once, here, outside the
    recording, is state that exists before the program, like the step counts.
    """
    target = [Replicate() if isinstance(pl, Partial) else pl for pl in p.placements]
    for key, t in state.items():
        if type(t) is DTensor and t.shape == p.shape and t.device_mesh == p.device_mesh and list(t.placements) != target:
            with torch.no_grad():
                state[key] = t.redistribute(p.device_mesh, target)


def _init_adam_state(opt, group, p) -> None:
    """The state torch's ``Adam._init_group`` gives a fused group's param at its first step, with
    the step count a float32 DTensor (torch's would be a plain tensor on the handle's device)."""
    mesh = p.device_mesh
    state = opt.state[p]
    state["step"] = distribute_tensor(torch.zeros((), dtype=torch.float32), mesh, [Replicate()] * mesh.ndim)
    with torch.no_grad():
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _eager_fusable(group) -> bool:
    """Outside a capture a group steps fused where its user asked for that or left torch to pick
    (foreach and fused both None); an explicit ``foreach`` is kept."""
    return bool(group.get("fused")) or (group.get("foreach") is None and group.get("fused") is None)


def _convert(opt, tracked: _Tracked, capturing: bool) -> None:
    """Switch groups to fused (else capturable) steps with device step counts and give them lr
    mirrors (not recorded). Outside a capture only to fused steps (see :func:`_eager_fusable`)."""
    adam = isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
    for i, group in enumerate(opt.param_groups):
        params = group["params"]
        if not capturing and i not in tracked.fused and not _eager_fusable(group):
            continue
        if tracked.settled.get(i) == len(params):
            continue
        if not params or not all(type(p) is DTensor for p in params):
            continue
        mesh = params[0].device_mesh
        if i in tracked.fused or _can_fuse(opt, group, params, mesh):
            # torch refuses fused and foreach both True at construction, and SGD's step tests
            # foreach first
            group["fused"], group["foreach"] = True, False
            tracked.fused.add(i)
        elif capturing and "capturable" in group:
            group["capturable"] = True
            tracked.capturable.add(i)
        else:
            continue
        fused = i in tracked.fused
        settled = fused
        for p in params:
            state = opt.state.get(p)
            if fused and adam and not state and p.grad is not None:
                _init_adam_state(opt, group, p)  # the first step: torch would make a plain step count
                continue
            if not state:
                # none yet (no gradient, or SGD's momentum buffer, made by the step from the
                # gradient and maybe placed unlike the param): look again next step
                settled = False
                continue
            step = state.get("step")
            if isinstance(step, torch.Tensor) and type(step) is not DTensor:
                step = step.detach().to(torch.float32) if fused else step.detach()  # fused steps are float32
                state["step"] = distribute_tensor(step, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            if fused:
                _place_like(p, state)
        if i not in tracked.mirrors and type(group["lr"]) is float and all(p.device_mesh == mesh for p in params):
            lr = torch.tensor(group["lr"], dtype=torch.float32)
            tracked.mirrors[i] = _Mirror(distribute_tensor(lr, mesh, [Replicate()] * mesh.ndim), group["lr"])
        if settled:
            tracked.settled[i] = len(params)


def _patch_capturable_devices(opt, tracked: _Tracked) -> None:
    """Let torch's capturable check accept the handles' device type for this step only.

    torch refuses ``capturable=True`` for parameters whose device type is not one it can capture
    CUDA graphs for (cuda, xpu, hpu, ...), and a DTensor of a CPU mesh reports ``cpu``. The check
    guards CUDA-graph capture, not the math: the capturable update is ordinary tensor ops, which
    dtorch runs on the workers whatever their device. The functions that run the step look the
    name up in their module's globals (``from .optimizer import _get_capturable_supported_devices``
    in torch/optim/adam.py, as in torch 2.11), so the name is rebound in the modules of the
    optimizer's classes for the duration of the step, and restored by the post-hook.
    """
    original = torch_optimizer._get_capturable_supported_devices
    devices = {p.device.type for group in opt.param_groups for p in group["params"]}
    if devices <= set(original()):
        return

    def supported(*args, **kwargs):
        return [*original(*args, **kwargs), *sorted(devices)]

    for cls in type(opt).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and getattr(module, "_get_capturable_supported_devices", None) is original:
            module._get_capturable_supported_devices = supported
            tracked.patched.append((module, original))


def _capturing(session) -> bool:
    """A step is being captured for replay (dt.compile / dt.capture record inside
    :func:`steps_taken`); other recordings (tests, debugging tools) leave optimizers alone."""
    return bool(_watchers) and session.is_recording


def _pre_hook(opt, args, kwargs) -> None:
    tracked = _tracked.get(opt)
    if tracked is None:
        session = _dtensor_session(opt)
        if session is None:
            return
        tracked = _tracked[opt] = _Tracked(weakref.ref(opt), session)
        # a loaded state replaces the one converted (its step counts may be plain tensors again)
        opt.register_load_state_dict_post_hook(lambda _opt: tracked.settled.clear())
    session = tracked.session
    if session.closed:
        return  # torch's own step raises, naming the ended session
    capturing = _capturing(session)
    with session.unrecorded() if capturing else contextlib.nullcontext():
        _convert(opt, tracked, capturing)
        tracked.refresh()
    groups = opt.param_groups
    for i, mirror in tracked.mirrors.items():
        if type(groups[i]["lr"]) is float:
            tracked.floats[i] = groups[i]["lr"]
            groups[i]["lr"] = mirror.tensor
    if capturing:
        for watcher in _watchers:
            watcher.append((tracked, tracked.settings()))
    if tracked.capturable:
        _patch_capturable_devices(opt, tracked)


def _post_hook(opt, args, kwargs) -> None:
    tracked = _tracked.get(opt)
    if tracked is not None:
        _restore(opt, tracked)


def _restore(opt, tracked: _Tracked) -> None:
    groups = opt.param_groups
    for i, lr in tracked.floats.items():
        if groups[i]["lr"] is tracked.mirrors[i].tensor:
            groups[i]["lr"] = lr
    tracked.floats.clear()
    for module, original in reversed(tracked.patched):
        module._get_capturable_supported_devices = original
    tracked.patched.clear()


@attrs.frozen(eq=False)
class Guards:
    """The optimizers a captured step used, with the settings it froze."""

    steps: tuple  # (tracked, settings) per optimizer step taken

    @property
    def settings(self) -> tuple:
        return tuple((id(t), s) for t, s in self.steps)

    def ready(self) -> bool:
        """Rewrite the lr mirrors that changed; False when a frozen setting changed (re-capture)."""
        for tracked, settings in self.steps:
            opt = tracked.optimizer()
            if opt is None:
                continue
            if tracked.settings() != settings:
                return False
            tracked.refresh()
        return True

    def changed(self) -> str:
        """Which frozen settings differ now (for messages)."""
        for tracked, settings in self.steps:
            opt = tracked.optimizer()
            if opt is None:
                continue
            for i, (old, new) in enumerate(zip(settings, tracked.settings())):
                diff = {k: (v, dict(new).get(k)) for k, v in old if dict(new).get(k) != v}
                if diff:
                    return f"{type(opt).__name__} group {i}: " + ", ".join(
                        f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items())
        return "nothing"


@contextlib.contextmanager
def steps_taken():
    """Collect the optimizer steps the block takes while recording (make :class:`Guards` of them).

    Whatever a step left switched (an lr mirror, the patched device check) is put back at the end,
    also when the step raised.
    """
    steps: list = []
    _watchers.append(steps)
    try:
        yield steps
    finally:
        _watchers.remove(steps)
        for tracked, _ in steps:
            opt = tracked.optimizer()
            if opt is not None:
                _restore(opt, tracked)


_installed: list = []


def install() -> None:
    """Register the global step hooks once (``dtorch_core`` calls this at import)."""
    if not _installed:
        _installed.append(torch_optimizer.register_optimizer_step_pre_hook(_pre_hook))
        _installed.append(torch_optimizer.register_optimizer_step_post_hook(_post_hook))
