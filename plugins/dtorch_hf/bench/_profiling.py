"""Where a step's time goes, for bench/hf_models.py --profile.

- ``kernels``: one step under torch.profiler (CUDA): kernel count and summed kernel time against
  the step's wall time (how busy the GPU was), then one more step with CPU activity on every
  thread, recording which op launched each kernel (dtorch's workers run in this process with the
  thread runner, so their ops are seen: ``kernel name -> "op <- caller <- ..." [shapes]``).
- ``aten_ops``: the aten ops one step calls on this process's dispatcher (for dtorch: the ops the
  controller plans), by name.
- ``controller``: cProfile of the controller issuing one step (the call, not the synchronise).

A side here is bench/hf_models.py's ``Side``: ``call()`` issues a step, ``sync()`` waits for it.
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats

import torch

LAUNCHERS_KEPT = 3  # per kernel name: the most frequent launching op chains


def _all_threads_config():
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the controller's thread only
        return None


def kernels(side, top_names: bool) -> dict:
    """Kernels of one step of ``side`` (count, summed GPU time, how busy the GPU was) and, with
    ``top_names``, per kernel name its count, time and launching ops."""
    from torch.profiler import ProfilerActivity, profile

    side.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = side.step()
    names: collections.Counter = collections.Counter()
    gpu_us: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += 1
            gpu_us[e.name] += e.device_time
    total = sum(gpu_us.values()) / 1000
    row = {"kernels": sum(names.values()), "gpu_ms": total, "wall_ms": 1000 * wall,
           "gpu_busy": total / (1000 * wall) if wall else float("nan")}
    if top_names:
        row["names"], row["name_us"] = dict(names), dict(gpu_us)
        row["launchers"] = launchers(side)
    return row


def launchers(side) -> dict:
    """``kernel name -> {"op <- caller <- ... [input shapes]": count}`` over one step (a second,
    slower profiled step: CPU activity on every thread, with shapes)."""
    from torch.profiler import ProfilerActivity, profile

    side.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 experimental_config=_all_threads_config()) as prof:
        side.step()
    found: dict = collections.defaultdict(collections.Counter)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels:
            continue
        chain, shapes, p = [], None, e
        while p is not None and len(chain) < 5:
            if p.name.startswith("aten::") or not chain:
                chain.append(p.name)
                if shapes is None and p.name.startswith("aten::"):
                    shapes = p.input_shapes
            p = p.cpu_parent
        where = " <- ".join(chain) + (f" {shapes}" if shapes else "")
        for k in e.kernels:
            found[k.name][where] += 1
    return {name: dict(c.most_common(LAUNCHERS_KEPT)) for name, c in found.items()}


def aten_ops(side) -> collections.Counter:
    """The aten ops one step of ``side`` calls on this process's dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    side.sync()
    with Count() as mode:
        side.out = side.call()
    side.sync()
    return mode.ops


def aten_op_summary(diffusers_side, dtorch_side, top: int) -> dict:
    ops = {"diffusers": aten_ops(diffusers_side), "eager": aten_ops(dtorch_side)}
    diff = [(k, ops["eager"][k], ops["diffusers"][k]) for k in set(ops["eager"]) | set(ops["diffusers"])
            if ops["eager"][k] != ops["diffusers"][k]]
    return {"counts": {k: sum(v.values()) for k, v in ops.items()},
            "differing": sorted(diff, key=lambda d: -abs(d[1] - d[2]))[:top]}


def controller(side, top: int) -> str:
    """cProfile of the controller issuing one step, by own time and by cumulative time."""
    side.sync()
    prof = cProfile.Profile()
    prof.enable()
    side.out = side.call()
    prof.disable()
    side.sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("dtorch_core", top)  # module wrappers would fill it
    return text.getvalue()


def print_kernel_diff(prof: dict, top: int, indent: str) -> None:
    """The kernels whose count or time differs most from diffusers', with what launched them."""
    base = prof.get("diffusers", {})
    if not top or "names" not in base:
        return
    for side in ("eager", "replay"):
        mine = prof.get(side, {})
        if "names" not in mine:
            continue
        keys = set(mine["names"]) | set(base["names"])
        diff = [(k, mine["names"].get(k, 0), base["names"].get(k, 0),
                 mine["name_us"].get(k, 0.0) - base["name_us"].get(k, 0.0)) for k in keys]
        diff = [d for d in diff if d[1] != d[2] or abs(d[3]) > 50]
        diff.sort(key=lambda d: -abs(d[3]))
        for k, n_mine, n_base, dus in diff[:top]:
            print(f"{indent}{side} {n_mine:5d} vs {n_base:5d} kernels, {dus / 1000:+8.2f} ms  {k[:100]}")
            who = mine.get("launchers", {}).get(k) if n_mine > n_base else base.get("launchers", {}).get(k)
            for where, n in (who or {}).items():
                print(f"{indent}      {n:5d}x from {where[:160]}")
