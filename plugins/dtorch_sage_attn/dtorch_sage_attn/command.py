"""``dtorch attention``: the selector's decisions on disk (list or clear), and the section that
``dtorch info`` shows for them."""

from __future__ import annotations

import argparse
import json

from dtorch_core.cli import InfoSection

from .cache import cache_dir, list_files


def cached_decisions() -> list[dict]:
    """One entry per cache file: its path, GPU, versions and decisions (None where corrupt)."""
    out = []
    for path, data in list_files():
        if data is None:
            out.append({"path": str(path), "corrupt": True})
            continue
        out.append({"path": str(path), "gpu": data.get("gpu"), "versions": data.get("versions", {}),
                    "decisions": data.get("decisions", {})})
    return out


def describe(files: list[dict]) -> list[str]:
    lines = [f"cache: {cache_dir()}"]
    if not files:
        lines.append("no decisions yet (the selector decides at the first attention call of each shape)")
    for f in files:
        if f.get("corrupt"):
            lines.append(f"{f['path']}: corrupt (ignored)")
            continue
        versions = ", ".join(f"{k} {v}" for k, v in sorted(f["versions"].items()))
        lines.append(f"{f['gpu']} ({versions}):")
        for key, d in sorted(f["decisions"].items()):
            lines.append(f"  {key}: {d.get('choice')} ({d.get('reason')})")
    return lines


class AttentionCommand:
    help = "list (or --clear) the attention kernel choices dtorch_sage_attn made and cached"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the decisions as JSON")
        parser.add_argument("--clear", action="store_true", help="delete the cache files (decide again)")

    def run(self, args: argparse.Namespace) -> int:
        if args.clear:
            for path, _ in list_files():
                path.unlink(missing_ok=True)
                path.with_suffix(".lock").unlink(missing_ok=True)
            print(f"cleared {cache_dir()}")
            return 0
        files = cached_decisions()
        print(json.dumps(files, indent=2, sort_keys=True) if args.json else "\n".join(describe(files)))
        return 0

    def info_section(self) -> InfoSection:
        files = cached_decisions()
        return InfoSection("attention kernels (dtorch_sage_attn)", tuple(describe(files)), {"files": files})
