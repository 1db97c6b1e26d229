"""The joint attention's layout ops (dtorch_hf/joint.py) against the steps they stand for
(concatenation, diffusers' RoPE, transposes; the split back into streams): bit-equal on
replicated, batch-split and head-split inputs (5 heads on 4 ranks: 2/1/1/1), one op each side
of SDPA in inference, the separate steps with gradients."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from dtorch_hf.joint import joint_heads, stream_outputs

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir.instructions import Call

R = dt.Replicate()
B, H, D = 3, 5, 8
LENGTHS = (7, 4)


def _op_names(rec) -> list[str]:
    return [current_session().plan_names[i.plan_id].op_name for i in rec.instructions if type(i) is Call]


def _tables(length):
    angles = torch.randn(length, D // 2).repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("rope", [False, True], ids=["sd3", "flux rope"])
@pytest.mark.parametrize("dim", [None, 0, 2], ids=["replicated", "batch", "heads"])
def test_joint_heads_and_stream_outputs_match_the_steps(session, rope, dim):
    mesh = dt.init_device_mesh("cpu", (4,))
    place = [R if dim is None else dt.Shard(dim)]
    streams = [[torch.randn(B, n, H, D) for _ in range(3)] for n in LENGTHS]
    tables = _tables(sum(LENGTHS)) if rope else None
    joined = [torch.cat(ts, dim=1) for ts in zip(*streams)]
    if rope:
        joined[:2] = [apply_rotary_emb(t, tables, sequence_dim=1) for t in joined[:2]]
    want = [t.transpose(1, 2) for t in joined]
    dist = [[dt.distribute_tensor(t, mesh, place) for t in ts] for ts in zip(*streams)]
    dtables = None if tables is None else tuple(dt.distribute_tensor(t, mesh, [R]) for t in tables)
    with torch.no_grad(), current_session().recording() as rec:
        got = joint_heads(*dist, dtables)
        outs = stream_outputs(got[0], list(LENGTHS))
    assert _op_names(rec) == ["dtorch_hf.joint_heads.default", "dtorch_hf.stream_outputs.default"]
    heads_place = [R if dim is None else dt.Shard(1 if dim == 2 else 0)]
    for g, w in zip(got, want):
        assert list(g.placements) == heads_place and tuple(g.shape) == tuple(w.shape)
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)
    for o, w in zip(outs, want[0].transpose(1, 2).split(LENGTHS, dim=1)):
        assert o.placements == tuple(place) and o.is_contiguous()
        torch.testing.assert_close(o.full_tensor(), w, rtol=0, atol=0)


def test_steps_with_gradients_or_one_stream(session):
    mesh = dt.init_device_mesh("cpu", (4,))
    streams = [[dt.distribute_tensor(torch.randn(B, n, H, D), mesh, [R]).requires_grad_() for _ in range(3)]
               for n in LENGTHS]
    with current_session().recording() as rec:
        q, k, v = joint_heads(*(list(ts) for ts in zip(*streams)))
        parts = stream_outputs(q, list(LENGTHS))
    assert "dtorch_hf.joint_heads.default" not in _op_names(rec)
    sum(p.sum() for p in parts).backward()
    torch.testing.assert_close(streams[0][0].grad.full_tensor(), torch.ones(B, 7, H, D))
    with torch.no_grad(), current_session().recording() as rec:
        one = joint_heads([streams[0][0]], [streams[0][1]], [streams[0][2]])
    assert _op_names(rec) == ["aten.transpose.int"] * 3 and tuple(one[0].shape) == (B, H, 7, D)


def test_one_stream_with_rope_rotates_in_one_op(session):
    """Flux's single-stream blocks: q and k rotated and transposed in one op, v's transpose a
    view (not an op output)."""
    mesh = dt.init_device_mesh("cpu", (4,))
    q, k, v = (torch.randn(B, 9, H, D) for _ in range(3))
    tables = _tables(9)
    want = [apply_rotary_emb(q, tables, sequence_dim=1).transpose(1, 2),
            apply_rotary_emb(k, tables, sequence_dim=1).transpose(1, 2), v.transpose(1, 2)]
    dist = [dt.distribute_tensor(t, mesh, [dt.Shard(2)]) for t in (q, k, v)]
    dtables = tuple(dt.distribute_tensor(t, mesh, [R]) for t in tables)
    with torch.no_grad(), current_session().recording() as rec:
        got = joint_heads([dist[0]], [dist[1]], [dist[2]], dtables)
    assert _op_names(rec) == ["dtorch_hf.joint_heads.default", "aten.transpose.int"]
    for g, w in zip(got, want):
        assert g.placements == (dt.Shard(1),)
        torch.testing.assert_close(g.full_tensor(), w, rtol=0, atol=0)
