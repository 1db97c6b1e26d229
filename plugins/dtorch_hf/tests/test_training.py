"""One torch.optim.AdamW step on a mesh against the same step on the controller: the tiny Flux
and SD3 transformers of test_flux/test_sd3 on every mesh of hf_testing.TRANSFORMER_MESHES, and
the CLIP text encoder of test_clip on its tp and tp x dp meshes, both runners.

The loss is the mean squared error of the model's output against a fixed random target. The
check compares each parameter's update (after - before) with torch's, not the parameters
themselves (a wrong gradient moves a weight by lr at most, well inside 1e-4 of the weight).
AdamW's first step is lr * g / (|g| + eps); with eps = 1 and gradients well below 1 the update
is nearly lr * g, so comparing updates compares the gradients themselves, where a small eps
would leave only their signs (lr * sign(g)). Weight decay is off for the same reason. lr = 1
keeps the updates (about the gradients, 1e-5 and up) far above the weights' float32 spacing
(about 1e-8): at lr = 1e-2 a one-ulp difference in a rounded weight is 1e-4 of its update.
"""

from __future__ import annotations

import dtorch_hf
import pytest
import torch
import torch.nn.functional as F
from hf_testing import MESHES, TRANSFORMER_MESHES, make_transformer_mesh, rel_err

import dtorch_core as dt

diffusers = pytest.importorskip("diffusers")
import test_clip
import test_flux
import test_sd3
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.utils import logging as diffusers_logging
from transformers import CLIPTextModelWithProjection

LR, EPS = 1.0, 1.0
# an update below this is a gradient at rounding level (|g| < 1e-6 on O(1) activations)
ROUNDING = 1e-6 * LR
# meshes a model cannot train on yet, with the reason (xfail, strict: a fix shows as XPASS)
CANNOT_TRAIN: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    diffusers_logging.set_verbosity_error()
    out = {}
    for name, cls, config in (("flux", FluxTransformer2DModel, test_flux.CONFIG),
                              ("sd3", SD3Transformer2DModel, test_sd3.CONFIG)):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"train-{name}")
        cls(**config).save_pretrained(path)
        out[name] = path
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("train-clip")
    CLIPTextModelWithProjection(test_clip.tiny_config("uneven")).save_pretrained(path)
    out["clip"] = path
    return out


def _flux_inputs():
    # 15 image + 7 text tokens (both uneven on sp), batch 2 (split by "cfg")
    return test_flux._inputs(*test_flux.CASES["15img+7txt-b2"])


def _sd3_inputs():
    return test_sd3._inputs(*test_sd3.CASES["15img+7txt-b2"])


def _sample_loss(model, inputs, target):
    return F.mse_loss(model(**inputs).sample, target)


def _clip_loss(model, inputs, targets):
    out = model(input_ids=inputs[0], attention_mask=inputs[1])
    return F.mse_loss(out.last_hidden_state, targets[0]) + F.mse_loss(out.text_embeds, targets[1])


def _target(shape, seed=5):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def adamw_step(model, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    loss = loss_fn(model)
    loss.backward()
    opt.step()
    return loss.detach()


def assert_step_matches(ref, model, loss_fn):
    """One AdamW step of each model; the losses and every parameter's update agree."""
    before = {name: p.detach().clone() for name, p in ref.named_parameters()}
    want_loss = adamw_step(ref, loss_fn)
    got_loss = adamw_step(model, loss_fn)
    assert rel_err(got_loss, want_loss) <= 1e-4
    want = dict(ref.named_parameters())
    moved = 0
    for name, p in model.named_parameters():
        got_update = p.detach().full_tensor() - before[name]
        want_update = want[name].detach() - before[name]
        if want_update.abs().max() <= ROUNDING:
            # no gradient (k_proj's bias: softmax ignores a shift shared by every key), up to
            # rounding in either model
            assert got_update.abs().max() <= ROUNDING, name
            continue
        moved += 1
        # an update is read as new - old: where the weight is large against the update (a norm's
        # weight near 1, updates near lr), each element carries the weight's own rounding (one
        # ulp of it), so a difference within two ulps of the weight is rounding, not an error
        ulps = 2 * torch.finfo(before[name].dtype).eps * before[name].abs().max()
        assert rel_err(got_update, want_update) <= 1e-4 or (got_update - want_update).abs().max() <= ulps, name
    assert moved > len(want) // 2            # the step moved most of the weights


def _mark(model_name, mesh_name, *, with_name=False):
    """The parameter(s) of one case, xfail where CANNOT_TRAIN gives a reason."""
    values = (model_name, mesh_name) if with_name else (mesh_name,)
    reason = CANNOT_TRAIN.get((model_name, mesh_name))
    return pytest.param(*values, marks=pytest.mark.xfail(reason=reason, strict=True) if reason else ())


TRANSFORMERS = {"flux": (FluxTransformer2DModel, _flux_inputs), "sd3": (SD3Transformer2DModel, _sd3_inputs)}


@pytest.mark.parametrize(("family", "mesh_name"),
                         [_mark(f, m, with_name=True) for f in sorted(TRANSFORMERS) for m in sorted(TRANSFORMER_MESHES)])
def test_transformer_adamw_step(session, saved, family, mesh_name):
    cls, make_inputs = TRANSFORMERS[family]
    ref = cls.from_pretrained(saved[family]).train()
    model = cls.from_pretrained(saved[family]).train()
    dtorch_hf.parallelize(model, make_transformer_mesh(mesh_name))
    inputs = make_inputs()
    target = _target(inputs["hidden_states"].shape)
    assert_step_matches(ref, model, lambda m: _sample_loss(m, inputs, target))
    assert not dt.fallback_counts(), dt.fallback_counts()


# CLIP is served over "tp" and "dp" (it refuses "sp" and "cfg"): its own meshes
@pytest.mark.parametrize("mesh_name", [_mark("clip", m) for m in ("tp4", "tp2xdp2")])
def test_clip_adamw_step(session, saved, mesh_name):
    ref = CLIPTextModelWithProjection.from_pretrained(saved["clip"]).train()
    model = CLIPTextModelWithProjection.from_pretrained(saved["clip"]).train()
    shape, names = MESHES[mesh_name]
    dtorch_hf.parallelize(model, dt.init_device_mesh("cpu", shape, mesh_dim_names=names))
    inputs = test_clip.clip_inputs(eos=test_clip.CONFIGS["uneven"]["eos_token_id"])
    targets = (_target((3, 7, 40)), _target((3, 12), seed=6))
    assert_step_matches(ref, model, lambda m: _clip_loss(m, inputs, targets))
    # the EOS pooling (index.Tensor) and its backward (index_put) have rules: nothing falls back
    assert not dt.fallback_counts(), dt.fallback_counts()
