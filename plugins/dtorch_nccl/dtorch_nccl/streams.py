"""CUDA worker streams: compute on one stream, communication on another, ordered with events.

A worker runs its batches on its compute stream. A collective runs on its communication stream
after the compute issued before it (``comm.wait_stream(compute)``), and compute does not wait for
it until it touches a tensor the collective uses: the collective's input (so compute cannot
overwrite it while it is being sent) or its output. Compute that touches neither - the next
layer's matmuls while a gradient is all-reduced - overlaps the collective.

Memory: a collective's input was allocated on the compute stream and is read on the
communication stream, and its output the other way round; ``record_stream`` tells the caching
allocator, so neither block is handed out again while the other stream may still use it.

Everything here is also legal inside CUDA graph capture (no host synchronisation, no event
queries): ``communicate`` forks the communication stream from compute with an event and
``join`` joins it back, which is the fork/join pattern capture accepts.
"""

from __future__ import annotations

import torch

from dtorch_core.worker.streams import WorkerStreams

from .device import device_for_rank, memory_stats


class CudaStreams(WorkerStreams):
    """A compute stream and a communication stream on one CUDA device."""

    @classmethod
    def device_for(cls, device_type: str, rank: int) -> torch.device:
        return device_for_rank(rank)

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.compute = torch.cuda.Stream(device)
        # high priority: a collective's kernels start ahead of queued compute that does not need
        # them, so the compute that does waits less
        self.comm = torch.cuda.Stream(device, priority=-1)
        self.outstanding = False
        self._in_flight: set[int] = set()  # storages communication uses that compute has not waited for
        self._comm_done: torch.cuda.Event | None = None
        # one event each for the fork and the join, recorded again at every collective (a wait
        # takes the latest record): making events per collective cost more than the collective
        # of a small tensor
        self._fork = torch.cuda.Event()
        self._done = torch.cuda.Event()
        self._ran = torch.cuda.Event()  # recorded after each batch: ``drained`` queries it

    def claim_process(self) -> None:
        torch.cuda.set_device(self.device)

    def run(self, fn):
        with torch.cuda.stream(self.compute):  # also makes self.device current in this thread
            try:
                return fn()
            finally:
                self._ran.record(self.compute)

    reports_drain = True

    def drained(self) -> bool:
        return self._ran.query()

    def communicate(self, fn, value):
        comm, compute = self.comm, self.compute
        self._fork.record(compute)
        comm.wait_event(self._fork)
        # switching by hand skips the stream context's checks, a large part of a small
        # collective's cost
        current = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(comm)
        try:
            result = fn()
        finally:
            torch.cuda.set_stream(current)
        in_flight = self._in_flight
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(comm)
            in_flight.add(value.untyped_storage().data_ptr())
        if isinstance(result, torch.Tensor) and result.is_cuda:
            result.record_stream(self.compute)
            in_flight.add(result.untyped_storage().data_ptr())
        in_flight.discard(0)  # empty tensors have no memory to guard
        self._done.record(comm)
        self._comm_done = self._done
        self.outstanding = True
        return result

    def join_reads(self, values) -> None:
        in_flight = self._in_flight
        for v in values:
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in in_flight:
                self.join()
                return

    def join(self) -> None:
        """Make compute wait for every collective issued so far (events on one stream complete
        in order, so the last one stands for all)."""
        if self._comm_done is not None:
            self.compute.wait_event(self._comm_done)
            self._comm_done = None
        self._in_flight.clear()
        self.outstanding = False

    def to_device(self, value):
        if value.device == self.device:
            # made by the controller itself on this GPU (thread runner): on its stream, which
            # is the default one unless the user's program chose another
            self.compute.wait_stream(torch.cuda.default_stream(self.device))
            value.record_stream(self.compute)
            return value
        if value.device.type == "cpu":
            # through pinned memory the copy is asynchronous: a blocking one would make the
            # worker wait for all compute queued before it (the pinned block is held by torch's
            # host allocator until the copy is done)
            return value.pin_memory().to(self.device, non_blocking=True)
        return value.to(self.device)

    def to_host(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        if self.outstanding:
            self.join_reads((value,))
        with torch.cuda.stream(self.compute):
            # a blocking copy: it waits for the compute stream, so the controller (another thread
            # or process, on other streams) reads finished data
            return value.to("cpu")

    can_capture = True

    def capture(self, fn):
        """A CUDA graph of the work ``fn()`` issues on the compute stream (and the communication
        stream it forks, joined back before the capture ends)."""
        self.join()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.compute):
            fn()
            self.join()
        return graph

    def synchronize(self) -> None:
        self.join()
        self.compute.synchronize()
        self.comm.synchronize()

    def memory_stats(self) -> dict:
        return memory_stats(self.device)
