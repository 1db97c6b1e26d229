"""``dtorch_hf.from_pretrained`` of one model directory: built on the meta device, each worker
reading its own shards (the controller sends no weight data), dtype conversion, tied and
non-persistent tensors, sharded checkpoints, and the errors for directories it cannot load.
Against transformers' own ``from_pretrained`` of the same directory, on both runners."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel, T5ForConditionalGeneration

import dtorch_core as dt
import dtorch_hf
from dtorch_core.controller.session import Session
from dtorch_core.errors import CheckpointMismatchError
from dtorch_hf import tiny_pipelines

from hf_testing import make_mesh, rel_err, tiny_config


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("t5")
    T5ForConditionalGeneration(tiny_config("uneven")).save_pretrained(path)   # 5 heads, d_ff 37
    return str(path)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("clip")
    tiny_pipelines.clip_text_model(CLIPTextModelWithProjection, 16).save_pretrained(path)
    return str(path)


def sent_bytes(monkeypatch) -> list:
    """Bytes of every tensor the controller sends to the workers (``Session.put``), in order."""
    sent = []
    real_put = Session.put

    def spy(self, shards, mesh):
        sent.append(sum(t.numel() * t.element_size() for t in shards.values()))
        return real_put(self, shards, mesh)

    monkeypatch.setattr(Session, "put", spy)
    return sent


def _assert_same_t5_logits(model, ref, batch=3, length=9, decoder_length=4) -> None:
    """The loaded seq2seq model's logits equal the library's model's on random tokens."""
    ids = torch.randint(2, 64, (batch, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(input_ids=ids, decoder_input_ids=ids[:, :decoder_length]).logits
        want = ref(input_ids=ids, decoder_input_ids=ids[:, :decoder_length]).logits
    assert rel_err(got, want) <= 1e-4


def _assert_same_weights(model, ref) -> None:
    got = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    want = dict(ref.named_parameters(remove_duplicate=False)) | dict(ref.named_buffers())
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert isinstance(got[name], dt.DTensor), name
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name].full_tensor(), t), name


@pytest.mark.parametrize("mesh_name", ["tp4", "tp2xdp2"])
def test_t5_loads_into_shards(session, monkeypatch, t5_dir, mesh_name):
    sent = sent_bytes(monkeypatch)
    model = dtorch_hf.from_pretrained(t5_dir, mesh=make_mesh(mesh_name))
    assert sum(sent) == 0, sent       # every weight was read by the workers themselves
    ref = T5ForConditionalGeneration.from_pretrained(t5_dir).eval()
    assert type(model) is T5ForConditionalGeneration and not model.training
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    assert dt.Shard(0) in q.placements                       # the T5 family's tp plan
    assert model.lm_head.weight is model.shared.weight is model.encoder.embed_tokens.weight  # still tied
    _assert_same_weights(model, ref)
    _assert_same_t5_logits(model, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_converted_on_the_workers(session, t5_dir, dtype):
    # fp32 files read as bf16/fp16 shards; in fp16 transformers keeps T5's "wo" in fp32
    model = dtorch_hf.from_pretrained(t5_dir, mesh=make_mesh("tp4"), torch_dtype=dtype)
    ref = T5ForConditionalGeneration.from_pretrained(t5_dir, dtype=dtype).eval()
    _assert_same_weights(model, ref)
    assert (model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32) == (dtype == torch.float16)


def test_encoder_from_a_sharded_checkpoint(session, tmp_path):
    torch.manual_seed(0)
    T5EncoderModel(tiny_config("even")).save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    model = dtorch_hf.from_pretrained(tmp_path, mesh=make_mesh("tp4"))
    ref = T5EncoderModel.from_pretrained(tmp_path).eval()
    assert type(model) is T5EncoderModel
    _assert_same_weights(model, ref)


def test_variant_files(session, tmp_path):
    torch.manual_seed(0)
    T5EncoderModel(tiny_config("even")).save_pretrained(tmp_path, variant="fp16")
    assert os.path.isfile(tmp_path / "model.fp16.safetensors")
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="expected model.safetensors"):
        dtorch_hf.from_pretrained(tmp_path, mesh=make_mesh("tp4"))
    model = dtorch_hf.from_pretrained(tmp_path, mesh=make_mesh("tp4"), variant="fp16")
    _assert_same_weights(model, T5EncoderModel.from_pretrained(tmp_path, variant="fp16").eval())


def test_non_persistent_buffers_get_their_values(session, clip_dir):
    # CLIP's position_ids is in no file: the constructor's arange is replayed on the workers
    model = dtorch_hf.from_pretrained(clip_dir, mesh=make_mesh("tp2xdp2"))
    ref = CLIPTextModelWithProjection.from_pretrained(clip_dir).eval()
    ids = model.text_model.embeddings.position_ids
    assert "text_model.embeddings.position_ids" not in load_file(os.path.join(clip_dir, "model.safetensors"))
    assert isinstance(ids, dt.DTensor) and torch.equal(ids.full_tensor(), torch.arange(8).unsqueeze(0))
    _assert_same_weights(model, ref)
    tokens = torch.randint(2, 54, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(input_ids=tokens), ref(input_ids=tokens)
    assert rel_err(got.text_embeds, want.text_embeds) <= 1e-4
    assert rel_err(got.last_hidden_state, want.last_hidden_state) <= 1e-4


def test_model_no_family_serves_is_replicated(session, clip_dir, monkeypatch):
    # a model class without a registered family still loads, replicated on the whole mesh
    monkeypatch.setattr(dtorch_hf.loading, "family_for",
                        lambda model: (_ for _ in ()).throw(dtorch_hf.UnknownModelError("none")))
    model = dtorch_hf.from_pretrained(clip_dir, mesh=make_mesh("tp4"))
    assert all(p.placements == (dt.Replicate(),) for p in model.parameters())
    _assert_same_weights(model, CLIPTextModelWithProjection.from_pretrained(clip_dir).eval())


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_errors_name_what_is_missing(session, tmp_path, t5_dir, clip_dir):
    mesh = make_mesh("tp4")
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="is not a directory"):
        dtorch_hf.from_pretrained(tmp_path / "nowhere", mesh=mesh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="neither model_index.json .* nor config.json"):
        dtorch_hf.from_pretrained(tmp_path / "empty", mesh=mesh)
    no_weights = _copy(t5_dir, tmp_path / "no_weights")
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="no weights: expected model.safetensors"):
        dtorch_hf.from_pretrained(no_weights, mesh=mesh)
    no_class = _copy(t5_dir, tmp_path / "no_class")
    config = json.loads((no_class / "config.json").read_text())
    del config["architectures"]
    (no_class / "config.json").write_text(json.dumps(config))
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="names no model class"):
        dtorch_hf.from_pretrained(no_class, mesh=mesh)
    # an index pointing outside the directory, and a file that is not safetensors
    escaping = _copy(t5_dir, tmp_path / "escaping")
    names = list(load_file(escaping / "model.safetensors"))
    (escaping / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "../model.safetensors")}))
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="cannot read the weights file '../model.safetensors'"):
        dtorch_hf.from_pretrained(escaping, mesh=mesh)
    garbage = _copy(t5_dir, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="cannot read the weights file 'model.safetensors'"):
        dtorch_hf.from_pretrained(garbage, mesh=mesh)
    # a tensor missing from the file, and one of another shape
    lacking = _copy(clip_dir, tmp_path / "lacking")
    weights = load_file(lacking / "model.safetensors")
    del weights["text_projection.weight"]
    weights["text_model.final_layer_norm.weight"] = torch.ones(17)
    save_file(weights, lacking / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match="text_projection.weight") as missing:
        dtorch_hf.from_pretrained(lacking, mesh=mesh)
    assert missing.value.missing == ("text_projection.weight",)
    weights["text_projection.weight"] = torch.zeros(16, 16)
    save_file(weights, lacking / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match="final_layer_norm.weight.*file \\(17,\\), model \\(16,\\)"):
        dtorch_hf.from_pretrained(lacking, mesh=mesh)


def test_plain_clip_text_model(session, tmp_path):
    torch.manual_seed(0)
    tiny_pipelines.clip_text_model(CLIPTextModel, 16).save_pretrained(tmp_path)
    model = dtorch_hf.from_pretrained(tmp_path, mesh=make_mesh("dp2xtp2"))
    assert type(model) is CLIPTextModel
    _assert_same_weights(model, CLIPTextModel.from_pretrained(tmp_path).eval())
