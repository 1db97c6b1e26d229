"""T5 on a mesh against the same model on the controller: encoder outputs, a training step
(AdamW) and greedy generate, for tp=4 and tp=2 x dp=2, even and uneven shards, both runners."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import T5EncoderModel, T5ForConditionalGeneration

import dtorch_core as dt
import dtorch_hf

from hf_testing import CONFIGS, make_mesh, rel_err, tiny_config



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each tiny config's random weights, saved once with save_pretrained: at the default
    initializer scale, and at a large one for generate (see tiny_config)."""
    out = {}
    for kind in CONFIGS:
        for scale in (1.0, 10.0):
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(f"t5-{kind}-{scale:g}")
            T5ForConditionalGeneration(tiny_config(kind, scale)).save_pretrained(path)
            out[kind, scale] = path
    return out


def _inputs(batch=3, length=7):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 2:] = 0          # a padded row: the mask path is exercised
    return ids, mask


def _pair(cls, path):
    ref = cls.from_pretrained(path).eval()
    return ref, cls.from_pretrained(path).eval()


def _check_fallbacks(allowed=frozenset()):
    assert set(dt.fallback_counts()) <= set(allowed), dt.fallback_counts()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("mesh_name", ["tp4", "tp2xdp2"])
def test_encoder_matches(session, saved, kind, mesh_name):
    ref, model = _pair(T5EncoderModel, saved[kind, 1.0])
    out = dtorch_hf.parallelize(model, make_mesh(mesh_name))
    assert out is model
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    assert isinstance(q, dt.DTensor) and dt.Shard(0) in q.placements
    ids, mask = _inputs()
    got = model(input_ids=ids, attention_mask=mask)
    want = ref(input_ids=ids, attention_mask=mask)
    assert type(got) is type(want)
    assert isinstance(got.last_hidden_state, dt.DTensor)
    assert rel_err(got.last_hidden_state, want.last_hidden_state) <= 1e-4
    _check_fallbacks()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("mesh_name", ["tp4", "dp2xtp2"])
def test_adamw_step_matches_torch(session, saved, kind, mesh_name):
    ref, model = _pair(T5ForConditionalGeneration, saved[kind, 1.0])
    ref.train(), model.train()
    dtorch_hf.parallelize(model, make_mesh(mesh_name))
    ids, mask = _inputs()
    labels = torch.randint(2, 64, (3, 5), generator=torch.Generator().manual_seed(2))
    losses = []
    for m in (ref, model):
        # eps 1e-3, not 1e-8: Adam's first step is lr * g / (|g| + eps), and a gradient entry
        # near rounding level (2.7e-9 here) gets a step that any other summation order changes
        # by most of lr; a larger eps keeps the step a smooth function of the gradient
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss)
    assert rel_err(losses[1], losses[0].detach()) <= 1e-4
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p.detach(), want[name].detach()) <= 1e-4, name
    _check_fallbacks()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("mesh_name", ["tp4", "tp2xdp2"])
def test_generate_tokens_equal(session, saved, kind, mesh_name):
    ref, model = _pair(T5ForConditionalGeneration, saved[kind, 10.0])
    dtorch_hf.parallelize(model, make_mesh(mesh_name))
    ids, mask = _inputs()
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    got = got.full_tensor() if isinstance(got, dt.DTensor) else got
    assert len(set(want.flatten().tolist())) > 2      # the tokens say something
    assert torch.equal(got, want)
    _check_fallbacks()  # generate's EOS check (torch.isin) has a rule too


def test_compiled_training_steps_replay(session, saved):
    """Six AdamW steps under dt.compile (calls 4-6 replay) equal six plain torch steps."""
    ref, model = _pair(T5ForConditionalGeneration, saved["even", 1.0])
    ref.train(), model.train()
    dtorch_hf.parallelize(model, make_mesh("tp2xdp2"))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-3) for m in (ref, model)]

    def train_step(m, opt, ids, labels):
        opt.zero_grad()
        loss = m(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        return loss.detach()

    step = dt.compile(train_step)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        ids, labels = torch.randint(2, 64, (4, 7), generator=g), torch.randint(2, 64, (4, 5), generator=g)
        got = step(model, opts[1], ids, labels)
        assert rel_err(got, train_step(ref, opts[0], ids, labels)) <= 1e-4
    assert step.replays == 3
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p.detach(), want[name].detach()) <= 1e-4, name
    _check_fallbacks()


def test_tp_attention_runs_on_head_shards_without_gathers(session, saved):
    """With transformers' SDPA attention (its default) and heads that divide tp, a forward of a
    batch of 3 sends nothing but the rowwise all-reduces (o, wo): q, k, v and the scores stay on
    head shards. Eager attention's 4-D matmuls gather, and so does SDPA's math path, which the CPU
    takes where the position bias needs a gradient (training; README)."""
    ref, model = _pair(T5EncoderModel, saved["even", 1.0])
    assert model.config._attn_implementation == "sdpa"
    dtorch_hf.parallelize(model, make_mesh("tp4"))
    ids, mask = _inputs()
    with torch.no_grad(), dt.debug.comm_mode() as comm:
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert {event.kind for event, _ in comm.events} == {"all_reduce"}, sorted({(e.kind, e.op) for e, _ in comm.events})
    assert len(comm.events) == 2 * model.config.num_layers  # o and wo in every block
    assert rel_err(got, ref(input_ids=ids, attention_mask=mask).last_hidden_state) <= 1e-4
    _check_fallbacks()
