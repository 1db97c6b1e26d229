"""The Flux family: diffusers' ``FluxTransformer2DModel``, the class unmodified.

Tensor parallel (``"tp"``) over heads and MLP features: in the double-stream blocks q/k/v and
add_q/k/v_proj colwise, to_out.0 and to_add_out rowwise, each feed-forward's first Linear
colwise and second rowwise; in the single-stream blocks q/k/v and proj_mlp colwise and proj_out
rowwise. proj_out's input is ``cat([attention output, MLP output], dim=-1)`` of two
tp-sharded tensors; DTensor semantics make that concatenation exact (dtorch lays the global
concatenation out again before the rowwise matmul: a redistribution, not an approximation).
norm_q/norm_k (RMSNorm over head_dim) run on head shards: head_dim is never sharded. RoPE and
the adaLN modulation run on whatever shards their inputs have; the modulation Linears stay
replicated.

Sequence parallel (``"sp"``, Ulysses): the image and text hidden states enter the model sharded
on the sequence (Shard(1) on "sp", uneven lengths exact). Attention runs through
``DtorchFluxAttnProcessor`` (installed with diffusers' ``set_attn_processor``), which computes
diffusers' FluxAttnProcessor: q/k/v are redistributed from sequence shards to head shards (an
all-to-all), SDPA runs on whole sequences, and the output is redistributed back to sequence
shards. On a tp x sp mesh the heads end up split over both dims. The single-stream blocks run
with the text and image streams kept apart (``_single_block``), so their
concatenation along the sequence never gathers.

Batch (``"cfg"``, ``"dp"``): the inputs with a batch dim (``BATCH_INPUTS``) enter the model
split on it (Shard(0)); with "sp" as well, each batch shard is then split on the sequence.

The family sees neither the mesh nor ``sp_mode`` at parallelize time (``ModelFamily`` has only
``tp_plan(model)``), so the processor and the entry hook read the mesh from the DTensors they
meet at call time: the "sp" dim is found by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import dtorch_core as dt
from dtorch_core.placement import Shard

from ..batch import lay_out
from ..family import ModelFamily
from ..blocks import one_op_blocks
from ..joint import joint_heads, stream_outputs
from ..modulate import gated_residual, one_op_applies, one_op_modulation
from ..pos_embed import distributed_pos_embed
from ..rms_norm import one_op_rms_norms
from ..ring import ring_attention, ring_mesh_dim
from ..ring_mask import RingMask
from ..rotary import rotary
from ..timesteps import one_op_timesteps

# the inputs with a batch dim, split over "cfg" and "dp" where they enter the model
BATCH_INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")
SEQ, HEADS = 1, 2          # (batch, sequence, heads, head_dim), diffusers' attention layout
_HOOKED = "_dtorch_flux_sp_hook"


def _sp_dims(x) -> list[int]:
    if not isinstance(x, dt.DTensor):
        return []
    names = x.device_mesh.mesh_dim_names or ()
    return [i for i, n in enumerate(names) if n == "sp" and x.device_mesh.size(i) > 1]


def sp_mesh_dim(weight):
    """(mesh, index of its "sp" dim) of a model's DTensor parameter, or (None, None) where the
    model has no "sp" dim of more than one device: the families read the mesh at call time."""
    if not isinstance(weight, dt.DTensor):
        return None, None
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if "sp" not in names or mesh.size(names.index("sp")) == 1:
        return None, None
    return mesh, names.index("sp")


def _move(x, src: int, dst: int):
    """``x`` with every "sp" mesh dim that shards tensor dim ``src`` sharding ``dst`` instead
    (Ulysses' all-to-all when src/dst are the sequence and heads dims)."""
    dims = [i for i in _sp_dims(x) if x.placements[i] == Shard(src)]
    if not dims:
        return x
    wanted = list(x.placements)
    for i in dims:
        wanted[i] = Shard(dst)
    return x.redistribute(x.device_mesh, wanted)


def _heads(attn, x):
    return x.unflatten(-1, (-1, attn.head_dim))


def _project(attn, x, added: bool = False) -> tuple:
    """(query, key, value) of ``x`` in the (batch, seq, heads, head_dim) layout, through the
    attention's own projections (``added``: the text stream's add_*_proj of a double block)."""
    if added:
        return (attn.norm_added_q(_heads(attn, attn.add_q_proj(x))), attn.norm_added_k(_heads(attn, attn.add_k_proj(x))),
                _heads(attn, attn.add_v_proj(x)))
    return attn.norm_q(_heads(attn, attn.to_q(x))), attn.norm_k(_heads(attn, attn.to_k(x))), _heads(attn, attn.to_v(x))


def _joint_attention(attn, streams: list, image_rotary_emb, attention_mask=None) -> list:
    """FluxAttnProcessor's attention over the concatenation of ``streams`` (``[(q, k, v)]``,
    text first, as diffusers joins them): one output per stream, (batch, seq, heads, head_dim),
    in the stream's own sequence layout. With sp_mode="ring" the streams stay on their sequence
    shards (ring attention); otherwise (Ulysses) each stream's q/k/v go from sequence shards to
    head shards, the joint sequence is whole on every rank (its concatenation is local), and
    each stream's output goes back to its sequence shards."""
    ring_dim = ring_mesh_dim(attn, streams[-1][0])
    if ring_dim is not None:
        return _ring_flux(streams, image_rotary_emb, ring_dim, attention_mask)
    if isinstance(attention_mask, RingMask):
        attention_mask = attention_mask.mask
    seq_sharded = [bool(_sp_dims(q)) and Shard(SEQ) in q.placements for q, _, _ in streams]
    moved = [tuple(_move(t, SEQ, HEADS) for t in stream) for stream in streams]
    lengths = [q.shape[SEQ] for q, _, _ in moved]
    query, key, value = joint_heads(*(list(ts) for ts in zip(*moved)), image_rotary_emb)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
    # split the joint sequence while it is whole (head-sharded), then each stream back to its
    # own sequence shards
    parts = stream_outputs(out, lengths)
    return [_move(part, HEADS, SEQ) if sharded else part for part, sharded in zip(parts, seq_sharded)]


class DtorchFluxAttnProcessor:
    """diffusers' FluxAttnProcessor (non-fused projections, no IP adapter) through
    :func:`_joint_attention` (Ulysses or ring). Without an "sp" dim it is FluxAttnProcessor
    itself."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, text_stream=None):
        """``text_stream``: a single-stream block's text tokens kept apart from ``hidden_states``
        (see :func:`_single_block`), projected like them; returns (text, image)."""
        if getattr(attn, "fused_projections", False):
            raise NotImplementedError("dtorch's Flux attention does not serve fused qkv projections; unfuse them")
        streams = [_project(attn, hidden_states)]
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:
            streams.insert(0, _project(attn, encoder_hidden_states, added=True))
        elif text_stream is not None:
            streams.insert(0, _project(attn, text_stream))
        outs = _joint_attention(attn, streams, image_rotary_emb, attention_mask)
        dtype = streams[-1][0].dtype
        if not joint:
            flat = tuple(o.flatten(2, 3).to(dtype) for o in outs)
            return flat if text_stream is not None else flat[0]
        enc, out = outs
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(dtype).contiguous()))
        enc = attn.to_add_out(enc.flatten(2, 3).to(dtype).contiguous())
        return out, enc


def _ring_flux(streams: list, image_rotary_emb, ring_dim, attention_mask=None) -> list:
    """The joint attention as ring attention: each stream stays on its sequence shards (RoPE
    applied per stream with its part of the joint sequence's rotary table: text first; the
    mask, over the joint sequence, is cut into blocks by the ring)."""
    if image_rotary_emb is not None:
        start, rotated = 0, []
        for q, k, v in streams:
            part = tuple(t[start:start + q.shape[SEQ]] for t in image_rotary_emb)
            start += q.shape[SEQ]
            rotated.append((rotary(q, part), rotary(k, part), v))
        streams = rotated
    return ring_attention(*(list(ts) for ts in zip(*streams)), ring_dim, attn_mask=attention_mask)


def _single_block(block):
    """``block.forward`` (a FluxSingleTransformerBlock) with the text and image streams kept
    apart where "sp" shards them, and with its gated residual as one op in inference.

    diffusers' block concatenates the two streams along the sequence and splits them again at
    its end; with both streams sequence-sharded each of those would gather the joint sequence.
    Every op of the block but attention is per token, so under "sp" this runs them per stream
    (the same modules: the same values) and attention over the joint sequence through the
    block's attention module, given both streams. Without "sp", in inference on a distributed
    model, it is diffusers' block with ``residual + gate.unsqueeze(1) * proj_out(...)`` as
    dtorch_hf's ``gated_add``; otherwise diffusers' own forward."""
    original = block.forward

    def forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        kwargs = joint_attention_kwargs or {}
        sp = bool(_sp_dims(hidden_states))
        if sp and not set(kwargs) - {"attention_mask"}:
            streams = (encoder_hidden_states, hidden_states)
            normed = [block.norm(x, emb=temb) for x in streams]
            attended = block.attn(hidden_states=normed[1][0], image_rotary_emb=image_rotary_emb,
                                  text_stream=normed[0][0], attention_mask=kwargs.get("attention_mask"))
            text, image = (_single_stream(block, x, n, gate, a) for x, (n, gate), a in zip(streams, normed, attended))
            return text, image
        if sp or not one_op_applies(hidden_states):
            return original(hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
        text_len = encoder_hidden_states.shape[1]
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        normed, gate = block.norm(joint, emb=temb)
        attended = block.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **kwargs)
        joint = _single_stream(block, joint, normed, gate, attended)
        return joint[:, :text_len], joint[:, text_len:]

    return forward


def _single_stream(block, x, normed, gate, attended):
    """The end of a single-stream block for one stream: ``x`` plus the gated projection of the
    attention output beside the MLP's."""
    h = torch.cat([attended, block.act_mlp(block.proj_mlp(normed))], dim=2)
    h = gated_residual(x, gate, block.proj_out(h))
    return h.clip(-65504, 65504) if h.dtype == torch.float16 else h


def _sequence_shard_inputs(model):
    """A forward pre-hook laying ``hidden_states`` and ``encoder_hidden_states`` out as
    Shard(1) on the mesh's "sp" dim (read from the model's DTensor parameters at call time), and
    wrapping ``joint_attention_kwargs``' attention mask in a RingMask, so that ring attention
    lays it out once per call, not once per block (Ulysses unwraps it)."""

    def hook(module, args, kwargs):
        mesh, dim = sp_mesh_dim(module.x_embedder.weight)
        if mesh is None:
            return args, kwargs
        wanted = {dim: Shard(SEQ)}

        def shard(value):
            return lay_out(value, mesh, wanted) if isinstance(value, torch.Tensor) and value.ndim == 3 else value

        if args:
            args = (shard(args[0]),) + tuple(args[1:])
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = shard(kwargs["hidden_states"])
        if "encoder_hidden_states" in kwargs:
            kwargs["encoder_hidden_states"] = shard(kwargs["encoder_hidden_states"])
        elif len(args) > 1:
            args = (args[0], shard(args[1])) + tuple(args[2:])
        attention_kwargs = kwargs.get("joint_attention_kwargs") or {}
        if isinstance(attention_kwargs.get("attention_mask"), torch.Tensor):
            kwargs["joint_attention_kwargs"] = dict(attention_kwargs,
                                                    attention_mask=RingMask(attention_kwargs["attention_mask"]))
        return args, kwargs

    return hook


def prepare(model: nn.Module) -> None:
    """Install dtorch's attention processor and the sequence-parallel hooks (once)."""
    if getattr(model, _HOOKED, False):
        return
    model.set_attn_processor(DtorchFluxAttnProcessor())
    model.register_forward_pre_hook(_sequence_shard_inputs(model), with_kwargs=True)
    for block in model.single_transformer_blocks:
        block.forward = _single_block(block)
    model.pos_embed.forward = distributed_pos_embed(model.pos_embed, lambda: model.x_embedder.weight)
    one_op_timesteps(model, lambda: model.x_embedder.weight)
    one_op_modulation(model)
    one_op_blocks(model)
    one_op_rms_norms(model)
    setattr(model, _HOOKED, True)


def flux_tp_plan(model: nn.Module) -> dict:
    """The tp plan of a FluxTransformer2DModel. (It also installs the Ulysses attention
    processor and the "sp" entry hook: the family's only call at parallelize time.)"""
    prepare(model)
    colwise, rowwise = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    plan = {}
    if len(model.transformer_blocks):
        attn = "transformer_blocks.*.attn"
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            plan[f"{attn}.{proj}"] = colwise()
        plan[f"{attn}.to_out.0"] = rowwise()
        plan[f"{attn}.to_add_out"] = rowwise()
        for ff in ("ff", "ff_context"):
            plan[f"transformer_blocks.*.{ff}.net.0.proj"] = colwise()
            plan[f"transformer_blocks.*.{ff}.net.2"] = rowwise()
    if len(model.single_transformer_blocks):
        for proj in ("to_q", "to_k", "to_v"):
            plan[f"single_transformer_blocks.*.attn.{proj}"] = colwise()
        plan["single_transformer_blocks.*.proj_mlp"] = colwise()
        plan["single_transformer_blocks.*.proj_out"] = rowwise()
    return plan


FLUX_FAMILY = ModelFamily(
    name="flux",
    model_classes=("FluxTransformer2DModel",),
    dims=frozenset({"tp", "sp", "cfg", "dp"}),
    tp_plan=flux_tp_plan,
    batch_kwargs=BATCH_INPUTS,
    sp_modes=("ulysses", "ring"),
)
