"""`dtorch worker`'s rank (--rank, else RANK (torchrun), else SLURM_PROCID (Slurm)) and device."""

from __future__ import annotations

import pytest
from dtorch_zmq.cli import local_device_index
from dtorch_zmq.worker import worker_rank

from dtorch_core.errors import ConfigError


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


def test_the_device_comes_from_the_flag_then_local_rank_then_slurm_localid(monkeypatch):
    # a multi-node job's global rank is no device index on its host: the launcher's local rank is
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    assert local_device_index(None) is None  # then the worker uses its rank (one host)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_device_index(None) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device_index(None) == 1
    assert local_device_index(0) == 0
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ConfigError, match="LOCAL_RANK='-1'"):
        local_device_index(None)
