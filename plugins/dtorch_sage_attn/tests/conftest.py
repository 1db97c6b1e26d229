"""Fixtures of the dtorch_sage_attn tests: each test's own attention cache directory and a fresh
selector (no decision leaks between tests), DTORCH_ATTENTION unset."""

from __future__ import annotations

import os
import sys

import pytest
from dtorch_sage_attn import reset_routes, set_selector

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def attention_cache(tmp_path, monkeypatch):
    directory = tmp_path / "attention"
    monkeypatch.setenv("DTORCH_ATTENTION_CACHE", str(directory))
    monkeypatch.delenv("DTORCH_ATTENTION", raising=False)
    previous = set_selector(None)
    reset_routes()
    yield directory
    set_selector(previous)
