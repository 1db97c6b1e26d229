"""The thread runner's CUDA communicator: worker threads of one process exchange CUDA tensors.

It wraps the core :class:`~dtorch_core.comm.inprocess.InProcessExchange` (members meet in a shared
table, the last to arrive computes every member's result with the shared ``combine_all``
arithmetic), and adds what CUDA needs: every contribution travels with an event recorded on its
owner's communication stream, the computing member waits for those events on its own
communication stream (copying from other GPUs when members live on different devices), and every
result travels back with an event the receiving member waits for. No member blocks its host
thread on the GPU.
"""

from __future__ import annotations

import functools

import attrs
import torch

from dtorch_core.comm.inprocess import InProcessExchange


@attrs.frozen
class _Ready:
    """A CUDA tensor and the event after which any stream may read it."""

    tensor: torch.Tensor
    event: torch.cuda.Event


def _publish(value):
    """Wrap a contribution with an event on the producing (current) stream."""
    if not isinstance(value, torch.Tensor) or not value.is_cuda:
        return value  # a WorkerFailure (or a host tensor) travels as it is
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(value.device))
    return _Ready(value, event)


def _take(item, stream: torch.cuda.Stream):
    """``item``'s tensor, usable on ``stream`` (on ``stream``'s device)."""
    if type(item) is not _Ready:
        return item
    t = item.tensor
    if t.device == stream.device:
        stream.wait_event(item.event)
        t.record_stream(stream)  # the owner may free it while ``stream`` still reads it
        return t
    # another GPU: a cross-device copy orders itself after the current streams of both devices,
    # so the source device's current stream waits for the producer first
    source = torch.cuda.current_stream(t.device)
    source.wait_event(item.event)
    t.record_stream(source)
    with torch.cuda.stream(stream):
        return t.to(stream.device)


def _combine(compute, items):
    """Runs on the member that arrives last, with its communication stream current."""
    stream = torch.cuda.current_stream()
    results = compute([_take(item, stream) for item in items])
    done = torch.cuda.Event()
    done.record(stream)
    return [_Ready(r, done) if isinstance(r, torch.Tensor) and r.is_cuda else r for r in results]


@attrs.define
class CudaInProcessExchange:
    """The exchange interface of the worker for CUDA worker threads of one process."""

    inner: InProcessExchange

    @classmethod
    def create(cls, *, timeout: float = 300.0, turn=None) -> "CudaInProcessExchange":
        return cls(InProcessExchange(timeout=timeout, turn=turn))

    def exchange(self, key, index: int, size: int, value, compute):
        if size == 1:
            return compute([value])[0]  # nothing crosses a stream
        out = self.inner.exchange(key, index, size, _publish(value), functools.partial(_combine, compute))
        return _take(out, torch.cuda.current_stream())

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)
