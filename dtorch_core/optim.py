"""Optimizers whose every step-dependent value lives on the workers.

``torch.optim.Adam``/``AdamW`` keep the step count in a CPU tensor on the controller and compute
the bias corrections there as Python numbers. Under ``dt.compile`` that is handled for them
(``optim_replay`` switches them to ``capturable=True`` when a step is captured), so they replay
unchanged. :class:`AdamW` here keeps the step count as a replicated distributed tensor from its
first step and computes the corrections with tensor ops, eagerly too: no controller-side
counter, no hooks, and its state is the same before and after a capture.
"""

from __future__ import annotations

import torch

from .placement import Replicate
from .tensor import DTensor


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW`` without amsgrad) that replays.

    Same hyper-parameters and update as ``torch.optim.AdamW``; the bias corrections are float32
    tensors instead of float64 Python numbers, so results agree with torch to float32 rounding.
    Its ``lr`` is a float read when the step is captured (it has no tensor-lr path): a captured
    step is re-captured when its hyper-parameters change (see ``dt.compile``); prefer
    ``torch.optim.AdamW`` with an lr scheduler, whose new lr replays without re-capture.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = _scalar_like(p)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                step.add_(1)
                if decay:
                    p.mul_(1 - lr * decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                correction1 = 1 - torch.pow(beta1, step)
                correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
                denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)
                p.sub_(exp_avg / denom * (lr / correction1))
        return loss


def _scalar_like(p: torch.Tensor) -> torch.Tensor:
    """A float32 zero on the same devices as ``p`` (replicated over its mesh)."""
    if isinstance(p, DTensor):
        from .api import zeros

        return zeros((), device_mesh=p.device_mesh, placements=[Replicate()] * p.device_mesh.ndim,
                     dtype=torch.float32)
    return torch.zeros((), dtype=torch.float32, device=p.device)
