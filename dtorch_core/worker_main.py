"""Entry point of a ``process`` runner worker: ``python -m dtorch_core.worker_main CONFIG``.

CONFIG is JSON written by the controller (rank, world size, rendezvous port, channel specs).
The worker takes its device (the streams registered for the device type pick it), joins the
torch.distributed group of its communicator, then executes batches until it is told to stop,
its channel closes, or its controller disappears.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta


def _watch_parent(parent_pid: int) -> None:
    # a worker must not outlive its controller, however the controller ended (even SIGKILL)
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.25)


def main(argv=None) -> int:
    config = json.loads((argv or sys.argv)[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, which stops us
    if config.get("nice"):
        os.nice(int(config["nice"]))
    threading.Thread(target=_watch_parent, args=(config["parent_pid"],), daemon=True).start()

    import structlog
    import torch
    import torch.distributed as dist

    from .ir import wire
    from .ir.instructions import Reply, WorkerFailure
    from .logging import configure
    from .plugins import get_plugins
    from .transport.channel import ChannelSpec, open_channel
    from .runners.process import PROTOCOL, READY, SHUTDOWN
    from .worker.streams import make_streams
    from .worker.loop import Worker

    configure()
    rank = config["rank"]
    log = structlog.get_logger("dtorch_core.worker").bind(rank=rank)
    torch.set_num_threads(int(config["threads"]))
    rx = open_channel(ChannelSpec.decode(config["recv"]))
    tx = open_channel(ChannelSpec.decode(config["send"]))
    plugins = get_plugins()
    streams = make_streams(plugins.registry("streams"), config["device_type"], rank)
    streams.claim_process()  # before the process group: NCCL binds to the current device
    dist.init_process_group(
        config["backend"],
        init_method=f"tcp://127.0.0.1:{config['master_port']}",
        rank=rank,
        world_size=config["world_size"],
        timeout=timedelta(seconds=float(config["timeout"])),
    )
    device = streams.device
    log = log.bind(device=str(device))
    send_lock = threading.Lock()

    def reply(r: Reply) -> None:
        data = wire.encode(r)
        with send_lock:
            tx.send(data)

    exchange = plugins.registry("communicators").get(config["communicator"]).create(rank, device)
    worker = Worker(rank, device, plugins.registry("kernels"), exchange, reply, streams)
    reply(Reply(READY, rank, value=None))
    log.debug("worker ready")
    while True:
        try:
            data = rx.recv(None)
        except Exception as exc:  # the controller closed the channel: nothing left to do
            log.debug("channel closed", error=repr(exc))
            break
        if data == SHUTDOWN:
            break
        try:
            batch = wire.decode(data)
            if not isinstance(batch, list):
                raise wire.WireError(f"expected a list of instructions, got {type(batch).__name__}")
        except Exception as exc:
            log.warning("rejected a frame", error=str(exc))
            reply(Reply(PROTOCOL, rank, error=WorkerFailure(rank, "decode", None, str(exc))))
            continue
        streams.run(functools.partial(worker.run_batch, batch))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
