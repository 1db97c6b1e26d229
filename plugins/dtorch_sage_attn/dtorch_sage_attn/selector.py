"""The kernel selector: which attention kernel serves a call, decided once per key and kept.

Key: GPU name (the cache file), dtype, head_dim, causal, Sq and Sk buckets (powers of two),
GQA ratio, whether the log-sum-exp is read, and the ``DTORCH_ATTENTION`` mode. For a new key
(``auto``): every sage-type candidate that can serve the call runs once on the call's own
inputs (its first call compiles: it is never timed) and goes through the accuracy gate against
SDPA's math in fp32 (:mod:`.gate`); SDPA and the candidates that pass are timed after warm-up;
the fastest wins, but SDPA keeps any tie within 1% (:data:`TIE`), so ``auto`` is never
meaningfully slower than SDPA. ``DTORCH_ATTENTION=sdpa`` always runs SDPA; ``sage`` the fastest
gated sage-type kernel; ``ours`` this plugin's kernel; a forced kernel that cannot serve a call
(or fails the gate) falls back to SDPA and says so once.

Under CUDA-graph capture nothing new is decided and no kernel runs for the first time there: a
key decided earlier in this process (its kernel already ran) keeps its choice, anything else
runs SDPA. Decisions are kept in memory and in the disk cache (:mod:`.cache`), which is what
``dtorch info`` lists.
"""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from collections.abc import Callable

import attrs
import structlog
import torch

from . import gate
from .cache import CacheIdentity, DecisionCache
from .candidates import default_candidates, package_version
from .records import SDPA, AttentionCall, Candidate, Decision

log = structlog.get_logger(__name__)

MODES = ("auto", "sdpa", "sage", "ours")
TIE = 0.01  # a candidate must beat SDPA by more than this fraction to be chosen


def _is_mode_kernel(name: str, mode: str) -> bool:
    """Whether a candidate is one DTORCH_ATTENTION=mode names (ours: ours and ours_gluon)."""
    return name == mode or name.startswith(mode + "_")


def attention_mode() -> str:
    mode = os.environ.get("DTORCH_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in MODES:
        _say_once(f"DTORCH_ATTENTION={mode!r} is not one of {MODES}; using auto")
        return "auto"
    return mode


_said: set = set()
_said_lock = threading.Lock()


def _say_once(message: str) -> None:
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning(message)


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (sequence lengths in one bucket share a decision)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def decision_key(call: AttentionCall, mode: str) -> str:
    q, k = call.q, call.k
    gqa = q.shape[1] // max(1, k.shape[1])
    dtype = DTYPE_NAMES.get(q.dtype, str(q.dtype).replace("torch.", ""))
    return (f"{dtype} d{q.shape[-1]} {'causal' if call.causal else 'full'} sq<={bucket(q.shape[2])} "
            f"sk<={bucket(k.shape[2])} gqa{gqa} {'lse' if call.need_lse else 'out'} {mode}")


_device_names: dict = {}


def device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name


def is_capturing(call: AttentionCall) -> bool:
    return call.q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def measure_time(name: str, fn: Callable, device: torch.device, *, rounds: int = 5, min_ms: float = 2.0) -> float:
    """Seconds per call of ``fn`` (candidate ``name``) after one warm-up call: the best of
    ``rounds`` rounds of enough calls to take ``min_ms`` (CUDA events on the current stream; the
    wall clock elsewhere)."""
    fn()
    if device.type != "cuda":
        best = math.inf
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    iters = max(1, min(100, math.ceil(min_ms / max(start.elapsed_time(end), 1e-3))))
    best = math.inf
    for _ in range(rounds):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best / 1000.0


def _versions() -> tuple:
    return (("torch", torch.__version__), ("triton", package_version("triton")),
            ("sageattention", package_version("sageattention")))


@attrs.define
class Selector:
    """Decides and remembers which kernel serves each key (see the module docstring).

    ``candidates``: the sage-type kernels (default: those importable here); ``timer(name, fn,
    device) -> seconds per call`` (default :func:`measure_time`); ``use_disk``: read and write
    the disk cache."""

    candidates: list | None = None
    timer: Callable = measure_time
    use_disk: bool = True
    missing: dict = attrs.field(factory=dict)  # candidate -> why it is not importable
    decisions: dict = attrs.field(factory=dict)  # (gpu, key) -> Decision
    warmed: set = attrs.field(factory=set)  # (gpu, key, choice): the kernel ran in this process
    _caches: dict = attrs.field(factory=dict)
    _keys: dict = attrs.field(factory=dict)  # see _key_of
    _lock: threading.RLock = attrs.field(factory=threading.RLock)

    def __attrs_post_init__(self):
        if self.candidates is None:
            self.candidates, self.missing = default_candidates()

    def cache_for(self, gpu: str) -> DecisionCache:
        cache = self._caches.get(gpu)
        if cache is None:
            cache = self._caches[gpu] = DecisionCache(CacheIdentity(gpu, _versions()))
        return cache

    def _key_of(self, call: AttentionCall) -> tuple[str, str, str]:
        """(mode, gpu, key) of ``call``, memoised on the raw inputs of the key (this runs on
        every call: a tuple lookup is cheaper than formatting the key)."""
        q, k = call.q, call.k
        raw = (os.environ.get("DTORCH_ATTENTION"), q.device, q.dtype, q.shape, k.shape, call.causal, call.need_lse)
        found = self._keys.get(raw)
        if found is None:
            mode = attention_mode()
            found = self._keys[raw] = (mode, device_name(q.device), decision_key(call, mode))
        return found

    def choose(self, call: AttentionCall, sdpa: Candidate) -> Candidate:
        """The kernel to run ``call`` with (``sdpa`` runs the call as the controller planned it)."""
        mode, gpu, key = self._key_of(call)
        capturing = is_capturing(call)
        with self._lock:
            decision = self.decisions.get((gpu, key))
            if decision is None and capturing:
                _say_once(f"attention {key}: first seen during CUDA-graph capture; SDPA runs it (decide before capture)")
                return sdpa
            if decision is None:
                decision = self._decide_shared(call, sdpa, mode, gpu, key)
            chosen = self._candidate(decision.choice, sdpa)
            if chosen is None:
                _say_once(f"attention {key}: the cached choice {decision.choice!r} is not available here; using SDPA")
                return sdpa
            if capturing and (gpu, key, chosen.name) not in self.warmed:
                return sdpa
            if chosen is not sdpa:
                # a key covers a range of lengths: this call may be one the kernel cannot serve
                # (causal with Sq != Sk where the first call had Sq == Sk, say)
                why = chosen.unsupported(call)
                if why:
                    _say_once(f"attention {key}: {chosen.name} cannot serve a call of this key ({why}); SDPA runs it")
                    return sdpa
            self.warmed.add((gpu, key, chosen.name))
            return chosen

    def _candidate(self, name: str, sdpa: Candidate) -> Candidate | None:
        if name == SDPA:
            return sdpa
        return next((c for c in self.candidates if c.name == name), None)

    def _decide_shared(self, call, sdpa, mode, gpu, key) -> Decision:
        """A decision from the disk cache (another process or an earlier run measured it), or a
        new one measured here and stored; the disk lock keeps the processes of one session from
        measuring the same key at once."""
        if not self.use_disk:
            decision = self.decide(call, sdpa, mode)
        else:
            cache = self.cache_for(gpu)
            with cache.locked():
                decision = cache.load().get(key)
                if decision is None:
                    decision = self.decide(call, sdpa, mode)
                    try:
                        cache.store(key, decision)
                    except OSError as exc:
                        _say_once(f"attention cache {cache.path} not written ({exc}); decisions stay in memory")
        self.decisions[(gpu, key)] = decision
        log.info("attention kernel chosen", gpu=gpu, key=key, choice=decision.choice, reason=decision.reason)
        return decision

    def decide(self, call: AttentionCall, sdpa: Candidate, mode: str) -> Decision:
        """Measure and choose for a new key (see the module docstring)."""
        if mode == "sdpa":
            return Decision(SDPA, "DTORCH_ATTENTION=sdpa")
        pool = [c for c in self.candidates if mode == "auto" or (mode == "sage" and c.kind == "sage")
                or _is_mode_kernel(c.name, mode)]
        reasons = [f"{name}: {why}" for name, why in self.missing.items()
                   if mode in ("auto", "sage") or _is_mode_kernel(name, mode)]
        serving = []
        for c in pool:
            why = c.unsupported(call)
            if why:
                reasons.append(f"{c.name}: {why}")
            else:
                serving.append(c)
        if not serving:
            return self._fallback(mode, "no other kernel serves this call (" + "; ".join(reasons or ["none installed"]) + ")")
        ref = gate.reference(call)
        sdpa_out, sdpa_lse = sdpa.run(call)
        gates = {SDPA: gate.check(call, sdpa_out, sdpa_lse, ref).describe()}
        passing = []
        for c in serving:
            try:
                out, lse = c.run(call)  # the first call (it compiles): never timed
            except Exception as exc:  # noqa: BLE001 - a kernel that fails is no candidate
                gates[c.name] = f"FAIL: raised {type(exc).__name__}: {str(exc)[:200]}"
                continue
            result = gate.check(call, out, lse, ref)
            if result.passed and call.need_lse and not call.causal and call.k.shape[2] >= 2:
                try:
                    merged = gate.check_merged(call, c.run, ref)
                except Exception as exc:  # noqa: BLE001
                    gates[c.name] = f"FAIL: raised {type(exc).__name__} on half the keys: {str(exc)[:200]}"
                    continue
                if not merged.passed:
                    result = attrs.evolve(merged, passed=False)
                    gates[c.name] = "merged halves " + result.describe()
                    continue
            gates[c.name] = result.describe()
            if result.passed:
                passing.append(c)
        del ref
        if not passing:
            return self._fallback(mode, "no candidate passed the accuracy gate", gate=gates)
        timed = passing if mode != "auto" else [sdpa] + passing
        times = {}
        if len(timed) == 1:
            return Decision(passing[0].name, f"DTORCH_ATTENTION={mode}: the only kernel that serves and passes", {}, gates)
        for c in timed:
            times[c.name] = self.timer(c.name, lambda c=c: c.run(call), call.q.device) * 1e3
        best = min(passing, key=lambda c: times[c.name])
        if mode != "auto":
            return Decision(best.name, f"DTORCH_ATTENTION={mode}: the fastest that passes", times, gates)
        if times[best.name] < times[SDPA] * (1.0 - TIE):
            return Decision(best.name, f"fastest: {times[SDPA] / times[best.name]:.2f}x SDPA", times, gates)
        return Decision(SDPA, f"SDPA is as fast (within {TIE:.0%}) or faster", times, gates)

    def _fallback(self, mode: str, why: str, gate: dict | None = None) -> Decision:
        if mode in ("sage", "ours"):
            _say_once(f"DTORCH_ATTENTION={mode}: {why}; SDPA runs these calls")
        return Decision(SDPA, why, {}, gate or {})


_selector: Selector | None = None
_selector_lock = threading.Lock()


def get_selector() -> Selector:
    """The process's selector (thread workers share it; each worker process has its own)."""
    global _selector
    with _selector_lock:
        if _selector is None:
            _selector = Selector()
        return _selector


def set_selector(selector: Selector | None) -> Selector | None:
    """Install ``selector`` for this process (None: a default one is built when next needed);
    returns the previous one."""
    global _selector
    with _selector_lock:
        previous, _selector = _selector, selector
        return previous
