"""dtorch in two minutes: distributed tensors, ops, and an MLP trained with plain AdamW.

Runs on the default embedded runner (one worker thread per device, 4 devices on a 2x2 mesh)
and checks every result against plain PyTorch; exits non-zero if they differ beyond 1e-4.

    python examples/demo.py                      # thread runner, world size 4
    dtorch run --runner inline examples/demo.py  # the same program on another runner
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

import dtorch_core as dt

TOLERANCE = 1e-4


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def distribute_mlp(model: MLP, mesh) -> MLP:
    """Tensor parallel on "tp" (column-wise up, row-wise down), replicated on "dp".

    Every parameter becomes a distributed tensor; the module itself is unchanged.
    """
    R, S = dt.Replicate(), dt.Shard
    plan = {
        "up.weight": [R, S(0)],  # [hidden, dim]: split the output features
        "up.bias": [R, S(0)],
        "down.weight": [R, S(1)],  # [classes, hidden]: split the input features
        "down.bias": [R, R],
    }
    for name, placements in plan.items():
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        param = getattr(module, attr)
        setattr(module, attr, nn.Parameter(dt.distribute_tensor(param.detach(), mesh, placements)))
    return model


def max_diff(a, b) -> float:
    a = a.full_tensor() if isinstance(a, dt.DTensor) else a
    return (a - b).abs().max().item()


def main() -> int:
    failures = []

    def check(what: str, diff: float) -> None:
        status = "ok" if diff <= TOLERANCE else "MISMATCH"
        print(f"  {what:<44} max |dtorch - torch| = {diff:.2e}  {status}")
        if diff > TOLERANCE:
            failures.append(what)

    # 1. a session and a mesh: `dtorch run --runner/--world-size` or DTORCH_RUNNER can change both
    session = dt.init(world_size=4)
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    print(f"runner: {session.runner.name}, {session.world_size} devices, mesh: {mesh}")

    # 2. distributed tensors and ops (10 rows over 2 shards, 6 columns: uneven shards are fine)
    torch.manual_seed(0)
    a, b = torch.randn(10, 6), torch.randn(6, 8)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0), dt.Replicate()])
    w = dt.distribute_tensor(b, mesh, [dt.Replicate(), dt.Shard(1)])
    y = F.gelu(x @ w).sum(dim=1)  # returns at once: the workers compute in the background
    print(f"y: shape {tuple(y.shape)}, placements {y.placements}")  # metadata only, no round trip
    print("ops on distributed tensors:")
    check("gelu(x @ w).sum(dim=1)", max_diff(y, F.gelu(a @ b).sum(dim=1)))
    z = torch.softmax(x, dim=-1).mean(dim=0, keepdim=True) + x.std()
    check("softmax(x).mean(0) + x.std()", max_diff(z, torch.softmax(a, -1).mean(0, keepdim=True) + a.std()))
    moved = x.redistribute(mesh, [dt.Replicate(), dt.Shard(1)])
    check(f"redistribute to {list(moved.placements)}", max_diff(moved, a))

    # 3. training: the same MLP, the same data, plain torch.optim.AdamW on both sides
    torch.manual_seed(1)
    reference = MLP()
    model = distribute_mlp(copy.deepcopy(reference), mesh)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = torch.randn(24, 16), torch.randint(0, 5, (24,))
    batch = dt.distribute_tensor(inputs, mesh, [dt.Shard(0), dt.Replicate()])  # data parallel on dp
    labels = dt.distribute_tensor(targets, mesh, [dt.Shard(0), dt.Replicate()])
    print("training an MLP with AdamW (tp=2 x dp=2):")
    print(f"  {'step':>4}  {'dtorch loss':>12}  {'torch loss':>12}  {'diff':>9}")
    worst = 0.0
    for step in range(5):
        opt_ref.zero_grad()
        loss_ref = F.cross_entropy(reference(inputs), targets)
        loss_ref.backward()
        opt_ref.step()

        opt.zero_grad()
        loss = F.cross_entropy(model(batch), labels)
        loss.backward()
        opt.step()

        value = loss.full_tensor().item()  # a read: the one place the controller waits
        diff = abs(value - loss_ref.item())
        worst = max(worst, diff)
        print(f"  {step:>4}  {value:>12.6f}  {loss_ref.item():>12.6f}  {diff:>9.2e}")
    check("losses over 5 steps", worst)
    check("up.weight after training", max_diff(model.up.weight.detach(), reference.up.weight.detach()))

    # 4. capture and replay: the whole step recorded once, then sent as one message per call
    def train_step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    torch.manual_seed(2)
    base = MLP()
    eager, replayed = (distribute_mlp(copy.deepcopy(base), mesh) for _ in range(2))
    # dtorch's AdamW keeps its step count on the workers (torch's computes its bias corrections on
    # the controller, which a replay would freeze; dt.compile refuses it with a message)
    opt_e, opt_r = dt.optim.AdamW(eager.parameters(), lr=1e-2), dt.optim.AdamW(replayed.parameters(), lr=1e-2)
    step = dt.compile(train_step)
    worst = 0.0
    for _ in range(8):
        got = step(replayed, opt_r, batch, labels)
        worst = max(worst, max_diff(got, train_step(eager, opt_e, batch, labels).full_tensor()))
    print(f"capture and replay: {step.replays} of 8 steps replayed from one message each")
    check("replayed losses vs eager", worst)

    # 5. what ran where
    fallbacks = dt.fallback_counts()
    print(f"ops that ran through the replicated fallback: {fallbacks or 'none'}")
    stats = dt.memory_stats()
    print("live tensors per device: " + ", ".join(f"rank {s['rank']}: {s['live_tensors']}" for s in stats))
    dt.shutdown()

    if failures:
        print(f"FAILED: {', '.join(failures)} differ from plain torch by more than {TOLERANCE}")
        return 1
    print(f"all results match plain torch within {TOLERANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
