"""Module-level parallelism: parallel styles and ``parallelize_module``, data parallel and fully
sharded parameters, and initialisation of meta-built models on the workers (``materialize``)."""

from .data_parallel import data_parallel
from .fully_shard import fully_shard
from .init_recording import meta_init
from .loss import loss_parallel
from .materialize import materialize
from .parallelize import parallelize_module
from .styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "data_parallel",
    "fully_shard",
    "loss_parallel",
    "materialize",
    "meta_init",
    "parallelize_module",
]
