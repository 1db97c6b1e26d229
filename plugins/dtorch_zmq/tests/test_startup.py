"""Start-up with many workers joining at once: 40 stand-in workers (``bench/_standin.py``: the
real hello, welcome, node channels and credit, as threads of two forked processes), on one node
or on five, all welcomed, each follower only after its leader said its channels exist
(``NODE_UP``); a joiner with another key among them is still refused, naming its address."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from dtorch_zmq import frames as fr
from dtorch_zmq import runner as remote
from dtorch_zmq.errors import AuthenticationError
from dtorch_zmq.keys import write_key
from zmq_testing import LOOPBACK, free_port

import dtorch_core as dt
from dtorch_core.controller.session import current_session

STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "_standin.py")
WORLD = 40


def standins(address: str, key_file: str, first: int, end: int, node_size: int, processes: int,
             stderr=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", DTORCH_FANOUT_RING_BYTES=str(64 << 10))
    return subprocess.Popen([sys.executable, STANDIN, "--address", address, "--key-file", key_file,
                             "--ranks", str(first), str(end), "--node-size", str(node_size),
                             "--processes", str(processes)], env=env, stdin=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.parametrize("node_size", [WORLD, 8], ids=["one node of 40", "five nodes of 8"])
def test_forty_workers_joining_at_once_are_all_welcomed_followers_after_their_leader(key_file, monkeypatch,
                                                                                    node_size):
    events = []  # (what, rank) in the order the controller's I/O thread did it
    node_up, welcome_all = remote.RemoteRunner._node_up, remote.RemoteRunner._welcome_all

    def record_node_up(self, conn):
        events.append(("node up", conn.rank))
        node_up(self, conn)

    def record_welcomes(self, messages):
        messages = list(messages)
        events.extend(("welcome", conn.rank) for conn, _ in messages)
        welcome_all(self, messages)

    monkeypatch.setattr(remote.RemoteRunner, "_node_up", record_node_up)
    monkeypatch.setattr(remote.RemoteRunner, "_welcome_all", record_welcomes)
    address = f"tcp://{LOOPBACK}:{free_port()}"
    proc = standins(address, key_file, 0, WORLD, node_size, processes=2)
    try:
        dt.init(world_size=WORLD, runner="remote", listen=address, key_file=key_file, startup_timeout=120,
                heartbeat_timeout=60)
        runner = current_session().runner
        nodes = [tuple(range(n, min(WORLD, n + node_size))) for n in range(0, WORLD, node_size)]
        assert [(leader.rank,) + leader.followers for leader in runner.leaders] == nodes
        assert {runner._conns[r].node for r in range(WORLD)} == {f"sim{r // node_size}" for r in range(WORLD)}
        for node in nodes:
            assert all(runner._conns[r].leader == node[0] for r in node[1:])
        assert sorted(r for what, r in events if what == "welcome") == list(range(WORLD))  # each once
        assert sorted(r for what, r in events if what == "node up") == [n[0] for n in nodes]
        for node in nodes:  # a follower's WELCOME left only after its leader's NODE_UP arrived
            up = events.index(("node up", node[0]))
            assert events.index(("welcome", node[0])) < up
            assert all(events.index(("welcome", r)) > up for r in node[1:])
        assert runner._held == {}
        for _ in range(3):  # every rank answers, through its leader: the node channels carry replies
            dt.synchronize()
    finally:
        dt.shutdown()
        code = proc.wait(60)
    assert code == 0


def test_a_joiner_with_another_key_among_many_is_refused_naming_its_address(key_file, tmp_path):
    other = str(tmp_path / "other.key")
    write_key(other)
    address = f"tcp://{LOOPBACK}:{free_port()}"
    good = standins(address, key_file, 0, WORLD - 1, 8, processes=2)
    bad = standins(address, other, WORLD - 1, WORLD, 8, processes=1, stderr=subprocess.PIPE)
    start = time.monotonic()
    try:
        with pytest.raises(AuthenticationError) as err:
            dt.init(world_size=WORLD, runner="remote", listen=address, key_file=key_file, startup_timeout=120)
        took = time.monotonic() - start
        assert err.value.peer.startswith(LOOPBACK)
        assert "HMAC" in str(err.value)
        assert took < 60, took  # as soon as the joiner has started (a torch import on a loaded machine)
        _, said = bad.communicate(timeout=30)
        assert bad.returncode == 1  # its one rank ended refused
        assert "refused this worker" in said.decode()
    finally:
        bad.kill()
        try:  # the good ones that had said hello were told to exit; one not connected yet waits: stop it
            good.wait(15)
        except subprocess.TimeoutExpired:
            good.kill()
            good.wait()


def test_the_node_up_kind_is_authenticated_like_every_other():
    key = os.urandom(32)
    mac = fr.Mac(key)
    nonce = os.urandom(16)
    frames = fr.seal(mac, fr.TO_CONTROLLER, fr.NODE_UP, 3, nonce, [b""])
    assert fr.open_message(mac, fr.TO_CONTROLLER, frames, 3, nonce)[0] == fr.NODE_UP
    with pytest.raises(fr.FrameError, match="HMAC"):
        fr.open_message(fr.Mac(os.urandom(32)), fr.TO_CONTROLLER, frames, 3, nonce)
