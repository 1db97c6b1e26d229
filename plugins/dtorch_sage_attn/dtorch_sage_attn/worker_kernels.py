"""The worker kernels of the inference attention ops: each asks the selector which kernel serves
the call, and returns exactly what the aten op it stands for returns (the same outputs, shapes,
strides, dtypes and devices), whichever kernel ran.

SDPA (the fallback and the timing anchor) is dtorch_core's own kernel of that aten op (empty
batch/head shards and the memory-efficient kernel's bias alignment handled there)."""

from __future__ import annotations

import threading

import torch

from dtorch_core.ops.kernels import aligned_bias, empty_safe

from .records import SDPA, AttentionCall, Candidate
from .selector import _say_once, get_selector

# per op: the name of its mask argument, the index of its log-sum-exp output, and whether its
# log-sum-exp is always computed (the flash ops) or only with ``compute_log_sumexp``
MASK_ARGS = ("attn_mask", "attn_bias")
LSE_INDEX = 1


def bind(op, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def needs_lse(bound: dict) -> bool:
    """Whether the op's caller gets a log-sum-exp: always for the flash ops (ring attention reads
    it), with ``compute_log_sumexp`` for the others."""
    return bool(bound.get("compute_log_sumexp", True))


def blocking_reason(op, bound: dict) -> str | None:
    """Why no candidate may serve this call at all (the controller routes such calls to SDPA
    already; checked again here for callers of the inference ops themselves)."""
    if any(bound.get(name) is not None for name in MASK_ARGS):
        return "a mask/bias"
    if bound.get("dropout_p"):
        return "dropout"
    q = bound["query"]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} inputs"
    if q.ndim != 4:
        return f"{q.ndim}-D inputs"
    if q.requires_grad or bound["key"].requires_grad or bound["value"].requires_grad:
        return "inputs that need gradients"
    return None


class OutputLayout:
    """The aten op's outputs for a signature of inputs, from one meta call (cached): the
    kernel's output and log-sum-exp are laid out as the op's, the other outputs (RNG state,
    sequence offsets: unused without dropout) are made as the op makes them."""

    def __init__(self, op):
        self.op = op
        self.name = op._schema.name.split("::")[1]
        self._meta: dict = {}
        self._lock = threading.Lock()

    def meta_outputs(self, args, kwargs):
        signature = tuple(_signature(a) for a in args) + tuple((k, _signature(v)) for k, v in sorted(kwargs.items()))
        with self._lock:
            out = self._meta.get(signature)
            if out is None:
                out = self._meta[signature] = self.op(*_to_meta(args), **_to_meta(kwargs))
            return out

    def pack(self, bound, args, kwargs, out, lse):
        meta = self.meta_outputs(args, kwargs)
        device = bound["query"].device
        result = []
        for i, m in enumerate(meta):
            if i == 0:
                result.append(_as_layout(out, m))
            elif i == LSE_INDEX:
                result.append(self._lse(bound, m, lse, device))
            elif isinstance(m, torch.Tensor):
                # RNG state and debug outputs, never read without dropout (uninitialised, as some
                # dtypes, e.g. uint64, cannot be filled on CUDA); the memory-efficient op keeps
                # its philox seed/offset on the CPU
                where = "cpu" if self.name == "_scaled_dot_product_efficient_attention" else device
                result.append(torch.empty(m.shape, dtype=m.dtype, device=where))
            else:
                result.append(m)
        return tuple(result)

    def _lse(self, bound, meta_lse, lse, device):
        if not needs_lse(bound):
            if self.name == "_scaled_dot_product_cudnn_attention":
                return None  # cuDNN returns no log-sum-exp tensor without compute_log_sumexp
            return torch.empty(meta_lse.shape, dtype=meta_lse.dtype, device=device)
        if self.name == "_scaled_dot_product_efficient_attention":
            padded = torch.full(meta_lse.shape, float("inf"), dtype=torch.float32, device=device)
            padded[..., :lse.shape[-1]] = lse
            return padded
        return _as_layout(lse.reshape(meta_lse.shape), meta_lse)

    def unpack(self, bound, outputs):
        """(out, lse or None) of the aten op's outputs, lse as (B, H, Sq)."""
        out, lse = outputs[0], outputs[LSE_INDEX]
        if lse is None or not needs_lse(bound):
            return out, None
        sq = bound["query"].shape[2]
        return out, lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :sq]


def _signature(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.stride(), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return a


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


def _as_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s strides (a copy only where they differ): later views on the worker
    were planned on the aten op's layout."""
    if t.stride() == like.stride() and t.dtype == like.dtype:
        return t
    out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=t.device)
    return out.copy_(t)


def inference_kernel(op):
    """The worker kernel of the inference twin of aten attention op ``op``."""
    fallback = empty_safe(aligned_bias(op))
    layout = OutputLayout(op)

    def kernel(*args, **kwargs):
        bound = bind(op, args, kwargs)
        q, k = bound["query"], bound["key"]
        if 0 in q.shape or 0 in k.shape:
            return fallback(*args, **kwargs)  # an empty shard (uneven heads or batch): nothing to choose
        why = blocking_reason(op, bound)
        if why:
            _say_once(f"{layout.name}: {why} -> SDPA")
            return fallback(*args, **kwargs)
        call = AttentionCall(q, k, bound["value"], causal=bool(bound["is_causal"]),
                             scale=bound["scale"], need_lse=needs_lse(bound))
        sdpa = Candidate(SDPA, "sdpa", lambda c: layout.unpack(bound, fallback(*args, **kwargs)))
        chosen = get_selector().choose(call, sdpa)
        if chosen.name == SDPA:
            return fallback(*args, **kwargs)
        try:
            out, lse = chosen.run(call)
        except Exception as exc:  # noqa: BLE001 - a kernel that refuses a call must not fail the op
            _say_once(f"{layout.name}: {chosen.name} raised {type(exc).__name__}: {str(exc)[:200]}; SDPA runs it")
            return fallback(*args, **kwargs)
        return layout.pack(bound, args, kwargs, out, lse)

    return kernel
