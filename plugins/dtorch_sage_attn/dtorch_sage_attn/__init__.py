"""dtorch_sage_attn: the attention kernel for SDPA's forward on dtorch workers, chosen per shape
among SDPA, ``sageattention`` 1.0.6 and this plugin's INT8/FP8 Triton kernel by measured speed,
only among those that pass an accuracy gate; inference calls only (see the README)."""

from .records import AttentionCall, Candidate, Decision, GateResult
from .routing import reset_routes, routes
from .selector import MODES, Selector, get_selector, set_selector

__all__ = ["MODES", "AttentionCall", "Candidate", "Decision", "GateResult", "Selector", "get_selector",
           "reset_routes", "routes", "set_selector"]
