"""The sage-type candidate kernels: ``sageattention`` 1.0.6 (where it imports), this plugin's
own Triton kernel (``triton_sage``, where triton imports and the tensors are on CUDA) and, with
DTORCH_SAGE_GLUON=1, its Gluon rewrite (``ours_gluon``: sm_90 only).

SDPA, the third candidate, is built per call by the worker kernel (it is the aten op the
controller's dispatch chose, on that call's arguments)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os

import structlog
import torch

from .records import AttentionCall, Candidate

log = structlog.get_logger(__name__)

HALF_DTYPES = (torch.float16, torch.bfloat16)
SAGEATTENTION_HEAD_DIMS = (64, 96, 128)


def _common_reason(call: AttentionCall) -> str | None:
    """Why no sage-type kernel can serve ``call``, whatever the kernel."""
    if call.q.device.type != "cuda":
        return f"{call.q.device.type} tensors (sage kernels run on CUDA)"
    if call.q.dtype not in HALF_DTYPES:
        return f"{call.q.dtype} inputs (sage kernels take fp16/bf16)"
    return None


# -- sageattention 1.0.6 ----------------------------------------------------------------------
def _sageattention_unsupported(call: AttentionCall) -> str | None:
    reason = _common_reason(call)
    if reason:
        return reason
    if call.need_lse:
        return "the call needs the log-sum-exp (sageattention 1.0.6 does not return it)"
    if call.q.shape[-1] not in SAGEATTENTION_HEAD_DIMS:
        return f"head_dim {call.q.shape[-1]} (sageattention 1.0.6 takes {SAGEATTENTION_HEAD_DIMS})"
    if call.q.shape[1] != call.k.shape[1]:
        # its users report wrong bf16 output with GQA; the gate would catch it, but not run it
        return "GQA (query heads != key heads)"
    if call.causal and call.q.shape[2] != call.k.shape[2]:
        return "causal with Sq != Sk (sageattention 1.0.6 masks only square attention)"
    if any(t.stride(-1) != 1 for t in (call.q, call.k, call.v)):
        return "a head dim that is not contiguous"
    return None


def _sageattention_candidate(sageattn) -> Candidate:
    def run(call: AttentionCall):
        # its own K smoothing subtracts the mean from k in place (k is the worker's tensor, read
        # again later): smooth out of place instead (softmax is unchanged by it either way)
        k = call.k - call.k.mean(dim=2, keepdim=True)
        out = sageattn(call.q, k, call.v, tensor_layout="HND", is_causal=call.causal, sm_scale=call.scale,
                       smooth_k=False)
        return out, None

    return Candidate("sageattention", "sage", run, _sageattention_unsupported)


# -- this plugin's kernels: Triton, and its Gluon rewrite for sm_90 (opt-in) -------------------
def _triton_candidate(module, name: str = "ours", config=None) -> Candidate:
    def unsupported(call: AttentionCall) -> str | None:
        reason = _common_reason(call) or module.unsupported_reason(
            call.q, call.k, call.v, causal=call.causal, attn_mask=None, dropout_p=0.0)
        if reason is None and config is not None and not module.gluon_serves(call.q, config):
            reason = "the Gluon kernel needs an sm_90 GPU and Triton with Gluon"
        return reason

    def run(call: AttentionCall):
        out = module.sage_attention(call.q, call.k, call.v, causal=call.causal, scale=call.scale,
                                    return_lse=call.need_lse, config=config)
        return out if call.need_lse else (out, None)

    return Candidate(name, "sage", run, unsupported)


def gluon_opted_in() -> bool:
    """DTORCH_SAGE_GLUON=1 adds the Gluon kernel as candidate ``ours_gluon``. Opt-in: on an
    H100 it ran right but slower than the Triton kernel at every shape measured (README), so by
    default the selector does not spend a compile and a timing on it."""
    return os.environ.get("DTORCH_SAGE_GLUON", "0") == "1"


def default_candidates() -> tuple[list[Candidate], dict[str, str]]:
    """The sage-type candidates importable in this process, and for each missing one why."""
    found, missing = [], {}
    try:
        from sageattention import sageattn
    except Exception as exc:  # noqa: BLE001 - any import failure means "not a candidate"
        missing["sageattention"] = f"not importable ({type(exc).__name__}: {exc})"
    else:
        found.append(_sageattention_candidate(sageattn))
    try:
        importlib.import_module("triton")
        module = importlib.import_module("dtorch_sage_attn.triton_sage")
    except Exception as exc:  # noqa: BLE001
        missing["ours"] = f"not importable ({type(exc).__name__}: {exc})"
    else:
        found.append(_triton_candidate(module))
        if gluon_opted_in():
            found.append(_triton_candidate(module, "ours_gluon", module.GLUON_CONFIG))
    return found, missing


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
