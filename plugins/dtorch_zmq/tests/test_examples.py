"""The Slurm and Kubernetes examples (examples/slurm, examples/kubernetes), as far as one host allows.

Neither Slurm nor Kubernetes runs here, so each test plays their part on 127.0.0.1 only:
- Slurm: the batch script itself runs under bash with a stand-in ``scontrol`` (the first node is
  127.0.0.1) and ``srun`` (it starts its command once per task with SLURM_PROCID set, as srun
  does), and a small controller program as the script's program.
- Kubernetes: the manifest is read (a small YAML reader of its own, checked against PyYAML where
  that is installed), and each worker pod's container command runs as the Job controller would
  start it: RANK from its completion index, ``$(VAR)`` expanded from the container's env, the
  Service's name standing for 127.0.0.1 and the Secret mounted in a temporary directory.
Either way the workers run the example's ``dtorch worker`` command line unchanged, and the
controller (launcher mode, world 2) checks a computation over uneven shards against torch.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dtorch_zmq.keys import write_key
from zmq_testing import LOOPBACK, free_port, reap

REPO = Path(__file__).resolve().parents[3]
SBATCH = REPO / "examples" / "slurm" / "dtorch.sbatch"
MANIFEST = REPO / "examples" / "kubernetes" / "dtorch-job.yaml"
RUN_TIMEOUT_S = 120
ANNOTATION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

# The controller of both tests: dt.init() from the environment the example sets up, then a
# matmul over a 5-row tensor sharded 3 + 2, against plain torch.
CONTROLLER = """
import os, torch
import dtorch_core as dt
session = dt.init(startup_timeout=60)  # runner, world size, listen address, key file: all from the env
try:
    assert session.runner.name == "remote" and session.runner.world_size == 2, session.runner
    mesh = dt.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, generator=g), torch.randn(3, 4, generator=g)
    dx = dt.distribute_tensor(x, mesh, [dt.Shard(0)])
    dw = dt.distribute_tensor(w, mesh, [dt.Replicate()])
    shards = dx.local_shards()
    assert {r: tuple(s.shape) for r, s in shards.items()} == {0: (3, 3), 1: (2, 3)}, "uneven shards expected"
    got = torch.relu(dx @ dw).sum(0).full_tensor()
    torch.testing.assert_close(got, torch.relu(x @ w).sum(0))
    print("controller check ok:", got.tolist())
finally:
    dt.shutdown()
"""

FAKE_SCONTROL = """#!/bin/sh
# stand-in for `scontrol show hostnames LIST`: the allocation is this host
echo 127.0.0.1
"""

# Stand-in srun: skips its options (the script writes them as --opt=value), records the command
# it got, and runs it once per task with the task's SLURM_PROCID, as srun does; exits with the
# worst status.
FAKE_SRUN = """import json, os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
with open(os.environ["FAKE_SRUN_LOG"], "w") as f:
    json.dump(args, f)
tasks = int(os.environ["SLURM_NTASKS"])
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(t), SLURM_LOCALID=str(t), SLURM_NODEID="0"))
         for t in range(tasks)]
sys.exit(max(p.wait() for p in procs))
"""


def _fresh_key(path: Path, mode: int = 0o600) -> str:
    write_key(str(path))
    path.chmod(mode)
    return str(path)


def _run(cmd, env, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``cmd`` in a process group of its own, killed whole if it runs past ``timeout``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[:2]} still running after {timeout}s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _base_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # this venv's `dtorch`
    env.update(OMP_NUM_THREADS="1", DTORCH_WORKER_THREADS="1")
    for name in ("RANK", "SLURM_PROCID", "DTORCH_AGENTS"):  # the examples' settings, not the caller's
        env.pop(name, None)
    return env


# ---------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------
def srun_command(script: str) -> list[str]:
    """The command the script's ``srun`` line runs (continuations joined, options and ``&`` dropped)."""
    joined = re.sub(r"\\\n", " ", script)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("srun ")]
    assert len(lines) == 1, f"expected one srun line, found {lines}"
    words = shlex.split(lines[0].rstrip("&"))[1:]
    while words and words[0].startswith("-"):
        words.pop(0)
    return words


def test_the_sbatch_script_starts_one_worker_per_task_ranked_by_slurm():
    script = SBATCH.read_text()
    assert subprocess.run(["bash", "-n", str(SBATCH)], check=False, capture_output=True, timeout=30).returncode == 0
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.MULTILINE))
    assert {"nodes", "ntasks-per-node"} <= set(directives), directives
    cmd = srun_command(script)
    assert cmd[:2] == ["dtorch", "worker"], cmd
    assert cmd[cmd.index("--controller") + 1] == "tcp://$HEAD:$PORT"
    assert "--key-file" in cmd and "--rank" not in cmd  # the rank is the task's SLURM_PROCID
    assert re.search(r"^export DTORCH_LISTEN=\S*:\$PORT\}?$", script, re.MULTILINE), "the controller listens on $PORT"
    assert re.search(r"^export DTORCH_RUNNER=remote$", script, re.MULTILINE)
    assert re.search(r"^export DTORCH_WORLD_SIZE=\$SLURM_NTASKS$", script, re.MULTILINE)


def test_the_sbatch_script_runs_a_session_under_a_stand_in_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun.py").write_text(FAKE_SRUN)
    # through sh: a shebang naming this interpreter could pass the kernel's length limit
    srun = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(bin_dir / "srun.py"))} "$@"\n'
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", srun)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    port = free_port()
    key = _fresh_key(tmp_path / "key")
    env = _base_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.update(SLURM_JOB_NODELIST="node[1]", SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="2",
               DTORCH_PORT=str(port), DTORCH_KEY_FILE=key, FAKE_SRUN_LOG=str(tmp_path / "srun.json"),
               # the script's default binds every interface; here only loopback, on the script's port
               DTORCH_LISTEN=f"tcp://{LOOPBACK}:{port}")
    done = _run(["bash", str(SBATCH), sys.executable, "-c", CONTROLLER], env, RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "controller check ok" in done.stdout, done.stdout[-4000:]
    # srun got exactly the script's worker command line, expanded as bash does in the job
    want = [w.replace("$HEAD", LOOPBACK).replace("$PORT", str(port)).replace("$DTORCH_KEY_FILE", key)
            for w in srun_command(SBATCH.read_text())]
    assert json.loads((tmp_path / "srun.json").read_text()) == want


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------
def _strip_comment(line: str) -> str:
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _split_flow(text: str) -> list[str]:
    items, buf, quote = [], "", None
    for c in text:
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == ",":
            items.append(buf.strip())
            buf = ""
            continue
        buf += c
    return items + ([buf.strip()] if buf.strip() else [])


def yaml_scalar(text: str):
    """A scalar as YAML 1.1 reads it (the subset the manifest uses), a flow list of them included."""
    if text.startswith("[") and text.endswith("]"):
        return [yaml_scalar(t) for t in _split_flow(text[1:-1])]
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if re.fullmatch(r"0[0-7]+", text):
        return int(text, 8)  # YAML 1.1 octal, as Kubernetes reads defaultMode: 0600
    if re.fullmatch(r"-?(0|[1-9]\d*)", text):
        return int(text)
    return {"true": True, "false": False, "null": None, "~": None}.get(text, text)


def _parse_block(lines, i: int, indent: int):
    """The block of ``lines`` starting at ``i`` whose lines are indented ``indent``: (value, next i)."""
    if lines[i][0] == indent and lines[i][1].startswith("- "):
        items = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
            rest = lines[i][1][2:]
            if re.match(r"[\w.'\"/-]+:( |$)", rest):  # a mapping item: its first key is on the dash's line
                lines[i] = (indent + 2, rest)
                value, i = _parse_block(lines, i, indent + 2)
            else:
                value, i = yaml_scalar(rest), i + 1
            items.append(value)
        return items, i
    mapping = {}
    while i < len(lines) and lines[i][0] == indent:
        key, _, rest = lines[i][1].partition(":")
        rest = rest.strip()
        i += 1
        if rest:
            mapping[key.strip()] = yaml_scalar(rest)
        elif i < len(lines) and lines[i][0] > indent:
            mapping[key.strip()], i = _parse_block(lines, i, lines[i][0])
        else:
            mapping[key.strip()] = None
    return mapping, i


def parse_yaml_documents(text: str) -> list:
    """The documents of a block-style YAML file (mappings, lists, scalars, flow lists of scalars)."""
    docs, lines = [], []
    for raw in text.splitlines() + ["---"]:
        line = _strip_comment(raw)
        if line.strip() == "---":
            if lines:
                docs.append(_parse_block(lines, 0, lines[0][0])[0])
            lines = []
        elif line.strip():
            lines.append((len(line) - len(line.lstrip(" ")), line.strip()))
    return docs


def manifest() -> dict:
    docs = parse_yaml_documents(MANIFEST.read_text())
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(by_name) == len(docs) == 3, list(by_name)
    return {"service": by_name["Service", "dtorch-controller"], "controller": by_name["Job", "dtorch-controller"],
            "workers": by_name["Job", "dtorch-workers"]}


def _container(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _key_mount(job: dict, container: dict) -> tuple[str, dict]:
    """(mountPath, secret volume) of the pod's key."""
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    (mount,) = container["volumeMounts"]
    return mount["mountPath"], volumes[mount["name"]]["secret"]


def k8s_expand(word: str, env: dict) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in a container's command (``$$`` is a literal ``$``)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), word)


def test_our_yaml_reader_agrees_with_pyyaml_on_the_manifest():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: nothing to compare our reader with")
    assert parse_yaml_documents(MANIFEST.read_text()) == [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_the_manifest_wires_workers_controller_service_and_key_together():
    m = manifest()
    service, controller, workers = m["service"], m["controller"], m["workers"]
    worker, boss = _container(workers), _container(controller)
    worker_env, boss_env = _env(worker), _env(boss)
    spec = workers["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert int(boss_env["DTORCH_WORLD_SIZE"]) == spec["completions"]
    assert boss_env["DTORCH_RUNNER"] == "remote"
    assert worker_env["RANK"] == {"fieldRef": {"fieldPath": ANNOTATION_INDEX}}
    assert worker["command"][:2] == ["dtorch", "worker"] and "--rank" not in worker["command"]
    # the Service: headless (the rendezvous store's port is not known in advance), on the listen port
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= controller["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    listen_port = int(boss_env["DTORCH_LISTEN"].rsplit(":", 1)[1])
    assert port["port"] == port["targetPort"] == listen_port
    assert worker_env["DTORCH_CONTROLLER"] == f"tcp://{service['metadata']['name']}:{listen_port}"
    # the key: one Secret, mounted 0600 where DTORCH_KEY_FILE points, in both pods
    for job, container in ((controller, boss), (workers, worker)):
        mount_path, secret = _key_mount(job, container)
        assert secret["secretName"] == "dtorch-key" and secret["defaultMode"] == 0o600
        assert os.path.dirname(_env(container)["DTORCH_KEY_FILE"]) == mount_path


def test_the_worker_pods_command_runs_a_session(tmp_path):
    m = manifest()
    workers, worker = m["workers"], _container(m["workers"])
    service_address = f"{m['service']['metadata']['name']}:{m['service']['spec']['ports'][0]['port']}"
    mount_path, secret = _key_mount(workers, worker)
    mount = tmp_path / "secret"  # the Secret's volume, mounted with its defaultMode
    mount.mkdir()
    _fresh_key(mount / "key", secret["defaultMode"])
    port = free_port()

    def simulated(value: str) -> str:  # the Service's name resolves to the controller: here 127.0.0.1
        return value.replace(service_address, f"{LOOPBACK}:{port}").replace(mount_path, str(mount))

    procs = []
    try:
        for index in range(workers["spec"]["completions"]):
            env = _base_env()
            for name, value in _env(worker).items():
                # the downward API gives RANK the pod's completion-index annotation
                env[name] = str(index) if value == {"fieldRef": {"fieldPath": ANNOTATION_INDEX}} else simulated(value)
            env["JOB_COMPLETION_INDEX"] = str(index)  # what the Job controller also sets
            command = [k8s_expand(w, env) for w in worker["command"] + worker.get("args", [])]
            assert command[command.index("--controller") + 1] == f"tcp://{LOOPBACK}:{port}"
            procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
        boss_env = _base_env()
        boss_env.update({name: simulated(value) for name, value in _env(_container(m["controller"])).items()})
        boss_env["DTORCH_LISTEN"] = f"tcp://{LOOPBACK}:{port}"  # the pod binds every interface; here loopback
        done = _run([sys.executable, "-c", CONTROLLER], boss_env)
        assert done.returncode == 0, done.stdout[-4000:]
        assert "controller check ok" in done.stdout
        assert reap(procs, 20.0) == [0] * len(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
