"""The plugin on a mesh of 4 CPU workers (thread and process runners, uneven shards), against
plain torch on the same inputs: inference attention calls reach the selector (with a stand-in
kernel on the thread runner, whose workers share this process's selector), training calls,
masks, dropout and fp32 stay on SDPA, on the CPU every call runs SDPA and the disk cache says
so, and a Flux transformer (dtorch_hf) under tp, Ulysses and ring attention routes its
attention through the selector (ring's blockwise calls with their log-sum-exp)."""

from __future__ import annotations

import os

import dtorch_sage_attn
import pytest
import torch
import torch.nn.functional as F
from dtorch_sage_attn import Selector, routes, set_selector
from dtorch_sage_attn.command import cached_decisions
from dtorch_sage_attn.records import SDPA
from standins import fixed_times, standin

import dtorch_core as dt

RUNNERS = [r for r in os.environ.get("DTORCH_SAGE_TEST_RUNNERS", "thread,process").split(",") if r]


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request, tmp_path_factory):
    """Four workers on ``request.param``; process workers inherit this module's cache dir."""
    cache = tmp_path_factory.mktemp("workers-cache")
    saved = os.environ.get("DTORCH_ATTENTION_CACHE")
    os.environ["DTORCH_ATTENTION_CACHE"] = str(cache)
    dt.init(world_size=4, runner=request.param)
    yield request.param, cache
    dt.shutdown()
    if saved is None:
        os.environ.pop("DTORCH_ATTENTION_CACHE", None)
    else:
        os.environ["DTORCH_ATTENTION_CACHE"] = saved


@pytest.fixture
def calls(runner, monkeypatch):
    """On the thread runner, a stand-in "ours" (exact, faster than SDPA) recording the calls
    it serves; None on the process runner (its workers keep their own default selectors)."""
    name, cache = runner
    if name == "process":
        monkeypatch.setenv("DTORCH_ATTENTION_CACHE", str(cache))
        return None
    served = []
    set_selector(Selector([standin("ours", calls=served)], timer=fixed_times({SDPA: 1.0, "ours": 0.5})))
    return served


def _qkv(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]


def _close(got, want, tol=2e-2):
    got = got.full_tensor() if isinstance(got, dt.DTensor) else got
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err <= tol, err


# (mesh shape, names, placements): batch 3 over 2 (2+1) x heads 6 over 2 (3+3); heads 6 over 4
# (2+2+2+0: rank 3 holds no head)
LAYOUTS = {"dp2xtp2": ((2, 2), ("dp", "tp"), [dt.Shard(0), dt.Shard(1)]),
           "tp4": ((4,), ("tp",), [dt.Shard(1)])}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inference_calls_reach_the_selector_on_uneven_shards(runner, calls, layout):
    shape, names, placements = LAYOUTS[layout]
    mesh = dt.init_device_mesh("cpu", shape, mesh_dim_names=names)
    q, k, v = _qkv((3, 6, 7, 16))
    for repeat in range(2):  # the first round decides (the stand-in also runs to be gated and timed)
        if calls is not None:
            calls.clear()
        before = routes().get("inference", 0)
        with torch.no_grad():
            got = F.scaled_dot_product_attention(*(dt.distribute_tensor(t, mesh, placements) for t in (q, k, v)))
            causal = F.scaled_dot_product_attention(*(dt.distribute_tensor(t, mesh, placements) for t in (q, k, v)),
                                                    is_causal=True)
        _close(got, F.scaled_dot_product_attention(q, k, v))
        _close(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert routes()["inference"] == before + 2
    if calls is not None:
        # every non-empty local shard was served by the stand-in, with its local heads
        local_heads = {c[0][1] for c in calls}
        assert local_heads == ({3} if layout == "dp2xtp2" else {2})
        assert len(calls) == (8 if layout == "dp2xtp2" else 6)  # 4 (3) shards with heads, twice


def test_training_masks_dropout_and_fp32_stay_on_sdpa(runner, calls):
    mesh = dt.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    q, k, v = _qkv((2, 5, 6, 16))
    placed = [dt.distribute_tensor(t, mesh, [dt.Shard(1)]) for t in (q, k, v)]
    # training: the inputs need gradients, grad mode is on
    leaves = [p.detach().requires_grad_() for p in placed]
    plain = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves)
    want = F.scaled_dot_product_attention(*plain)
    _close(out, want)
    out.float().sum().backward()
    want.float().sum().backward()
    for got_leaf, want_leaf in zip(leaves, plain):
        _close(got_leaf.grad, want_leaf.grad, 3e-2)
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    with torch.no_grad():
        _close(F.scaled_dot_product_attention(*placed, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        fp32 = [p.float() for p in placed]
        _close(F.scaled_dot_product_attention(*fp32), F.scaled_dot_product_attention(q.float(), k.float(), v.float()), 1e-5)
        # torch's CPU SDPA takes its math path with dropout (no attention op to route); the
        # attention op itself with dropout, as CUDA's SDPA issues it:
        dropped = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*placed, 0.5)[0]
    assert dropped.shape == q.shape
    seen = routes()
    for route in ("gradients needed", "a mask/bias", "torch.float32 inputs", "dropout"):
        assert seen.get(route, 0) >= 1, seen
    assert "inference" not in seen
    if calls is not None:
        assert calls == []


def test_on_cpu_every_call_runs_sdpa_and_is_reported(runner, monkeypatch):
    _name, cache = runner
    set_selector(None)  # the default candidates (thread workers use this process's selector)
    monkeypatch.setenv("DTORCH_ATTENTION_CACHE", str(cache))
    mesh = dt.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    q, k, v = _qkv((1, 5, 33, 32), seed=4)
    with torch.no_grad():
        got = F.scaled_dot_product_attention(*(dt.distribute_tensor(t, mesh, [dt.Shard(1)]) for t in (q, k, v)))
    # the same CPU kernel on each head: identical to plain torch
    assert torch.equal(got.full_tensor(), F.scaled_dot_product_attention(q, k, v))
    (cpu_file,) = [f for f in cached_decisions() if f.get("gpu") == "cpu"]
    decision = cpu_file["decisions"]["bf16 d32 full sq<=64 sk<=64 gqa1 lse auto"]
    assert decision["choice"] == SDPA and "cpu tensors (sage kernels run on CUDA)" in decision["reason"]


# ---------------------------------------------------------------------------------------------
# Flux (dtorch_hf): tp heads, Ulysses sequence, ring blocks
# ---------------------------------------------------------------------------------------------
diffusers = pytest.importorskip("diffusers")
import dtorch_hf
from diffusers import FluxTransformer2DModel
from diffusers.utils import logging as diffusers_logging

FLUX_CONFIG = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                   "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)}
# (latent h, w, text tokens): 16 image + 4 text (every stream divides over 4: no padding in the
# ring), 15 image + 7 text (both uneven: the ring pads and masks, Ulysses splits unevenly)
FLUX_CASES = {"16img+4txt": (4, 4, 4), "15img+7txt": (3, 5, 7)}
FLUX_MESHES = {"tp4": ("tp", "ulysses"), "sp4-ulysses": ("sp", "ulysses"), "sp4-ring": ("sp", "ring")}


def _flux_inputs(h, w, txt):
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {"hidden_states": torch.randn(1, h * w, 16, generator=g).bfloat16(),
                "encoder_hidden_states": torch.randn(1, txt, 32, generator=g).bfloat16(),
                "pooled_projections": torch.randn(1, 16, generator=g).bfloat16(),
                "timestep": torch.tensor([0.3]).bfloat16(), "img_ids": img_ids.reshape(-1, 3), "txt_ids": torch.zeros(txt, 3)}


@pytest.fixture(scope="module")
def flux_path(tmp_path_factory):
    diffusers_logging.set_verbosity_error()
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("flux")
    FluxTransformer2DModel(**FLUX_CONFIG).save_pretrained(path)
    return path


@pytest.mark.parametrize("case", sorted(FLUX_CASES))
@pytest.mark.parametrize("mesh_name", sorted(FLUX_MESHES))
def test_flux_attention_routes_through_the_selector(runner, calls, flux_path, mesh_name, case):
    dim_name, sp_mode = FLUX_MESHES[mesh_name]
    h, w, txt = FLUX_CASES[case]
    ref = FluxTransformer2DModel.from_pretrained(flux_path, torch_dtype=torch.bfloat16).eval()
    model = FluxTransformer2DModel.from_pretrained(flux_path, torch_dtype=torch.bfloat16).eval()
    dtorch_hf.parallelize(model, dt.init_device_mesh("cpu", (4,), mesh_dim_names=(dim_name,)), sp_mode=sp_mode)
    x = _flux_inputs(h, w, txt)
    dtorch_sage_attn.reset_routes()
    with torch.no_grad():
        got = model(**x).sample
        want = ref(**x).sample
    _close(got, want, 3e-2)
    seen = routes()
    padded_ring = sp_mode == "ring" and case == "15img+7txt"
    if padded_ring:
        assert seen.get("a mask/bias", 0) >= 1  # padded key blocks carry a bias: SDPA
    else:
        assert seen.get("inference", 0) == 2 * (4 if sp_mode == "ring" else 1)  # 2 blocks; ring: 4 steps each
    if calls is None or padded_ring:
        return
    tokens = h * w + txt
    # (CPU's flash op always returns its log-sum-exp, so every CPU call asks for one)
    if sp_mode == "ulysses":  # tp: 4 heads over 4; Ulysses: sequence -> heads; one head, every token
        assert {c[0][1:3] for c in calls} == {(1, tokens)}
    else:  # ring: each rank's block of image + text tokens, with the log-sum-exp
        assert {c[0][1:3] for c in calls} == {(4, tokens // 4)} and all(c[2] for c in calls)
        # 2 attention blocks x 4 steps x 4 ranks, plus, where this test met the key first, the
        # gate's runs (the whole call and its two halves of the keys) and the timer's
        assert len(calls) - 2 * 4 * 4 in (0, 4)
