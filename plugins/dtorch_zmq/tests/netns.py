"""Separate "hosts" on this machine: network namespaces joined by a bridge, for the fault tests.

:class:`Network` makes one namespace per host, each with a veth pair whose outer end is on a
bridge in the root namespace (the controller's side). Every address is one this module assigns,
in a /24 of 10.213.0.0/16 that no interface of this machine uses when the network is made: the
controller is ``.1``, host ``i`` is ``.(11 + i)``. A namespace has no route but its /24, so
nothing inside can reach anything else. Names carry this process's id (``dtorch-<pid>-h<i>``,
bridge ``dtb<pid>``, veths ``dtv<pid>h<i>``), so concurrent runs do not collide; :func:`remove_stale`
removes what a run killed before its clean-up left behind.

:class:`NetnsAgent` runs `dtorch agent` inside a host's namespace (``ip netns exec``), under a host
name of its own.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import attrs

SUBNET_PREFIX = "10.213"  # 10.213.N.0/24, N picked free per network
AGENT_PORT = 7100  # every namespace has its own ports: the same one on each host
_LOCK_FILE = "/tmp/dtorch-netns-tests.lock"  # two runs picking a subnet at once take turns


class NetnsUnavailable(Exception):
    """Namespaces or veth pairs cannot be made here (not root, no `ip`, no kernel support)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsUnavailable("no `ip` command (iproute2) on this machine") from None
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


@attrs.define
class Host:
    index: int
    namespace: str
    address: str  # its IPv4 address on the bridge
    outer_link: str  # the veth end on the bridge (root namespace): down = this host is cut off
    inner_link: str  # the veth end inside the namespace

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's network namespace, with a host name of its own (the
        namespace's: a UTS namespace too, so that workers on different "hosts" are on different
        nodes, as they would be). Every step execs the next: the process's pid is ``argv``'s."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.namespace, *argv]

    def net_inode(self) -> int:
        """The inode of the namespace, to compare with ``/proc/PID/ns/net``."""
        return os.stat(f"/run/netns/{self.namespace}").st_ino


class Network:
    """A bridge with the controller's address and ``hosts`` namespaces on it; :meth:`close` removes
    everything (also after a failed start)."""

    def __init__(self, hosts: int):
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("unshare") is None or shutil.which("hostname") is None:
            raise NetnsUnavailable("no `unshare` or `hostname` command (util-linux) on this machine")
        tag = str(os.getpid())
        self.bridge = f"dtb{tag}"
        self.hosts: list[Host] = []
        remove_stale()
        try:
            with open(_LOCK_FILE, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                subnet = _free_subnet()
                self.controller_address = f"{subnet}.1"
                ip("link", "add", self.bridge, "type", "bridge")
                ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(hosts):
                host = Host(i, f"dtorch-{tag}-h{i}", f"{subnet}.{11 + i}", f"dtv{tag}h{i}", f"eth{i}")
                self.hosts.append(host)
                ip("netns", "add", host.namespace)
                ip("link", "add", host.outer_link, "type", "veth", "peer", "name", host.inner_link,
                   "netns", host.namespace)
                ip("link", "set", host.outer_link, "master", self.bridge, "up")
                ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.inner_link)
                ip("-n", host.namespace, "link", "set", host.inner_link, "up")
                ip("-n", host.namespace, "link", "set", "lo", "up")
            self._wait_until_forwarding(self.hosts)
        except BaseException:
            self.close()
            raise

    def cut(self, host: Host) -> None:
        """A partition: ``host`` can no longer reach, or be reached by, anything."""
        ip("link", "set", host.outer_link, "down")

    def heal(self, host: Host) -> None:
        ip("link", "set", host.outer_link, "up")
        self._wait_until_forwarding([host])

    def close(self) -> None:
        for host in self.hosts:
            ip("netns", "del", host.namespace, check=False)  # takes its veth pair with it
        ip("link", "del", self.bridge, check=False)

    def _wait_until_forwarding(self, hosts: list[Host], timeout_s: float = 10.0) -> None:
        """Until the hosts' links are up again (a veth's carrier comes back a moment later)."""
        deadline = time.monotonic() + timeout_s
        for host in hosts:
            while "state UP" not in ip("link", "show", host.outer_link).stdout:
                if time.monotonic() > deadline:
                    raise NetnsUnavailable(f"the veth {host.outer_link} did not come up")
                time.sleep(0.05)


def _free_subnet() -> str:
    used = set(re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", ip("-4", "-o", "addr", "show").stdout))
    for n in range(1, 255):
        if str(n) not in used:
            return f"{SUBNET_PREFIX}.{n}"
    raise NetnsUnavailable(f"no free /24 left in {SUBNET_PREFIX}.0.0/16")


def remove_stale() -> None:
    """Remove namespaces and bridges of earlier runs whose process is gone (a run killed before its
    clean-up); those of live runs are left alone."""
    for name in ip("netns", "list", check=False).stdout.split():
        match = re.fullmatch(r"dtorch-(\d+)-h\d+", name)
        if match and not _pid_alive(int(match.group(1))):
            ip("netns", "del", name, check=False)
    for match in re.finditer(r"^\d+: dtb(\d+)[:@]", ip("-o", "link", "show", check=False).stdout, re.MULTILINE):
        if not _pid_alive(int(match.group(1))):
            ip("link", "del", f"dtb{match.group(1)}", check=False)


def _pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between the open and the read
        return False


def in_namespace(pid: int, host: Host) -> bool:
    return os.stat(f"/proc/{pid}/ns/net").st_ino == host.net_inode()


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - start


class NetnsAgent:
    """`dtorch agent` in ``host``'s namespace on ``host.address:AGENT_PORT``; its log goes to
    ``log_path``. Its workers inherit an environment that pins gloo to the host's own link."""

    def __init__(self, host: Host, key_file: str, devices: int, tmp_dir, port: int = AGENT_PORT):
        self.host = host
        self.address = f"{host.address}:{port}"
        self.log_path = tmp_dir / f"agent-h{host.index}-{time.monotonic_ns()}.log"
        env = dict(os.environ, DTORCH_LOG_LEVEL="info", NO_COLOR="1", GLOO_SOCKET_IFNAME=host.inner_link,
                   OMP_NUM_THREADS="1", DTORCH_WORKER_THREADS="1")
        argv = [sys.executable, "-m", "dtorch_core.cli", "agent", "--listen", self.address, "--key-file", key_file,
                "--devices", str(devices), "--log-dir", str(tmp_dir / f"workers-h{host.index}"), "--grace", "2"]
        with open(self.log_path, "wb") as log:
            # `ip netns exec` execs the agent: this pid is the agent's
            self.proc = subprocess.Popen(host.command(argv), stdout=subprocess.PIPE, stderr=log,
                                         stdin=subprocess.DEVNULL, env=env, text=True)
        line = read_line(self.proc.stdout, timeout_s=60)
        if "listening on" not in line:
            self.kill()
            raise AssertionError(f"no ready line from the agent in {host.namespace}: {line!r}\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def read_line(stream, timeout_s: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else ""
