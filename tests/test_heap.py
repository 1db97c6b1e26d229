"""The controller's heap under a session (dtorch_core/controller/heap.py): frozen at dt.init so
that full collections skip the libraries' objects, unfrozen at dt.shutdown, off with
DTORCH_GC_FREEZE=0; garbage cycles made during the session are still collected."""

from __future__ import annotations

import gc
import weakref

import torch

import dtorch_core as dt


class _Node:
    pass


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_a_session_freezes_the_heap_it_starts_with_and_collects_what_it_makes(monkeypatch):
    monkeypatch.delenv("DTORCH_GC_FREEZE", raising=False)
    dt.shutdown()
    old = _cycle()
    gc.collect()  # old enough to sit in the oldest generation
    before, old = weakref.ref(old), None  # a cycle from before the session, now garbage
    assert gc.get_freeze_count() == 0
    dt.init(world_size=2, runner="thread")
    try:
        assert gc.get_freeze_count() > 0
        during = weakref.ref(_cycle())
        mesh = dt.init_device_mesh("cpu", (2,))
        x = dt.distribute_tensor(torch.ones(4, 2), mesh, [dt.Shard(0)])
        assert torch.equal((x + x).full_tensor(), torch.full((4, 2), 2.0))
        gc.collect()
        assert during() is None  # made during the session: collected as always
        assert before() is not None  # frozen with the heap: kept until the session ends
    finally:
        dt.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None  # unfrozen at shutdown: collected


def test_dtorch_gc_freeze_0_leaves_the_heap_alone(monkeypatch):
    monkeypatch.setenv("DTORCH_GC_FREEZE", "0")
    dt.shutdown()
    dt.init(world_size=2, runner="thread")
    try:
        assert gc.get_freeze_count() == 0
    finally:
        dt.shutdown()


def test_process_workers_freeze_their_heap_when_ready(monkeypatch):
    # a worker process imported torch as the controller did: full collections in the middle of
    # a step skip those objects too (dt.memory_stats reports the worker's frozen count)
    monkeypatch.delenv("DTORCH_GC_FREEZE", raising=False)
    dt.shutdown()
    dt.init(world_size=2, runner="process")
    try:
        frozen = [s["frozen_objects"] for s in dt.memory_stats()]
    finally:
        dt.shutdown()
    assert all(n > 10_000 for n in frozen), frozen  # torch alone is about 100,000 objects
    monkeypatch.setenv("DTORCH_GC_FREEZE", "0")
    dt.init(world_size=2, runner="process")
    try:
        assert [s["frozen_objects"] for s in dt.memory_stats()] == [0, 0]
    finally:
        dt.shutdown()
