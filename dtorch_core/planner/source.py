"""Where in the user's code an op was issued: the innermost frame outside dtorch and torch."""

from __future__ import annotations

import os
import sys

import torch

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dtorch_core/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_internal_code: dict = {}  # code object -> whether it belongs to dtorch, torch or generated code


def user_source(depth: int = 1) -> tuple[str, int] | None:
    """(file, line) of the innermost frame outside dtorch and torch, starting ``depth`` frames up
    (dtorch's own frames are skipped wherever they are: how many lie between the user's call and
    the planner depends on the path, e.g. the native hot path has no ``__torch_dispatch__`` frame)."""
    f = sys._getframe(depth)
    internal = _internal_code
    while f is not None:
        code = f.f_code
        flag = internal.get(code)
        if flag is None:
            name = code.co_filename
            flag = internal[code] = name.startswith(_PKG_DIR) or name.startswith(_TORCH_DIR) or name.startswith("<")
        if not flag:
            return (code.co_filename, f.f_lineno)
        f = f.f_back
    return None


def format_source(source) -> str | None:
    if source is None:
        return None
    if isinstance(source, tuple):
        return f"{source[0]}:{source[1]}"
    return str(source)
