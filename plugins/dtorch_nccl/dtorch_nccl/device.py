"""Which CUDA device a worker drives, and what its memory counters say."""

from __future__ import annotations

import torch

from dtorch_core.errors import DeviceError


def device_for_rank(rank: int, count: int | None = None) -> torch.device:
    """Worker ``rank`` drives ``cuda:rank % count`` (``count``: the devices torch sees).

    More workers than GPUs share them round-robin: the thread runner's virtual devices. The
    process runner needs one GPU per worker (NCCL refuses two ranks on one GPU).
    """
    if count is None:
        count = torch.cuda.device_count()
    if count < 1:
        raise DeviceError(
            f"device_type='cuda' needs a CUDA device, and torch {torch.__version__} sees none "
            f"(CUDA build: {torch.version.cuda or 'no'}; CUDA_VISIBLE_DEVICES may hide them); "
            f"use device_type='cpu' or run on a machine with a GPU"
        )
    return torch.device("cuda", rank % count)


def memory_stats(device: torch.device) -> dict:
    """The caching allocator's counters for ``device``: what tensors hold now and at their peak,
    and what the allocator has reserved from the driver. One physical device's numbers: workers
    that share a GPU (thread runner) report the same counters."""
    stats = torch.cuda.memory_stats(device)  # one call: each of the memory_* helpers makes one
    return {
        "device": str(device),
        "device_allocated_bytes": stats.get("allocated_bytes.all.current", 0),
        "device_reserved_bytes": stats.get("reserved_bytes.all.current", 0),
        "device_peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
        "device_peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
    }
