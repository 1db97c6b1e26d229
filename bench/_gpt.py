"""The GPT of examples/train_gpt.py for bench/train_gpt.py and its DTensor anchor: one model, one
data order, one optimizer, whatever runs it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "train_gpt.py")
_NAME = "dtorch_example_train_gpt"  # not "train_gpt": that is bench/train_gpt.py's own name


def load_example():
    """examples/train_gpt.py as a module (it is a script, not part of the package)."""
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    if REPO_ROOT not in sys.path:
        sys.path.insert(1, REPO_ROOT)  # run from a checkout without installing dtorch-core
    spec = importlib.util.spec_from_file_location(_NAME, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


# the model and data options, the same on every side (the anchor gets them forwarded)
MODEL_OPTIONS = {  # option: (type, default, help)
    "--batch": (int, 16, "sequences per step, the global batch (split over dp)"),
    "--seq-len": (int, 128, "tokens per sequence"),
    "--d-model": (int, 128, "model width"),
    "--heads": (int, 4, "attention heads"),
    "--layers": (int, 4, "transformer blocks"),
    "--lr": (float, 1e-3, "AdamW learning rate"),
    "--seed": (int, 0, "initial weights and data order"),
}


def add_model_options(parser: argparse.ArgumentParser) -> None:
    for flag, (kind, default, text) in MODEL_OPTIONS.items():
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")


def model_argv(args: argparse.Namespace) -> list[str]:
    """The model options of ``args`` as command-line arguments (for the anchor)."""
    out = []
    for flag in MODEL_OPTIONS:
        out += [flag, str(getattr(args, flag[2:].replace("-", "_")))]
    return out


def config(args: argparse.Namespace):
    return load_example().GPTConfig(seq_len=args.seq_len, d_model=args.d_model, heads=args.heads,
                                     layers=args.layers)
