"""``dtorch agent``: one per node; starts and stops worker processes for authenticated controllers.

The service itself is ``agent_service``; this is the command around it: options, the key file,
the device count, the ready line on stdout and a clean exit on SIGTERM/SIGINT (the current
session's workers are stopped first).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import tempfile
import threading

import structlog

from dtorch_core.errors import ConfigError

from .agent_service import DEFAULT_GRACE_S, AgentService, serve
from .keys import read_key

log = structlog.get_logger(__name__)


def local_devices(requested: int | None) -> tuple[int, str]:
    """(how many workers this node runs, their device type): the CUDA devices when there are any,
    else CPU workers (as many as asked, by default one per core)."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda:
        if requested is not None and requested > cuda:
            raise ConfigError(f"--devices {requested}: this node has {cuda} CUDA devices")
        return (cuda if requested is None else requested), "cuda"
    return (os.cpu_count() or 1) if requested is None else requested, "cpu"


def _listen_address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 0 picks a free one), got {text!r}")
    return text


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _read_tls(cert_file: str | None, key_file: str | None) -> tuple[bytes, bytes] | None:
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        raise ConfigError("--tls-cert and --tls-key go together (a certificate and its private key)")
    try:
        with open(key_file, "rb") as f:
            private_key = f.read()
        with open(cert_file, "rb") as f:
            return private_key, f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS files: {exc}") from None


class AgentCommand:
    help = "run the node agent: a gRPC service that starts workers for authenticated controllers"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Serve controllers that hold the key in --key-file: start one `dtorch worker` per rank "
            "they ask for, report the workers' health, stop them when asked, and kill them when "
            "the controller stops renewing its lease. Prints `dtorch agent listening on HOST:PORT` "
            "once it serves. One session at a time."
        )
        parser.add_argument("--listen", required=True, type=_listen_address, metavar="HOST:PORT",
                            help="address to serve on (port 0 picks a free one)")
        parser.add_argument("--key-file", required=True, metavar="FILE",
                            help="the key shared with controllers and workers (`dtorch keygen FILE`)")
        parser.add_argument("--devices", type=_count, metavar="N",
                            help="workers this node runs, one per device (default: the CUDA devices, "
                                 "or one per CPU core without CUDA)")
        parser.add_argument("--log-dir", metavar="DIR",
                            help="where the workers' logs go (default: a new temporary directory)")
        parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                            help="how long a stopped worker has between SIGTERM and SIGKILL")
        parser.add_argument("--tls-cert", metavar="FILE",
                            help="serve over TLS with this certificate chain (PEM); controllers then "
                                 "need DTORCH_AGENT_TLS_CA naming the CA that signed it")
        parser.add_argument("--tls-key", metavar="FILE", help="the TLS certificate's private key (PEM)")
        parser.add_argument("--worker-command", metavar="CMD",
                            help="command line run per rank instead of `dtorch worker`, with the same "
                                 "--controller/--key-file/--rank/--device-index arguments appended "
                                 "(for tests)")

    def run(self, args: argparse.Namespace) -> int:
        from dtorch_core.logging import LEVEL_ENV, configure

        if not os.environ.get(LEVEL_ENV):
            configure("info")  # a daemon: its log of sessions and refusals is the point
        key = read_key(args.key_file)
        tls = _read_tls(args.tls_cert, args.tls_key)
        devices, device_type = local_devices(args.devices)
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="dtorch-agent-")
        worker_command = shlex.split(args.worker_command) if args.worker_command else None
        service = AgentService(key=key, key_file=args.key_file, devices=devices, device_type=device_type,
                               log_dir=log_dir, worker_command=worker_command, grace_s=args.grace)
        try:
            server, port, health_servicer = serve(args.listen, service, tls=tls)
        except OSError as exc:
            service.close()
            raise ConfigError(f"--listen {args.listen}: {exc}") from None
        host = args.listen.rpartition(":")[0]
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        print(f"dtorch agent listening on {host}:{port} ({'TLS; ' if tls else ''}devices: {devices} {device_type}; "
              f"worker logs: {log_dir})", flush=True)
        log.info("agent serving", listen=f"{host}:{port}", devices=devices, device_type=device_type,
                 log_dir=log_dir)
        while not stop.wait(0.5):  # a timed wait lets the signal handlers run promptly
            pass
        health_servicer.enter_graceful_shutdown()
        service.close()
        server.stop(grace=1.0).wait()
        log.info("agent stopped")
        return 0
