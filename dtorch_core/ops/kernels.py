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
        start, step = fill
        return (torch.arange(off, off + n, device=device) * step + start).to(dtype)
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
    if weight.shape[1] == 0 or indices.numel() == 0:
        # an empty shard (no columns, or no indices): nothing to look up, and CUDA's kernels
        # fault on zero-width rows
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    if vocab_size == vocab_total:
        return aten.embedding.default(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    local = indices - vocab_offset
    inside = (local >= 0) & (local < vocab_size)
    if vocab_size == 0:  # an empty shard of the table (more ranks than rows): all zeros
        return weight.new_zeros(tuple(indices.shape) + (weight.shape[1],))
    out = aten.embedding.default(weight, local.clamp(0, vocab_size - 1), -1, False, False)
    return out * inside.unsqueeze(-1).to(out.dtype)


def embedding_backward_kernel(grad, indices, num_weights, padding_idx, scale_grad_by_freq, *,
                              vocab_offset, vocab_size):
    if grad.numel() == 0:
        # an empty shard: no gradient reaches these rows (CUDA's kernel faults on zero-width rows)
        return grad.new_zeros((vocab_size, grad.shape[-1]))
    if vocab_offset == 0 and vocab_size == num_weights:
        return aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    full = aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    return full.narrow(0, vocab_offset, vocab_size).clone()


# -- random ops: the global tensor is drawn from the seed on every rank and each rank keeps its
#    region, so values do not depend on the placement or the runner ---------------------------
def _global_uniform(x, seed, region, global_shape):
    gen = _generator(x.device, seed)
    return torch.rand(global_shape, generator=gen, device=x.device)[_region_index(region)]


def bernoulli_kernel(x, p=None, *, generator=None, op, region, global_shape, seed):
    """bernoulli / bernoulli_ (float or tensor ``p``; ``bernoulli(x)`` draws with probabilities x)."""
    if x.device.type == "meta":
        return x if op.endswith("_") else torch.empty_like(x)
    u = _global_uniform(x, seed, region, global_shape)
    if op.endswith("_"):
        return x.copy_(u < (0.5 if p is None else p))
    return (u < (x if p is None else p)).to(x.dtype)


def random_fill_kernel(x, *args, generator=None, op, region, global_shape, seed, **kwargs):
    """uniform_ / normal_ / random_-style in-place fills and rand_like / randn_like."""
    if x.device.type == "meta":
        return x if op.endswith("_") else torch.empty_like(x, dtype=kwargs.get("dtype"))
    gen = _generator(x.device, seed)
    if op in ("rand_like", "randn_like"):
        maker = torch.rand if op == "rand_like" else torch.randn
        full = maker(global_shape, generator=gen, dtype=kwargs.get("dtype") or x.dtype, device=x.device)
        return full[_region_index(region)].clone()
    full = torch.empty(global_shape, dtype=x.dtype, device=x.device)
    getattr(full, op)(*args, generator=gen, **kwargs)
    return x.copy_(full[_region_index(region)])


# -- attention: the CPU kernels divide by zero on an empty batch/head shard -------------------
ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
)


def attention_overloads():
    for name in ATTENTION_OPS:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            yield getattr(packet, overload)


def attention_kernel_name(op) -> str:
    return f"dtorch::attention/{op._schema.name}.{op._overloadname}"


def empty_safe(op):
    """Run ``op``, or return zero outputs of the right shapes when the batch or head dim of a
    local shard is empty (uneven shards leave trailing ranks with nothing)."""

    def kernel(*args, **kwargs):
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(t.ndim >= 3 and 0 in t.shape[:2] for t in tensors):
            return op(*args, **kwargs)
        device = tensors[0].device

        def meta(a):
            return a.to("meta") if isinstance(a, torch.Tensor) else a

        out = op(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})

        def real(o):
            if not isinstance(o, torch.Tensor):
                return o
            return torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device).zero_()

        return tuple(real(o) for o in out) if isinstance(out, (tuple, list)) else real(out)

    return kernel


# elements: torch's sdpa pads ``attn_bias`` rows to this for the memory-efficient CUDA kernel
MEM_EFFICIENT_ALIGNMENT = 16


def aligned_bias(op):
    """Run ``op`` with its ``attn_bias`` padded like torch's sdpa pads it, where the op has one.

    The memory-efficient kernel needs bias strides that are multiples of 16 elements; sdpa pads
    the bias and passes a slice of the padded tensor, but a worker's local shard of that slice is
    a fresh contiguous tensor, so it is padded again here the same way."""
    names = [a.name for a in op._schema.arguments]
    if "attn_bias" not in names:
        return op
    index = names.index("attn_bias")

    def kernel(*args, **kwargs):
        if index < len(args):
            if _misaligned(args[index]):
                args = args[:index] + (_padded_rows(args[index]),) + args[index + 1:]
        elif _misaligned(kwargs.get("attn_bias")):
            kwargs = dict(kwargs, attn_bias=_padded_rows(kwargs["attn_bias"]))
        return op(*args, **kwargs)

    return kernel


def _misaligned(bias) -> bool:
    return isinstance(bias, torch.Tensor) and any(s % MEM_EFFICIENT_ALIGNMENT for s in bias.stride()[:-1])


def _padded_rows(bias: torch.Tensor) -> torch.Tensor:
    last = bias.shape[-1]
    return torch.nn.functional.pad(bias, (0, -last % MEM_EFFICIENT_ALIGNMENT))[..., :last]


def register(registry) -> None:
    registry.add("dtorch::mean", mean_kernel)
    registry.add("dtorch::factory", factory_kernel, seeded=True)
    registry.add("dtorch::native_dropout", native_dropout_kernel, seeded=True)
    registry.add("dtorch::bernoulli", bernoulli_kernel, seeded=True)
    registry.add("dtorch::random_fill", random_fill_kernel, seeded=True)
    registry.add("dtorch::embedding", embedding_kernel)
    registry.add("dtorch::embedding_backward", embedding_backward_kernel)
    for op in attention_overloads():
        registry.add(attention_kernel_name(op), empty_safe(aligned_bias(op)))
