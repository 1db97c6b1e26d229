"""Entry point of a ``process`` runner worker (runners/spawn.py starts it with ``--config-fd FD``).

The configuration is JSON the controller writes into an inherited pipe (rank, world size, the
FileStore rendezvous, channel specs). The worker takes its device (the streams registered for
the device type pick it), joins the torch.distributed group of its communicator, then executes
batches until it is told to stop, its channel closes, or its controller disappears. A worker
whose controller is gone exits quietly: one log line at most, no traceback.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
from datetime import timedelta


PR_SET_PDEATHSIG = 1
CONTROLLER_GONE = 3  # exit status of a worker whose controller disappeared


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process the moment its parent's thread ends (Linux): all
    workers go at once, before a peer's broken connection can make gloo complain."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher thread below still ends the worker


def controller_gone(parent_pid: int, why: str = "") -> None:
    """Exit at once and quietly (one line on stderr): nobody is left to report to."""
    try:
        os.write(2, f"dtorch worker (pid {os.getpid()}): controller {parent_pid} is gone{why}; exiting\n".encode())
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # nothing else from this process: no traceback, no gloo complaint
        os.dup2(devnull, 1)
    except OSError:
        pass
    os._exit(CONTROLLER_GONE)


def _watch_parent(parent_pid: int) -> None:
    # a worker must not outlive its controller, however the controller ended (even SIGKILL)
    while True:
        if os.getppid() != parent_pid:
            controller_gone(parent_pid)
        time.sleep(0.25)


def main(argv=None) -> int:
    from .runners.spawn import read_config

    config = read_config(list(argv or sys.argv))
    parent_pid = config["parent_pid"]
    if config.get("die_with_parent"):
        _die_with_parent()
    if os.getppid() != parent_pid:  # it ended before we asked
        controller_gone(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, which stops us
    if config.get("nice"):
        os.nice(int(config["nice"]))
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        return _serve(config)
    except BaseException as exc:
        if os.getppid() != parent_pid or _is_channel_closed(exc):
            controller_gone(parent_pid, f" ({type(exc).__name__})")
        raise


def _is_channel_closed(exc: BaseException) -> bool:
    from .transport.base import ChannelClosedError

    while exc is not None:
        if isinstance(exc, ChannelClosedError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _serve(config: dict) -> int:

    import structlog
    import torch
    import torch.distributed as dist

    from .controller.heap import freeze_worker
    from .ir import wire
    from .ir.instructions import Reply
    from .logging import configure
    from .plugins import get_plugins
    from .transport.channel import ChannelSpec, open_channel
    from .runners.process import READY, SHUTDOWN
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
        init_method=config["init_method"],
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
    freeze_worker()
    reply(Reply(READY, rank, value=None))
    log.debug("worker ready")
    report_drain = bool(config.get("report_drain")) and streams.reports_drain and hasattr(rx, "set_hungry")
    while True:
        try:
            data = next_frame(rx, streams) if report_drain else rx.recv(None)
        except Exception as exc:  # the controller closed the channel: nothing left to do
            log.debug("channel closed", error=repr(exc))
            if os.getppid() != config["parent_pid"]:
                controller_gone(config["parent_pid"])
            break
        if data == SHUTDOWN:
            break
        run_frame(worker, streams, data, rank, reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


DRAIN_POLL_S = 20e-6  # how often an idle worker asks its device whether it has caught up


def next_frame(rx, streams):
    """The next batch frame from ``rx``; while none is there, watch the device, and once it has
    run everything it was given raise the channel's hungry flag, so that the controller sends
    what it holds at once (runners/process.py: flush on drain)."""
    from .transport.base import ChannelTimeoutError

    data = rx.try_recv()
    if data is not None:
        return data
    while not streams.drained():
        try:
            return rx.recv(DRAIN_POLL_S)
        except ChannelTimeoutError:
            pass
    rx.set_hungry()
    return rx.recv(None)


def run_frame(worker, streams, data, rank: int, reply, decode=None) -> None:
    """Decode one batch frame and run it on the worker's streams. A frame that does not decode
    is answered with a PROTOCOL failure, and the worker keeps serving (every transport's
    worker loop ends here). ``decode(data)``, when given, makes the batch instead of
    ``wire.decode`` (a transport whose frames are not one wire message)."""
    try:
        batch = (decode or _wire_decode())(data)
        if not isinstance(batch, list):
            from .ir.wire import WireError

            raise WireError(f"expected a list of instructions, got {type(batch).__name__}")
    except Exception as exc:
        _reject(exc, rank, reply)
        return
    streams.run(functools.partial(worker.run_batch, batch))


@functools.cache
def _wire_decode():
    # imported at the first frame, not at every one: a step's first frame after a sync point is
    # on its critical path (4 imports a frame cost 2.5 us on this project's CPU machine)
    from .ir import wire

    return wire.decode


def _reject(exc: Exception, rank: int, reply) -> None:
    import structlog

    from .ir.instructions import Reply, WorkerFailure
    from .runners.process import PROTOCOL

    structlog.get_logger("dtorch_core.worker").bind(rank=rank).warning("rejected a frame", error=str(exc))
    reply(Reply(PROTOCOL, rank, error=WorkerFailure(rank, "decode", None, str(exc))))
