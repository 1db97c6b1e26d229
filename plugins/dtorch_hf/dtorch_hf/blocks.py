"""The adaLN-Zero blocks of SD3 and Flux in inference, with their modulation as one op each.

After attention, each stream of a double-stream block (SD3's ``JointTransformerBlock``, Flux's
``FluxTransformerBlock``) adds the attention output back through a gate, modulates its second
layer norm and adds the feed-forward output back through another gate: diffusers writes those
as about twenty small ops per stream and block, each a dispatch on the controller. In inference
on a distributed model these forwards run the same modules in the same order, with the
modulated norm and the gated residuals as dtorch_hf's ops (dtorch_hf/modulate.py): the same
expressions on each worker's shard, so the same values. Flux's single-stream block gets its
gated residual likewise (families/flux.py). With gradients, autocast, plain tensors, a chunked
feed-forward or a norm the kernels do not compute, diffusers' own forward runs.
"""

from __future__ import annotations

import torch

from .modulate import modulated_stream, one_op_applies, plain_norm


def _fused(block, x) -> bool:
    return (one_op_applies(x) and plain_norm(block.norm2) and getattr(block, "_chunk_size", None) is None
            and (getattr(block, "norm2_context", None) is None or plain_norm(block.norm2_context)))


def sd3_block_forward(block):
    """``block.forward`` for an SD3 ``JointTransformerBlock`` (SD3.5's dual attention and the
    last block's ``context_pre_only`` included)."""
    original = block.forward

    def forward(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
        if not _fused(block, hidden_states):
            return original(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
        kwargs = joint_attention_kwargs or {}
        mods = block.norm1(hidden_states, emb=temb)  # 7 with dual attention: its norm and gate last
        normed, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[:5]
        if block.context_pre_only:
            context = block.norm1_context(encoder_hidden_states, temb)
        else:
            context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
                encoder_hidden_states, emb=temb)
        attn_out, context_out = block.attn(hidden_states=normed, encoder_hidden_states=context, **kwargs)
        branches = [(gate_msa, attn_out)]
        if block.use_dual_attention:
            branches.append((mods[6], block.attn2(hidden_states=mods[5], **kwargs)))
        hidden_states = modulated_stream(hidden_states, branches, block.norm2, shift_mlp, scale_mlp, gate_mlp,
                                         block.ff)
        if block.context_pre_only:
            return None, hidden_states
        encoder_hidden_states = modulated_stream(encoder_hidden_states, [(c_gate_msa, context_out)],
                                                 block.norm2_context, c_shift_mlp, c_scale_mlp, c_gate_mlp,
                                                 block.ff_context)
        return encoder_hidden_states, hidden_states

    return forward


def flux_block_forward(block):
    """``block.forward`` for a Flux ``FluxTransformerBlock`` (an IP-adapter output included)."""
    original = block.forward

    def forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
        if not _fused(block, hidden_states):
            return original(hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
        normed, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
        context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(encoder_hidden_states, emb=temb)
        outs = block.attn(hidden_states=normed, encoder_hidden_states=context, image_rotary_emb=image_rotary_emb,
                          **(joint_attention_kwargs or {}))
        hidden_states = modulated_stream(hidden_states, [(gate_msa, outs[0])], block.norm2, shift_mlp, scale_mlp,
                                         gate_mlp, block.ff)
        if len(outs) == 3:
            hidden_states = hidden_states + outs[2]
        encoder_hidden_states = modulated_stream(encoder_hidden_states, [(c_gate_msa, outs[1])], block.norm2_context,
                                                 c_shift_mlp, c_scale_mlp, c_gate_mlp, block.ff_context)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states

    return forward


def one_op_blocks(model) -> None:
    """Give every double-stream block of ``model`` (SD3 or Flux) the forward above."""
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    for module in model.modules():
        if type(module) is JointTransformerBlock:
            module.forward = sd3_block_forward(module)
        elif type(module) is FluxTransformerBlock:
            module.forward = flux_block_forward(module)
