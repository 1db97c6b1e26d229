"""How long a sync point takes on the process runner, hop by hop, against torch's own sync.

    python bench/sync_latency.py [--device cuda] [--rounds 200] [--step dit|gpt2|none] [--size large]

Part 1, the round trip. A tiny op then a sync, ``--rounds`` times: plain torch (a kernel, then
``torch.cuda.synchronize()``; on a CPU device the anchor is the op alone) against dtorch's
``dt.synchronize()`` on the process runner, world 1, split into its hops, every stamp from one
clock (``time.perf_counter_ns``, CLOCK_MONOTONIC on Linux):

- *flushed*: the request's batch is in the worker's channel (``Session.request`` flushes);
- *reply read*: the controller's reply thread has decoded the worker's reply (so this hop is
  the worker's wake, its run of the batch, its device sync and the reply's trip back);
- *awake*: the thread that called ``dt.synchronize()`` runs again (a condition and the GIL).

Also an idle sync (nothing issued since the last one).

Part 2, a step's start (``--step``, a block of bench/_blocks.py, eager, as bench/model_steps.py
runs it): from the return of the previous step's sync to the first op the controller dispatches,
to the first batch handed to the channel, and the wall time of each batch send (a send can wait
on the worker: the wall time against the calling thread's CPU time says so).

Figures are medians (and 90th percentiles) in microseconds; the ratio is dtorch's sync against
torch's in the same run. It tells whether the controller's wait at a step's end is the sync's
own latency or the work before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(1, os.path.dirname(BENCH_DIR))  # run from a checkout without installing dtorch-core

now = time.perf_counter_ns


def quantiles(values) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values) / 1e3, values[int(0.9 * (len(values) - 1))] / 1e3


class Stamps:
    """Stamps the hops of the session's requests by wrapping the runner's methods."""

    def __init__(self, session):
        self.flushed = self.read = None
        runner = session.runner
        submit, reply = runner.submit, runner._reply

        def stamped_submit(batch):
            submit(batch)
            self.flushed = now()

        def stamped_reply(r):
            reply(r)
            self.read = now()

        runner.submit, runner._reply = stamped_submit, stamped_reply


def torch_round_trip(device, rounds: int) -> list[int]:
    x = torch.ones(1024, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for _ in range(rounds):
        t0 = now()
        x = x + 1
        sync()
        out.append(now() - t0)
    return out


def dtorch_round_trip(dt, stamps, mesh, rounds: int, *, idle: bool) -> dict:
    x = dt.distribute_tensor(torch.ones(1024), mesh, [dt.Replicate()])
    dt.synchronize()
    hops = {"total": [], "flushed": [], "reply read": [], "awake": []}
    for _ in range(rounds):
        t0 = now()
        if not idle:
            x = x + 1
        dt.synchronize()
        t1 = now()
        hops["total"].append(t1 - t0)
        hops["flushed"].append(stamps.flushed - t0)
        hops["reply read"].append(stamps.read - stamps.flushed)
        hops["awake"].append(t1 - stamps.read)
    return hops


def step_start(dt, args, mesh, dtype) -> dict:
    """Stamps of a step's start: previous sync's return -> first op -> first batch sent."""
    import _blocks
    from model_steps import train_step

    from dtorch_core.runners import sending
    from dtorch_core.tensor import DTensor

    state = {"first_op": None, "first_send": None, "sends": []}
    dispatch = DTensor.__dict__["__torch_dispatch__"].__func__

    def stamped_dispatch(cls, func, types, args=(), kwargs=None):
        if state["first_op"] is None:
            state["first_op"] = now()
        return dispatch(cls, func, types, args, kwargs)

    send = sending.Sender.send

    def stamped_send(self, data, timeout):
        t0, c0 = now(), time.thread_time_ns()
        send(self, data, timeout)
        if state["first_send"] is None:
            state["first_send"] = t0
        state["sends"].append((now() - t0, time.thread_time_ns() - c0, len(data)))

    torch.manual_seed(0)
    model, batch_fn, loss_fn = _blocks.make(args.step, args.size, dtype=dtype)
    model = dt.nn.parallelize_module(model, mesh, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    batches = [tuple(dt.distribute_tensor(t, mesh, [dt.Replicate()]) for t in batch_fn(i)) for i in range(2)]
    for i in range(args.warmup):
        train_step(model, opt, loss_fn, batches[i % 2])
        dt.synchronize()
    to_op, to_send, steps = [], [], []
    sends = []
    DTensor.__torch_dispatch__ = classmethod(stamped_dispatch)
    sending.Sender.send = stamped_send
    try:
        for i in range(args.steps):
            dt.synchronize()
            state.update(first_op=None, first_send=None, sends=[])
            t0 = now()
            train_step(model, opt, loss_fn, batches[i % 2])
            dt.synchronize()
            steps.append(now() - t0)
            to_op.append(state["first_op"] - t0)
            to_send.append(state["first_send"] - state["first_op"])
            sends += state["sends"]
    finally:
        DTensor.__torch_dispatch__ = classmethod(dispatch)
        sending.Sender.send = send
    waited = [w - c for w, c, _ in sends]
    return {"step": steps, "sync return -> first op": to_op, "first op -> first batch sent": to_send,
            "send wall": [w for w, _, _ in sends], "send wall - CPU": waited, "sends per step": len(sends) / args.steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--step", default="dit", help="a block of bench/_blocks.py, or none")
    parser.add_argument("--size", default=None, help="default large on cuda, tiny on cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    args.size = args.size or ("large" if args.device == "cuda" else "tiny")

    import dtorch_core as dt
    from dtorch_core.api import current_session

    dt.init(world_size=1, runner="process", device_type=args.device)
    try:
        mesh = dt.init_device_mesh(args.device, (1,))
        stamps = Stamps(current_session())
        anchor = torch_round_trip(args.device, args.rounds)
        busy = dtorch_round_trip(dt, stamps, mesh, args.rounds, idle=False)
        idle = dtorch_round_trip(dt, stamps, mesh, args.rounds, idle=True)
        a_med, a_p90 = quantiles(anchor)
        print(f"device {args.device}, world 1, process runner, {args.rounds} rounds; us, median / p90")
        print(f"{'':34s} {'median':>9s} {'p90':>9s}")
        print(f"{'torch: op + device sync':34s} {a_med:9.1f} {a_p90:9.1f}")
        for name, hops in (("dtorch: op + dt.synchronize()", busy), ("dtorch: idle dt.synchronize()", idle)):
            med, p90 = quantiles(hops["total"])
            print(f"{name:34s} {med:9.1f} {p90:9.1f}   ({med / a_med:.2f}x torch)")
            for hop in ("flushed", "reply read", "awake"):
                med, p90 = quantiles(hops[hop])
                print(f"{'  ' + hop:34s} {med:9.1f} {p90:9.1f}")
        if args.step != "none":
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            got = step_start(dt, args, mesh, dtype)
            print(f"\n{args.step} {args.size}, eager, {args.steps} steps ({got.pop('sends per step'):.0f} batch sends a step)")
            for name, values in got.items():
                med, p90 = quantiles(values)
                print(f"{name:34s} {med:9.1f} {p90:9.1f}")
    finally:
        dt.shutdown()


if __name__ == "__main__":
    main()
