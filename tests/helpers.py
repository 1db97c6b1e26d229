"""Helpers for comparing distributed results with plain torch, shared by the test files:
placement constants, ``distribute``/``distribute_spread``, ``assert_close``, and the op checkers
``check_op`` (with ``sample_placements``) and ``check`` (with ``on_mesh``)."""

from __future__ import annotations

import contextlib
import itertools
import os
import random

import pytest
import torch

import dtorch_core as dt

R = dt.Replicate()
P = dt.Partial("sum")

# The device type and number of workers the suite runs with (see conftest.py).
DEVICE = os.environ.get("DTORCH_TEST_DEVICE", "cpu")
WORLD_SIZE = int(os.environ.get("DTORCH_TEST_WORLD_SIZE", "4"))
MESH_2D = (2, WORLD_SIZE // 2) if WORLD_SIZE % 2 == 0 else (1, WORLD_SIZE)


def needs_world_size(n: int):
    """Skip a test written for exactly ``n`` workers when the suite runs with another number."""
    return pytest.mark.skipif(WORLD_SIZE != n, reason=f"written for {n} workers; DTORCH_TEST_WORLD_SIZE={WORLD_SIZE}")


# A bad index in a CPU kernel raises, and the worker reports it and keeps serving; on a GPU it
# is a device-side assert, which ends the process's CUDA context for good.
bad_index_raises = pytest.mark.skipif(
    DEVICE != "cpu", reason=f"an out-of-range index on {DEVICE!r} is a device-side assert, not an exception"
)
# CPU kernels give the same bits for the same inputs; GPU libraries may pick another kernel (and
# rounding) for another memory layout or stream, so bitwise comparisons hold on the CPU only.
BITWISE = DEVICE == "cpu"


def S(d):
    return dt.Shard(d)


def placements_for(t: torch.Tensor, mesh, *, partial=True, limit=None):
    """Placement lists to try for ``t`` on ``mesh``: Replicate, Shard of each dim (uneven
    sizes included) and, if ``partial``, Partial(sum)."""
    one = [dt.Replicate()] + [dt.Shard(d) for d in range(t.ndim)]
    if partial:
        one.append(dt.Partial("sum"))
    out = list(itertools.product(one, repeat=mesh.ndim))
    return out if limit is None else out[:limit]


def distribute(t: torch.Tensor, mesh, placements, requires_grad=False):
    """Distribute ``t``; Partial(sum) placements get split values that add up to ``t``."""
    x = dt.distribute_tensor(t.detach(), mesh, placements)
    if requires_grad:
        x.requires_grad_(True)
    return x


def assert_close(actual, expected, *, rtol=1e-5, atol=1e-5, msg=""):
    if isinstance(actual, dt.DTensor):
        actual = actual.full_tensor()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{msg}\n{m}")


# ---------------------------------------------------------------------------------------------
# the op checkers shared by the test_ops_* files
# ---------------------------------------------------------------------------------------------
def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]


def _differentiable(t):
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def distribute_spread(t, mesh, placements, requires_grad=False, seed=0):
    """Like ``helpers.distribute`` but every rank of a Partial mesh dim holds a different part
    of the value, so an op that forgets to reduce a Partial input shows even where
    ``f(0) == 0``: random parts that add up to ``t`` (sum) or average to it (avg); for max/min
    each element's true value sits on one random rank and the others hold smaller/larger ones.
    """
    from dtorch_core.mesh import root_coordinate
    from dtorch_core.spec import shard_region

    root = mesh.root
    full = tuple(placements)
    part_dims = [m for m, p in enumerate(full) if isinstance(p, dt.Partial)]
    if not part_dims:
        return distribute(t, mesh, placements, requires_grad)
    kinds = {full[m].reduce_op for m in part_dims}
    assert mesh.is_root and len(kinds) == 1, "one Partial kind per tensor"
    kind = kinds.pop()
    gen = torch.Generator().manual_seed(seed + 7)
    # one part per coordinate along the Partial mesh dims: replicas along the other mesh dims
    # must hold equal values
    keys = list(itertools.product(*(range(root.shape[m]) for m in part_dims)))
    noise = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k in keys}
    mean = sum(noise.values()) / len(keys)
    owner = torch.randint(len(keys), t.shape, generator=gen)
    parts = {}
    for n, k in enumerate(keys):
        if kind == "sum":
            parts[k] = t / len(keys) + noise[k] - mean
        elif kind == "avg":
            parts[k] = t + noise[k] - mean
        else:
            off = noise[k].abs() * (owner != n)
            parts[k] = t - off if kind == "max" else t + off
    shards = {}
    for rank in root.ranks:
        coord = root_coordinate(root, rank)
        region = shard_region(tuple(t.shape), full, root.shape, coord)
        index = tuple(slice(o, o + n) for o, n in region)
        shards[rank] = parts[tuple(coord[m] for m in part_dims)][index].contiguous()
    x = dt.from_local(shards, mesh, full, shape=tuple(t.shape))
    if requires_grad:
        x.requires_grad_(True)
    return x


def check_op(fn, inputs, placements, mesh, *, grad=True, rtol=1e-4, atol=1e-4, seed=0,
             expect_placements=None, spread=True, backward_fallback=()):
    """Compare ``fn(*inputs)`` on torch with ``fn`` on the inputs distributed with ``placements``.

    ``placements[i]`` is a placement list for input ``i`` or ``None`` to pass it as a plain
    torch tensor. Partial inputs are spread over the ranks (``distribute_spread``) unless
    ``spread`` is False. With ``grad`` every floating input requires grad, the outputs are
    back-propagated with a random cotangent, and the input gradients are compared.
    ``expect_placements``: placements the first output must have (checks that the rule kept a
    shard or a Partial instead of gathering). Strict mode is on: an op without a valid rule
    raises, and no op may have run through the replicated fallback, except the ops named in
    ``backward_fallback`` during the backward pass (ops of families these files do not cover;
    each use names the op so it can go once that family has its rule). Surprising gathers are
    allowed here (``gathers=False``): some views of uneven shards cannot keep them, and these
    suites check values and rule coverage (tests/test_explain.py checks the gathers).
    """
    dt.set_strict(True, gathers=False)
    msg = f"placements={placements}"
    place = distribute_spread if spread else distribute
    ref_in = [t.detach().clone().requires_grad_(grad and _differentiable(t)) for t in inputs]
    dist_in = [
        t.detach().clone() if p is None
        else place(t, mesh, p, requires_grad=grad and _differentiable(t))
        for t, p in zip(inputs, placements)
    ]
    ref_out = _flat(fn(*ref_in))
    out = fn(*dist_in)
    dist_out = _flat(out)
    assert len(dist_out) == len(ref_out), msg
    for o, r in zip(dist_out, ref_out):
        assert isinstance(o, dt.DTensor), f"{msg}: output is {type(o).__name__}, not a DTensor"
        assert o.shape == r.shape and o.dtype == r.dtype, f"{msg}: {o} vs {r.shape} {r.dtype}"
        assert_close(o.full_tensor(), r.detach(), rtol=rtol, atol=atol, msg=msg)
    if expect_placements is not None:
        assert tuple(dist_out[0].placements) == tuple(expect_placements), f"{msg}: got {dist_out[0].placements}"
    if grad:
        pairs = [(o, r) for o, r in zip(dist_out, ref_out) if r.requires_grad]
        assert pairs, f"{msg}: no differentiable output"
        gen = torch.Generator().manual_seed(seed + 1)
        cots = [torch.randn(r.shape, generator=gen, dtype=r.dtype) for _, r in pairs]
        torch.autograd.backward([r for _, r in pairs], cots)
        if backward_fallback:
            dt.set_strict(False)
        torch.autograd.backward([o for o, _ in pairs],
                                [dt.distribute_tensor(c, mesh, [R] * mesh.ndim) for c in cots])
        fallen = set(dt.fallback_counts())
        assert fallen <= set(backward_fallback), f"{msg}: fallback in backward {fallen}"
        dt.set_strict(True, gathers=False)
        n = 0
        for x, r in zip(dist_in, ref_in):
            if r.requires_grad and isinstance(x, dt.DTensor):
                if r.grad is None:  # not an input of the differentiable part (e.g. a mask)
                    assert x.grad is None, msg
                    continue
                assert x.grad is not None, f"{msg}: no gradient"
                assert_close(x.grad.full_tensor(), r.grad, rtol=rtol, atol=atol, msg=f"{msg} (grad)")
                n += 1
        assert n, f"{msg}: no gradient compared"
    assert set(dt.fallback_counts()) <= set(backward_fallback), f"{msg}: fallback {dt.fallback_counts()}"
    return out


def sample_placements(inputs, mesh, k, *, seed=0, partial=True):
    """Up to ``k`` placement combinations (one placement list per input), sampled with a fixed
    seed from every Replicate/Shard(d)/Partial choice per input (all-Replicate left out);
    inputs that are not floating never get Partial."""
    per_input = [placements_for(t, mesh, partial=partial and _differentiable(t)) for t in inputs]
    # every input replicated exercises nothing distributed
    combos = [c for c in itertools.product(*per_input) if any(p != R for pl in c for p in pl)]
    if len(combos) <= k:
        return combos
    return random.Random(seed).sample(combos, k)


def on_mesh(mesh, spec):
    """Placements for ``mesh`` from a 2-D spec: the 1-D mesh takes its first non-Replicate entry."""
    if mesh.ndim == 2:
        return list(spec)
    return [next((p for p in spec if p != R), R)]


def check(mesh, fn, tensors, specs, *, grad=(), atol=1e-5, rtol=1e-5, native=True):
    """Run ``fn`` on distributed copies of ``tensors`` (placements from ``specs``) and on the
    tensors themselves; compare every output and, for inputs in ``grad``, the gradients of a
    random weighting of the outputs. Returns the distributed outputs."""
    dts = [
        distribute(t, mesh, on_mesh(mesh, s), requires_grad=i in grad) if s is not None else t
        for i, (t, s) in enumerate(zip(tensors, specs))
    ]
    refs = [t.detach().clone().requires_grad_(i in grad) for i, t in enumerate(tensors)]
    out, ref = _flat(fn(*dts)), _flat(fn(*refs))
    assert len(out) == len(ref)
    for k, (o, r) in enumerate(zip(out, ref)):
        assert isinstance(o, dt.DTensor), f"output {k} is {type(o).__name__}"
        assert o.shape == r.shape and o.dtype == r.dtype
        assert_close(o.full_tensor(), r, atol=atol, rtol=rtol, msg=f"output {k}")
    if grad:
        gen = torch.Generator().manual_seed(7)
        pairs = [(o, r) for o, r in zip(out, ref) if r.requires_grad]
        weights = [torch.randn(r.shape, generator=gen) for _, r in pairs]
        sum((o.full_tensor() * w).sum() for (o, _), w in zip(pairs, weights)).backward()
        sum((r * w).sum() for (_, r), w in zip(pairs, weights)).backward()
        for i in grad:
            assert dts[i].grad is not None, f"input {i} got no gradient"
            assert_close(dts[i].grad.full_tensor(), refs[i].grad, atol=atol, rtol=rtol, msg=f"grad of input {i}")
    if native:
        assert dt.fallback_counts() == {}
    return out


def train(model, batches, opt_factory, loss_fn, steps, *, clip=None):
    """Train ``steps`` steps of ``batches`` (input, target); the losses as Python floats."""
    opt = opt_factory(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batches[step]
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.full_tensor().item() if isinstance(loss, dt.DTensor) else loss.item())
    return losses


def run_ranks(target, args_of_rank, world: int) -> None:
    """Run ``target(*args_of_rank(rank), errors)`` in ``world`` spawned processes; fail naming
    the ranks that hung (2 minutes) and the tracebacks the ranks put on ``errors``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(*args_of_rank(r), errors), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not alive, f"ranks hung: {[procs.index(p) for p in alive]}"
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@contextlib.contextmanager
def python_path():
    """The Python dispatcher for the block (as with DTORCH_NATIVE_DISPATCH=0)."""
    from dtorch_core.planner import native_dispatch
    from dtorch_core.tensor import DTensor

    installed = DTensor.__dict__["__torch_dispatch__"]
    DTensor.__torch_dispatch__ = native_dispatch.PYTHON_TORCH_DISPATCH
    try:
        yield
    finally:
        DTensor.__torch_dispatch__ = installed


def mutated_messages(data: bytes, trials: int, *, header: bool = False, seed: int = 0):
    """``trials`` wire messages made from ``data`` by one flipped, dropped or inserted byte (the
    header's body length kept consistent, so the body is read), and with ``header`` also byte
    flips in the header and cut messages: the decoders' fuzz input. Yields (trial, offset, bytes)."""
    body_len = int.from_bytes(data[4:8], "little")
    rng = random.Random(seed)
    kinds = 4 if header else 3
    for trial in range(trials):
        mutated = bytearray(data)
        where = rng.randrange(0 if header else 16, len(mutated))
        kind = trial % kinds
        if kind == 0:
            mutated[where] = rng.randrange(256)
        elif kind == 1:
            where = max(where, 16)
            del mutated[where]
            mutated[4:8] = (body_len - 1).to_bytes(4, "little")
        elif kind == 2:
            where = max(where, 16)
            mutated.insert(where, rng.randrange(256))
            mutated[4:8] = (body_len + 1).to_bytes(4, "little")
        else:
            del mutated[where:]
        yield trial, where, bytes(mutated)
