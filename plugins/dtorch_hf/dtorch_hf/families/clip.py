"""The CLIP text family: transformers' ``CLIPTextModel`` and ``CLIPTextModelWithProjection``
(the text encoders of the SD3 and Flux pipelines), the classes unmodified.

Tensor parallel (``"tp"``) over heads and MLP features, in every encoder layer: ``self_attn``
q/k/v_proj and ``mlp.fc1`` colwise, ``self_attn.out_proj`` and ``mlp.fc2`` rowwise. CLIPAttention
reshapes with ``(*batch_and_seq, -1, head_dim)`` and DTensor shapes are global, so head counts
the tp size does not divide give uneven shards, handled exactly. The embeddings, layer norms,
``final_layer_norm`` and ``text_projection`` stay replicated, so ``last_hidden_state``, every
entry of ``hidden_states`` (SD3 reads ``hidden_states[-2]``), the EOS-pooled ``pooler_output``
and ``text_embeds`` come out replicated on "tp".

Data parallel (``"dp"``): ``input_ids`` enter the model as Shard(0) (the batch); the outputs
stay batch-split. The causal mask is built from the replicated sequence positions.
"""

from __future__ import annotations

from torch import nn

import dtorch_core as dt

from ..family import ModelFamily

SP_CFG_REASON = ("CLIP text encoders are served over 'tp' and 'dp'; a 77-token prompt gains nothing "
                 "from sequence parallel, and CFG halves are a pipeline's batch")


def _layers_prefix(model: nn.Module) -> str:
    # CLIPTextModelWithProjection holds the CLIPTextModel as ``text_model``
    return "text_model.encoder.layers" if isinstance(getattr(model, "text_model", None), nn.Module) else "encoder.layers"


def clip_tp_plan(model: nn.Module) -> dict:
    """The tp plan of a CLIP text model: glob patterns over its encoder layers."""
    colwise, rowwise = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    layers = _layers_prefix(model)
    plan = {f"{layers}.*.self_attn.{proj}": colwise() for proj in ("q_proj", "k_proj", "v_proj")}
    plan[f"{layers}.*.self_attn.out_proj"] = rowwise()
    plan[f"{layers}.*.mlp.fc1"] = colwise()
    plan[f"{layers}.*.mlp.fc2"] = rowwise()
    return plan


CLIP_TEXT_FAMILY = ModelFamily(
    name="clip-text",
    model_classes=("CLIPTextModel", "CLIPTextModelWithProjection"),
    dims=frozenset({"tp", "dp"}),
    tp_plan=clip_tp_plan,
    refused={"sp": SP_CFG_REASON, "cfg": SP_CFG_REASON},
    batch_modules=("",),
    batch_kwargs=("input_ids",),
)
