"""Wire format cost: encode + decode of real instruction batches, against pickle in the same run.

    python bench/wire.py [--rounds 15] [--json out.json]

Pickle is only the yardstick (workers never unpickle). Batches are captured from real programs
under the inline runner:
  calls256    256 Calls of the ``mix`` stream (bench/_streams.py) at steady state (4-digit tids)
  batch256    the same stream's batches as the session flushes them (Calls + Deletes), 256 items
  training    every instruction of a transformer block's forward/backward/AdamW step (DefinePlans,
              Collectives, Puts with their tensors), one message
  put_1MiB    one Put of a 1 MiB float32 shard per rank (2 ranks): the tensor path
  reply_1MiB  one Reply carrying a 1 MiB float32 tensor (what full_tensor() reads)
Each row: encode and decode time per message (the minimum over rounds, rounds interleaved
with pickle's), message sizes, and the ratio wire / pickle of encode + decode.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import dtorch_core as dt  # noqa: E402
from dtorch_core.ir import wire  # noqa: E402
from dtorch_core.ir.instructions import Call, Put, Reply  # noqa: E402
from dtorch_core.controller.session import current_session  # noqa: E402

from _streams import STREAMS, global_inputs  # noqa: E402


def capture(fn) -> list:
    """Every batch a program submits, under the inline runner with 2 ranks."""
    dt.init(world_size=2, runner="inline")
    batches: list = []
    runner = current_session().runner
    submit = runner.submit

    def record(batch):
        batches.append(list(batch))
        submit(batch)

    runner.submit = record
    try:
        fn()
        dt.synchronize()
    finally:
        dt.shutdown()
    return batches


def mix_program(steps: int):
    def run():
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
        ga, gb = global_inputs(2)
        a = dt.distribute_tensor(ga, mesh, [dt.Shard(0)])
        b = dt.distribute_tensor(gb, mesh, [dt.Shard(0)])
        step, _ = STREAMS["mix"]
        for _ in range(steps):
            a = step(a, b)

    return run


def training_program():
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d=16, heads=4, ff=40):
            super().__init__()
            self.heads = heads
            self.ln = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.fc = nn.Linear(d, ff)
            self.out = nn.Linear(ff, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
            q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.out(F.gelu(self.fc(x)))

    def run():
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
        torch.manual_seed(0)
        model = Block()
        plan = {"fc.weight": [dt.Shard(0)], "fc.bias": [dt.Shard(0)], "out.weight": [dt.Shard(1)]}
        for name, module in model.named_modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                full = f"{name}.{pname}" if name else pname
                dp = dt.distribute_tensor(p.detach(), mesh, plan.get(full, [dt.Replicate()]))
                setattr(module, pname, nn.Parameter(dp))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = dt.distribute_tensor(torch.randn(4, 8, 16), mesh, [dt.Shard(0)])
        for _ in range(2):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.full_tensor()

    return run


def cases() -> dict:
    batches = capture(mix_program(2000))
    flat = [ins for batch in batches for ins in batch]
    calls = [ins for ins in flat if type(ins) is Call]
    training = [ins for batch in capture(training_program()) for ins in batch]
    mb = torch.randn(256 * 1024)
    return {
        "calls256": calls[-256:],
        "batch256": flat[-256:],
        "training": training,
        "put_1MiB": [Put(7, 1, {0: mb, 1: mb + 1})],
        "reply_1MiB": Reply(3, 1, value=mb),
    }


def best_time(fn, arg, number: int) -> float:
    t = time.perf_counter()
    for _ in range(number):
        fn(arg)
    return (time.perf_counter() - t) / number


def measure(value, rounds: int) -> dict:
    codecs = {
        "wire": (wire.encode, wire.decode),
        "pickle": (lambda v: pickle.dumps(v, protocol=5), pickle.loads),
    }
    msgs = {name: enc(value) for name, (enc, _) in codecs.items()}
    # about 20 ms per sample
    t0 = best_time(codecs["pickle"][0], value, 3)
    number = max(3, min(2000, int(0.02 / max(t0, 1e-7))))
    best: dict = {}
    for _ in range(rounds):
        for name, (enc, dec) in codecs.items():
            for what, fn, arg in (("enc", enc, value), ("dec", dec, msgs[name])):
                t = best_time(fn, arg, number)
                key = (name, what)
                best[key] = min(best.get(key, t), t)
    out = {}
    for name in codecs:
        out[name] = {
            "encode_us": best[(name, "enc")] * 1e6,
            "decode_us": best[(name, "dec")] * 1e6,
            "bytes": len(msgs[name]),
        }
    total = lambda n: out[n]["encode_us"] + out[n]["decode_us"]  # noqa: E731
    out["ratio_wire_pickle"] = total("wire") / total("pickle")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    results = {}
    print(f"{'case':12s} {'items':>5s} | {'wire enc':>9s} {'dec':>9s} {'bytes':>8s} | "
          f"{'pickle enc':>10s} {'dec':>9s} {'bytes':>8s} | wire/pickle")
    for name, value in cases().items():
        r = measure(value, args.rounds)
        results[name] = r
        w, p = r["wire"], r["pickle"]
        n = len(value) if isinstance(value, list) else 1
        print(
            f"{name:12s} {n:5d} | {w['encode_us']:8.1f}us {w['decode_us']:8.1f}us {w['bytes']:8d} | "
            f"{p['encode_us']:9.1f}us {p['decode_us']:8.1f}us {p['bytes']:8d} | {r['ratio_wire_pickle']:.2f}x"
        )
    c = results["calls256"]
    per_call = (c["wire"]["encode_us"] + c["wire"]["decode_us"]) / 256
    print(f"calls256: {per_call:.2f} us per Call (encode + decode); "
          f"ratio wire/pickle {c['ratio_wire_pickle']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
