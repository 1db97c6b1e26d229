"""The hook implementations of dtorch_nccl (its entry point). Importing it touches no GPU."""

from __future__ import annotations

from dtorch_core import hookimpl
from dtorch_core.comm.kinds import Communicator

from .inprocess import CudaInProcessExchange
from .streams import CudaStreams

# Payloads are CUDA tensors and go through NCCL (their shapes come in the instruction, so nothing
# is exchanged before them); CPU tensors a worker exchanges go through gloo.
DIST_BACKEND = "cpu:gloo,cuda:nccl"


def _nccl_exchange(rank, device):
    from dtorch_core.comm.dist import DistExchange

    return DistExchange(rank, device)


@hookimpl
def dtorch_register_streams(registry) -> None:
    registry.add("cuda", CudaStreams)


@hookimpl
def dtorch_register_communicators(registry) -> None:
    registry.add("nccl", Communicator(_nccl_exchange, "process", ("cuda",), dist_backend=DIST_BACKEND))
    registry.add("cuda-inprocess", Communicator(CudaInProcessExchange.create, "thread", ("cuda",)))
