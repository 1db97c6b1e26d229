"""Stand-in candidate kernels and timings for the selector's tests (CPU tensors): an exact
kernel (SDPA's math in fp32, cast back), an inaccurate one, one that returns NaN, each recording
the calls it served."""

from __future__ import annotations

import torch
from dtorch_sage_attn import Candidate
from dtorch_sage_attn.gate import reference


def exact(call):
    out, lse = reference(call)
    return out.to(call.q.dtype), (lse if call.need_lse else None)


def noisy(call):
    out, lse = exact(call)
    g = torch.Generator().manual_seed(0)
    return (out.float() + 0.2 * torch.randn(out.shape, generator=g) * out.float().abs().mean()).to(out.dtype), lse


def nan_output(call):
    out, lse = exact(call)
    out = out.clone()
    out.view(-1)[0] = float("nan")
    return out, lse


def standin(name, run=exact, *, kind="sage", unsupported=None, calls=None) -> Candidate:
    """A candidate named ``name`` that appends (q shape, k shape, need_lse) to ``calls`` per run."""

    def recorded(call):
        if calls is not None:
            calls.append((tuple(call.q.shape), tuple(call.k.shape), call.need_lse))
        return run(call)

    return Candidate(name, kind, recorded, unsupported or (lambda call: None))


def fixed_times(table: dict, log: list | None = None):
    """A timer that runs ``fn`` once and reports ``table[name]`` milliseconds."""

    def timer(name, fn, device):
        fn()
        if log is not None:
            log.append(name)
        return table[name] / 1e3

    return timer
