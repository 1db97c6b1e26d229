"""The family registry and parallelize's checks: registration through the entry point, mesh
dims by name (unknown and refused ones), plan overrides, and a third-party family."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.nn as nn
from transformers import T5EncoderModel

import dtorch_core as dt
import dtorch_hf
from dtorch_core.plugins import get_plugins

from hf_testing import make_mesh, rel_err, tiny_config


def test_registered_through_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="dtorch") if ep.name == "hf"]
    assert [ep.value for ep in eps] == ["dtorch_hf.plugin"]
    assert get_plugins().registry("model_families").owners["t5"] == "hf"
    family = dtorch_hf.registered_families()["t5"]
    assert family.model_classes == ("T5EncoderModel", "T5ForConditionalGeneration")


FAMILIES = ["clip-text", "flux", "sd3", "t5", "vae"]      # sorted, as dtorch info lists them


def test_dtorch_info_lists_the_families():
    from dtorch_core.cli import collect_info, format_info

    assert list(collect_info().model_families) == FAMILIES
    line = next(line for line in format_info(collect_info()).splitlines() if "model families" in line)
    assert line.split(":", 1)[1].strip() == ", ".join(FAMILIES)
    assert dtorch_hf.registered_families()["clip-text"].model_classes == ("CLIPTextModel", "CLIPTextModelWithProjection")
    assert dtorch_hf.registered_families()["vae"].model_classes == ("AutoencoderKL",)


@pytest.mark.parametrize("dim", ["sp", "cfg"])
def test_t5_refuses_sp_and_cfg(session, dim):
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", dim))
    with pytest.raises(dtorch_hf.UnsupportedMeshDimError, match=f"'{dim}'.*not supported for T5 yet"):
        dtorch_hf.parallelize(T5EncoderModel(tiny_config("even")), mesh)


def test_unknown_dim_name(session):
    mesh = dt.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    with pytest.raises(dtorch_hf.UnsupportedMeshDimError, match="'x' means nothing"):
        dtorch_hf.parallelize(T5EncoderModel(tiny_config("even")), mesh)
    with pytest.raises(dt.errors.ConfigError, match="sp_mode"):
        dtorch_hf.parallelize(T5EncoderModel(tiny_config("even")), make_mesh("tp4"), sp_mode="zigzag")


def test_unknown_model_names_families(session):
    with pytest.raises(dtorch_hf.UnknownModelError, match="no dtorch model family serves Linear.*'t5'"):
        dtorch_hf.parallelize(nn.Linear(4, 4), make_mesh("tp4"))


def test_plan_override(session):
    torch.manual_seed(0)
    ref = T5EncoderModel(tiny_config("even")).eval()
    model = T5EncoderModel(tiny_config("even")).eval()
    model.load_state_dict(ref.state_dict())
    # only the feed-forward blocks sharded; attention replicated
    plan = {"encoder.block.*.layer.1.DenseReluDense.wi_*": dt.nn.ColwiseParallel(),
            "encoder.block.*.layer.1.DenseReluDense.wo": dt.nn.RowwiseParallel()}
    dtorch_hf.parallelize(model, make_mesh("dp2xtp2"), plan=plan)
    assert model.encoder.block[0].layer[0].SelfAttention.q.weight.placements == (dt.Replicate(), dt.Replicate())
    assert dt.Shard(0) in model.encoder.block[0].layer[1].DenseReluDense.wi_0.weight.placements
    ids = torch.randint(2, 64, (4, 6))
    assert rel_err(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state) <= 1e-4
    with pytest.raises(dt.PlacementError, match="matches no sub-module"):
        dtorch_hf.parallelize(T5EncoderModel(tiny_config("even")), make_mesh("tp4"), plan={"nope.*": dt.nn.ColwiseParallel()})


def test_plan_of_torch_styles(session):
    """plan= takes torch.distributed.tensor.parallel's styles as dt.nn.parallelize_module does."""
    from torch.distributed.tensor import parallel as torch_tp

    torch.manual_seed(0)
    ref = T5EncoderModel(tiny_config("even")).eval()
    model = T5EncoderModel(tiny_config("even")).eval()
    model.load_state_dict(ref.state_dict())
    plan = {"encoder.block.*.layer.1.DenseReluDense.wi_*": torch_tp.ColwiseParallel(),
            "encoder.block.*.layer.1.DenseReluDense.wo": torch_tp.RowwiseParallel()}
    dtorch_hf.parallelize(model, make_mesh("tp4"), plan=plan)
    ffn = model.encoder.block[1].layer[1].DenseReluDense
    assert (ffn.wi_0.weight.placements, ffn.wo.weight.placements) == ((dt.Shard(0),), (dt.Shard(1),))
    ids = torch.randint(2, 64, (3, 7))
    assert rel_err(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state) <= 1e-4


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 13), nn.Linear(13, 8)

    def forward(self, input_ids):
        return self.down(torch.relu(self.up(input_ids)))


def test_third_party_family(session):
    """What a plugin's dtorch_register_model_families does, done on the loaded registry."""
    family = dtorch_hf.ModelFamily(
        name="tiny-mlp", model_classes=("TinyMLP",), dims=frozenset({"tp", "dp"}),
        tp_plan=lambda model: {"up": dt.nn.ColwiseParallel(), "down": dt.nn.RowwiseParallel()})
    registry = get_plugins().registry("model_families")
    registry.add("tiny-mlp", family)
    try:
        torch.manual_seed(0)
        ref = TinyMLP()
        model = TinyMLP()
        model.load_state_dict(ref.state_dict())
        dtorch_hf.parallelize(model, make_mesh("tp2xdp2"))
        x = torch.randn(6, 8)
        out = model(input_ids=x)
        assert out.placements == (dt.Replicate(), dt.Shard(0))      # the batch stays split over dp
        assert rel_err(out, ref(x)) <= 1e-5
    finally:
        registry.entries.pop("tiny-mlp")
        registry.owners.pop("tiny-mlp")


def test_unused_dims_replicate(session):
    """unused_dims="replicate": a dim the family cannot use (T5 and "sp") is replicated over,
    as a pipeline puts its text encoder on the transformer's mesh; the output is unchanged."""
    torch.manual_seed(0)
    ref = T5EncoderModel(tiny_config("uneven")).eval()
    model = T5EncoderModel(tiny_config("uneven")).eval()
    model.load_state_dict(ref.state_dict())
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("sp", "tp"))
    dtorch_hf.parallelize(model, mesh, unused_dims="replicate")
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    assert tuple(q.placements) == (dt.Replicate(), dt.Shard(0))
    ids = torch.randint(2, 64, (3, 7))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state) <= 1e-4
    with pytest.raises(dt.errors.ConfigError, match="unused_dims"):
        dtorch_hf.parallelize(T5EncoderModel(tiny_config("even")), mesh, unused_dims="ignore")


def test_tp_of_one_device_applies_no_plan(session):
    """A "tp" dim of size 1 shards nothing: the plan's styles (and their activation copies on
    the workers) are left out, the model is replicated there, and the output is unchanged."""
    torch.manual_seed(0)
    ref = T5EncoderModel(tiny_config("even")).eval()
    model = T5EncoderModel(tiny_config("even")).eval()
    model.load_state_dict(ref.state_dict())
    mesh = dt.init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    dtorch_hf.parallelize(model, mesh)
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    assert tuple(q.placements) == (dt.Replicate(), dt.Replicate())
    ids = torch.randint(2, 64, (3, 7))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state) <= 1e-4
