"""T5's relative position bias as one op (dtorch_hf/position_bias.py) against transformers'
``T5Attention.compute_bias``: the same values for the encoder (bidirectional) and the decoder
(with past tokens), the weight replicated or split by heads (5 heads on 4 ranks: 2/1/1/1); on a
distributed T5 no position tensor is sent from the controller, in a forward and in generate;
transformers' code where the weight needs a gradient."""

from __future__ import annotations

import pytest
import torch
from transformers import T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Attention
from dtorch_hf.position_bias import one_op_compute_bias

import dtorch_core as dt
import dtorch_hf
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call, Put

from hf_testing import make_mesh, tiny_config

R = dt.Replicate()


def _op_names(rec) -> list[str]:
    return [current_session().plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]


def _long_puts(rec) -> list:
    """The integer tensors the controller sent (positions and buckets are int64)."""
    return [i for i in rec.instructions if type(i) is Put
            and any(t.dtype == torch.long for t in i.shards.values())]


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("placement", [R, dt.Shard(1)], ids=["replicated", "head shards"])
def test_bias_matches_transformers(session, decoder, placement):
    config = tiny_config("uneven")
    config.is_decoder = decoder
    torch.manual_seed(0)
    attention = T5Attention(config, has_relative_attention_bias=True).eval()
    want = attention.compute_bias(6, 9, past_seen_tokens=3 if decoder else 0)
    mesh = dt.init_device_mesh("cpu", (4,))
    weight = attention.relative_attention_bias.weight
    attention.relative_attention_bias.weight = torch.nn.Parameter(dt.distribute_tensor(weight.detach(), mesh, [placement]))
    compute_bias = one_op_compute_bias(attention)
    with torch.no_grad(), current_session().recording() as rec:
        got = compute_bias(6, 9, past_seen_tokens=3 if decoder else 0)
    assert _op_names(rec) == ["dtorch_hf.t5_position_bias.default"] and not _long_puts(rec)
    assert got.placements == (placement,) and tuple(got.shape) == (1, 5, 6, 9)
    torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)
    # with the weight's gradient to come: transformers' code, differentiable
    with current_session().recording() as rec:
        grad = compute_bias(6, 9, past_seen_tokens=3 if decoder else 0)
    assert "dtorch_hf.t5_position_bias.default" not in _op_names(rec) and grad.requires_grad
    grad.sum().backward()
    assert attention.relative_attention_bias.weight.grad is not None


def test_distributed_t5_sends_no_positions_in_forward_and_generate(session, tmp_path):
    torch.manual_seed(0)
    T5ForConditionalGeneration(tiny_config("uneven", 10.0)).save_pretrained(tmp_path)
    ref = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    model = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    dtorch_hf.parallelize(model, make_mesh("tp4"))
    ids = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), current_session().recording() as rec:
        tokens = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    want = ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens.full_tensor() if isinstance(tokens, dt.DTensor) else tokens, want)
    names = _op_names(rec)
    # the encoder's bias once, the decoder's at every step
    assert names.count("dtorch_hf.t5_position_bias.default") >= 1 + 4, names.count("dtorch_hf.t5_position_bias.default")
    # the input ids are sent (and generate's 1-D token tensors); no (queries, keys) positions or buckets
    assert not [p for p in _long_puts(rec) if any(t.ndim == 2 and not torch.equal(t, ids) for t in p.shards.values())]
