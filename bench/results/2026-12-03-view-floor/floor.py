"""torch's own cost of a wrapper subclass's op (no dtorch): add against views, CPU and CUDA.

The subclass's __torch_dispatch__ returns a fresh wrapper of a fixed shape, so the figure is
torch's dispatch to Python and back, its view tracking, and one _make_wrapper_subclass.
"""
import sys
import time

import torch


class Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, device):
        return torch.Tensor._make_wrapper_subclass(cls, (1, 64, 32), dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch.Tensor._make_wrapper_subclass(cls, (64, 32), dtype=torch.float32, device=args[0].device)


def per_call(fn, calls=3000, rounds=5):
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best * 1e6


for device in sys.argv[1:] or ["cpu"]:
    w = Wrapper(device)
    x = torch.randn(1, 64, 32, device=device)
    cases = {"add": (lambda: w + w, lambda: x + x), "view": (lambda: w.view(64, 32), lambda: x.view(64, 32)),
             "unsqueeze": (lambda: w.unsqueeze(1), lambda: x.unsqueeze(1)), "t": (lambda: w[0].t(), lambda: x[0].t())}
    for name, (sub, plain) in cases.items():
        s, p = per_call(sub), per_call(plain)
        print(f"{device:5s} {name:10s} plain {p:6.2f} us  empty subclass {s:6.2f} us  (+{s - p:5.2f})")
