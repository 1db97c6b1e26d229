"""SD3 and Flux pipelines loaded through ``dtorch_hf.from_pretrained`` onto a mesh: a 2-step
generation equals diffusers' single-device pipeline of the same directory, with the same
generator, on tp=4, sp=4, tp=2 x sp=2 (Ulysses and ring attention) and cfg=2 x sp=2, both
runners. The tiny random
pipelines (every component of the real ones) are saved with ``save_pretrained``; nothing is
downloaded."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from PIL import Image

import dtorch_core as dt
import dtorch_hf
from dtorch_hf import tiny_pipelines

from test_pretrained import sent_bytes

PROMPT = "a photo of a cat"
# 20 x 24 pixels: latents 10 x 12; SD3's 2x2 patches and Flux's 2x2 packing give 5 x 6 = 30
# image tokens (uneven on sp 4); text: SD3 8 CLIP + 7 T5 = 15 tokens, Flux 7 (both uneven)
CALL = {"num_inference_steps": 2, "height": 20, "width": 24, "max_sequence_length": tiny_pipelines.T5_MAX_LENGTH}
# SD3 guides by CFG (guidance_scale 7 by default: a batch of 2, split over "cfg"); Flux runs
# its true CFG (a negative prompt and true_cfg_scale > 1) so that "cfg" has something to split
EXTRA = {"sd3": {}, "flux": {"negative_prompt": "a dog", "true_cfg_scale": 2.0}}
MESHES = {"tp4": ((4,), ("tp",)), "sp4": ((4,), ("sp",)), "tp2xsp2": ((2, 2), ("tp", "sp")),
          "cfg2xsp2": ((2, 2), ("cfg", "sp")), "tp2xsp2-ring": ((2, 2), ("tp", "sp"))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()       # "accelerate not found" on every load
    return {kind: tiny_pipelines.save_tiny_pipeline(kind, str(tmp_path_factory.mktemp(kind)))
            for kind in tiny_pipelines.PIPELINES}


def _generate(pipe, kind, output_type):
    return pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type=output_type,
                **CALL, **EXTRA[kind]).images


@pytest.fixture(scope="module")
def reference(saved):
    """diffusers' own pipeline of each directory, on the controller: images as arrays and PIL."""
    out = {}
    for kind, path in saved.items():
        pipe = DiffusionPipeline.from_pretrained(path)
        out[kind] = {"np": _generate(pipe, kind, "np"), "pil": _generate(pipe, kind, "pil")}
    return out


def _mesh(name):
    shape, names = MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _rel(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _check_layout(pipe, mesh_name):
    names = MESHES[mesh_name][1]
    q = pipe.transformer.transformer_blocks[0].attn.to_q.weight
    assert isinstance(q, dt.DTensor) and q.device_mesh.mesh_dim_names == names
    assert (dt.Shard(0) in q.placements) == ("tp" in names)
    families = dtorch_hf.registered_families()
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        for p in getattr(pipe, name, torch.nn.Module()).parameters():
            assert isinstance(p, dt.DTensor) and p.device_mesh.mesh_dim_names == names
    # the text encoders by their families over "tp" (CLIP's where it is registered)
    t5 = pipe.text_encoder_3 if hasattr(pipe, "text_encoder_3") else pipe.text_encoder_2
    assert (dt.Shard(0) in t5.encoder.block[0].layer[0].SelfAttention.q.weight.placements) == ("tp" in names)
    if "clip-text" in families:
        clip = getattr(pipe.text_encoder, "text_model", pipe.text_encoder)   # transformers 5: no text_model
        clip_q = clip.encoder.layers[0].self_attn.q_proj.weight
        assert (dt.Shard(0) in clip_q.placements) == ("tp" in names)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", sorted(tiny_pipelines.PIPELINES))
def test_generation_equals_single_device(session, saved, reference, monkeypatch, kind, mesh_name):
    sp_mode = "ring" if mesh_name.endswith("-ring") else "ulysses"
    sent = sent_bytes(monkeypatch)
    pipe = dtorch_hf.from_pretrained(saved[kind], mesh=_mesh(mesh_name), sp_mode=sp_mode)
    assert sum(sent) == 0, sent        # every model's weights read by the workers themselves
    assert type(pipe).__name__ == tiny_pipelines.describe(saved[kind])["_class_name"]
    _check_layout(pipe, mesh_name)
    seen = []
    pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].placements), with_kwargs=True)
    got = _generate(pipe, kind, "np")
    names = MESHES[mesh_name][1]
    if kind == "sd3" and "cfg" in names:
        # the CFG batch (conditional + unconditional) split over "cfg"
        assert all(p[names.index("cfg")] == dt.Shard(0) for p in seen), seen
    if "sp" in names:
        assert all(p[names.index("sp")] == dt.Shard(1) for p in seen), seen
    want = reference[kind]["np"]
    assert isinstance(got, np.ndarray) and got.shape == want.shape == (1, 20, 24, 3)
    assert _rel(got, want) <= 1e-4


@pytest.mark.parametrize("kind", sorted(tiny_pipelines.PIPELINES))
def test_pil_images_and_progress_bar(session, saved, reference, capfd, kind):
    pipe = dtorch_hf.from_pretrained(saved[kind], mesh=_mesh("tp2xsp2"))
    capfd.readouterr()
    images = _generate(pipe, kind, "pil")
    err = capfd.readouterr().err
    assert "2/2" in err                                  # diffusers' own progress bar
    assert len(images) == 1 and isinstance(images[0], Image.Image) and images[0].size == (24, 20)
    got, want = np.asarray(images[0], dtype=np.int16), np.asarray(reference[kind]["pil"][0], dtype=np.int16)
    assert np.abs(got - want).max() <= 1               # uint8 rounding of values equal to 1e-6


def test_bfloat16_pipeline(session, saved):
    # bf16 shards read from fp32 files; against diffusers' torch_dtype=bfloat16 load (the sums
    # run in another order on shards, so bf16 rounding differs: a loose bound)
    pipe = dtorch_hf.from_pretrained(saved["flux"], mesh=_mesh("tp2xsp2"), torch_dtype=torch.bfloat16)
    ref = DiffusionPipeline.from_pretrained(saved["flux"], dtype=torch.bfloat16)
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        got = {n: p.dtype for n, p in getattr(pipe, name).named_parameters()}
        assert got == {n: p.dtype for n, p in getattr(ref, name).named_parameters()}, name
    assert pipe.transformer.dtype == torch.bfloat16
    assert _rel(_generate(pipe, "flux", "np"), _generate(ref, "flux", "np")) <= 2e-2


def test_unsupported_pipeline_and_missing_component(session, saved, tmp_path):
    import json
    import shutil

    other = shutil.copytree(saved["sd3"], tmp_path / "other")
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="StableDiffusionPipeline pipeline.*serves"):
        dtorch_hf.from_pretrained(other, mesh=_mesh("tp4"))
    lacking = shutil.copytree(saved["flux"], tmp_path / "lacking")
    shutil.rmtree(lacking / "text_encoder_2")
    with pytest.raises(dtorch_hf.NotAPretrainedModelError, match="lacks the folder text_encoder_2/"):
        dtorch_hf.from_pretrained(lacking, mesh=_mesh("tp4"))


def test_one_diffusers_model_directory(session, saved):
    from diffusers import SD3Transformer2DModel

    model = dtorch_hf.from_pretrained(os.path.join(saved["sd3"], "transformer"), mesh=_mesh("tp2xsp2"))
    ref = SD3Transformer2DModel.from_pretrained(os.path.join(saved["sd3"], "transformer")).eval()
    assert type(model) is SD3Transformer2DModel and not model.training
    assert dt.Shard(0) in model.transformer_blocks[0].attn.to_q.weight.placements
    want = dict(ref.named_parameters()) | dict(ref.named_buffers())
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name].full_tensor(), t), name


def test_buffer_left_out_of_the_files_gets_its_constructor_value(session, saved, tmp_path):
    # SD3's positional table (a persistent buffer) removed from the file: computed as the
    # constructor computes it; a parameter removed would raise (test_pretrained)
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(os.path.join(saved["sd3"], "transformer"), tmp_path / "transformer")
    weights = load_file(path / "diffusion_pytorch_model.safetensors")
    want = weights.pop("pos_embed.pos_embed")
    save_file(weights, path / "diffusion_pytorch_model.safetensors")
    model = dtorch_hf.from_pretrained(path, mesh=_mesh("sp4"))
    assert torch.equal(model.pos_embed.pos_embed.full_tensor(), want)
