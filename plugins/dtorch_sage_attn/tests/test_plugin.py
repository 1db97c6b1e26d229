"""The plugin installs and registers through its entry point: the inference twins' rules and
kernels, the SDPA ops' routing decompositions, and the ``dtorch attention`` command, whose
section ``dtorch info`` shows (the disk cache's decisions); a captured and replayed step keeps
its attention calls on the selector; ``bench/flux_step.py --tiny`` runs on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from dtorch_sage_attn import Selector, routes, set_selector
from dtorch_sage_attn.records import SDPA
from dtorch_sage_attn.routing import forward_ops, inference_twins, kernel_name
from standins import fixed_times, standin

import dtorch_core as dt
from dtorch_core.plugins import build_plugins

BENCH = Path(__file__).resolve().parent.parent / "bench" / "flux_step.py"


def test_registers_through_its_entry_point():
    plugins = build_plugins()
    assert "sage_attn" in dict(plugins.describe())
    ops, kernels = plugins.registry("ops"), plugins.registry("kernels")
    twins = inference_twins()
    assert set(twins) == set(forward_ops()) and len(twins) == 4
    for op, twin in twins.items():
        assert ops.decomposition_for(op) is not None
        assert ops.rule_for(twin).kernel == kernel_name(op)
        assert kernel_name(op) in kernels and kernels.owners[kernel_name(op)] == "sage_attn"
    assert "attention" in plugins.registry("cli_commands")


def _dtorch(*args, env):
    return subprocess.run([sys.executable, "-m", "dtorch_core", *args], capture_output=True, text=True,
                          timeout=120, env=env, check=True).stdout


def test_dtorch_info_lists_the_cached_choices(attention_cache):
    set_selector(Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.5})))
    dt.init(world_size=2, runner="thread")
    try:
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        q = dt.distribute_tensor(torch.randn(1, 4, 9, 16).bfloat16(), mesh, [dt.Shard(1)])
        with torch.no_grad():
            F.scaled_dot_product_attention(q, q, q).full_tensor()
    finally:
        dt.shutdown()
    env = dict(os.environ, DTORCH_ATTENTION_CACHE=str(attention_cache))
    text = _dtorch("info", env=env)
    section = text[text.index("attention kernels (dtorch_sage_attn):"):]
    assert f"cache: {attention_cache}" in section
    assert "bf16 d16 full sq<=16 sk<=16 gqa1 lse auto: ours (fastest: 2.00x SDPA)" in section
    (entry,) = json.loads(_dtorch("attention", "--json", env=env))
    assert entry["gpu"] == "cpu" and next(iter(entry["decisions"].values()))["choice"] == "ours"
    info = json.loads(_dtorch("info", "--json", env=env))
    (plugin_section,) = [s for s in info["sections"] if s["title"].startswith("attention kernels")]
    assert plugin_section["data"]["files"][0]["decisions"]
    _dtorch("attention", "--clear", env=env)
    assert not list(attention_cache.glob("*.json"))
    assert "no decisions yet" in _dtorch("info", env=env)


def test_replayed_step_keeps_attention_on_the_selector():
    served = []
    set_selector(Selector([standin("ours", calls=served)], timer=fixed_times({SDPA: 1.0, "ours": 0.5})))
    dt.init(world_size=4, runner="thread")
    try:
        mesh = dt.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        def step(x):
            with torch.no_grad():
                h = x * 2 + 1  # keeps the heads sharded
                return F.scaled_dot_product_attention(h, h, h, is_causal=True)

        compiled = dt.compile(step)
        for seed in range(4):
            x = torch.randn(1, 6, 11, 16, generator=torch.Generator().manual_seed(seed)).bfloat16()
            got = compiled(dt.distribute_tensor(x, mesh, [dt.Shard(1)])).full_tensor()
            want = step(x)
            assert ((got.float() - want.float()).norm() / want.float().norm()) < 2e-2
    finally:
        dt.shutdown()
    assert routes().get("inference", 0) >= 1 and served  # recorded and replayed through the twin op
    assert {c[0][1] for c in served} == {2}  # 6 heads over 4: 2+2+2+0, the empty shard skipped


def test_flux_step_bench_runs_tiny_on_cpu(attention_cache):
    env = dict(os.environ, DTORCH_ATTENTION_CACHE=str(attention_cache))
    result = subprocess.run([sys.executable, str(BENCH), "--tiny", "--device", "cpu", "--world-size", "2",
                             "--warmup", "1", "--rounds", "1", "--iters", "1"],
                            check=False, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed-up sdpa/auto" in result.stdout and "PSNR inf dB" in result.stdout  # CPU: both SDPA
    assert "cpu tensors (sage kernels run on CUDA)" in result.stdout
