"""Worker kernels that free a tensor's memory while its handle lives on, and give it back.

``fully_shard`` uses them for the parameters it gathers for a module's forward: autograd keeps
the gathered tensors (and views of them, e.g. a Linear's transposed weight) for the backward,
but their memory is released after the forward and refilled just before the module's backward,
as torch's FSDP does by resizing storage.
"""

from __future__ import annotations

import torch


def release_storage_kernel(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Free ``x``'s memory (its storage shrinks to 0 bytes; views of it share that). A no-op when
    ``x`` shares its storage with ``keep`` (a gather that was only an alias of the shard)."""
    storage = x.untyped_storage()
    if storage.nbytes() and storage.data_ptr() != keep.untyped_storage().data_ptr():
        storage.resize_(0)
    return x


def refill_storage_kernel(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Give ``x`` its memory back (if released) and copy ``source``'s values into it."""
    storage = x.untyped_storage()
    if x.numel() and storage.nbytes() == 0:
        extent = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1
        storage.resize_(extent * x.element_size())
    x.copy_(source)
    return x


def register(registry) -> None:
    registry.add("dtorch::release_storage", release_storage_kernel)
    registry.add("dtorch::refill_storage", refill_storage_kernel)
