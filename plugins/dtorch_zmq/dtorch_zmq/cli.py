"""The ``dtorch keygen`` and ``dtorch worker`` commands."""

from __future__ import annotations

import argparse
import os

from dtorch_core.errors import ConfigError


class KeygenCommand:
    help = "write a new random key file (mode 0600) for remote controllers, agents and workers"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("file", help="where to write the key")
        parser.add_argument("--force", action="store_true", help="replace an existing file")

    def run(self, args: argparse.Namespace) -> int:
        from .keys import write_key

        write_key(args.file, force=args.force)
        print(f"wrote a new key to {args.file} (mode 0600); give it to every agent and worker host")
        return 0


class WorkerCommand:
    help = "run one worker of a remote session (started by torchrun, Slurm, Kubernetes or an agent)"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--controller", required=True, metavar="tcp://HOST:PORT",
                            help="the address the controller listens on (its listen=)")
        parser.add_argument("--key-file", required=True, help="the session's key file (dtorch keygen)")
        parser.add_argument("--rank", type=int, default=None, help="this worker's rank (else RANK or SLURM_PROCID)")
        parser.add_argument("--device-index", type=int, default=None,
                            help="local device to use (default: LOCAL_RANK (torchrun), else SLURM_LOCALID, "
                                 "else the rank)")
        parser.add_argument("--controller-timeout", type=float, default=10.0, metavar="SECONDS",
                            help="exit when the controller is silent this long once connected (default 10)")
        parser.add_argument("--connect-timeout", type=float, default=120.0, metavar="SECONDS",
                            help="exit when no controller answers this long after starting (default 120)")

    def run(self, args: argparse.Namespace) -> int:
        from .runner import parse_address
        from .worker import serve, worker_rank

        parse_address(args.controller)
        rank = worker_rank(args.rank)
        if rank < 0:
            raise ConfigError(f"--rank {rank}: a rank is >= 0")
        return serve(args.controller, args.key_file, rank, local_device_index(args.device_index),
                     silence_s=args.controller_timeout, connect_s=args.connect_timeout)


def local_device_index(given: int | None) -> int | None:
    """The device this worker uses on its host: ``--device-index``, else the launcher's local
    rank (torchrun's LOCAL_RANK, Slurm's SLURM_LOCALID), else None (the rank: one host)."""
    if given is not None:
        return given
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name)
        if value is not None:
            try:
                index = int(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a device index") from None
            if index < 0:
                raise ConfigError(f"{name}={value!r} is not a device index")
            return index
    return None
