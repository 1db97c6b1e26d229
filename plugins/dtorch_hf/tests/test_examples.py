"""The examples' ``--tiny`` commands, exactly as their docstrings give them, run as
subprocesses (all at once): each must exit 0 having checked itself against one device, and the
pipeline examples must write their PNG. Keeps the documented commands true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

PLUGIN = Path(__file__).resolve().parents[1]
EXAMPLES = ("sd3_generate.py", "flux_generate.py", "t5_generate.py")


def documented_tiny_commands() -> list[list[str]]:
    """``python examples/X.py --tiny ...`` lines of the examples' docstrings, as argv lists."""
    commands = []
    for name in EXAMPLES:
        text = (PLUGIN / "examples" / name).read_text()
        doc = text.split('"""')[1]
        for line in doc.splitlines():
            match = re.match(r"\s*python (examples/\S+\.py)( --tiny[^#]*)", line)
            if match:
                commands.append([sys.executable, str(PLUGIN / match.group(1)), *match.group(2).split()])
    return commands


def test_tiny_examples_run_and_match_one_device(tmp_path):
    commands = documented_tiny_commands()
    assert {Path(c[1]).name for c in commands} == set(EXAMPLES)
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}   # nothing may be downloaded
    runs = []
    for i, argv in enumerate(commands):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        runs.append((argv, cwd, subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True)))
    for argv, cwd, proc in runs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{' '.join(argv[1:])} failed:\n{out[-3000:]}"
        assert "equal to one device: True" in out, out[-3000:]
        name = Path(argv[1]).name
        if name != "t5_generate.py":
            png = cwd / f"{name.split('_')[0]}.png"
            with Image.open(png) as image:
                assert image.size == (24, 20) and image.format == "PNG"
