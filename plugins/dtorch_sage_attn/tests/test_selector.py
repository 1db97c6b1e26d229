"""The selector's logic with stand-in kernels and stand-in timings (CPU tensors): the accuracy
gate, the fastest accurate kernel, ties to SDPA, DTORCH_ATTENTION, the disk cache, CUDA-graph
capture, and the default candidates on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from dtorch_sage_attn import AttentionCall, Candidate, Selector, gate
from dtorch_sage_attn import selector as selector_module
from dtorch_sage_attn.cache import cache_dir
from dtorch_sage_attn.records import SDPA
from standins import exact, fixed_times, nan_output, noisy, standin

aten = torch.ops.aten


def make_call(*, sq=40, sk=40, heads=4, kv_heads=4, dim=16, causal=False, need_lse=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(2, kv_heads, sk, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(2, kv_heads, sk, dim, generator=g).to(torch.bfloat16)
    return AttentionCall(q, k, v, causal=causal, need_lse=need_lse)


def sdpa_candidate(calls=None):
    """SDPA as the worker kernel builds it: the aten op on the call's tensors."""

    def run(call):
        if calls is not None:
            calls.append(call.q.shape)
        k, v = call.k, call.v
        if k.shape[1] != call.q.shape[1]:
            group = call.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(call.q, k, v, 0.0, call.causal, scale=call.scale)
        return out, (lse if call.need_lse else None)

    return Candidate(SDPA, "sdpa", run)


def test_gate_metrics_on_exact_inaccurate_and_nan_outputs():
    for call in (make_call(), make_call(causal=True, sq=24, sk=40), make_call(heads=8, kv_heads=2, need_lse=True)):
        ref = gate.reference(call)
        # the reference is SDPA's math: torch's own math kernel in fp32 agrees
        k = call.k.float().repeat_interleave(call.q.shape[1] // call.k.shape[1], 1)
        v = call.v.float().repeat_interleave(call.q.shape[1] // call.k.shape[1], 1)
        want = torch.ops.aten._scaled_dot_product_attention_math(call.q.float(), k, v, is_causal=call.causal)[0]
        assert torch.allclose(ref[0], want, atol=1e-5)
        good = gate.check(call, *exact(call), ref)
        assert good.passed and good.cosine > 0.9999 and good.rel_l1 < 5e-3
        bad = gate.check(call, *noisy(call), ref)
        assert not bad.passed and (bad.cosine < gate.MIN_COSINE or bad.rel_l1 > gate.MAX_REL_L1)
        nan = gate.check(call, *nan_output(call), ref)
        assert not nan.passed and not nan.finite
    call = make_call(need_lse=True)
    out, lse = exact(call)
    shifted = gate.check(call, out, lse + 0.2, gate.reference(call))
    assert not shifted.passed and shifted.lse_max_err == pytest.approx(0.2, abs=1e-3)
    assert gate.check(call, out, lse + 0.05, gate.reference(call)).passed  # a few hundredths pass


def test_gate_rejects_inaccurate_and_nan_candidates():
    calls = {"noisy": [], "nan": []}
    sel = Selector([standin("noisy", noisy, calls=calls["noisy"]), standin("nan", nan_output, calls=calls["nan"])],
                   timer=fixed_times({SDPA: 1.0, "noisy": 0.1, "nan": 0.1}))
    chosen = sel.choose(make_call(), sdpa_candidate())
    assert chosen.name == SDPA
    (decision,) = sel.decisions.values()
    assert decision.reason == "no candidate passed the accuracy gate"
    assert decision.gate["noisy"].startswith("FAIL") and "NaN/inf" in decision.gate["nan"]
    assert decision.gate[SDPA].startswith("pass")
    assert len(calls["noisy"]) == 1 and len(calls["nan"]) == 1  # gated once, never timed


def test_fastest_accurate_candidate_wins_and_first_call_is_never_timed():
    events = []
    calls = {name: [] for name in ("slow", "fast", "wrong")}

    def logged(name, fn):
        def run(call):
            events.append(("run", name))
            return fn(call)
        return run

    cands = [standin(n, logged(n, f), calls=calls[n]) for n, f in (("slow", exact), ("fast", exact), ("wrong", noisy))]
    table = {SDPA: 1.0, "slow": 0.5, "fast": 0.3, "wrong": 0.01}

    def timer(name, fn, device):
        events.append(("time", name))
        fn()
        return table[name] / 1e3

    sel = Selector(cands, timer=timer)
    chosen = sel.choose(make_call(), sdpa_candidate())
    assert chosen.name == "fast"
    (decision,) = sel.decisions.values()
    assert decision.times_ms == {SDPA: 1.0, "slow": 0.5, "fast": 0.3}  # the inaccurate one is not timed
    timed = [name for kind, name in events if kind == "time"]
    assert timed == [SDPA, "slow", "fast"]
    for name in ("slow", "fast"):  # its first call (the gate's, which compiles) comes before any timing
        assert events.index(("run", name)) < events.index(("time", SDPA))
    # the decision is kept: the next call of the key neither gates nor times
    before = len(events)
    assert sel.choose(make_call(seed=1), sdpa_candidate()).name == "fast"
    assert len(events) == before


@pytest.mark.parametrize("candidate_ms, want", [(0.995, SDPA), (1.0, SDPA), (1.2, SDPA), (0.98, "ours")])
def test_ties_within_one_percent_go_to_sdpa(candidate_ms, want):
    sel = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": candidate_ms}))
    assert sel.choose(make_call(), sdpa_candidate()).name == want


def test_key_buckets_sequence_lengths_and_separates_what_matters():
    mode = "auto"
    key = selector_module.decision_key
    assert key(make_call(sq=33), mode) == key(make_call(sq=64), mode)
    assert key(make_call(sq=64), mode) != key(make_call(sq=65), mode)
    base = key(make_call(), mode)
    for other in (make_call(causal=True), make_call(need_lse=True), make_call(heads=8, kv_heads=2),
                  make_call(dim=32), make_call(sk=200)):
        assert key(other, mode) != base
    assert key(make_call(), "sage") != base


def test_forced_modes(monkeypatch):
    slow_sage = []
    cands = [standin("sageattention", calls=slow_sage), standin("ours", unsupported=lambda c: "head_dim 16")]
    times = fixed_times({SDPA: 1.0, "sageattention": 3.0})
    monkeypatch.setenv("DTORCH_ATTENTION", "sdpa")
    sel = Selector(cands, timer=times)
    assert sel.choose(make_call(), sdpa_candidate()).name == SDPA and not slow_sage
    monkeypatch.setenv("DTORCH_ATTENTION", "sage")  # the best sage-type kernel, however slow
    assert sel.choose(make_call(), sdpa_candidate()).name == "sageattention"
    monkeypatch.setenv("DTORCH_ATTENTION", "ours")  # cannot serve: SDPA, said once
    with pytest.warns(RuntimeWarning, match="DTORCH_ATTENTION=ours: no other kernel serves"):
        assert sel.choose(make_call(), sdpa_candidate()).name == SDPA
    (ours,) = [d for (gpu, k), d in sel.decisions.items() if k.endswith(" ours")]
    assert "head_dim 16" in ours.reason
    monkeypatch.setenv("DTORCH_ATTENTION", "fastest-please")
    with pytest.warns(RuntimeWarning, match="not one of"):
        assert selector_module.attention_mode() == "auto"


def test_disk_cache_round_trips_and_is_keyed_by_gpu_and_versions(monkeypatch, attention_cache):
    call = make_call()
    sel = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.5}))
    assert sel.choose(call, sdpa_candidate()).name == "ours"
    (path,) = attention_cache.glob("*.json")
    assert path.parent == cache_dir()
    data = json.loads(path.read_text())
    assert data["gpu"] == "cpu" and set(data["versions"]) == {"torch", "triton", "sageattention"}
    assert data["versions"]["torch"] == torch.__version__
    (entry,) = data["decisions"].values()
    assert entry["choice"] == "ours" and entry["times_ms"] == {SDPA: 1.0, "ours": 0.5}

    def no_timing(name, fn, device):
        raise AssertionError("a cached key was measured again")

    calls = []
    fresh = Selector([standin("ours", calls=calls)], timer=no_timing)  # a new process: memory empty
    assert fresh.choose(call, sdpa_candidate()).name == "ours" and not calls  # read, not measured

    # another GPU name or other versions: another file, measured afresh
    monkeypatch.setattr(selector_module, "device_name", lambda device: "NVIDIA H200")
    other_gpu = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 2.0}))
    assert other_gpu.choose(call, sdpa_candidate()).name == SDPA
    monkeypatch.setattr(selector_module, "_versions", lambda: (("torch", "9.9"), ("triton", None), ("sageattention", "1.0.6")))
    other_versions = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.1}))
    assert other_versions.choose(call, sdpa_candidate()).name == "ours"
    names = sorted(p.name for p in attention_cache.glob("*.json"))
    assert len(names) == 3 and any(n.startswith("NVIDIA_H200__torch-9.9") for n in names)


def test_corrupt_cache_file_is_ignored_with_a_warning(attention_cache):
    sel = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.5}))
    path = attention_cache / sel.cache_for("cpu").identity.file_name()
    attention_cache.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert sel.choose(make_call(), sdpa_candidate()).name == "ours"
    assert json.loads(path.read_text())["decisions"]  # rewritten whole at the decision


def test_under_capture_nothing_new_is_decided_or_run_first(monkeypatch, attention_cache):
    capturing = {"on": True}
    monkeypatch.setattr(selector_module, "is_capturing", lambda call: capturing["on"])
    calls = []
    sel = Selector([standin("ours", calls=calls)], timer=fixed_times({SDPA: 1.0, "ours": 0.5}))
    with pytest.warns(RuntimeWarning, match="first seen during CUDA-graph capture"):
        assert sel.choose(make_call(), sdpa_candidate()).name == SDPA
    assert not calls and not sel.decisions and not list(attention_cache.glob("*.json"))
    capturing["on"] = False
    assert sel.choose(make_call(), sdpa_candidate()).name == "ours"  # decided eagerly (it ran)
    capturing["on"] = True
    assert sel.choose(make_call(), sdpa_candidate()).name == "ours"  # decided and warm: kept in capture
    # a decision read from disk whose kernel never ran in this process: SDPA under capture
    capturing["on"] = False
    loaded = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.5}))
    loaded._decide_shared(make_call(), sdpa_candidate(), "auto", "cpu", selector_module.decision_key(make_call(), "auto"))
    capturing["on"] = True
    assert loaded.choose(make_call(), sdpa_candidate()).name == SDPA


def test_log_sum_exp_calls_use_only_kernels_that_return_it():
    no_lse = standin("sageattention", unsupported=lambda c: "needs lse" if c.need_lse else None)
    sel = Selector([no_lse, standin("ours")], timer=fixed_times({SDPA: 1.0, "sageattention": 0.2, "ours": 0.5}))
    assert sel.choose(make_call(need_lse=True), sdpa_candidate()).name == "ours"
    assert sel.choose(make_call(need_lse=False), sdpa_candidate()).name == "sageattention"


def test_default_candidates_on_cpu_leave_every_call_to_sdpa(attention_cache, monkeypatch):
    sel = Selector()
    assert {c.name for c in sel.candidates} | set(sel.missing) == {"sageattention", "ours"}
    monkeypatch.setenv("DTORCH_SAGE_GLUON", "1")  # the Gluon kernel only where asked for
    sel = Selector()
    assert {c.name for c in sel.candidates} | set(sel.missing) == {"sageattention", "ours",
                                                                   "ours_gluon"}
    for call in (make_call(), make_call(need_lse=True, causal=True)):
        assert sel.choose(call, sdpa_candidate()).name == SDPA
    for decision in sel.decisions.values():
        assert decision.choice == SDPA and "cpu tensors" in decision.reason
    (path,) = attention_cache.glob("cpu__*.json")
    assert len(json.loads(path.read_text())["decisions"]) == 2


def test_a_call_the_chosen_kernel_cannot_serve_runs_sdpa():
    square_only = standin("ours", unsupported=lambda c: "Sq != Sk" if c.q.shape[2] != c.k.shape[2] else None)
    sel = Selector([square_only], timer=fixed_times({SDPA: 1.0, "ours": 0.5}))
    assert sel.choose(make_call(sq=40, sk=40, causal=True), sdpa_candidate()).name == "ours"
    with pytest.warns(RuntimeWarning, match="cannot serve a call of this key"):
        assert sel.choose(make_call(sq=40, sk=48, causal=True), sdpa_candidate()).name == SDPA  # same key


def test_an_unwritable_cache_directory_keeps_decisions_in_memory(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DTORCH_ATTENTION_CACHE", str(blocker / "attention"))  # under a file: not creatable
    sel = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.5}))
    with pytest.warns(RuntimeWarning, match="not written"):
        assert sel.choose(make_call(), sdpa_candidate()).name == "ours"
    assert sel.choose(make_call(), sdpa_candidate()).name == "ours"  # from memory


def test_log_sum_exp_is_gated_by_merging_halves_of_the_keys():
    def skewed(call):  # lse off by +-0.09: under the direct check's 0.1, but the merge weighs wrong
        out, lse = exact(call)
        return out, lse + (0.09 if call.k.shape[2] % 2 == 0 else -0.09)

    sel = Selector([standin("skewed", skewed), standin("ours")],
                   timer=fixed_times({SDPA: 1.0, "skewed": 0.1, "ours": 0.5}))
    assert sel.choose(make_call(sk=41, need_lse=True), sdpa_candidate()).name == "ours"
    (decision,) = sel.decisions.values()
    assert decision.gate["skewed"].startswith("merged halves FAIL") and decision.gate["ours"].startswith("pass")


def test_ours_mode_takes_both_of_our_kernels(monkeypatch):
    """DTORCH_ATTENTION=ours picks the faster of our Triton and Gluon kernels, never another."""
    monkeypatch.setenv("DTORCH_ATTENTION", "ours")
    cands = [standin("sageattention"), standin("ours"), standin("ours_gluon")]
    sel = Selector(cands, timer=fixed_times({SDPA: 1.0, "sageattention": 0.1, "ours": 0.6,
                                             "ours_gluon": 0.5}))
    assert sel.choose(make_call(), sdpa_candidate()).name == "ours_gluon"
