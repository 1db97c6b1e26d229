"""Collectives between worker processes through torch.distributed.

Every communicating step is an all-gather of the members' contributions followed by the same
``combine_all`` arithmetic the in-process runners use, so every runner computes the same values.
Contributions travel as bytes (any dtype, any shape, uneven sizes): first a small header per
member (failed flag, dtype, shape), then the padded payloads. Headers always live on the CPU, so
reading them never waits for a device; payloads live on the worker's device. With a mixed
backend such as ``"cpu:gloo,cuda:nccl"`` the headers go through gloo and CUDA payloads through
NCCL, on the caller's current stream (the worker's communication stream).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from ..mesh import DeviceMesh

MAX_NDIM = 16
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


@attrs.define
class DistExchange:
    """The exchange interface of :class:`~dtorch_core.runtime.worker.Worker` over process groups."""

    rank: int
    device: torch.device
    groups: dict = attrs.field(factory=dict)  # (mesh_id, mesh_dim, group index) -> process group

    def define_mesh(self, mesh_id: int, shape, ranks) -> None:
        """Create one process group per group of every mesh dim (every rank must call this)."""
        root = DeviceMesh("worker", tuple(shape), tuple(ranks))
        for d in range(len(shape)):
            for gi, members in enumerate(root.groups(d)):
                group = dist.new_group(list(members)) if len(members) > 1 else None
                if self.rank in members:
                    self.groups[(mesh_id, d, gi)] = (group, members)

    def exchange(self, key, index: int, size: int, value, compute):
        from ..graph.instructions import WorkerFailure

        if size == 1:
            return compute([value])[0]
        group, members = self.groups[key[:3]]
        failed = type(value) is WorkerFailure
        header = torch.zeros(3 + MAX_NDIM, dtype=torch.int64)
        if not failed:
            if value.ndim > MAX_NDIM:
                failed = True
                value = WorkerFailure(self.rank, "collective", None, f"tensors above {MAX_NDIM} dims")
            else:
                header[1] = _CODE[value.dtype]
                header[2] = value.ndim
                header[3:3 + value.ndim] = torch.tensor(value.shape, dtype=torch.int64)
        header[0] = int(failed)
        headers = [torch.empty_like(header) for _ in members]
        dist.all_gather(headers, header, group=group)
        if any(int(h[0]) for h in headers):
            failure = value if failed else WorkerFailure(
                self.rank, "collective", None, f"a peer in group {members} failed before this collective")
            return failure
        dtype = _DTYPES[int(headers[0][1])]
        shapes = [tuple(int(n) for n in h[3:3 + int(h[2])]) for h in headers]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = [itemsize * _numel(s) for s in shapes]
        width = max(max(nbytes), 1)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        if nbytes[index]:
            mine[: nbytes[index]] = value.contiguous().reshape(-1).view(torch.uint8)
        payloads = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in members]
        dist.all_gather(payloads, mine, group=group)
        values = [
            p[:n].view(dtype).reshape(s) if n else torch.empty(s, dtype=dtype, device=self.device)
            for p, n, s in zip(payloads, nbytes, shapes)
        ]
        return compute(values)[index]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
