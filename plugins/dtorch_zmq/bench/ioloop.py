"""The cost of one message through the transport's I/O loop (``dtorch_zmq.transport.IOLoop``).

    python plugins/dtorch_zmq/bench/ioloop.py [--messages 300] [--gap-ms 3]

A controller-side loop (ROUTER, mandatory routing, high-water marks off) sends one 3.4 kB
message (a batch's size) every ``--gap-ms`` to a DEALER on 127.0.0.1, as a session does between
batches: prints the sending thread's CPU per message (queueing and waking the loop) and the I/O
thread's (waking, sending), then the I/O thread's CPU per second while idle for 4 s
(every worker and controller has such a loop). Linux only (per-thread CPU from ``/proc``).
"""

from __future__ import annotations

import argparse
import threading
import time

import zmq
from dtorch_zmq import transport as zt


def thread_cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=3.0)
    args = parser.parse_args()
    ctx = zt.new_context()
    router = zt.quiet_socket(ctx, zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = zt.quiet_socket(ctx, zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"bench")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()
    loop = zt.IOLoop(ctx, router, lambda frames: None, lambda now: None, "bench-io").start()
    n = args.messages
    got = []
    receiver = threading.Thread(target=lambda: got.extend(dealer.recv_multipart() for _ in range(n)))
    receiver.start()
    payload = b"x" * 3400
    time.sleep(0.1)
    io_start = thread_cpu_ns(loop._thread.native_id)
    sender = 0
    for _ in range(n):
        time.sleep(args.gap_ms / 1000)
        t = time.thread_time_ns()
        loop.send(zt.Outgoing([(identity, b"h" * 61 + payload)]))
        sender += time.thread_time_ns() - t
    receiver.join(60)
    io = thread_cpu_ns(loop._thread.native_id) - io_start
    assert len(got) == n and all(bytes(m[0])[61:] == payload for m in got)
    idle_start = thread_cpu_ns(loop._thread.native_id)
    time.sleep(4.0)
    idle = thread_cpu_ns(loop._thread.native_id) - idle_start
    print(f"{n} messages, one every {args.gap_ms:g} ms: sender {sender / n / 1000:.1f} us CPU per message, "
          f"I/O thread {io / n / 1000:.1f} us; idle I/O thread {idle / 4e6:.2f} ms CPU per s")
    loop.stop()
    dealer.close(0)
    router.close(0)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
