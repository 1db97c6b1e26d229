"""The seams device plugins use: worker streams, communicator choice, device type checks.

A recording ``WorkerStreams`` replaces the CPU streams for one test, so the test sees that the
thread runner's workers run every batch inside ``run``, every communicating collective inside
``communicate``, join before compute reads what a collective produced, hand fetched tensors
through ``to_host`` and merge ``memory_stats``, while results stay equal to plain torch.
"""

from __future__ import annotations

import threading

import pytest
import torch

import dtorch_core as dt
from dtorch_core.comm.kinds import Communicator, choose_communicator
from dtorch_core.plugins import get_plugins, reset_plugins
from dtorch_core.registry import Registry
from dtorch_core.worker.streams import WorkerStreams

from .helpers import DEVICE, assert_close


class RecordingStreams(WorkerStreams):
    """CPU streams that count what the worker asks of them (one instance per worker)."""

    lock = threading.Lock()
    events: list = []

    def _note(self, what):
        with self.lock:
            self.events.append((self.device.type, what))

    def run(self, fn):
        self._note("run")
        return fn()

    def communicate(self, fn, value):
        self._note("communicate")
        result = fn()
        self.outstanding = True  # as a device with a separate communication stream would be
        return result

    def join_reads(self, values):
        self._note("join_reads")
        self.outstanding = False

    def to_host(self, value):
        self._note("to_host")
        return value.clone()

    def synchronize(self):
        self._note("synchronize")

    def memory_stats(self):
        return {"device_test_counter": 7}


@pytest.fixture
def recording_streams():
    dt.shutdown()
    reset_plugins()
    registry = get_plugins().registry("streams")
    registry.add("cpu", RecordingStreams, replace=True)
    RecordingStreams.events = []
    yield RecordingStreams
    dt.shutdown()
    reset_plugins()


def test_thread_workers_go_through_their_streams(recording_streams):
    dt.init(world_size=2, runner="thread")
    mesh = dt.init_device_mesh("cpu", (2,))
    a, b = torch.randn(5, 3), torch.randn(3, 4)
    x = dt.distribute_tensor(a, mesh, [dt.Shard(0)])
    w = dt.distribute_tensor(b, mesh, [dt.Shard(0)])  # x @ w needs w gathered: a collective
    y = (x @ w).relu()
    assert_close(y, (a @ b).relu())
    events = [what for _, what in recording_streams.events]
    assert "run" in events
    assert "communicate" in events
    # the matmul reads the gathered w after the collective: compute joined first
    assert events.index("join_reads") > events.index("communicate")
    assert "to_host" in events
    stats = dt.memory_stats()
    assert [s["device_test_counter"] for s in stats] == [7, 7]
    assert [s["rank"] for s in stats] == [0, 1]
    assert ("cpu", "synchronize") in recording_streams.events


def test_communicators_are_chosen_by_scope_and_device_type():
    registry = get_plugins().registry("communicators")
    assert choose_communicator(registry, "process", "cpu")[0] == "gloo"
    assert choose_communicator(registry, "thread", "cpu")[0] == "inprocess"
    assert choose_communicator(registry, "process", "cpu", "gloo")[1].dist_backend == "gloo"
    with pytest.raises(dt.PluginError, match="does not serve thread workers"):
        choose_communicator(registry, "thread", "cpu", "gloo")
    own = Registry("communicators")
    own.add("b", Communicator(lambda **_: None, "thread", ("xpu",)))
    own.add("a", Communicator(lambda **_: None, "thread", ("xpu",)))
    own.add("c", Communicator(lambda r, d: None, "process", ("xpu", "cpu"), dist_backend="gloo"))
    assert choose_communicator(own, "thread", "xpu")[0] == "a"  # several fit: the first by name
    assert choose_communicator(own, "process", "cpu")[0] == "c"
    with pytest.raises(dt.errors.DeviceError, match="no communicator for process workers on device type 'npu'"):
        choose_communicator(own, "process", "npu")
    with pytest.raises(dt.PluginError, match="scope"):
        Communicator(lambda: None, "host", ("cpu",))


@pytest.mark.parametrize("runner_name", ["inline", "thread", "process"])
def test_device_type_without_a_plugin_raises_on_the_controller(runner_name):
    dt.shutdown()
    with pytest.raises(dt.errors.DeviceError, match="npu"):
        dt.init(world_size=2, runner=runner_name, device_type="npu")
    assert not dt.is_initialized()


def test_mesh_device_type_must_match_the_workers(mesh1d):
    assert dt.device_type() == DEVICE == mesh1d.device_type
    other = "meta" if DEVICE != "meta" else "cpu"
    with pytest.raises(dt.PlacementError, match=rf"dt.init\(device_type='{other}'\)"):
        dt.init_device_mesh(other, (1,))
