"""Worker kernel ``dtorch::materialize``: replay a recorded initialisation, keep this rank's shards.

The controller (``dtorch_core/nn/init_trace.py``) sends a program of steps; this kernel runs
them on CPU tensors with one CPU generator seeded like the controller's, so every draw equals
what building the model on one CPU device draws. Each recorded storage is a flat byte buffer
here, allocated when a step first touches it and dropped when the program says no later step
reads it; a tensor argument is a strided view of its storage's buffer. After the step that
gives a target its final value, this rank's region of it is copied into the target's local
shard (on the worker's device).
"""

from __future__ import annotations

import torch

from ..worker.kernels import _global_rng_lock, resolve_op

_INIT_FUNCTIONS = frozenset({"trunc_normal_", "orthogonal_", "sparse_", "dirac_"})


def _with_global_stream(stream: torch.Generator, fn):
    """Run ``fn`` with torch's global CPU generator in ``stream``'s state, and advance ``stream``
    as ``fn`` advanced it (for ops without a generator argument, and initialisers like sparse_
    that draw from the global generator whatever they are given)."""
    with _global_rng_lock, torch.random.fork_rng(devices=[]):
        torch.set_rng_state(stream.get_state())
        out = fn()
        stream.set_state(torch.get_rng_state())
        return out


def _takes_generator(fn) -> bool:
    return any(a.name == "generator" for a in fn._schema.arguments)


class _Replay:
    def __init__(self, storages, constants, generators):
        self.storages = storages
        self.constants = constants
        self.generators = []
        for state in generators:
            g = torch.Generator()
            g.set_state(state)
            self.generators.append(g)
        self.buffers: dict = {}

    def buffer(self, key: int) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None:
            nbytes, data = self.storages[key]
            buf = data.clone() if data is not None else torch.empty(nbytes, dtype=torch.uint8)
            self.buffers[key] = buf
        return buf

    def tensor(self, ref) -> torch.Tensor:
        key, dtype, size, stride, offset = ref
        return self.buffer(key).view(dtype).as_strided(size, stride, offset)

    def value(self, x):
        if type(x) is dict:
            if "t" in x:
                return self.tensor(x["t"])
            if "c" in x:
                return self.constants[x["c"]]
            if "g" in x:
                return self.generators[x["g"]]
            dtype, size, stride = x["m"]
            return torch.empty_strided(size, stride, dtype=dtype)
        if type(x) in (tuple, list):
            return type(x)(self.value(a) for a in x)
        return x

    def adopt(self, out: torch.Tensor, key: int, ref) -> None:
        """Make ``out`` (a step's new tensor) the buffer of storage ``key``."""
        nbytes = self.storages[key][0]
        _, dtype, size, stride, offset = ref
        storage = out.untyped_storage()
        if (storage.nbytes() == nbytes and out.dtype == dtype and tuple(out.stride()) == tuple(stride)
                and out.storage_offset() == offset and out.device.type == "cpu"):
            self.buffers[key] = torch.empty(0, dtype=torch.uint8).set_(storage)
            return
        # a kernel chose another layout than the meta function: copy into the recorded one
        self.buffers.pop(key, None)
        self.tensor(ref).copy_(out)


def materialize_kernel(*shards, steps, storages, constants, generators, targets, prologue, regions,
                       seed=None, rng_state=None):
    """Fill ``shards`` (this rank's local shards of the targets) by replaying ``steps``; returns
    them (the call's outputs, so that a failure here marks them failed).

    ``regions[i]`` is this rank's ``(offset, length)`` per dim of target ``i``. The stream
    starts from ``torch.manual_seed(seed)`` or, without a seed, from ``rng_state``.
    """
    # the stream the model's constructor drew from: torch's global CPU generator, seeded alike
    stream = torch.Generator()
    if seed is not None:
        stream.manual_seed(seed)
    else:
        stream.set_state(rng_state)
    replay = _Replay(storages, constants, generators)

    def extract(indices):
        for i in indices:
            index = tuple(slice(off, off + n) for off, n in regions[i])
            shards[i].copy_(replay.tensor(targets[i])[index])

    extract(prologue)
    for kind, name, args, kwargs, fresh, done, free, random in steps:
        a = replay.value(args)
        kw = {k: replay.value(v) for k, v in kwargs.items()}
        if kind == "init":
            if name not in _INIT_FUNCTIONS:
                raise ValueError(f"materialize: {name!r} is not a replayable torch.nn.init function")
            fn = getattr(torch.nn.init, name)
        else:
            fn = resolve_op(name)
        if not random:
            out = fn(*a, **kw)
        elif kind == "aten" and _takes_generator(fn):
            # a draw from the default generator during construction draws from ``stream`` here:
            # no lock, so workers in one process draw at the same time
            if kw.get("generator") is None:
                kw["generator"] = stream
            out = fn(*a, **kw)
        else:
            out = _with_global_stream(stream, lambda: fn(*a, **kw))
        if fresh:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for k, key, ref in fresh:
                replay.adopt(outs[k], key, ref)
        extract(done)
        for key in free:
            replay.buffers.pop(key, None)
    return shards


def register(registry) -> None:
    registry.add("dtorch::materialize", materialize_kernel)
