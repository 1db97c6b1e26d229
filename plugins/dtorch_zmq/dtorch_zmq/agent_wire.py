"""What the agent and its client share: the gRPC method names, the JSON message codec and the
call token.

No protoc: every method is a generic unary-unary handler whose request and reply are JSON
objects as UTF-8 bytes (plain dicts of str, int, float, bool, list; never pickle).

Every call carries ``dtorch-token: v1:<unix time>:<nonce>:<hmac>`` in its metadata. The HMAC
(SHA-256) covers the method name, the time, the nonce and the SHA-256 of the request bytes, under
a key derived from the shared key file, so the raw key never travels and a token recorded from
one call cannot be replayed for another call, another body or, after its time window, at all.
The agent remembers the nonces of its window, so a token is good once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time

SERVICE = "dtorch.agent.v1.Agent"
METHODS = ("StartWorkers", "StopWorkers", "RenewLease", "Status")
TOKEN_HEADER = "dtorch-token"
TOKEN_VERSION = "v1"
# a token is accepted this long either side of the agent's clock (hosts' clocks drift a little)
TOKEN_WINDOW_S = 60.0
# the agent key is derived, not the raw key, so the same key file can also sign ZMQ frames
# without one use's MACs ever being valid for the other
_DERIVATION_LABEL = b"dtorch agent token v1"
# the client never lets gRPC reach for an HTTP proxy: only the agent's own address is contacted;
# each channel keeps its own connections (gRPC shares them, and their reconnect back-off, across
# a process's channels by default), and a lost agent is tried again within 2 s
CHANNEL_OPTIONS = (
    ("grpc.enable_http_proxy", 0),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def method_path(method: str) -> str:
    return f"/{SERVICE}/{method}"


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":"), sort_keys=True).encode()


def decode(data: bytes) -> dict:
    """The JSON object in ``data``; ValueError when it is not JSON, TypeError when not an object."""
    message = json.loads(data.decode()) if data else {}
    if not isinstance(message, dict):
        raise TypeError(f"expected a JSON object, got {type(message).__name__}")
    return message


def derive_agent_key(key: bytes) -> bytes:
    return hmac.new(key, _DERIVATION_LABEL, hashlib.sha256).digest()


def _mac(agent_key: bytes, method: str, stamp: str, nonce: str, body: bytes) -> str:
    text = b"\n".join((method.encode(), stamp.encode(), nonce.encode(), hashlib.sha256(body).digest()))
    return hmac.new(agent_key, text, hashlib.sha256).hexdigest()


def make_token(agent_key: bytes, method: str, body: bytes, *, now: float | None = None) -> str:
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    return ":".join((TOKEN_VERSION, stamp, nonce, _mac(agent_key, method, stamp, nonce, body)))


class TokenChecker:
    """Checks call tokens against one key; remembers the nonces it accepted within the window."""

    def __init__(self, agent_key: bytes, *, window_s: float = TOKEN_WINDOW_S):
        self._key = agent_key
        self._window_s = window_s
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def refusal(self, token: str | None, method: str, body: bytes) -> str | None:
        """None when ``token`` is good for this call, else why it is not (for the agent's log)."""
        if not token:
            return "no token"
        parts = token.split(":")
        if len(parts) != 4 or parts[0] != TOKEN_VERSION:
            return "malformed token"
        _, stamp, nonce, mac = parts
        if not hmac.compare_digest(mac.encode(), _mac(self._key, method, stamp, nonce, body).encode()):
            return "token not made with this agent's key"
        try:
            age = time.time() - float(stamp)
        except ValueError:
            return "malformed token time"
        if abs(age) > self._window_s:
            return f"token {age:+.0f} s old (accepted within {self._window_s:.0f} s; check the clocks)"
        with self._lock:
            now = time.monotonic()
            self._seen = {n: t for n, t in self._seen.items() if t > now}
            if nonce in self._seen:
                return "token replayed"
            self._seen[nonce] = now + 2 * self._window_s
        return None
