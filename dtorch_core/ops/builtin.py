"""The builtin operator plugin: sharding rules and worker kernels for aten ops."""

from __future__ import annotations

from ..hookspecs import hookimpl
from . import (
    composite,
    conv,
    data_dependent,
    foreach,
    foreach_norm,
    foreach_rule,
    fused_optim,
    indexing,
    kernels,
    linear,
    losses,
    materialize_kernel,
    matmul,
    nn,
    pointwise,
    reductions,
    storage_kernels,
    views,
)


@hookimpl
def dtorch_register_ops(registry) -> None:
    for family in (pointwise, reductions, matmul, linear, views, indexing, nn, conv, losses, foreach, foreach_rule,
                   fused_optim):
        family.register(registry)
    data_dependent.register(registry)  # decompositions: nonzero, masked_select, x[mask], unique, ...
    composite.register(registry)  # last: only ops that got nothing above


@hookimpl
def dtorch_register_kernels(registry) -> None:
    kernels.register(registry)
    linear.register_kernels(registry)
    materialize_kernel.register(registry)
    storage_kernels.register(registry)
    foreach_norm.register_kernels(registry)
    conv.register_kernels(registry)
    data_dependent.register_kernels(registry)
