"""Tensor-parallel building blocks: parallel styles and ``parallelize_module``."""

from .data_parallel import data_parallel
from .loss import loss_parallel
from .parallelize import parallelize_module
from .styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "data_parallel",
    "loss_parallel",
    "parallelize_module",
]
