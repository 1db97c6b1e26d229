"""Recording how a model built on the meta device is initialised, so workers can replay it.

Inside :func:`meta_init` (or while ``materialize`` re-runs ``reset_parameters``) every op that
touches a meta tensor is recorded in order, as an :class:`InitTrace`:

- aten ops that write a tensor (``uniform_``, ``normal_``, ``fill_``, ``mul_``...) or make a new
  one (``zeros``, ``arange``, ``tril``...), seen by a ``TorchDispatchMode``. Views are not
  recorded: every tensor argument is named by its storage and its layout (size, stride,
  offset), so a view needs no step of its own;
- the ``torch.nn.init`` functions that return at once on meta tensors (``trunc_normal_``,
  ``orthogonal_``, ``sparse_``, ``dirac_``: their draws depend on the values drawn), recorded
  as one call each and replayed by calling the same function;
- the values of ``torch.tensor(data)``/``as_tensor``/``new_tensor`` results, which the meta
  device would otherwise drop, kept as constants.

No value is computed on the controller. :meth:`InitTrace.compile` turns the trace into a
:class:`ReplayProgram` for the worker kernel ``dtorch::materialize``
(``dtorch_core/ops/materialize_kernel.py``): dead steps dropped, and after each step the storages
whose values are no longer needed freed, so a worker holds about one full tensor at a time
even where a parameter is drawn twice (``nn.Linear``'s own init, then a model's
``_init_weights``): the first draw is still made (it advances the random stream) and freed at
once.

The random stream is torch's CPU generator: the workers draw every recorded random op, in
order, from one CPU generator seeded like the controller's, so the values are bit-identical to
building the model on one CPU device.

The modes and wrappers that do the recording (and :func:`meta_init` itself) are in
``init_recording.py``; this module holds the trace and its compilation.
"""

from __future__ import annotations

import contextlib

import attrs
import structlog
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..errors import MaterializeError

log = structlog.get_logger(__name__)

# aten ops (by base name) that only allocate: their storage has no values until written
_EMPTY_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"})
# in-place ops that overwrite every element of ``self`` without reading it
_OVERWRITE_OPS = frozenset({
    "fill_", "zero_", "uniform_", "normal_", "random_", "exponential_", "cauchy_", "log_normal_",
    "geometric_", "copy_", "bernoulli_",
})
# ops whose first tensor argument only lends its metadata (shape, dtype) to the result
_METADATA_ONLY = frozenset({
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones",
    "new_full",
})
# the torch.nn.init functions recorded as one call (init_recording.INIT_FUNCTIONS) that draw
# random numbers
_RANDOM_INIT = frozenset({"trunc_normal_", "orthogonal_", "sparse_"})
_SCALARS = (bool, int, float, complex, str, torch.dtype, torch.layout, torch.memory_format)

_TRACE_OF = WeakTensorKeyDictionary()  # meta tensor seen while recording -> its InitTrace


@attrs.define
class _Storage:
    key: int
    nbytes: int
    kind: str  # "fresh" (made by a step), "empty", "external" (made before recording), "const"
    data: torch.Tensor | None = None  # the bytes of a "const" storage


@attrs.frozen
class _Step:
    kind: str  # "aten" (an op) or "init" (a torch.nn.init function)
    name: str
    args: tuple
    kwargs: dict
    reads: frozenset  # storage keys whose values the step reads (partial writes included)
    overwrites: frozenset  # storage keys it overwrites whole, without reading
    partial: frozenset  # storage keys it writes in part
    fresh: tuple  # (output index, storage key, ref) of outputs with new storage
    random: bool


@attrs.frozen
class ReplayProgram:
    """What ``dtorch::materialize`` runs on each worker (every field travels on the wire).

    ``steps``: ``(kind, name, args, kwargs, fresh, extract, free, random)`` tuples, where tensor
    arguments are ``{"t": ref}`` (a ref is ``(storage, dtype, size, stride, offset)``), CPU
    constants ``{"c": i}``, metadata-only tensors ``{"m": (dtype, size, stride)}`` and explicit
    generators ``{"g": i}``; ``extract``: target indices whose final value exists after the
    step; ``free``: storages no later step reads. ``storages``: key -> (nbytes, bytes or None);
    ``targets``: one ref per tensor to fill; ``prologue``: targets known before any step.
    ``peak_bytes``: the most bytes of recorded storages a worker holds at once.
    """

    steps: tuple
    storages: dict
    constants: tuple
    generators: tuple
    targets: tuple
    prologue: tuple
    peak_bytes: int

    def kernel_kwargs(self) -> dict:
        return {
            "steps": self.steps,
            "storages": self.storages,
            "constants": self.constants,
            "generators": self.generators,
            "targets": self.targets,
            "prologue": self.prologue,
        }


@attrs.define
class InitTrace:
    """The recorded initialisation ops of one recording, in order (see the module docstring)."""

    rng_state: torch.Tensor  # torch's CPU generator state when recording began
    steps: list = attrs.field(factory=list)
    storages: dict = attrs.field(factory=dict)  # storage key -> _Storage
    constants: list = attrs.field(factory=list)
    generators: list = attrs.field(factory=list)  # (generator, its state when first used)
    paused: int = 0
    _keys: dict = attrs.field(factory=dict)  # StorageImpl address -> storage key
    _anchors: list = attrs.field(factory=list)  # keeps those storages (and addresses) alive

    # -- naming tensors ---------------------------------------------------------------------
    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def storage_key(self, t: torch.Tensor, kind: str = "external") -> int:
        """The key of ``t``'s storage, registering it (as ``kind``) on first sight."""
        storage = t.untyped_storage()
        key = self._keys.get(storage._cdata)
        if key is None:
            key = len(self.storages)
            self._keys[storage._cdata] = key
            self._anchors.append(storage)
            self.storages[key] = _Storage(key, storage.nbytes(), kind)
        _TRACE_OF[t] = self
        return key

    def known_key(self, t: torch.Tensor) -> int | None:
        return self._keys.get(t.untyped_storage()._cdata)

    def ref(self, t: torch.Tensor) -> tuple:
        return (self.storage_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _generator(self, g: torch.Generator) -> int:
        for i, (h, _) in enumerate(self.generators):
            if h is g:
                return i
        if g.device.type != "cpu":
            raise MaterializeError(
                f"an initialiser drew from a {g.device.type} generator; only CPU generators can be "
                "replayed on the workers (pass a CPU torch.Generator, or none)"
            )
        self.generators.append((g, g.get_state()))
        return len(self.generators) - 1

    def _template(self, x, where: str):
        if isinstance(x, torch.Tensor):
            if x.is_meta:
                return {"t": self.ref(x)}
            self.constants.append(x.detach().clone())
            return {"c": len(self.constants) - 1}
        if isinstance(x, torch.Generator):
            return {"g": self._generator(x)}
        if isinstance(x, torch.device):
            return torch.device("cpu") if x.type == "meta" else x
        if isinstance(x, (tuple, list)):  # torch.Size included: it travels as a tuple
            return (list if isinstance(x, list) else tuple)(self._template(a, where) for a in x)
        if x is None or isinstance(x, _SCALARS):
            return x
        raise MaterializeError(
            f"{where} got an argument of type {type(x).__name__} that cannot be replayed on the workers; "
            "initialise this tensor with torch ops or torch.nn.init functions"
        )

    # -- recording --------------------------------------------------------------------------
    def record_op(self, func, args, kwargs, out) -> None:
        name = func._schema.name.split("::")[-1]
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        if not any(t.is_meta for t in ins) and not any(o.is_meta for o in outs):
            if torch.Tag.nondeterministic_seeded in func.tags:
                raise MaterializeError(
                    f"{func} drew random values for a {_devices(ins + outs)} tensor inside dt.nn.meta_init(); "
                    "the workers could not draw the same values in order: create it on the meta device"
                )
            return
        for t in ins:
            if t.is_meta:
                self.storage_key(t)
        if name in _EMPTY_OPS:
            for o in outs:
                if o.is_meta and self.known_key(o) is None:
                    self.storage_key(o, "empty")
            return
        written = _written(func, args, kwargs)
        fresh = [(k, o) for k, o in enumerate(outs) if o.is_meta and self.known_key(o) is None]
        if not written and not fresh:
            for o in outs:  # a view: named by its storage and layout wherever it is used later
                if o.is_meta:
                    self.storage_key(o)
            return
        overwrites, partial = set(), set()
        for t, is_out in written:
            if not t.is_meta:
                continue
            key = self.storage_key(t)
            if (is_out or name in _OVERWRITE_OPS) and _covers_storage(t):
                overwrites.add(key)
            else:
                partial.add(key)
        skip = {id(t) for t, _ in written}
        metadata_only = ins[0] if name in _METADATA_ONLY and ins else None
        reads = {self.storage_key(t) for t in ins if t.is_meta and id(t) not in skip and t is not metadata_only}
        partial |= overwrites & reads  # it reads what it overwrites (an overlapping copy_)
        overwrites -= reads
        args_t = self._template(tuple(args), str(func))
        if metadata_only is not None and args and args[0] is metadata_only:
            t = metadata_only
            args_t = ({"m": (t.dtype, tuple(t.shape), tuple(t.stride()))},) + args_t[1:]
        kwargs_t = {k: self._template(v, str(func)) for k, v in kwargs.items()}
        fresh_refs = tuple((k, self.storage_key(o, "fresh"), self.ref(o)) for k, o in fresh)
        for o in outs:
            if o.is_meta:
                self.storage_key(o)
        self.steps.append(_Step("aten", func.name(), args_t, kwargs_t, frozenset(reads | partial),
                                frozenset(overwrites), frozenset(partial), fresh_refs,
                                torch.Tag.nondeterministic_seeded in func.tags))

    def record_init(self, name: str, arguments: dict) -> None:
        tensor = arguments["tensor"]
        key = self.storage_key(tensor)
        kwargs = {k: self._template(v, f"torch.nn.init.{name}") for k, v in arguments.items()}
        whole = _covers_storage(tensor)
        self.steps.append(_Step("init", name, (), kwargs, frozenset() if whole else frozenset({key}),
                                frozenset({key}) if whole else frozenset(),
                                frozenset() if whole else frozenset({key}), (), name in _RANDOM_INIT))

    def record_constant(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """``meta`` (a fresh meta tensor) holds ``value``: keep its bytes."""
        if self.known_key(meta) is not None or not _covers_storage(meta):
            return
        if value.dtype != meta.dtype or value.shape != meta.shape:
            return
        key = self.storage_key(meta, "const")
        self.storages[key].data = value.detach().contiguous().reshape(-1).view(torch.uint8).clone()

    # -- compiling --------------------------------------------------------------------------
    def compile(self, targets: list) -> ReplayProgram:
        """A program that fills ``targets`` (``(name, meta tensor)`` pairs) with their values.

        Raises :class:`MaterializeError` naming every target whose value no recorded step sets.
        """
        known = {k: s.kind == "const" for k, s in self.storages.items()}
        last_write: dict = {}
        for i, step in enumerate(self.steps):
            ok = all(known[k] for k in step.reads)
            for _, k, _ in step.fresh:
                known[k] = ok
                last_write[k] = i
            for k in step.overwrites:
                known[k] = ok
                last_write[k] = i
            for k in step.partial:
                known[k] = known[k] and ok
                last_write[k] = i
        unknown = [name for name, t in targets if not known.get(self.known_key(t), False)]
        if unknown:
            raise MaterializeError(
                f"no recorded initialisation sets the values of {', '.join(unknown)}. Build the model inside "
                "dt.nn.meta_init() so its initialisation is recorded (models built under a plain "
                "torch.device('meta') only get their modules' reset_parameters()), or give these tensors "
                "values before materialize (e.g. assign CPU tensors)"
            )
        refs = tuple(self.ref(t) for _, t in targets)
        extract_at: dict = {}
        prologue = []
        for index, ref in enumerate(refs):
            i = last_write.get(ref[0])
            if i is None:
                prologue.append(index)
            else:
                extract_at.setdefault(i, []).append(index)
        kept = _liveness(self.steps, extract_at)
        used = {r[0] for r in refs}
        for step, _, free in kept:
            used |= step.reads | step.overwrites | step.partial | {k for _, k, _ in step.fresh}
        storages = {k: (self.storages[k].nbytes, self.storages[k].data) for k in sorted(used)}
        steps = tuple(
            (s.kind, s.name, s.args, s.kwargs, s.fresh, tuple(extract_at.get(i, ())), free, s.random)
            for s, i, free in kept
        )
        program = ReplayProgram(steps, storages, tuple(self.constants), tuple(st for _, st in self.generators),
                                refs, tuple(prologue), _peak_bytes(kept, storages))
        log.debug("init program", steps=len(steps), recorded=len(self.steps), targets=len(refs),
                  peak_bytes=program.peak_bytes)
        return program


def _liveness(steps: list, extract_at: dict) -> list:
    """``(step, index, storages to free after it)`` for the steps that matter, in order.

    Walks backwards: a step matters if it draws random numbers (the stream must advance as it
    did), fills a target, or writes a value a later step reads. After a step, a storage it
    touched is freed unless a later step reads the value it now holds.
    """
    needed: set = set()
    kept = []
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        fresh = {k for _, k, _ in step.fresh}
        writes = step.overwrites | step.partial | fresh
        if not (step.random or i in extract_at or writes & needed):
            continue
        touched = step.reads | writes
        kept.append((step, i, tuple(sorted(k for k in touched if k not in needed))))
        needed -= step.overwrites | fresh
        needed |= step.reads
    kept.reverse()
    return kept


def _peak_bytes(kept, storages) -> int:
    live: dict = {}
    peak = 0
    for step, _, free in kept:
        for k in step.reads | step.overwrites | step.partial | {k for _, k, _ in step.fresh}:
            live[k] = storages[k][0]
        peak = max(peak, sum(live.values()))
        for k in free:
            live.pop(k, None)
    return peak


def _tensors(x) -> list:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _devices(ts) -> str:
    return "/".join(sorted({t.device.type for t in ts})) or "plain"


def _written(func, args, kwargs) -> list:
    """(tensor, is an out= argument) for every tensor argument ``func`` writes."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        for t in _tensors(value):
            out.append((t, bool(getattr(arg, "is_out", arg.kwarg_only))))
    return out


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its whole storage, densely: writing all of it leaves nothing old."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def trace_of(t: torch.Tensor) -> InitTrace | None:
    """The recording that saw ``t`` (a meta tensor), if any."""
    return _TRACE_OF.get(t)
