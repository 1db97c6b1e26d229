"""Sharded checkpoints (``dt.checkpoint``): round trips across meshes and placements with AdamW
state, compared with a torch model that never went through a checkpoint; crashes during save;
loading into the wrong model or from an incomplete directory.

The meshes go 2x2 -> 4x1 -> 1x1 (``MESH_2D`` -> ``(WORLD_SIZE, 1)`` when the suite runs with
another number of workers), where 1x1 is a plain torch model (the controller reads the workers'
files itself): the case of a user who trains distributed and evaluates on one device.
"""

from __future__ import annotations

import copy
import json
import os
import signal

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import dtorch_core as dt
from dtorch_core.checkpoint import publish
from dtorch_core.checkpoint import saving as save_module

from .helpers import DEVICE, MESH_2D, WORLD_SIZE, P, R, S, assert_close, needs_world_size


class Net(nn.Module):
    """Dims of 5 and 7: uneven over 2 and 4 shards (one shard of 5 over 4 is empty)."""

    def __init__(self, hidden=7):
        super().__init__()
        self.fc1 = nn.Linear(5, hidden)
        self.fc2 = nn.Linear(hidden, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))  # stays a plain tensor
        self.register_buffer("acc", torch.arange(7.0))  # state only, distributed (Partial on 2x2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


LAYOUT_2X2 = {
    "fc1.weight": [S(0), S(1)],
    "fc1.bias": [R, S(0)],
    "fc2.weight": [S(1), R],
    "fc2.bias": [S(0), S(0)],
    "acc": [P, S(0)],
}
LAYOUT_4X1 = {
    "fc1.weight": [S(1), R],  # 5 columns over 4: 2, 2, 1, 0
    "fc1.bias": [S(0), R],
    "fc2.weight": [R, R],
    "fc2.bias": [R, R],
    "acc": [P, R],
}


def distributed(model: nn.Module, mesh, layout: dict) -> nn.Module:
    """``model`` with the parameters and buffers named in ``layout`` distributed on ``mesh``."""
    for name, placements in layout.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = getattr(owner, attr)
        dist = dt.distribute_tensor(value.detach(), mesh, placements)
        if isinstance(value, nn.Parameter):
            setattr(owner, attr, nn.Parameter(dist))
        else:
            owner.register_buffer(attr, dist)
    return model


def adamw(model, lr=0.05):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def value(t):
    return t.full_tensor() if isinstance(t, dt.DTensor) else t.detach()


def full_state(model) -> dict:
    return {k: value(v).clone() for k, v in model.state_dict(keep_vars=True).items()}


def assert_same_state(model, expected: dict, *, exact=False):
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for name, t in model.state_dict(keep_vars=True).items():
        assert_close(value(t), expected[name], msg=name, **tol)


def assert_pieces_written_once(path):
    """Every element of every distributed key is in exactly one rank file, and the rank files
    hold nothing else (no replica wrote a region twice)."""
    index = json.load(open(path / "index.json"))
    expected = 0
    for key, entry in index["tensors"].items():
        sizes = [p["sizes"] for p in entry["pieces"]]
        assert sum(torch.Size(s).numel() for s in sizes) == torch.Size(entry["shape"]).numel(), key
        if entry["distributed"]:
            expected += torch.Size(entry["shape"]).numel() * getattr(torch, entry["dtype"]).itemsize
    stored = 0
    for name in index["files"]:
        if name.startswith("rank-"):
            with safe_open(str(path / name), framework="pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    stored += t.numel() * t.element_size()
    assert stored == expected


def test_round_trip_2x2_to_4x1_to_plain_with_adamw(runner, tmp_path):
    torch.manual_seed(0)
    ref = Net()
    ref_opt = adamw(ref)
    xs = [torch.randn(6, 5) for _ in range(3)]

    mesh22 = dt.init_device_mesh(DEVICE, MESH_2D)
    model = distributed(copy.deepcopy(ref), mesh22, LAYOUT_2X2)
    opt = adamw(model)
    step(model, opt, xs[0])
    step(ref, ref_opt, xs[0])
    dt.checkpoint.save(model, opt, tmp_path / "a", extra={"step": 1})
    saved = full_state(model)
    saved_exp_avg = opt.state[model.fc1.weight]["exp_avg"].full_tensor()
    assert_pieces_written_once(tmp_path / "a")
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == ["controller.safetensors", "index.json"] + [f"rank-{r:05d}.safetensors" for r in range(WORLD_SIZE)]
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no temporary directory left behind

    # 4x1, other placements, other initial values, a fresh optimizer with another lr
    mesh41 = dt.init_device_mesh(DEVICE, (WORLD_SIZE, 1))
    torch.manual_seed(1)
    model = distributed(Net(), mesh41, LAYOUT_4X1)
    opt = adamw(model, lr=0.5)
    assert dt.checkpoint.load(model, opt, tmp_path / "a") == {"step": 1}
    assert model.fc1.weight.placements == (S(1), R) and model.acc.placements == (P, R)
    assert_same_state(model, saved, exact=True)
    assert_same_state(model, ref.state_dict())
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    exp_avg = opt.state[model.fc1.weight]["exp_avg"]
    assert exp_avg.placements == (S(1), R)
    assert_close(exp_avg.full_tensor(), saved_exp_avg, rtol=0, atol=0)
    step(model, opt, xs[1])
    step(ref, ref_opt, xs[1])
    assert_same_state(model, ref.state_dict())
    dt.checkpoint.save(model, opt, tmp_path / "b", extra={"step": 2})
    assert_pieces_written_once(tmp_path / "b")

    # 1x1: a plain torch model on the controller
    plain = Net()
    plain_opt = adamw(plain, lr=0.5)
    assert dt.checkpoint.load(plain, plain_opt, tmp_path / "b") == {"step": 2}
    step(plain, plain_opt, xs[2])
    step(ref, ref_opt, xs[2])
    assert_same_state(plain, ref.state_dict())
    assert plain_opt.state[plain.fc1.weight]["step"].item() == 3
    assert dt.fallback_counts() == {}


def test_optimizer_state_of_every_kind_round_trips(runner, tmp_path):
    """A DTensor ``step``, a plain one, a non-tensor value, and state saved from a 2x2 mesh that
    the optimizer does not have yet when loading on 4x1 (created laid out like its parameter)."""
    mesh22 = dt.init_device_mesh(DEVICE, MESH_2D)
    model = distributed(Net(), mesh22, LAYOUT_2X2)
    opt = adamw(model)
    step(model, opt, torch.randn(3, 5))
    opt.state[model.fc2.bias]["step"] = dt.distribute_tensor(torch.tensor(7.0), mesh22, [R, R])
    opt.state[model.fc2.bias]["note"] = [1, "two"]
    dt.checkpoint.save(model, opt, tmp_path / "c")

    mesh41 = dt.init_device_mesh(DEVICE, (WORLD_SIZE, 1))
    model2 = distributed(Net(), mesh41, LAYOUT_4X1)
    opt2 = adamw(model2)
    dt.checkpoint.load(model2, opt2, tmp_path / "c")
    state = opt2.state[model2.fc2.bias]
    assert isinstance(state["step"], dt.DTensor) and state["step"].full_tensor().item() == 7.0
    assert state["note"] == [1, "two"]
    assert isinstance(opt2.state[model2.fc1.weight]["step"], torch.Tensor)
    for name, p in model.named_parameters():
        q = model2.get_parameter(name)
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[q][k].placements == q.placements
            assert_close(opt2.state[q][k].full_tensor(), opt.state[p][k].full_tensor(), rtol=0, atol=0)


def test_loading_another_model_names_missing_unexpected_and_mismatched_keys(runner, tmp_path):
    mesh22 = dt.init_device_mesh(DEVICE, MESH_2D)
    model = distributed(Net(), mesh22, LAYOUT_2X2)
    dt.checkpoint.save(model, adamw(model), tmp_path / "c")

    other = nn.Sequential()
    other.fc1 = nn.Linear(5, 8)  # another hidden size: shapes differ
    other.head = nn.Linear(8, 5)
    other = distributed(other, mesh22, {"fc1.weight": [S(0), R]})
    before = other.fc1.weight.full_tensor()
    with pytest.raises(dt.checkpoint.CheckpointMismatchError) as info:
        dt.checkpoint.load(other, adamw(other), tmp_path / "c")
    err = info.value
    assert set(err.missing) >= {"model.head.weight", "model.head.bias"}
    assert set(err.unexpected) >= {"model.fc2.weight", "model.fc2.bias", "model.scale", "model.acc"}
    assert set(err.mismatched) == {"model.fc1.weight", "model.fc1.bias"}
    assert "(8, 5) here" in err.mismatched["model.fc1.weight"]
    assert "optim.param_groups[0].head.weight" in err.missing
    assert "optim.param_groups[0].fc2.weight" in err.unexpected
    assert "model.head.weight" in str(err) and "model.fc2.weight" in str(err)
    assert_close(other.fc1.weight.full_tensor(), before, rtol=0, atol=0)  # nothing was loaded

    with pytest.raises(dt.checkpoint.CheckpointMismatchError, match="dtype float32 in the checkpoint, float64"):
        dt.checkpoint.load(Net().double(), None, tmp_path / "c")
    dt.checkpoint.save(model, None, tmp_path / "no-optimizer")
    with pytest.raises(dt.checkpoint.CheckpointMismatchError, match="optim.param_groups"):
        dt.checkpoint.load(model, adamw(model), tmp_path / "no-optimizer")


def test_tied_weights_are_written_once(tmp_path):
    model = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight
    dt.checkpoint.save(model, None, tmp_path / "c")
    index = json.load(open(tmp_path / "c" / "index.json"))
    assert index["tensors"]["model.0.weight"] == index["tensors"]["model.1.weight"]
    with safe_open(str(tmp_path / "c" / "controller.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["model.0.weight"]
    other = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    dt.checkpoint.load(other, None, tmp_path / "c")
    assert torch.equal(other[0].weight, model[0].weight) and torch.equal(other[1].weight, model[0].weight)


@needs_world_size(4)  # rank 2 fails its write
def test_failed_write_on_a_worker_keeps_the_last_checkpoint(runner, tmp_path, monkeypatch):
    """A worker whose file cannot be written: the save raises naming the rank and the file, and
    the previous checkpoint at the path is untouched and loads."""
    mesh22 = dt.init_device_mesh(DEVICE, MESH_2D)
    model = distributed(Net(), mesh22, LAYOUT_2X2)
    opt = adamw(model)
    path = tmp_path / "ckpt"
    dt.checkpoint.save(model, opt, path, extra={"step": 1})
    saved = full_state(model)
    step(model, opt, torch.randn(3, 5))

    make_temp = publish.make_temp

    def sabotaged(p):
        tmp = make_temp(p)
        (tmp / "rank-00002.safetensors").mkdir()  # rank 2 cannot create its file
        return tmp

    monkeypatch.setattr(publish, "make_temp", sabotaged)
    with pytest.raises(dt.checkpoint.CheckpointIOError, match="rank 2") as info:
        dt.checkpoint.save(model, opt, path, extra={"step": 2})
    assert info.value.rank == 2 and info.value.file.endswith("rank-00002.safetensors")
    assert os.listdir(tmp_path) == ["ckpt"]  # the failed save's directory is gone

    plain = Net()
    assert dt.checkpoint.load(plain, None, path) == {"step": 1}
    for k, v in plain.state_dict().items():
        assert_close(v, saved[k], rtol=0, atol=0, msg=k)


@pytest.mark.skipif("process" not in os.environ.get("DTORCH_TEST_RUNNERS", "inline,thread,process"),
                    reason="process runner deselected by DTORCH_TEST_RUNNERS")
def test_killed_worker_during_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    session = dt.init(world_size=2, runner="process")
    try:
        mesh = dt.init_device_mesh("cpu", (2,))
        model = distributed(Net(), mesh, {"fc1.weight": [S(0)], "fc2.weight": [S(1)]})
        path = tmp_path / "ckpt"
        dt.checkpoint.save(model, None, path, extra={"step": 1})
        saved = full_state(model)
        with torch.no_grad():
            model.fc1.weight.add_(1.0)
        run_kernel = save_module.run_kernel

        def kill_then_run(*args, **kwargs):
            session.runner.procs[1].send_signal(signal.SIGKILL)
            return run_kernel(*args, **kwargs)

        monkeypatch.setattr(save_module, "run_kernel", kill_then_run)
        with pytest.raises(dt.WorkerLostError, match="rank 1"):
            dt.checkpoint.save(model, None, path, extra={"step": 2})
    finally:
        dt.shutdown()
    # rank 0 may still have been writing when the loss was reported: a leftover temporary
    # directory is possible (the next save removes it), a changed checkpoint is not
    assert all(n == "ckpt" or n.startswith(".ckpt.tmp-") for n in os.listdir(tmp_path))
    plain = Net()
    assert dt.checkpoint.load(plain, None, path) == {"step": 1}
    for k, v in plain.state_dict().items():
        assert_close(v, saved[k], rtol=0, atol=0, msg=k)


def test_a_crash_while_publishing_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    """Plain models (no session needed): interrupt the publish between its two renames (the
    path that systems without an atomic exchange take) and at the index."""
    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    old, new = Net(), Net()
    dt.checkpoint.save(old, None, path, extra={"v": "old"})

    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)

    def crash(tmp, p):
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(publish, "rename_into_place", crash)
    with pytest.raises(KeyboardInterrupt):
        dt.checkpoint.save(new, None, path, extra={"v": "new"})
    assert not path.exists()  # the crash hit between the renames: the old one is aside
    loaded = Net(hidden=7)
    assert dt.checkpoint.load(loaded, None, path) == {"v": "old"}
    assert_close(loaded.fc1.weight, old.fc1.weight, rtol=0, atol=0)

    monkeypatch.undo()
    dt.checkpoint.save(new, None, path, extra={"v": "new"})  # recovers and cleans up
    assert dt.checkpoint.load(loaded, None, path) == {"v": "new"}
    assert_close(loaded.fc1.weight, new.fc1.weight, rtol=0, atol=0)
    assert os.listdir(tmp_path) == ["ckpt"]

    # a crash before the index is written leaves only a temporary directory: path still loads
    def no_index(directory, index):
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(save_module, "write_index", no_index)
    monkeypatch.setattr(publish, "discard", lambda tmp: None)  # a real crash cleans nothing
    with pytest.raises(KeyboardInterrupt):
        dt.checkpoint.save(old, None, path)
    assert len(os.listdir(tmp_path)) == 2
    assert dt.checkpoint.load(loaded, None, path) == {"v": "new"}
    monkeypatch.undo()
    dt.checkpoint.save(old, None, path)
    assert os.listdir(tmp_path) == ["ckpt"]  # the next save removed the leftover


def test_incomplete_checkpoints_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    dt.checkpoint.save(Net(), None, path)
    os.remove(path / "controller.safetensors")
    with pytest.raises(dt.checkpoint.CheckpointIncompleteError, match="controller.safetensors is missing"):
        dt.checkpoint.load(Net(), None, path)
    os.remove(path / "index.json")
    with pytest.raises(dt.checkpoint.CheckpointIncompleteError, match="not a complete dtorch checkpoint"):
        dt.checkpoint.load(Net(), None, path)
    with pytest.raises(dt.checkpoint.CheckpointError, match="does not exist"):
        dt.checkpoint.load(Net(), None, tmp_path / "nothing")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(dt.checkpoint.CheckpointError, match="refusing to replace"):
        dt.checkpoint.save(Net(), None, tmp_path / "mine")
    with pytest.raises(dt.checkpoint.CheckpointError, match="extra must be JSON"):
        dt.checkpoint.save(Net(), None, tmp_path / "x", extra={"bad": object()})
