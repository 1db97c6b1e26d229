"""Worker kernels that sharding rules refer to by name (``dtorch::...``)."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _generator(device, seed: int) -> torch.Generator:
    dev = torch.device(device)
    if dev.type == "meta":
        return None
    return torch.Generator(device=dev).manual_seed(seed)


def _region_index(region):
    return tuple(slice(off, off + n) for off, n in region)


def mean_kernel(x, dim=None, keepdim=False, *, dtype=None, count):
    """Local sum divided by the global number of reduced elements: exact for uneven shards."""
    if dim is None:
        s = aten.sum.default(x, dtype=dtype)
    else:
        s = aten.sum.dim_IntList(x, dim, keepdim, dtype=dtype)
    return s / count


def factory_kernel(*, kind, shape, region, dtype, fill, device, seed=None):
    local_shape = tuple(n for _, n in region)
    if kind == "zeros":
        return torch.zeros(local_shape, dtype=dtype, device=device)
    if kind == "ones":
        return torch.ones(local_shape, dtype=dtype, device=device)
    if kind == "empty":
        return torch.empty(local_shape, dtype=dtype, device=device)
    if kind == "full":
        return torch.full(local_shape, fill, dtype=dtype, device=device)
    if kind == "arange":
        (off, n), = region
        return torch.arange(off, off + n, dtype=dtype, device=device)
    if kind in ("rand", "randn"):
        # the global tensor is drawn on every rank from the same seed: values do not depend on
        # the placement or the runner
        gen = _generator(device, seed)
        maker = torch.rand if kind == "rand" else torch.randn
        full = maker(shape, generator=gen, dtype=dtype, device=device)
        return full[_region_index(region)].clone()
    raise ValueError(f"unknown factory kind {kind!r}")


def native_dropout_kernel(x, p, train, *, region, global_shape, seed=None):
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if x.device.type == "meta":
        return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
    gen = _generator(x.device, seed)
    keep = torch.rand(global_shape, generator=gen, device=x.device)[_region_index(region)] >= p
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * keep * scale, keep


def embedding_kernel(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *,
                     vocab_offset, vocab_size, vocab_total):
    if vocab_size == vocab_total:
        return aten.embedding.default(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    local = indices - vocab_offset
    inside = (local >= 0) & (local < vocab_size)
    out = aten.embedding.default(weight, local.clamp(0, max(vocab_size - 1, 0)), -1, False, False)
    return out * inside.unsqueeze(-1).to(out.dtype)


def embedding_backward_kernel(grad, indices, num_weights, padding_idx, scale_grad_by_freq, *,
                              vocab_offset, vocab_size):
    if vocab_offset == 0 and vocab_size == num_weights:
        return aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    full = aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    return full.narrow(0, vocab_offset, vocab_size).clone()


def register(registry) -> None:
    registry.add("dtorch::mean", mean_kernel)
    registry.add("dtorch::factory", factory_kernel, seeded=True)
    registry.add("dtorch::native_dropout", native_dropout_kernel, seeded=True)
    registry.add("dtorch::embedding", embedding_kernel)
    registry.add("dtorch::embedding_backward", embedding_backward_kernel)
