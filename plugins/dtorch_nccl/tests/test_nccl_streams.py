"""CudaStreams on a real GPU: a collective overlaps compute that does not touch its tensors,
compute waits where it does (reads its output, overwrites its input), and memory one stream
still uses is not handed to the other.

Each test makes the communication stream slow on purpose (``torch.cuda._sleep`` spins a GPU
thread for a number of clock cycles) so a missing wait or a reused block shows up as a wrong
value or a wrong time, not as a rare race.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import requires_gpu

pytestmark = requires_gpu

SLEEP_MS = 40.0


@pytest.fixture(scope="module")
def cycles():
    """GPU clock cycles that ``torch.cuda._sleep`` takes for SLEEP_MS on this GPU."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm-up
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * SLEEP_MS / start.elapsed_time(end))


@pytest.fixture
def streams():
    from dtorch_nccl.streams import CudaStreams

    s = CudaStreams(torch.device("cuda", 0))
    yield s
    s.synchronize()


def _slow(cycles, fn):
    """A collective stand-in: the communication stream is busy, then ``fn`` runs on it."""

    def run():
        torch.cuda._sleep(cycles)
        return fn()

    return run


def _timed(streams, body) -> tuple[float, object]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def batch():
        start.record()
        out = body()
        end.record()
        return out

    out = streams.run(batch)
    streams.synchronize()
    return start.elapsed_time(end), out


def test_collective_overlaps_unrelated_compute_and_joins_for_its_output(streams, cycles):
    dev = streams.device
    x = torch.ones(1 << 16, device=dev)
    unrelated = torch.ones(16, device=dev)

    def overlapped():
        y = streams.communicate(_slow(cycles, lambda: x * 2), x)
        torch.cuda._sleep(cycles)  # unrelated compute, on the compute stream
        streams.join_reads([unrelated])
        assert streams.outstanding, "compute that reads none of the collective's tensors must not wait"
        streams.join_reads([y])
        assert not streams.outstanding
        return y + 1  # reads the collective's output: after the join

    def serial():
        y = streams.communicate(_slow(cycles, lambda: x * 2), x)
        streams.join_reads([y])
        torch.cuda._sleep(cycles)
        return y + 1

    t_overlap, z1 = _timed(streams, overlapped)
    t_serial, z2 = _timed(streams, serial)
    assert torch.equal(z1.cpu(), torch.full((1 << 16,), 3.0))
    assert torch.equal(z2.cpu(), torch.full((1 << 16,), 3.0))
    # two SLEEP_MS phases: side by side when overlapped, one after the other when not
    assert t_serial > 1.8 * SLEEP_MS, t_serial
    assert t_overlap < 0.75 * t_serial, (t_overlap, t_serial)


def test_compute_waits_before_overwriting_a_collectives_input(streams, cycles):
    dev = streams.device
    x = torch.ones(1 << 20, device=dev)

    def body():
        y = streams.communicate(_slow(cycles, lambda: x.clone()), x)  # reads x late
        streams.join_reads([x])  # the worker does this before any kernel that takes x
        x.add_(1)
        return y

    _, y = _timed(streams, body)
    assert torch.equal(y.cpu(), torch.ones(1 << 20))
    assert torch.equal(x.cpu(), torch.full((1 << 20,), 2.0))


def test_a_freed_input_is_not_reused_while_the_collective_reads_it(streams, cycles):
    dev = streams.device
    n = 1 << 22

    def body():
        x = torch.full((n,), 1.0, device=dev)  # allocated on the compute stream
        y = streams.communicate(_slow(cycles, lambda: x.clone()), x)
        del x  # the controller dropped it; the collective has not read it yet
        z = torch.full((n,), 7.0, device=dev)  # same size, same stream: would take x's block
        return y, z

    _, (y, z) = _timed(streams, body)
    assert torch.equal(y.cpu(), torch.ones(n))
    assert torch.equal(z.cpu(), torch.full((n,), 7.0))


def test_a_freed_output_is_not_reused_while_compute_reads_it(streams, cycles):
    dev = streams.device
    n = 1 << 22
    x = torch.ones(n, device=dev)

    def body():
        y = streams.communicate(lambda: x * 2, x)  # allocated on the communication stream
        streams.join_reads([y])
        torch.cuda._sleep(cycles)
        w = y + 0  # compute reads y late
        del y
        # a communication-stream allocation that has not waited for compute, as the member that
        # combines a thread-runner collective makes on its own stream: it would take y's block
        with torch.cuda.stream(streams.comm):
            q = torch.full((n,), 9.0, device=dev)
        return w, q

    _, (w, q) = _timed(streams, body)
    assert torch.equal(w.cpu(), torch.full((n,), 2.0))
    assert torch.equal(q.cpu(), torch.full((n,), 9.0))


def test_to_host_waits_for_the_collective(streams, cycles):
    dev = streams.device
    x = torch.arange(1000.0, device=dev)

    def body():
        y = streams.communicate(_slow(cycles, lambda: x * 3), x)
        return streams.to_host(y)  # no explicit join: to_host must see the finished values

    _, host = _timed(streams, body)
    assert host.device.type == "cpu"
    assert torch.equal(host, torch.arange(1000.0) * 3)


def test_to_device_does_not_wait_for_queued_compute(streams, cycles):
    host = torch.arange(float(1 << 20))

    def body():
        torch.cuda._sleep(cycles)  # compute is busy for SLEEP_MS
        t0 = time.perf_counter()
        on_gpu = streams.to_device(host)
        return on_gpu, (time.perf_counter() - t0) * 1e3

    _, (on_gpu, issue_ms) = _timed(streams, body)
    assert issue_ms < SLEEP_MS / 2, f"the worker waited {issue_ms:.1f} ms for compute to drain"
    assert torch.equal(on_gpu.cpu(), host)


def test_to_device_orders_after_the_controllers_stream(streams, cycles):
    dev = streams.device
    ones = torch.ones(1 << 20, device=dev)
    torch.cuda._sleep(cycles)  # this thread's (the controller's) default stream is busy
    made = ones * 5  # finished only after the sleep

    _, out = _timed(streams, lambda: streams.to_device(made) + 1)
    assert torch.equal(out.cpu(), torch.full((1 << 20,), 6.0))
