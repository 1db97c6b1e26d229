"""dtorch_nccl: CUDA workers for dtorch.

Installed, it registers (entry point ``nccl`` in group ``dtorch``):

- streams for device type ``cuda``: a compute and a communication stream per worker, ordered
  with CUDA events (:class:`~dtorch_nccl.streams.CudaStreams`), worker ``rank`` on
  ``cuda:rank % device_count``, CUDA memory counters in ``dt.memory_stats()``;
- communicator ``nccl`` for the ``process`` runner (torch.distributed with the mixed backend
  ``cpu:gloo,cuda:nccl``: headers on the CPU, payloads through NCCL);
- communicator ``cuda-inprocess`` for the ``thread`` runner (virtual devices on one GPU, peer
  copies between GPUs).

Use it with ``dt.init(device_type="cuda")`` and ``dt.init_device_mesh("cuda", ...)``.
"""

__version__ = "0.1.0"
