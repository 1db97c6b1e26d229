"""What bench/collectives.py and its torch.distributed anchor share: the collectives, their
tensor shapes and nccl-tests' bandwidth conventions.

A collective of size S works on a global (rows, 1024)-element tensor of S bytes:
  all_gather      Shard(0) -> Replicate     torch: all_gather_into_tensor(out[S], in[S/n])
  reduce_scatter  Partial  -> Shard(0)      torch: reduce_scatter_tensor(out[S/n], in[S])
  all_reduce      Partial  -> Replicate     torch: all_reduce(buf[S])
  all_to_all      Shard(0) -> Shard(1)      torch: all_to_all_single(out[S/n], in[S/n])
nccl-tests (doc/PERFORMANCE.md): algbw = size / time with size the output bytes per rank for
all_gather (S), the input bytes per rank for reduce_scatter (S), the buffer for all_reduce (S)
and the per-rank buffer for all_to_all (S/n); busbw = algbw * (n-1)/n, all_reduce 2(n-1)/n.
"""

from __future__ import annotations

import os

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value

import re  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLS = 1024
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "MB": 1 << 20,
         "G": 1 << 30, "GIB": 1 << 30, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """'1MiB', '256M', '1G', '65536' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise ValueError(f"size {text!r}: a number with an optional unit K, M, G (KiB, MiB, GiB)")
    return int(m.group(1)) * UNITS[m.group(2).upper()]


def format_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def shape_for(size: int, dtype: torch.dtype, world: int) -> tuple[int, int]:
    """The global (rows, cols) of ``size`` bytes; rows and cols divide by ``world``."""
    elems = size // torch.empty((), dtype=dtype).element_size()
    cols = COLS
    while cols > world and (elems % cols or (elems // cols) % world):  # small sizes: fewer columns
        cols //= 2
    rows = elems // cols
    if rows * cols * torch.empty((), dtype=dtype).element_size() != size or rows % world or cols % world:
        raise ValueError(f"size {size} B of {dtype} does not split into ({rows}, {cols}) evenly over {world} ranks")
    return rows, cols


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time used so far by process ``pid`` (all its threads; this process if None), in
    seconds, from the scheduler's nanosecond counters (``/proc/<pid>/task/*/schedstat``)."""
    if pid is None:
        return time.process_time()
    total = 0
    root = f"/proc/{pid}/task"
    for task in os.listdir(root):
        try:
            with open(f"{root}/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total / 1e9


def nccl_tests_bytes(op: str, size: int, world: int) -> int:
    """The 'size' nccl-tests would print for this collective."""
    return size // world if op == "all_to_all" else size


def bus_factor(op: str, world: int) -> float:
    if world == 1:
        return 1.0  # nccl-tests prints 0; 1 keeps a one-rank run readable (a local copy)
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
