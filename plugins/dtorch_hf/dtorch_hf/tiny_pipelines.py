"""Tiny random SD3 and Flux pipelines (and their tokenizers), built offline and saved with
``save_pretrained``: what the tests and the examples' ``--tiny`` load back through
``dtorch_hf.from_pretrained``. Nothing is downloaded; the values are random (seeded), so the
images are noise, but every component of the real pipelines is there, with the real classes.

Sizes are chosen so that the meshes of the tests split them unevenly: 4 heads over tp 4, text
and image lengths that sp 4 does not divide, a T5 of 5 heads.
"""

from __future__ import annotations

import json
import os
import string

import torch

# the CLIP tokenizers' vocabulary: the specials, then each lowercase letter as a word piece and as
# a word's last piece ("</w>"); every other character is the unknown token. No merges: a word is
# its letters. Small enough for text models of vocab 64.
_CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
CLIP_VOCAB_SIZE = 64
CLIP_MAX_LENGTH = 8       # the pipelines pad CLIP prompts to the tokenizer's model_max_length
T5_MAX_LENGTH = 7         # max_sequence_length to pass to the pipelines
T5_VOCAB_SIZE = 40


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    vocab = {tok: i for i, tok in enumerate(_CLIP_SPECIALS)}
    for ch in string.ascii_lowercase:
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def _t5_tokenizer():
    from transformers import T5TokenizerFast

    # a Unigram vocabulary: pad, eos, unk, then word-start letters and bare letters
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + ch, -1.0) for ch in string.ascii_lowercase[:18]]
    pieces += [(ch, -2.0) for ch in string.ascii_lowercase[:T5_VOCAB_SIZE - len(pieces)]]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def clip_text_model(cls, hidden: int, projection: int | None = None):
    """A tiny random ``cls`` (``CLIPTextModel`` or ``CLIPTextModelWithProjection``) of width
    ``hidden`` (4 heads, 2 layers, MLP width 2 * hidden + 5), matching the tiny CLIP tokenizer."""
    from transformers import CLIPTextConfig

    tok = _clip_tokenizer()
    config = CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden + 5,
                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH,
                            projection_dim=projection or hidden, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, hidden_act="gelu")
    return cls(config).eval()


def _t5_encoder(d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=T5_VOCAB_SIZE, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=5,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config).eval()


def _vae(latent_channels: int, **extra):
    from diffusers import AutoencoderKL

    # two levels: the latents are half the image's size (vae_scale_factor 2)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=2, sample_size=16,
                         use_quant_conv=False, use_post_quant_conv=False, **extra).eval()


def sd3_pipeline(seed: int = 0):
    """A tiny random ``StableDiffusion3Pipeline``: two CLIP text encoders (with projection), a T5
    encoder, an SD3 transformer (2 joint blocks, the last context_pre_only, SD3.5's second
    attention in block 0, q/k RMSNorms), an AutoencoderKL and the flow-matching scheduler."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=(0,)).eval()
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(4, scaling_factor=1.5, shift_factor=0.06),
        text_encoder=clip_text_model(CLIPTextModelWithProjection, 16), tokenizer=_clip_tokenizer(),
        text_encoder_2=clip_text_model(CLIPTextModelWithProjection, 16), tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(32), tokenizer_3=_t5_tokenizer())


def flux_pipeline(seed: int = 0):
    """A tiny random ``FluxPipeline``: a CLIP text encoder, a T5 encoder, a Flux transformer (1
    double- and 1 single-stream block, 4 heads of 16, RoPE axes 4+6+6), an AutoencoderKL and the
    flow-matching scheduler."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)).eval()
    return FluxPipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(4, scaling_factor=0.4, shift_factor=0.1),
        text_encoder=clip_text_model(CLIPTextModel, 16), tokenizer=_clip_tokenizer(),
        text_encoder_2=_t5_encoder(32), tokenizer_2=_t5_tokenizer())


PIPELINES = {"sd3": sd3_pipeline, "flux": flux_pipeline}


def save_tiny_pipeline(kind: str, path: str, seed: int = 0) -> str:
    """Build the tiny ``kind`` pipeline ("sd3" or "flux") and ``save_pretrained`` it into ``path``."""
    PIPELINES[kind](seed).save_pretrained(path)
    return path


def describe(path: str) -> dict:
    """The saved pipeline's ``model_index.json`` (which class each component is)."""
    with open(os.path.join(path, "model_index.json")) as f:
        return json.load(f)
