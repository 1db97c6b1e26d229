"""examples/train_gpt.py on N devices (cuda with the dtorch_nccl plugin, or cpu) against the
example's own one-device run (plain torch in this process): the losses of every step compared
(issue 7, run 1).

    python bench/train_gpt_devices.py --device-type cuda --layouts 1x2 2x1 --steps 30
    python bench/train_gpt_devices.py --device-type cpu --layouts 1x2 2x1 --steps 5      # test

Each layout ``DPxTP`` runs ``examples/train_gpt.py --dp DP --tp TP --runner <runner>
--device-type <type>`` through the example's own ``train()``, all in one dtorch session of
DP*TP workers (the example uses a running session), from the same seed on the same batches as
``--device-count 1``. Prints per layout the max relative loss difference to the one-device run
(target <= --rtol) and its wall time; the exit status is 1 when a layout differs or fails.
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set before
torch is imported.
"""

from __future__ import annotations

import os

for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_name] = _value

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402  (puts the repository root on sys.path too)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-type", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--runner", default="process")
    p.add_argument("--layouts", nargs="+", default=["1x2", "2x1"], help="DPxTP layouts, one session of DP*TP workers")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rtol", type=float, default=None,
                   help="max relative loss difference (default 1e-3 on cpu, 1e-2 on cuda: GPU kernels vs the CPU reference)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more example options, e.g. --d-model 256")
    args = p.parse_args(argv)
    # `timeout` sends SIGTERM: unwind, so the finally blocks stop the torchrun anchor (its own
    # session, out of timeout's reach) and the dtorch workers instead of leaving them on the GPUs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rtol = args.rtol if args.rtol is not None else (1e-3 if args.device_type == "cpu" else 1e-2)
    layouts = [tuple(int(v) for v in s.lower().split("x")) for s in args.layouts]
    worlds = {dp * tp for dp, tp in layouts}
    if len(worlds) != 1:
        p.error(f"--layouts must all have the same number of devices, got {sorted(worlds)}")
    world = worlds.pop()

    ex = _gpt.load_example()
    import dtorch_core as dt
    from dtorch_core.logging import configure

    configure("warning")
    common = ["--steps", str(args.steps), "--plot", "", "--no-progress", "--log-every", str(args.steps),
              "--log-level", "warning", *args.extra]
    t0 = time.perf_counter()
    ref = ex.train(ex.parse_args(common + ["--device-count", "1"]))
    ref_s = time.perf_counter() - t0
    print(f"one device (plain torch, cpu): {len(ref)} steps in {ref_s:.1f}s, loss {ref[0]:.4f} -> {ref[-1]:.4f}",
          flush=True)
    ok = True
    t0 = time.perf_counter()
    dt.init(world_size=world, runner=args.runner, device_type=args.device_type)
    print(f"dtorch session: {world} {args.device_type} workers ({args.runner} runner) in {time.perf_counter() - t0:.1f}s",
          flush=True)
    try:
        for dp, tp in layouts:
            t0 = time.perf_counter()
            try:
                got = ex.train(ex.parse_args(common + ["--dp", str(dp), "--tp", str(tp), "--runner", args.runner,
                                                       "--device-type", args.device_type]))
            except Exception:
                traceback.print_exc()
                print(f"dp{dp} x tp{tp}: FAILED")
                ok = False
                continue
            secs = time.perf_counter() - t0
            diff = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, ref)) if len(got) == len(ref) else float("inf")
            good = diff <= rtol
            ok &= good
            print(f"dp{dp} x tp{tp} on {args.device_type}: {len(got)} steps in {secs:.1f}s, loss {got[0]:.4f} -> "
                  f"{got[-1]:.4f}; max rel diff vs one device {diff:.1e} ({'ok' if good else 'MISMATCH'}, rtol {rtol:g}); "
                  f"fallbacks {dt.fallback_counts() or 'none'}", flush=True)
    finally:
        dt.shutdown()
    print("train_gpt_devices: " + ("all layouts match" if ok else "SOME LAYOUTS DIFFER OR FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
