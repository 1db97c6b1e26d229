"""Where the GPU idles in a step: a torch.profiler window read back into gaps between kernels.

Used by bench/gpu_idle.py on both sides: in the controller for plain torch, and in each process
runner worker through this folder's ``sitecustomize.py`` (the worker inherits the controller's
``sys.path``, so Python imports it at the worker's start). In a worker the window opens at a
``Stats`` that asks for memory figures (``dt.memory_stats()``) and closes at the next; every
``Stats`` in it (each step ends with ``dt.synchronize()``) marks a step's end. The summary of
window K is written as JSON into ``DTORCH_GPU_IDLE_OUT/windowK-workerR.json``.

A gap is the time between one kernel's end and the next one's start. It is *starved* when the
next kernel's launch call began after the previous kernel had ended (the GPU had nothing queued);
a starved gap is *waiting for the controller* when the worker's batch that launched it arrived
after that end (the worker itself had nothing to do), else *worker busy* (the worker was still
working through its batch). A gap whose kernel was launched in time is the GPU's own (a copy, an
event wait).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os

FRAME = "dtorch.frame"  # a batch frame in a worker: decode and run
DECODE = "dtorch.decode"  # a frame's decoding, inside it
SYNC = "dtorch.sync"  # one step's end (Stats in a worker, the bench's sync on the torch side)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaMemcpyAsync", "cudaMemsetAsync")


def cpu_events(prof) -> list:
    """(start us, end us, name) of the CPU events (aten ops, named ranges, Python functions when
    profiled with stacks), by start; kineto's clock is the same in every process of the machine."""
    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if e.device_type().name == "CPU":
            out.append((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, name))
    out.sort()
    return out


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def summarise(prof, *, min_gap_us: float = 2.0, top: int = 12) -> dict:
    """Per step of the profiled window: GPU busy and idle time, idle split by cause, top gaps."""
    events = list(prof.profiler.kineto_results.events())
    kernels, launches, frames, syncs, ops, decodes = [], {}, [], [], [], []
    for e in events:
        name = e.name()
        start, end = e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3
        if e.device_type().name == "CUDA":
            if getattr(e, "is_user_annotation", lambda: False)():
                continue  # a record_function range shown on the GPU's timeline, not a kernel
            kernels.append((start, end, name, e.correlation_id()))
        elif name in LAUNCHES:
            launches[e.correlation_id()] = (start, end)
        elif name == FRAME:
            frames.append((start, end))
        elif name == DECODE:
            decodes.append((start, end))
        elif name == SYNC:
            syncs.append((start, end))
        elif name.startswith("aten::"):
            ops.append((start, end, name))
    if not kernels:  # a CPU device: its aten ops stand in for kernels, each "launched" at its start
        kernels = [(start, end, name, None) for start, end, name in ops]
        launches = {None: None}
    kernels.sort()
    frames.sort()
    ops.sort()
    syncs.sort()
    frame_starts = [f[0] for f in frames]
    op_starts = [o[0] for o in ops]
    steps = []
    for (_, begin), (_, end) in itertools.pairwise(syncs):
        ks = [k for k in kernels if begin <= k[0] < end]
        if not ks:
            continue
        busy, gaps = 0.0, []
        names, name_us = {}, {}  # per kernel name: launches and summed time (a difference shows here)
        causes = {"waiting for the controller": 0.0, "worker busy": 0.0, "gpu side": 0.0}
        last_end = ks[0][0]
        for start, stop, name, corr in ks:
            names[name[:110]] = names.get(name[:110], 0) + 1
            name_us[name[:110]] = name_us.get(name[:110], 0.0) + stop - start
            if start - last_end > min_gap_us:
                gap = start - last_end
                launch = launches.get(corr) if corr is not None else (start, start)
                if launch is None or launch[0] < last_end:
                    cause = "gpu side"
                else:
                    i = bisect.bisect_right(frame_starts, launch[0]) - 1
                    frame_start = frames[i][0] if i >= 0 else float("-inf")
                    cause = "waiting for the controller" if frame_start >= last_end else "worker busy"
                causes[cause] += gap
                j = bisect.bisect_right(op_starts, launch[0]) - 1 if launch else -1
                op = ops[j][2] if j >= 0 else "?"
                gaps.append((gap, cause, name[:60], op, last_end, last_end - begin))
            busy += stop - max(start, last_end) if stop > last_end else 0.0
            last_end = max(last_end, stop)
        gaps.sort(reverse=True)
        # where the time before the first kernel goes: until the worker's first batch frame
        # began (the controller: its wake, its code to the first op, the first flush), that
        # frame's own time to the first launch (decode, frees, ops without kernels), the launch
        i = bisect.bisect_left(frame_starts, begin)
        first_frame = frames[i][0] if i < len(frames) and frames[i][0] < ks[0][0] else None
        # on a CPU device the first aten op stands in for the first launch
        first_launch = launches.get(ks[0][3]) if ks[0][3] is not None else (ks[0][0], ks[0][1])
        j = bisect.bisect_left(decodes, (first_frame,)) if first_frame is not None else len(decodes)
        decoded = decodes[j][1] if j < len(decodes) and decodes[j][1] <= ks[0][0] else None
        start_split = {
            "to_first_frame_us": (first_frame - begin) if first_frame is not None else None,
            "frame_decode_us": (decoded - first_frame) if decoded is not None else None,
            # against which: the median decoding of the step's frames
            "median_decode_us": _median([b - a for a, b in decodes if begin <= a < end]),
            "frame_to_launch_us": (first_launch[0] - first_frame) if first_frame is not None and first_launch else None,
            "launch_to_kernel_us": (ks[0][0] - first_launch[0]) if first_launch else None,
        }
        steps.append({
            "start_split": start_split,
            "wall_us": end - begin,
            "before_first_kernel_us": ks[0][0] - begin,
            "after_last_kernel_us": end - last_end,
            "kernels": len(ks),
            "busy_us": busy,
            "idle_between_kernels_us": sum(g[0] for g in gaps),
            "idle_by_cause_us": causes,
            "begin_us": begin,
            "kernel_names": {k: [n, round(name_us[k], 1)] for k, n in names.items()},
            "top_gaps": [{"us": round(g, 1), "cause": c, "kernel": k, "op": o, "start_us": t, "at_us": round(at, 1)}
                         for g, c, k, o, t, at in gaps[:top]],
        })
    return {"steps": steps}


def install() -> None:
    """In a process runner worker: profile the window and write its summary at the window's end."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from dtorch_core import worker_main
    from dtorch_core.ir.instructions import Stats
    from dtorch_core.worker.loop import Worker

    out = os.environ["DTORCH_GPU_IDLE_OUT"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    from dtorch_core.ir import wire

    state = {"window": 0, "prof": None}
    run_frame, execute, decode = worker_main.run_frame, Worker.execute, wire.decode

    def traced_decode(data):
        if state["prof"] is None:
            return decode(data)
        with record_function(DECODE):
            return decode(data)

    def traced_frame(*args, **kwargs):
        if state["prof"] is None:
            return run_frame(*args, **kwargs)
        with record_function(FRAME):
            return run_frame(*args, **kwargs)

    def traced_execute(self, ins):
        if type(ins) is not Stats:
            return execute(self, ins)
        opening = ins.memory and state["prof"] is None
        if opening:  # dt.memory_stats() opens the window, the next one closes it
            state["prof"] = profile(activities=activities)
            state["prof"].__enter__()
        if state["prof"] is None:
            return execute(self, ins)
        with record_function(SYNC):
            result = execute(self, ins)
        if ins.memory and not opening:
            prof, state["prof"] = state["prof"], None
            prof.__exit__(None, None, None)
            summary = summarise(prof)
            summary["rank"] = self.rank
            path = os.path.join(out, f"window{state['window']}-worker{self.rank}.json")
            with open(path + ".part", "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(path + ".part", path)  # the controller polls for the whole file
            state["window"] += 1
        return result

    worker_main.run_frame = traced_frame
    wire.decode = traced_decode  # run_frame looks it up on the module at each frame
    Worker.execute = traced_execute
