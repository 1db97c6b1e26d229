"""Typed readers for the fields of ``index.json``: a checkpoint directory may come from anyone,
so every field is checked for its JSON type before it is used, and a wrong one raises a
CheckpointCorruptError naming where in the index it is (never a KeyError or TypeError).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointCorruptError

MAX_NDIM = 64  # more dims than torch supports: a damaged or hostile index


def damaged(what: str, problem: str, entry: str | None = None) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"the checkpoint index is damaged: {what} {problem}; the checkpoint cannot be trusted, load "
        "another one (or save it again from the model)", entry=entry,
    )


def field(d: Any, name: str, what: str, entry: str | None = None) -> Any:
    """``d[name]``, where ``d`` must be a JSON object that has it."""
    if not isinstance(d, dict):
        raise damaged(what, f"is a {type(d).__name__}, not an object", entry)
    if name not in d:
        raise damaged(what, f"has no {name!r}", entry)
    return d[name]


def obj(v: Any, what: str, entry: str | None = None) -> dict:
    if not isinstance(v, dict):
        raise damaged(what, f"is a {type(v).__name__}, not an object", entry)
    return v


def seq(v: Any, what: str, entry: str | None = None) -> list:
    if not isinstance(v, list):
        raise damaged(what, f"is a {type(v).__name__}, not a list", entry)
    return v


def text(v: Any, what: str, entry: str | None = None) -> str:
    if not isinstance(v, str):
        raise damaged(what, f"is a {type(v).__name__}, not a string", entry)
    return v


def boolean(v: Any, what: str, entry: str | None = None) -> bool:
    if not isinstance(v, bool):
        raise damaged(what, f"is a {type(v).__name__}, not true/false", entry)
    return v


def integer(v: Any, what: str, entry: str | None = None, *, minimum: int | None = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise damaged(what, f"is {v!r}, not an integer", entry)
    if minimum is not None and v < minimum:
        raise damaged(what, f"is {v}, below {minimum}", entry)
    return v


def integers(v: Any, what: str, entry: str | None = None, *, minimum: int | None = 0) -> tuple:
    items = seq(v, what, entry)
    if len(items) > MAX_NDIM:
        raise damaged(what, f"has {len(items)} dims (at most {MAX_NDIM})", entry)
    return tuple(integer(n, f"{what}[{i}]", entry, minimum=minimum) for i, n in enumerate(items))


def optional(v: Any, read, what: str, entry: str | None = None):
    return None if v is None else read(v, what, entry)


def texts(v: Any, what: str, entry: str | None = None) -> tuple:
    return tuple(text(s, f"{what}[{i}]", entry) for i, s in enumerate(seq(v, what, entry)))


DATA_SUFFIX = ".safetensors"


def file_name(v: Any, what: str) -> str:
    """A data file's name: one plain path component ending in ``.safetensors``, so it can only
    name a file directly inside the checkpoint directory (no ``..``, no absolute path)."""
    name = text(v, what, None)
    if ("/" in name or "\\" in name or "\x00" in name or name in ("", ".", "..")
            or not name.endswith(DATA_SUFFIX) or name.startswith(".")):
        raise CheckpointCorruptError(
            f"the checkpoint index names data file {name!r} ({what}), which is not a plain "
            f"'*{DATA_SUFFIX}' file name inside the checkpoint directory; refusing to read outside "
            "it: the checkpoint is damaged or hostile, load another one", entry=name,
        )
    return name
