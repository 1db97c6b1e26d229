"""Credit reports (explicit flow control): every CREDIT_EVERY batches or CREDIT_BYTES bytes while
batches keep coming, and once the queue has been dry for CREDIT_IDLE_S; never a report per batch."""

from __future__ import annotations

import queue
import threading
import time

from dtorch_zmq import frames as fr
from dtorch_zmq import worker as zw


class FakeEndpoint:
    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.credits: list[tuple[float, int]] = []

    def credit(self, taken: int) -> None:
        self.credits.append((time.monotonic(), taken))


def _serve(endpoint, ran):
    replies = []
    code = zw.serve_batches(endpoint, 0, ran.append, replies.append)
    return code, replies


def test_a_busy_worker_reports_every_credit_every_batches_and_a_dry_one_after_the_idle_time():
    ep = FakeEndpoint()
    ran: list = []
    n = 2 * zw.CREDIT_EVERY + 5
    for i in range(n):  # all queued at once: the worker never runs dry until the last
        ep.inbox.put((fr.BATCH, memoryview(bytes([i % 251]) * 10)))
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _serve(ep, ran)))
    t.start()
    deadline = time.monotonic() + 10
    while len(ran) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    dry_at = time.monotonic()
    while len(ep.credits) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [c for _, c in ep.credits] == [zw.CREDIT_EVERY, 2 * zw.CREDIT_EVERY, n]
    # the last report came only once the queue had been dry (not per batch), and soon after
    assert ep.credits[2][0] - dry_at >= zw.CREDIT_IDLE_S * 0.5
    assert ep.credits[2][0] - dry_at < 5.0
    ep.inbox.put((fr.BATCH, memoryview(b"")))  # the request to exit
    t.join(10)
    code, replies = out["r"]
    assert code == 0 and len(replies) == 1 and len(ran) == n
    assert [bytes(d) for d in ran] == [bytes([i % 251]) * 10 for i in range(n)]


def test_large_batches_are_reported_by_their_bytes(monkeypatch):
    monkeypatch.setattr(zw, "CREDIT_BYTES", 1000)
    ep = FakeEndpoint()
    ran: list = []
    for _ in range(5):
        ep.inbox.put((fr.BATCH, memoryview(b"x" * 600)))
    ep.inbox.put((fr.BATCH, memoryview(b"")))
    code, _ = _serve(ep, ran)
    assert code == 0 and len(ran) == 5
    assert [c for _, c in ep.credits] == [2, 4]  # 1,200 bytes each time, before 64 batches


def test_no_report_while_nothing_was_taken():
    ep = FakeEndpoint()
    ep.inbox.put((fr.BATCH, memoryview(b"a")))
    t = threading.Thread(target=_serve, args=(ep, []))
    t.start()
    time.sleep(20 * zw.CREDIT_IDLE_S)
    assert [c for _, c in ep.credits] == [1]  # one report after the idle time, then nothing more
    ep.inbox.put((fr.BATCH, memoryview(b"")))
    t.join(10)
