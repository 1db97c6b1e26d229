"""On the controller: which attention calls may leave SDPA.

A worker kernel cannot know whether a backward will follow, but the controller can, at
dispatch: autograd records the op before ``DTensor.__torch_dispatch__`` sees it, with grad mode
and the inputs' ``requires_grad`` as the user set them. So each aten SDPA forward op that the
controller's dispatch produces (CPU flash, CUDA flash, memory-efficient, cuDNN) gets a
decomposition here that sends inference calls to its *inference twin* — a ``dtorch_sage::`` op
with the same schema and the same sharding rule, whose worker kernel asks the selector — and
plans every other call as before (``dispatch_direct``: dtorch_core's rule and kernel, i.e.
SDPA). Training calls, masks and biases, dropout, fp32 inputs, and ``compute_log_sumexp=True``
(torch's SDPA asks for it only when a backward may follow; inside an ``autograd.Function``'s
forward grad mode is off, so this flag is what tells a training call there) all stay on SDPA.
"""

from __future__ import annotations

import collections
import threading

import structlog
import torch

from dtorch_core.planner.dispatch import dispatch_direct

from .worker_kernels import MASK_ARGS, bind

log = structlog.get_logger(__name__)
aten = torch.ops.aten

LIBRARY = "dtorch_sage"
FORWARD_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
INFERENCE = "inference"  # the routes() entry of calls sent to the selector

_library = None
_routes: collections.Counter = collections.Counter()
_routes_lock = threading.Lock()


def forward_ops() -> list:
    """The aten SDPA forward ops of this torch build (default overloads)."""
    return [getattr(aten, name).default for name in FORWARD_OPS if hasattr(aten, name)]


def twin_name(op) -> str:
    return "inference" + op._schema.name.split("::")[1]


def kernel_name(op) -> str:
    """The worker kernel of ``op``'s inference twin."""
    return f"{LIBRARY}::attention/{op._schema.name.split('::')[1]}"


def inference_twins() -> dict:
    """aten forward op -> its inference twin (defined once per process)."""
    global _library
    if _library is None:
        library = torch.library.Library(LIBRARY, "DEF")
        for op in forward_ops():
            library.define(twin_name(op) + "(" + str(op._schema).split("(", 1)[1])
            # on plain and meta tensors the twin is the aten op itself (the planner infers its
            # outputs this way); on distributed tensors its sharding rule and kernel apply
            library.impl(twin_name(op), _same_as(op), "CompositeExplicitAutograd")
        _library = library
    namespace = getattr(torch.ops, LIBRARY)
    return {op: getattr(namespace, twin_name(op)).default for op in forward_ops()}


def _same_as(op):
    def impl(*args, **kwargs):
        return op(*args, **kwargs)

    return impl


def sdpa_reason(op, bound: dict) -> str | None:
    """Why this call must stay on SDPA, or None for an inference call the selector may serve."""
    tensors = [bound["query"], bound["key"], bound["value"]] + [bound.get(n) for n in MASK_ARGS]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return "gradients needed"
    if any(bound.get(name) is not None for name in MASK_ARGS):
        return "a mask/bias"
    if bound.get("dropout_p"):
        return "dropout"
    if bound.get("compute_log_sumexp"):
        return "compute_log_sumexp (a backward may follow)"
    if bound["query"].dtype not in (torch.float16, torch.bfloat16):
        return f"{bound['query'].dtype} inputs"
    return None


def routing_decomposition(op, twin):
    """The controller-side decomposition of aten op ``op``: its twin for inference calls, the
    op's own plan for everything else."""

    def route(*args, **kwargs):
        why = sdpa_reason(op, bind(op, args, kwargs))
        _count(why or INFERENCE)
        if why:
            return dispatch_direct(op, args, kwargs)
        return twin(*args, **kwargs)

    return route


def _count(route: str) -> None:
    with _routes_lock:
        first = route not in _routes
        _routes[route] += 1
    if first:
        log.info("attention calls routed", route=route, to="selector" if route == INFERENCE else "sdpa")


def routes() -> dict[str, int]:
    """Calls seen on this controller by route: ``"inference"`` (sent to the selector) or the
    reason they stayed on SDPA."""
    with _routes_lock:
        return dict(_routes)


def reset_routes() -> None:
    with _routes_lock:
        _routes.clear()
