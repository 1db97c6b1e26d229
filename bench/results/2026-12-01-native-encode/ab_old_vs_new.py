"""(bench/RESULTS.md, issue 18 controller half.) The previous extension is built from commit b5e0c58's
native/fastpath.cpp as a module `oldfp._fastpath` in /tmp/h3/oldpkg (cmake with nanobind, as native/CMakeLists.txt).

A/B of the controller's own CPU per op (thread_time of the issuing thread), old vs new native
hot path (and Python path), interleaved rounds in one process; batches dropped (no workers run)."""
import os, sys, time, gc, statistics, importlib.machinery, importlib.util
os.environ["OMP_NUM_THREADS"] = "1"
import torch
torch.set_num_threads(1)
import dtorch_core as dt
from dtorch_core.tensor import DTensor
from dtorch_core.planner import native_dispatch, source
from dtorch_core.planner.dispatch import dispatch
from dtorch_core.planner.plans import DirectPlan
from dtorch_core.ir.instructions import Call
from dtorch_core.controller import session as sm
from dtorch_core.ir.wire import encode
em = importlib.import_module("dtorch_core.ir.wire.encode")
from dtorch_core import _fastpath as new
spec = importlib.util.spec_from_file_location("oldfp._fastpath", "/tmp/h3/oldpkg/oldfp/_fastpath.cpython-311-x86_64-linux-gnu.so")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
old.configure(DTensor, torch.Tensor, DirectPlan, Call, torch.Tensor._make_wrapper_subclass, dispatch,
              source._internal_code, (source._PKG_DIR, source._TORCH_DIR, "<"))
paths = {"old native": classmethod(old.torch_dispatch), "new native": DTensor.__dict__["__torch_dispatch__"],
         "python": native_dispatch.PYTHON_TORCH_DISPATCH}
dt.init(world_size=2, runner="thread")
mesh = dt.init_device_mesh("cpu", (2,))
a = dt.distribute_tensor(torch.randn(128, 64), mesh, [dt.Shard(0)])
b = dt.distribute_tensor(torch.randn(128, 64), mesh, [dt.Shard(0)])
for _ in range(300): a + a; torch.relu(a * b + b)
s = sm._session
s.synchronize(); s.flush()
batches = []
s.runner.submit = batches.append
N = 3000
def add():
    for _ in range(N): a + a
def mix():
    for _ in range(N // 3): torch.relu(a * b + b)
R = int(sys.argv[1]) if len(sys.argv) > 1 else 15
res = {}
for r in range(R):
    for stream, fn in (("add", add), ("mix", mix)):
        for name, td in paths.items():
            DTensor.__torch_dispatch__ = td
            gc.collect(); batches.clear()
            t0 = time.thread_time(); fn(); t1 = time.thread_time()
            s.flush()
            # the process runner's flush work on what was issued: encode each batch (256 a batch)
            out = [i for bt in batches for i in bt]
            chunks = [out[i:i + 256] for i in range(0, len(out), 256)]
            for enc_name, w in (("python", (None, None)), ("native", (new.encode_calls, new.encode_ids))):
                em.set_call_writer(*w)
                t2 = time.thread_time()
                for c in chunks: encode(c)
                res.setdefault((stream, "encode " + enc_name), []).append((time.thread_time() - t2) / N * 1e6)
            em.set_call_writer(new.encode_calls, new.encode_ids)
            res.setdefault((stream, name), []).append((t1 - t0) / N * 1e6)
DTensor.__torch_dispatch__ = paths["new native"]
for (stream, name), v in sorted(res.items()):
    q = statistics.quantiles(v, n=4)
    print(f"{stream:4s} {name:16s} median {statistics.median(v):6.2f}  p25 {q[0]:6.2f}  min {min(v):6.2f} us/op")
print("load", os.getloadavg())
os._exit(0)
