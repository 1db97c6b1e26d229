"""``dtorch_hf.from_pretrained`` of checkpoints in other forms than one model's safetensors:
``.bin`` (pickle) weights, single and sharded (``*.bin.index.json``), of T5 and of the Flux and
SD3 transformers, on tp=4 and tp=2 x sp=2; safetensors winning over .bin; corrupt, truncated
and unsafe .bin files refused; diffusers' legacy VAE attention key names; transformers'
``key_mapping``. Against transformers'
and diffusers' own ``from_pretrained`` of the same directory, on every runner."""

from __future__ import annotations

import json
import os
import pickle

import dtorch_hf
import pytest
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.utils import logging as diffusers_logging
from hf_testing import rel_err, tiny_config
from safetensors.torch import load_file, save_file
from test_flux import CONFIG as FLUX_CONFIG
from test_flux import _inputs as flux_inputs
from test_pretrained import _assert_same_t5_logits, _assert_same_weights, sent_bytes
from test_sd3 import CONFIG as SD3_CONFIG
from test_sd3 import _inputs as sd3_inputs
from transformers import T5EncoderModel, T5ForConditionalGeneration

import dtorch_core as dt
from dtorch_core.errors import CheckpointIOError, CheckpointMismatchError

MESHES = {"tp4": ((4,), ("tp",)), "tp2xsp2": ((2, 2), ("tp", "sp"))}


def _mesh(name):
    shape, names = MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _save_bin_shards(state: dict, directory, stem: str, shards: int) -> None:
    # the sharded .bin layout both libraries write: stem-0000i-of-0000n.bin and stem.bin.index.json
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, os.path.join(directory, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(directory, f"{stem}.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _t5_bin_dir(path, sharded: bool) -> str:
    # transformers 5 writes safetensors only: the .bin files are what transformers 4's
    # save_pretrained(safe_serialization=False) wrote (torch.save of the state dict; tied keys too)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(tiny_config("uneven"))   # 5 heads, d_ff 37
    model.save_pretrained(path)
    os.remove(os.path.join(path, "model.safetensors"))
    if sharded:
        _save_bin_shards(model.state_dict(), path, "pytorch_model", 3)
    else:
        torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    return str(path)


@pytest.fixture(scope="module")
def t5_bin(tmp_path_factory):
    return {kind: _t5_bin_dir(tmp_path_factory.mktemp(f"t5-{kind}"), kind == "sharded")
            for kind in ("single", "sharded")}


@pytest.fixture(scope="module")
def transformers_bin(tmp_path_factory):
    """Flux in one ``diffusion_pytorch_model.bin``, SD3 sharded into several ``.bin`` files, as
    diffusers' ``save_pretrained(safe_serialization=False)`` writes them."""
    diffusers_logging.set_verbosity_error()
    out = {}
    for kind, cls, config, shard in (("flux", FluxTransformer2DModel, FLUX_CONFIG, "10GB"),
                                     ("sd3", SD3Transformer2DModel, SD3_CONFIG, "20KB")):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"{kind}-bin")
        cls(**config).save_pretrained(path, safe_serialization=False, max_shard_size=shard)
        out[kind] = (cls, str(path))
    return out


@pytest.mark.parametrize("kind", ["single", "sharded"])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_t5_from_bin(session, monkeypatch, t5_bin, kind, mesh_name):
    path = t5_bin[kind]
    files = [f for f in os.listdir(path) if f.endswith(".bin")]
    assert len(files) == (3 if kind == "sharded" else 1) and not any(f.endswith(".safetensors") for f in os.listdir(path))
    sent = sent_bytes(monkeypatch)
    model = dtorch_hf.from_pretrained(path, mesh=_mesh(mesh_name))
    assert sum(sent) == 0, sent          # the workers read every weight themselves
    ref = T5ForConditionalGeneration.from_pretrained(path).eval()
    assert dt.Shard(0) in model.encoder.block[0].layer[0].SelfAttention.q.weight.placements
    assert model.lm_head.weight is model.shared.weight
    _assert_same_weights(model, ref)
    _assert_same_t5_logits(model, ref)


@pytest.mark.parametrize("kind", ["flux", "sd3"])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_diffusion_transformer_from_bin(session, transformers_bin, kind, mesh_name):
    cls, path = transformers_bin[kind]
    files = os.listdir(path)
    if kind == "sd3":
        assert "diffusion_pytorch_model.bin.index.json" in files and sum(f.endswith(".bin") for f in files) > 1
    else:
        assert "diffusion_pytorch_model.bin" in files
    model = dtorch_hf.from_pretrained(path, mesh=_mesh(mesh_name))
    # diffusers looks for a sharded .bin index only when told use_safetensors=False
    ref = cls.from_pretrained(path, use_safetensors=False).eval()
    assert type(model) is cls
    assert dt.Shard(0) in model.transformer_blocks[0].attn.to_q.weight.placements
    _assert_same_weights(model, ref)
    x = flux_inputs(3, 5, 7, 1) if kind == "flux" else sd3_inputs(6, 10, 7, 1)   # 15 image + 7 text tokens
    with torch.no_grad():
        got, want = model(**x).sample, ref(**x).sample
    assert rel_err(got, want) <= 1e-4


def test_safetensors_wins_over_bin(session, tmp_path):
    # both formats present: safetensors is read (as transformers and diffusers read it); the .bin
    # here holds other values, which would show
    path = _t5_bin_dir(tmp_path, sharded=False)
    state = torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)
    T5ForConditionalGeneration.from_pretrained(path).save_pretrained(path)     # model.safetensors beside it
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, os.path.join(path, "pytorch_model.bin"))
    model = dtorch_hf.from_pretrained(path, mesh=_mesh("tp4"))
    ref = T5ForConditionalGeneration.from_pretrained(path).eval()
    assert ref.shared.weight.abs().sum() > 0
    _assert_same_weights(model, ref)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_bad_bin_files_name_the_file(session, tmp_path, t5_bin):
    mesh = _mesh("tp4")
    path = _t5_bin_dir(tmp_path / "t5", sharded=False)
    with open(os.path.join(path, "pytorch_model.bin"), "rb") as f:
        data = f.read()
    bad = {
        "truncated": data[: len(data) // 2],
        "garbage": b"not a pickle at all",
        # a pickle that would run a command when unpickled without weights_only
        "unsafe": pickle.dumps({"shared.weight": _Exploit()}),
    }
    for kind, content in bad.items():
        with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
            f.write(content)
        with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="cannot read the weights file 'pytorch_model.bin'"):
            dtorch_hf.from_pretrained(path, mesh=mesh)
        assert not os.path.exists("pwned") and not os.path.exists(os.path.join(path, "pwned")), kind
    # not a state dict
    torch.save([torch.ones(2)], os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="'pytorch_model.bin'.*not a state dict"):
        dtorch_hf.from_pretrained(path, mesh=mesh)
    # one truncated shard of a sharded checkpoint: that shard is named
    sharded = tmp_path / "sharded"
    os.mkdir(sharded)
    for f in os.listdir(t5_bin["sharded"]):
        with open(os.path.join(t5_bin["sharded"], f), "rb") as src, open(sharded / f, "wb") as dst:
            dst.write(src.read())
    shard = sharded / "pytorch_model-00002-of-00003.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="'pytorch_model-00002-of-00003.bin'"):
        dtorch_hf.from_pretrained(sharded, mesh=mesh)
    # a tensor missing from the .bin: the parameter is named, as for safetensors
    state = torch.load(os.path.join(t5_bin["single"], "pytorch_model.bin"), weights_only=True)
    del state["encoder.final_layer_norm.weight"]
    torch.save(state, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(CheckpointMismatchError, match="encoder.final_layer_norm.weight"):
        dtorch_hf.from_pretrained(path, mesh=mesh)


# diffusers' legacy VAE attention names: a tiny VAE (mid-block attention with biases), its file's
# keys renamed to what old diffusers wrote
VAE_CONFIG = {"in_channels": 3, "out_channels": 3, "block_out_channels": (8, 16), "layers_per_block": 1,
              "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
              "norm_num_groups": 4, "sample_size": 16, "latent_channels": 4}
LEGACY = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def _legacy_name(key: str) -> str:
    for new, old in LEGACY.items():
        if f".attentions.0.{new}." in key:
            return key.replace(f".{new}.", f".{old}.")
    return key


@pytest.fixture(scope="module")
def legacy_vae(tmp_path_factory):
    diffusers_logging.set_verbosity_error()
    torch.manual_seed(0)
    out = {}
    for fmt in ("safetensors", "bin"):
        path = tmp_path_factory.mktemp(f"vae-legacy-{fmt}")
        AutoencoderKL(**VAE_CONFIG).save_pretrained(path, safe_serialization=fmt == "safetensors")
        file = os.path.join(path, f"diffusion_pytorch_model.{fmt}")
        state = load_file(file) if fmt == "safetensors" else torch.load(file, weights_only=True)
        legacy = {_legacy_name(k): v for k, v in state.items()}
        renamed = sorted(set(legacy) - set(state))
        # encoder and decoder mid blocks: query/key/value/proj_attn, weight and bias each
        assert len(renamed) == 16 and all(".attentions.0." in k for k in renamed), renamed
        if fmt == "safetensors":
            save_file(legacy, file)
        else:
            torch.save(legacy, file)
        out[fmt] = str(path)
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("mesh_name", ["tp2xsp2", "dp4"])
def test_legacy_vae_attention_names(session, legacy_vae, fmt, mesh_name):
    path = legacy_vae[fmt]
    mesh = (_mesh(mesh_name) if mesh_name in MESHES
            else dt.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    model = dtorch_hf.from_pretrained(path, mesh=mesh)
    ref = AutoencoderKL.from_pretrained(path).eval()        # diffusers renames the legacy keys itself
    assert ref.encoder.mid_block.attentions[0].to_q.weight.abs().sum() > 0
    _assert_same_weights(model, ref)
    x = torch.randn(3, 3, 12, 10, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(model(x).sample, ref(x).sample) <= 1e-4
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="AutoencoderKL is a diffusers model"):
        dtorch_hf.from_pretrained(path, mesh=mesh, key_mapping={"query": "to_q"})


def test_key_mapping(session, tmp_path):
    # transformers' key_mapping: a checkpoint whose keys another library's names, mapped back by regexes
    torch.manual_seed(0)
    T5ForConditionalGeneration(tiny_config("uneven")).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    renamed = {k.replace(".SelfAttention.", ".self_attn.").replace("encoder.", "enc."): v for k, v in state.items()}
    assert len(set(renamed) - set(state)) > 10
    save_file(renamed, file)
    mapping = {r"^enc\.": "encoder.", r"\.self_attn\.": ".SelfAttention."}
    with pytest.raises(CheckpointMismatchError, match="SelfAttention"):
        dtorch_hf.from_pretrained(tmp_path, mesh=_mesh("tp4"))             # without it: missing weights
    model = dtorch_hf.from_pretrained(tmp_path, mesh=_mesh("tp2xsp2"), key_mapping=mapping)
    ref = T5ForConditionalGeneration.from_pretrained(tmp_path, key_mapping=mapping).eval()
    assert rel_err(ref.encoder.block[0].layer[0].SelfAttention.q.weight, state["encoder.block.0.layer.0.SelfAttention.q.weight"]) == 0
    _assert_same_weights(model, ref)
    _assert_same_t5_logits(model, ref, batch=2, length=7, decoder_length=3)
    # two keys mapped onto one name: refused
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="both renamed to"):
        dtorch_hf.from_pretrained(tmp_path, mesh=_mesh("tp4"), key_mapping={r"\.q\.": ".k."})


def test_sharded_variant(session, tmp_path):
    # a sharded variant's index is named as transformers names it: model.safetensors.index.fp16.json
    torch.manual_seed(0)
    T5EncoderModel(tiny_config("even")).save_pretrained(tmp_path, variant="fp16", max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.fp16.json")
    model = dtorch_hf.from_pretrained(tmp_path, mesh=_mesh("tp2xsp2"), variant="fp16")
    _assert_same_weights(model, T5EncoderModel.from_pretrained(tmp_path, variant="fp16").eval())


def test_bin_unreadable_on_the_workers_names_the_file(session, tmp_path, t5_bin, monkeypatch):
    # a shard that the controller's header read saw whole but that is corrupt when the workers
    # read it (replaced in between): the workers' error names the file and the rank
    for f in os.listdir(t5_bin["sharded"]):
        (tmp_path / f).write_bytes(open(os.path.join(t5_bin["sharded"], f), "rb").read())  # noqa: SIM115
    shard = "pytorch_model-00003-of-00003.bin"
    real_header = dtorch_hf.loading.header
    shapes = {f: real_header(str(tmp_path), f) for f in os.listdir(tmp_path) if f.endswith(".bin")}
    (tmp_path / shard).write_bytes(b"garbage")
    monkeypatch.setattr(dtorch_hf.loading, "header", lambda directory, file: shapes[file])
    with pytest.raises(CheckpointIOError, match=f"failed on rank .*{shard}") as err:
        dtorch_hf.from_pretrained(tmp_path, mesh=_mesh("tp4"))
    assert err.value.file == str(tmp_path / shard)
