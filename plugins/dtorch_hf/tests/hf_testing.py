"""Helpers of the dtorch_hf tests: tiny random T5 configurations (built here, nothing is
downloaded), the test meshes, the relative error, and for the diffusion transformers a record
of the sequence <-> head moves."""

from __future__ import annotations

from transformers import T5Config

import dtorch_core as dt

# "even": 4 heads and d_ff 64 divide tp 2 and 4, gated-GELU (wi_0/wi_1).
# "uneven": 5 heads (tp 2: 3+2 heads; tp 4: 2+2+1+0, torch.chunk's layout) and d_ff 37, relu (wi).
CONFIGS = {
    "even": dict(num_heads=4, d_ff=64, feed_forward_proj="gated-gelu"),
    "uneven": dict(num_heads=5, d_ff=37, feed_forward_proj="relu"),
}


def tiny_config(kind: str, initializer_factor: float = 1.0) -> T5Config:
    # initializer_factor: generate tests take a large one, so a random model's greedy tokens
    # vary (at 1.0 they are all the pad token); training tests keep 1.0, since at 10 the
    # softmaxes saturate and fp32 gradients of ~1e-7 make Adam's first step (about lr * sign)
    # differ between any two summation orders
    return T5Config(vocab_size=64, d_model=32, d_kv=8, num_layers=2, num_decoder_layers=2,
                    relative_attention_num_buckets=8, relative_attention_max_distance=16,
                    dropout_rate=0.0, initializer_factor=initializer_factor, decoder_start_token_id=0,
                    pad_token_id=0, eos_token_id=1, **CONFIGS[kind])


# (shape, names): tp over all four devices, and tp x dp with the dims in either order
MESHES = {"tp4": ((4,), ("tp",)), "tp2xdp2": ((2, 2), ("tp", "dp")), "dp2xtp2": ((2, 2), ("dp", "tp"))}


def make_mesh(name: str):
    shape, names = MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def rel_err(got, want) -> float:
    got = got.full_tensor() if isinstance(got, dt.DTensor) else got
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


# the diffusion transformers' meshes: tp over all four devices, Ulysses sp, both, and the
# batch split over "cfg" (a pipeline's unconditional and conditional halves) with sp
TRANSFORMER_MESHES = {"tp4": ((4,), ("tp",)), "sp4": ((4,), ("sp",)), "tp2xsp2": ((2, 2), ("tp", "sp")),
                      "cfg2xsp2": ((2, 2), ("cfg", "sp"))}


def make_transformer_mesh(name: str):
    shape, names = TRANSFORMER_MESHES[name]
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def record_moves(monkeypatch, family_module) -> list:
    """(source dim, destination dim, input shape) of every sequence <-> head move the family's
    attention processor makes (its ``_move``), in order."""
    moves = []
    real_move = family_module._move

    def spy(x, src, dst):
        out = real_move(x, src, dst)
        if out is not x:
            moves.append((src, dst, tuple(x.shape)))
        return out

    monkeypatch.setattr(family_module, "_move", spy)
    return moves
