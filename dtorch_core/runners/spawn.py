"""How the process runner starts a worker: its environment, command line and configuration.

- The configuration (rank, channel names, the rendezvous) reaches the worker through an
  inherited pipe, never its command line (which anyone can read with ``ps``).
- The rendezvous is a torch.distributed FileStore in a private (0700) directory: no port to
  race for, nothing listening on the network. gloo's own connections use the loopback
  interface unless ``GLOO_SOCKET_IFNAME`` says otherwise.
- The worker imports the controller's ``dtorch_core`` whatever directory it starts in: it runs
  with ``-c`` and puts the controller's package root first on ``sys.path`` (``python -m`` would
  put the working directory first, where another ``dtorch_core`` may be).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

#: the package root the controller imported dtorch_core from
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BOOT = (
    "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "sys.path.insert(0, {root!r}); "
    "from dtorch_core.worker_main import main; sys.exit(main())"
)


RDV_PREFIX = "dtorch-rdv-"


#: shared-memory rings are named /dtorch-PID-HEX after their controller (transport/channel.py)
RING_PREFIX = "dtorch-"
SHM_ROOT = "/dev/shm"


def private_dir() -> str:
    """A fresh directory only this user can enter (``tempfile.mkdtemp`` makes it 0700), named
    after this process; the rendezvous directories and shared-memory rings of controllers that
    ended without cleaning up (SIGKILL, SIGTERM while workers started) are removed first."""
    remove_stale_dirs()
    remove_stale_rings()
    return tempfile.mkdtemp(prefix=f"{RDV_PREFIX}{os.getpid()}-")


def remove_stale_rings(root: str = SHM_ROOT) -> None:
    """Unlink this user's ring objects whose controller (the pid in the name) is gone."""
    _remove_stale(root, RING_PREFIX, os.unlink, skip=RDV_PREFIX)


def _remove_stale(root: str, prefix: str, remove, skip: str | None = None) -> None:
    """``remove(path)`` for each entry of ``root`` named ``PREFIX<pid>-...`` that this user owns
    and whose process is gone (an entry that vanishes meanwhile is fine)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix) and not (skip and n.startswith(skip))]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            if pid.isdigit() and os.lstat(path).st_uid == os.getuid() and not _pid_alive(int(pid)):
                remove(path)
        except OSError:
            continue


def remove_stale_dirs(root: str | None = None) -> None:
    """Remove this user's rendezvous directories whose controller (the pid in the name) is gone."""
    _remove_stale(root or tempfile.gettempdir(), RDV_PREFIX, lambda path: shutil.rmtree(path, ignore_errors=True))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def store_url(directory: str) -> str:
    return "file://" + os.path.join(directory, "store")


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    # workers import what the controller can import (its sys.path, this package first)
    paths = [PACKAGE_ROOT] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["OMP_NUM_THREADS"] = str(threads)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs listen on loopback only
    return env


def config_pipe(config: dict) -> int:
    """The read end of a pipe that holds ``config`` as JSON (the child inherits it)."""
    data = json.dumps(config).encode()
    r, w = os.pipe()
    try:
        if len(data) > 60000:  # more than a pipe holds before it is read: never for a config
            raise ValueError(f"worker configuration too large ({len(data)} bytes)")
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def worker_command(config_fd: int) -> list[str]:
    return [sys.executable, "-c", _BOOT.format(root=PACKAGE_ROOT), "--config-fd", str(config_fd)]


def read_config(argv: list[str]) -> dict:
    """The worker's side: the configuration from ``--config-fd FD``."""
    if len(argv) != 3 or argv[1] != "--config-fd":
        raise SystemExit("dtorch worker: started without --config-fd; the process runner starts workers")
    with os.fdopen(int(argv[2]), "rb") as f:
        return json.loads(f.read())
