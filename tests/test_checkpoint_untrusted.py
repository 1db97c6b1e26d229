"""Checkpoints loaded from a directory someone else may have written (``dt.checkpoint.load``):
paths outside the directory and symbolic links, pieces that do not match the index or do not
tile their tensor, malformed indexes, loads that fail after the first checks, and the modes of
what ``save`` writes. Every refused load must leave the model and optimizer exactly as they
were; the untouched checkpoint must still load the plain torch model's values.

Checkpoints are saved from a 2x2 (``MESH_2D``) layout with uneven shards and loaded onto a 1-D
mesh, on every runner.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dtorch_core as dt
from dtorch_core.checkpoint import index as index_module
from dtorch_core.checkpoint import kernels
from dtorch_core.checkpoint import loading as loading_module
from dtorch_core.errors import CheckpointCorruptError

from .helpers import WORLD_SIZE, P, R, S, assert_close
from .test_checkpoint import LAYOUT_2X2, Net, adamw, distributed, full_state, step

# the tests that edit rank-00001 or need two pieces of a key
needs_two_workers = pytest.mark.skipif(WORLD_SIZE < 2, reason="needs two workers (two rank files)")

LAYOUT_1D = {"fc1.weight": [S(1)], "fc1.bias": [S(0)], "fc2.weight": [R], "fc2.bias": [S(0)], "acc": [P]}


@pytest.fixture
def saved(mesh2d, tmp_path):
    """(pristine checkpoint directory, the plain torch model whose values it holds)."""
    torch.manual_seed(0)
    ref = Net()
    ref_opt = adamw(ref)
    model = distributed(copy.deepcopy(ref), mesh2d, LAYOUT_2X2)
    opt = adamw(model)
    x = torch.randn(4, 5)
    step(model, opt, x)
    step(ref, ref_opt, x)
    path = tmp_path / "pristine"
    dt.checkpoint.save(model, opt, path, extra={"step": 1})
    return path, ref


@pytest.fixture
def target(mesh1d):
    """A model on another mesh with other values, and an optimizer that has state already."""
    torch.manual_seed(1)
    model = distributed(Net(), mesh1d, LAYOUT_1D)
    opt = adamw(model, lr=0.5)
    step(model, opt, torch.randn(3, 5))
    return model, opt


def snapshot(model, opt) -> dict:
    out = {f"model.{k}": v for k, v in full_state(model).items()}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim.{name}.{k}"] = v.full_tensor().clone() if isinstance(v, dt.DTensor) else copy.deepcopy(v)
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def assert_unchanged(model, opt, before: dict):
    after = snapshot(model, opt)
    assert after.keys() == before.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert_close(after[k], v, rtol=0, atol=0, msg=k)
        else:
            assert after[k] == v, k


def assert_loads_reference(model, opt, path, ref):
    assert dt.checkpoint.load(model, opt, path) == {"step": 1}
    for k, v in ref.state_dict().items():  # trained sharded vs plain: the sums may round differently
        assert_close(model.state_dict(keep_vars=True)[k], v, rtol=1e-5, atol=1e-6, msg=k)


def copy_of(path, tmp_path, name):
    dest = tmp_path / name
    shutil.copytree(path, dest, symlinks=True)
    return dest


def read_json(path):
    with open(path / "index.json") as f:
        return json.load(f)


def write_json(path, index):
    with open(path / "index.json", "w") as f:
        json.dump(index, f)


def rewrite_piece(path, file, name, tensor):
    """Replace tensor ``name`` of ``file`` and fix the size the index records (so only the piece is wrong)."""
    with safe_open(str(path / file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safetensors handle)
    tensors[name] = tensor
    save_file(tensors, str(path / file))
    index = read_json(path)
    index["files"][file] = os.path.getsize(path / file)
    write_json(path, index)


def refused(model, opt, path, before, match, error=CheckpointCorruptError):
    with pytest.raises(error, match=match) as info:
        dt.checkpoint.load(model, opt, path)
    assert_unchanged(model, opt, before)
    return info.value


@needs_two_workers
def test_files_outside_the_directory_and_links_are_refused(saved, target, tmp_path):
    path, ref = saved
    model, opt = target
    before = snapshot(model, opt)
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / "x.safetensors"
    shutil.copy(path / "rank-00001.safetensors", outside)  # the right bytes: only the path is wrong

    for i, name in enumerate(["../../elsewhere/x.safetensors", str(outside), "sub/x.safetensors", ".."]):
        bad = copy_of(path, tmp_path, f"bad-{i}")
        index = read_json(bad)
        index["files"][name] = index["files"].pop("rank-00001.safetensors")
        for entry in index["tensors"].values():
            for piece in entry["pieces"]:
                if piece["file"] == "rank-00001.safetensors":
                    piece["file"] = name
        write_json(bad, index)
        err = refused(model, opt, bad, before, "refusing to read outside")
        assert err.entry == name

    link = copy_of(path, tmp_path, "link")
    os.remove(link / "rank-00001.safetensors")
    os.symlink(outside, link / "rank-00001.safetensors")
    err = refused(model, opt, link, before, "rank-00001.safetensors is a symbolic link")
    assert err.entry == "rank-00001.safetensors"
    os.remove(link / "index.json")
    os.symlink(path / "index.json", link / "index.json")
    refused(model, opt, link, before, "index.json is not a regular file")

    assert_loads_reference(model, opt, path, ref)


@needs_two_workers
def test_the_workers_refuse_links_and_paths_themselves(saved, target, tmp_path, monkeypatch):
    """Skip the controller's checks (as if a file were swapped for a link after them): the
    workers' open refuses it, and the error names the file."""
    path, _ref = saved
    model, opt = target
    link = copy_of(path, tmp_path, "link")
    os.rename(link / "rank-00001.safetensors", tmp_path / "moved.safetensors")
    os.symlink(tmp_path / "moved.safetensors", link / "rank-00001.safetensors")
    monkeypatch.setattr(loading_module, "read_verified", index_module.read_index)
    with pytest.raises(dt.checkpoint.CheckpointIOError, match="may be partly loaded") as info:
        dt.checkpoint.load(model, opt, link)
    assert info.value.file.endswith("rank-00001.safetensors")

    dest = torch.zeros(7, 5)
    for name in ["rank-00001.safetensors", "../pristine/rank-00000.safetensors", str(path / "rank-00000.safetensors")]:
        reads = [(0, name, "model.fc1.weight", (4, 3), ((0, 4), (0, 3)), ((0, 4), (0, 3)))]
        with pytest.raises(kernels.CheckpointFileError):
            kernels.read_into(str(link), reads, [dest])
    assert torch.equal(dest, torch.zeros(7, 5))


def _piece(index, key, i):
    return index["tensors"][key]["pieces"][i]


@needs_two_workers
def test_pieces_must_match_the_index_and_tile_the_tensor(saved, target, tmp_path):
    path, ref = saved
    model, opt = target
    before = snapshot(model, opt)
    index = read_json(path)
    key = "model.fc1.weight"  # 7x5 over 2x2: pieces of 4x3, 4x2, 3x3, 3x2
    assert len(index["tensors"][key]["pieces"]) >= 2
    first = _piece(index, key, 0)
    with safe_open(str(path / first["file"]), framework="pt") as f:
        saved_piece = f.get_tensor(first["name"])
    shape = r"\(" + ", ".join(map(str, first["sizes"])) + r"\)"

    wrong_dtype = copy_of(path, tmp_path, "dtype")
    rewrite_piece(wrong_dtype, first["file"], first["name"], saved_piece.double())
    err = refused(model, opt, wrong_dtype, before, f"as F64 of shape {shape}; the index says float32 of shape {shape}")
    assert err.entry == key

    larger = copy_of(path, tmp_path, "larger")
    rewrite_piece(larger, first["file"], first["name"], torch.cat([saved_piece, saved_piece]))
    refused(model, opt, larger, before, f"of shape \\({2 * first['sizes'][0]}, ")

    def edited(name, edit):
        bad = copy_of(path, tmp_path, name)
        index = read_json(bad)
        edit(index["tensors"][key]["pieces"])
        write_json(bad, index)
        return bad

    def outside(pieces):  # one index past the end of dim 0
        pieces[-1]["offsets"][0] = 7 - pieces[-1]["sizes"][0] + 1

    def negative(pieces):
        pieces[-1]["offsets"][0] = -1

    def overlap(pieces):  # the same element count as the shape, one piece on top of another
        pieces[-1]["offsets"] = list(pieces[0]["offsets"])

    def hole(pieces):
        del pieces[-1]

    def short_region(pieces):
        pieces[0]["offsets"], pieces[0]["sizes"] = [0], [4]

    for edit, match in [(outside, "outside 0..7"), (negative, "below 0"), (overlap, "overlap"),
                        (hole, "part of it is in no piece"), (short_region, "offsets and 1 sizes|region of 1 dims")]:
        err = refused(model, opt, edited(edit.__name__, edit), before, match)
        assert err.entry == key

    assert_loads_reference(model, opt, path, ref)


def test_malformed_indexes_raise_typed_errors_before_allocating(saved, target, tmp_path):
    path, ref = saved
    model, opt = target
    before = snapshot(model, opt)

    def edited(name, edit):
        bad = copy_of(path, tmp_path, name)
        index = read_json(bad)
        edit(index)
        write_json(bad, index)
        return bad

    deep = copy_of(path, tmp_path, "deep")
    text = (deep / "index.json").read_text()
    (deep / "index.json").write_text(text.replace('"extra": {', '"extra": {"deep": ' + "[" * 100_000 + "]" * 100_000 + ", ", 1))
    refused(model, opt, deep, before, "nests its JSON too deeply")

    def unknown_parameter(index):
        index["optimizer"]["state"]["no.such.parameter"] = ["exp_avg"]

    def state_without_value(index):
        index["optimizer"]["state"]["fc1.bias"].append("exp_avg_max")

    def huge_shape(index):
        entry = index["tensors"]["optim.state.fc1.bias.exp_avg"]
        entry["shape"] = [2**40, 2**40]
        entry["pieces"] = [{"file": entry["pieces"][0]["file"], "name": entry["pieces"][0]["name"],
                            "offsets": [0, 0], "sizes": [2**40, 2**40]}]

    def huge_model_shape(index):
        entry = index["tensors"]["model.acc"]
        entry["shape"] = [10**15]
        entry["pieces"] = [dict(entry["pieces"][0], offsets=[0], sizes=[10**15])]

    def pieces_not_a_list(index):
        index["tensors"]["model.fc2.bias"]["pieces"] = {"file": "rank-00000.safetensors"}

    def shape_not_integers(index):
        index["tensors"]["model.fc2.bias"]["shape"] = ["5"]

    def no_such_dtype(index):
        index["tensors"]["model.fc2.bias"]["dtype"] = "float99"

    def ragged_value(index):  # a hyper-parameter that cannot become a tensor
        index["optimizer"]["param_groups"][0]["lr"] = {"tensor": [[1.0], [1.0, 2.0]], "dtype": "float32"}

    def tensors_not_an_object(index):
        index["tensors"] = [1, 2]

    for edit, match in [
        (unknown_parameter, "optimizer state of 'no.such.parameter', which is in none of its param groups"),
        (state_without_value, "lists optimizer state 'optim.state.fc1.bias.exp_avg_max' but holds no value"),
        (huge_shape, "optim.state.fc1.bias.exp_avg"),
        (huge_model_shape, "model.acc"),
        (pieces_not_a_list, "pieces is a dict, not a list"),
        (shape_not_integers, "is '5', not an integer"),
        (no_such_dtype, "dtype 'float99'"),
        (ragged_value, "optim.param_groups.0..lr"),
        (tensors_not_an_object, "tensors is a list, not an object"),
    ]:
        refused(model, opt, edited(edit.__name__, edit), before, match)

    assert_loads_reference(model, opt, path, ref)


def test_optimizer_state_larger_than_the_parameters_is_refused(runner, tmp_path):
    """A saved state tensor whose file really holds it, but with more elements than all the
    optimizer's parameters: refused before it is allocated."""
    torch.manual_seed(0)
    model = Net()
    opt = adamw(model)
    step(model, opt, torch.randn(2, 5))
    path = tmp_path / "c"
    dt.checkpoint.save(model, opt, path)
    rewrite_piece(path, "controller.safetensors", "optim.state.fc1.bias.exp_avg", torch.zeros(1000))
    index = read_json(path)
    entry = index["tensors"]["optim.state.fc1.bias.exp_avg"]
    entry["shape"], entry["pieces"][0]["sizes"] = [1000], [1000]
    write_json(path, index)
    fresh = Net()
    fresh_opt = adamw(fresh)  # no state yet: every state tensor would be allocated
    before = full_state(fresh)
    with pytest.raises(dt.checkpoint.CheckpointMismatchError, match="more elements than all 82"):
        dt.checkpoint.load(fresh, fresh_opt, path)
    assert fresh_opt.state == {}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_failed_load_leaves_the_model_as_it_was(saved, target, tmp_path):
    """One bad piece in the last file, for the last key read, or a bad optimizer entry: nothing
    is written, not even the keys that would have been read first."""
    path, ref = saved
    model, opt = target
    before = snapshot(model, opt)
    index = read_json(path)
    last_file = f"rank-{WORLD_SIZE - 1:05d}.safetensors"
    last_key = [k for k, e in index["tensors"].items() if any(p["file"] == last_file for p in e["pieces"])][-1]
    piece = next(p for p in index["tensors"][last_key]["pieces"] if p["file"] == last_file)
    bad = copy_of(path, tmp_path, "bad-piece")
    with safe_open(str(bad / last_file), framework="pt") as f:
        value = f.get_tensor(piece["name"])
    rewrite_piece(bad, last_file, piece["name"], value.to(torch.float16))
    refused(model, opt, bad, before, last_key)

    bad = copy_of(path, tmp_path, "bad-entry")
    index = read_json(bad)
    index["values"]["optim.state.fc2.bias.note"] = {"tensor": "not numbers", "dtype": "float32"}
    index["optimizer"]["state"]["fc2.bias"].append("note")
    write_json(bad, index)
    refused(model, opt, bad, before, "optim.state.fc2.bias.note")

    assert_loads_reference(model, opt, path, ref)


def test_saves_are_not_world_writable_with_umask_0(mesh2d, tmp_path):
    model = distributed(Net(), mesh2d, LAYOUT_2X2)
    opt = adamw(model)
    path = tmp_path / "new" / "ckpt"
    old = os.umask(0)
    try:
        dt.checkpoint.save(model, opt, path)
        dt.checkpoint.save(model, opt, path)  # replaces the first one
    finally:
        os.umask(old)
    checked = []
    for root, dirs, files in os.walk(tmp_path / "new"):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            mode = stat.S_IMODE(os.lstat(name).st_mode)
            assert mode & 0o022 == 0, f"{name} is {oct(mode)}"
            checked.append(name)
    assert len(checked) >= 3 + WORLD_SIZE  # new/, ckpt/, index.json, the data files
    plain = Net()
    dt.checkpoint.load(plain, None, path)
    for k, v in full_state(model).items():
        assert_close(plain.state_dict()[k], v, rtol=0, atol=0, msg=k)
