"""The values the selector works with: one attention call, one candidate kernel, a gate result
and a decision."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

SDPA = "sdpa"  # the candidate that is always there: the aten kernel the controller's dispatch chose


@attrs.frozen
class AttentionCall:
    """The tensors and flags of one attention call that a candidate kernel may serve: ``q``
    (B, Hq, Sq, D), ``k``/``v`` (B, Hkv, Sk, D); no mask and no dropout (those never reach a
    candidate). ``need_lse``: the caller reads the log-sum-exp (ring attention's block merges)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    scale: float | None = None
    need_lse: bool = False


@attrs.frozen
class Candidate:
    """A kernel the selector may pick.

    ``run(call) -> (out, lse or None)``: out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) fp32
    (natural-log log-sum-exp of the scaled scores) when ``call.need_lse``. ``unsupported(call)``:
    why this kernel cannot serve the call, or None. ``kind``: "sdpa" or "sage" (what
    ``DTORCH_ATTENTION=sage`` picks among)."""

    name: str
    kind: str
    run: Callable
    unsupported: Callable = lambda call: None


@attrs.frozen
class GateResult:
    """A candidate's output against the fp32 reference on the same inputs."""

    cosine: float
    rel_l1: float
    finite: bool
    lse_max_err: float | None
    passed: bool

    def describe(self) -> str:
        lse = "" if self.lse_max_err is None else f", lse max err {self.lse_max_err:.2e}"
        verdict = "pass" if self.passed else "FAIL"
        return f"{verdict}: cosine {self.cosine:.6f}, rel L1 {self.rel_l1:.2e}{lse}" + ("" if self.finite else ", NaN/inf")


@attrs.frozen
class Decision:
    """What the selector chose for one key, and why (kept in memory and in the disk cache)."""

    choice: str
    reason: str
    times_ms: dict = attrs.field(factory=dict)  # candidate -> measured time per call
    gate: dict = attrs.field(factory=dict)  # candidate -> GateResult.describe()

    def to_json(self) -> dict:
        return {"choice": self.choice, "reason": self.reason, "times_ms": dict(self.times_ms),
                "gate": dict(self.gate)}

    @classmethod
    def from_json(cls, data: dict) -> Decision:
        return cls(str(data["choice"]), str(data.get("reason", "")), dict(data.get("times_ms", {})),
                   dict(data.get("gate", {})))
