"""The disk cache under concurrent writers: worker processes storing decisions at the same time
lose none and never leave a partial file; a second decider of a key waits for the first and
reuses its decision instead of measuring again."""

from __future__ import annotations

import json
import multiprocessing

from dtorch_sage_attn import Selector
from dtorch_sage_attn.cache import CacheIdentity, DecisionCache
from dtorch_sage_attn.records import SDPA, Decision
from standins import fixed_times, standin
from test_selector import make_call, sdpa_candidate

IDENTITY = CacheIdentity("cpu", (("torch", "x"),))


def _writer(directory, rank, count):
    cache = DecisionCache(IDENTITY, directory)
    for i in range(count):
        with cache.locked():
            cache.store(f"key {rank}-{i}", Decision("ours", f"writer {rank}", {"ours": float(i)}))


def _decider(directory, queue):
    timed = []  # the candidates this process timed (none where it read the decision)
    sel = Selector([standin("ours")], timer=fixed_times({SDPA: 1.0, "ours": 0.5}, timed))
    sel.cache_for("cpu").directory = directory
    queue.put((sel.choose(make_call(), sdpa_candidate()).name, len(timed)))


def _run(target, args_per_process, start="fork"):
    ctx = multiprocessing.get_context(start)
    procs = [ctx.Process(target=target, args=args) for args in args_per_process]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.exitcode is None:
            p.kill()
        assert p.exitcode == 0, p.exitcode


def test_concurrent_writers_lose_no_decision(tmp_path):
    _run(_writer, [(tmp_path, rank, 15) for rank in range(4)])
    data = json.loads((tmp_path / IDENTITY.file_name()).read_text())
    assert len(data["decisions"]) == 60
    assert data["decisions"]["key 3-14"]["reason"] == "writer 3"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # no partial files left


def test_processes_deciding_one_key_measure_it_once(attention_cache):
    # spawned, not forked: a child forked from a process whose torch ran OpenMP threads can hang
    # in its first parallel op
    queue = multiprocessing.get_context("spawn").Queue()
    _run(_decider, [(attention_cache, queue)] * 2, start="spawn")
    results = [queue.get(timeout=10) for _ in range(2)]
    assert {name for name, _ in results} == {"ours"}
    assert sorted(n for _, n in results) == [0, 2]  # one process timed SDPA and ours; the other read it
