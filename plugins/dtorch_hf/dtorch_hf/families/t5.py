"""The T5 family: ``T5EncoderModel`` and ``T5ForConditionalGeneration``, transformers' own.

Tensor parallel over heads and MLP features: q, k, v and wi (wi_0/wi_1 when gated) colwise, o
and wo rowwise. The relative position bias (``relative_attention_bias``, an Embedding with
n_heads columns) is sharded by heads (Shard(1) on its weight) and its output left Shard on the
heads, so each tp shard computes its own heads' bias and adds it to its own heads' scores.
T5Attention's code runs unchanged: it reads n_heads/inner_dim from the config and reshapes
with ``(-1, d_kv)``, and DTensor shapes stay global, so those sizes stay right on shards;
head counts and d_ff that the tp size does not divide give uneven shards, handled exactly.
Where no gradient is needed the bias is one op made on the workers from the sizes
(dtorch_hf/position_bias.py), so no plain position tensor leaves the controller.
"""

from __future__ import annotations

import torch.nn as nn

import dtorch_core as dt

from ..family import ModelFamily
from ..position_bias import one_op_position_biases

SP_CFG_REASON = "T5 is served over 'tp' and 'dp' so far; sequence and CFG parallel are not supported for T5 yet"


def _stacks(model: nn.Module) -> list[str]:
    return [name for name in ("encoder", "decoder") if isinstance(getattr(model, name, None), nn.Module)]


def t5_tp_plan(model: nn.Module) -> dict:
    """The tp plan of a T5 model: glob patterns over its encoder and decoder stacks. (It also
    installs the one-op relative position bias: the family's only call at parallelize time.)"""
    one_op_position_biases(model)
    colwise, rowwise = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    gated = getattr(model.config, "is_gated_act", False)
    plan = {}
    for stack in _stacks(model):
        attn = f"{stack}.block.*.layer.*.*Attention"    # SelfAttention and EncDecAttention
        for proj in ("q", "k", "v"):
            plan[f"{attn}.{proj}"] = colwise()
        plan[f"{attn}.o"] = rowwise()
        ffn = f"{stack}.block.*.layer.*.DenseReluDense"
        for wi in (("wi_0", "wi_1") if gated else ("wi",)):
            plan[f"{ffn}.{wi}"] = colwise()
        plan[f"{ffn}.wo"] = rowwise()
        # output_layouts=None: the bias stays sharded on its heads dim, as the scores are
        plan[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"] = colwise(output_layouts=None)
    return plan


T5_FAMILY = ModelFamily(
    name="t5",
    model_classes=("T5EncoderModel", "T5ForConditionalGeneration"),
    dims=frozenset({"tp", "dp"}),
    tp_plan=t5_tp_plan,
    refused={"sp": SP_CFG_REASON, "cfg": SP_CFG_REASON},
    # the stacks, not the model: generate calls the encoder itself, and the decoder gets the
    # labels shifted right as decoder_input_ids
    batch_modules=("encoder", "decoder"),
    batch_kwargs=("input_ids", "inputs_embeds"),
)
