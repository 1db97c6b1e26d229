"""CLIP text encoders (transformers' CLIPTextModel, CLIPTextModelWithProjection) on a mesh
against the same model on the controller: tp=4, tp=2 x dp=2 (both orders) and dp=4, even and
uneven heads, both runners; what communicates; sp/cfg refused or replicated over."""

from __future__ import annotations

import dtorch_hf
import pytest
import torch
from hf_testing import MESHES, rel_err
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
from transformers.utils import logging as transformers_logging

import dtorch_core as dt

# "even": 4 heads of 8 and 64 MLP features divide tp 2 and 4; eos_token_id 2 takes transformers'
# legacy pooling (the argmax of the ids). "uneven": 5 heads of 8 (tp 2: 3+2, tp 4: 2+2+1+0)
# and 37 MLP features; eos_token_id 1 pools at each row's first EOS.
CONFIGS = {
    "even": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "eos_token_id": 2},
    "uneven": {"hidden_size": 40, "intermediate_size": 37, "num_attention_heads": 5, "eos_token_id": 1},
}
CLASSES = {"text": CLIPTextModel, "projection": CLIPTextModelWithProjection}
CLIP_MESHES = {**MESHES, "dp4": ((4,), ("dp",))}


def tiny_config(kind: str) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=64, num_hidden_layers=2, max_position_embeddings=16, projection_dim=12,
                          bos_token_id=0, pad_token_id=1, hidden_act="quick_gelu", **CONFIGS[kind])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    transformers_logging.set_verbosity_error()
    out = {}
    for kind in CONFIGS:
        for name, cls in CLASSES.items():
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"clip-{name}-{kind}")
            cls(tiny_config(kind)).save_pretrained(path)
            out[name, kind] = path
    return out


def clip_inputs(batch=3, length=7, eos=1, padded=True):
    """Token ids with one EOS per row at different positions (and, with ``padded``, a mask
    hiding the tail of row 1)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (batch, length), generator=g)
    for row in range(batch):
        ids[row, length - 1 - (2 * row) % length] = eos
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[1, length - 2:] = 0
    return ids, mask


def make_mesh(name: str):
    shape, names = CLIP_MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _pair(cls, path):
    return cls.from_pretrained(path).eval(), cls.from_pretrained(path).eval()


def _layers(model):
    return (model.text_model if hasattr(model, "text_model") else model).encoder.layers


def assert_outputs_equal(got, want):
    """Every tensor output of the model (hidden_states entry by entry) within 1e-4."""
    assert type(got) is type(want)
    assert len(got.hidden_states) == len(want.hidden_states)
    for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states)):
        assert rel_err(g, w) <= 1e-4, f"hidden_states[{i}]"
    for name in ("last_hidden_state", "pooler_output", "text_embeds"):
        if getattr(want, name, None) is not None:
            assert isinstance(getattr(got, name), dt.DTensor), name
            assert rel_err(getattr(got, name), getattr(want, name)) <= 1e-4, name


@pytest.mark.parametrize("cls_name", sorted(CLASSES))
@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("mesh_name", sorted(CLIP_MESHES))
def test_outputs_match(session, saved, mesh_name, kind, cls_name):
    ref, model = _pair(CLASSES[cls_name], saved[cls_name, kind])
    mesh = make_mesh(mesh_name)
    assert dtorch_hf.parallelize(model, mesh) is model
    attn = _layers(model)[1].self_attn
    sharded = "tp" in mesh.mesh_dim_names
    assert (dt.Shard(0) in attn.q_proj.weight.placements) == sharded
    assert (dt.Shard(1) in attn.out_proj.weight.placements) == sharded
    ids, mask = clip_inputs(eos=CONFIGS[kind]["eos_token_id"])
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert_outputs_equal(got, want)
    if "dp" in mesh.mesh_dim_names:          # the batch stays split where it entered
        dp = mesh.mesh_dim_names.index("dp")
        assert got.last_hidden_state.placements[dp] == dt.Shard(0)
    assert not dt.fallback_counts(), dt.fallback_counts()  # the EOS pooling (index.Tensor) has a rule


def test_tp_communicates_one_all_reduce_per_rowwise_linear(session, saved):
    """Even heads on tp=4: the two rowwise all-reduces per layer (out_proj, fc2) are the only
    communication (the EOS pooling meets replicated inputs). With 5 heads the q/k/v
    views also gather (the torch.chunk layout of 40 features on 4 is not the 2/2/1/0 heads'),
    as in T5."""
    ref, model = _pair(CLIPTextModelWithProjection, saved["projection", "even"])
    dtorch_hf.parallelize(model, make_mesh("tp4"))
    ids, mask = clip_inputs(eos=2)
    with torch.no_grad(), dt.debug.comm_mode() as comm:
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert comm.counts() == {"all_reduce": 2 * len(_layers(model))}
    with torch.no_grad():
        assert_outputs_equal(got, ref(input_ids=ids, attention_mask=mask, output_hidden_states=True))


@pytest.mark.parametrize("dim", ["sp", "cfg"])
def test_refuses_sp_and_cfg_or_replicates_over_them(session, saved, dim):
    path = saved["text", "uneven"]
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", dim))
    with pytest.raises(dtorch_hf.UnsupportedMeshDimError, match=f"'{dim}'.*not supported for CLIPTextModel"):
        dtorch_hf.parallelize(CLIPTextModel.from_pretrained(path), mesh)
    # a pipeline's mesh: the encoder is replicated over the dim it cannot use
    ref, model = _pair(CLIPTextModel, path)
    dtorch_hf.parallelize(model, mesh, unused_dims="replicate")
    assert model.encoder.layers[0].self_attn.q_proj.weight.placements == (dt.Shard(0), dt.Replicate())
    ids, mask = clip_inputs()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert_outputs_equal(got, ref(input_ids=ids, attention_mask=mask, output_hidden_states=True))
