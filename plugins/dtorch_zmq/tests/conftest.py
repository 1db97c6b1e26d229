"""Fixtures: a key file for the run, a module's session of 3 remote workers."""

from __future__ import annotations

import pytest
from dtorch_zmq.keys import write_key
from zmq_testing import RemoteSession


@pytest.fixture(scope="session")
def key_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("keys") / "session.key")
    write_key(path)
    return path


@pytest.fixture(scope="module")
def remote3(key_file):
    """A session of 3 remote workers (uneven shards for most shapes)."""
    session = RemoteSession(3, key_file)
    yield session
    assert session.close() == [0, 0, 0]
