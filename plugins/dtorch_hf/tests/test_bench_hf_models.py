"""bench/hf_models.py keeps working: its --tiny run on the CPU, as a subprocess (the script as a
user runs it), checked through its --json output; and an sp mode parallelize refuses fails it
with parallelize's reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("diffusers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "hf_models.py")


def _run(tmp_path, *args):
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, BENCH, "--tiny", "--device", "cpu", "--sizes", "cut", "--warmup", "4",
                           "--iters", "1", "--rounds", "1", "--json", str(out), *args],
                          check=False, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


# the GPU run's mesh, and tp x Ulysses sp over 4 workers (--cfg with a "cfg" dim was run by
# hand: a third subprocess would cost the suite another 15-20 s)
RUNS = {"tp1": ("--mesh", "tp=1"), "tp2xsp2": ("--mesh", "tp=2,sp=2")}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_tiny_run_times_every_side_and_matches_diffusers(tmp_path, run):
    proc, report = _run(tmp_path, *RUNS[run])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["failures"] == []
    labels = {"flux/cut", "sd3/cut"}
    assert set(report["results"]) == labels
    for label, case in report["results"].items():
        rows = case["rows"]
        assert set(rows) == {"diffusers", "eager", "replay"}, (label, rows)
        assert all(row["ms"] > 0 and row["steps"] == 1 for row in rows.values()), (label, rows)
        checks = case["checks"]
        assert checks["eager_shape_equal"] and checks["replay_shape_equal"], (label, checks)
        # --tiny copies the dtorch weights into the diffusers model and compares (fp32)
        assert checks["dtorch_vs_diffusers"] <= 1e-4, (label, checks)
        assert checks["replay_vs_eager"] <= 1e-4, (label, checks)
    assert "ratio = time / diffusers time" in proc.stdout
    assert all(label in proc.stdout for label in labels)


def test_a_refused_sp_mode_fails_the_run_with_the_reason(tmp_path):
    # --sp-mode goes to dtorch_hf.parallelize as it is (a mode no family serves: this stays
    # refused when ring attention lands)
    proc, report = _run(tmp_path, "--models", "flux", "--mesh", "sp=2", "--sp-mode", "zigzag")
    assert proc.returncode == 1
    assert "sp_mode='zigzag'" in proc.stdout
    assert report["failures"] and "dtorch_hf.parallelize" in report["failures"][0]
