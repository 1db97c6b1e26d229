"""`dtorch worker`'s rank: --rank, else RANK (torchrun), else SLURM_PROCID (Slurm)."""

from __future__ import annotations

import pytest
from dtorch_zmq.worker import worker_rank


def test_the_rank_comes_from_the_flag_then_rank_then_slurm(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert worker_rank(None) == 5
    monkeypatch.setenv("RANK", "2")
    assert worker_rank(None) == 2
    assert worker_rank(7) == 7


def test_no_rank_or_a_bad_one_says_what_to_set(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(SystemExit, match="--rank R or set RANK"):
        worker_rank(None)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(SystemExit, match="RANK='x'"):
        worker_rank(None)
