"""The hook implementations of dtorch_sage_attn (its entry point ``sage_attn``). Importing it
touches no GPU and compiles nothing: candidates are imported when a worker first needs one."""

from __future__ import annotations

from dtorch_core import hookimpl
from dtorch_core.ops.nn import attention_rule
from dtorch_core.planner.schema import Rule

from .command import AttentionCommand
from .routing import inference_twins, kernel_name, routing_decomposition
from .worker_kernels import inference_kernel


@hookimpl
def dtorch_register_ops(registry) -> None:
    # each SDPA forward op: inference calls go to its twin (same sharding rule as dtorch_core's,
    # the selector's worker kernel), all other calls are planned as dtorch_core plans them
    for op, twin in inference_twins().items():
        registry.add(twin, Rule(attention_rule, kernel=kernel_name(op)))
        registry.add_decomposition(op, routing_decomposition(op, twin))


@hookimpl
def dtorch_register_kernels(registry) -> None:
    # every device type: on the CPU the selector runs too, finds no candidate that serves CPU
    # tensors, and records that SDPA runs (what `dtorch info` lists)
    for op in inference_twins():
        registry.add(kernel_name(op), inference_kernel(op))


@hookimpl
def dtorch_register_cli_commands(registry) -> None:
    registry.add("attention", AttentionCommand())
