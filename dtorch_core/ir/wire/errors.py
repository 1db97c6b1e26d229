"""WireError, and the helpers that name a value in the encoder's and decoder's messages."""

from __future__ import annotations

import torch

from ...errors import DTorchError
from .codes import _CLASSES


class WireError(DTorchError):
    """A message could not be encoded (unsupported value) or decoded (malformed or foreign).

    A worker that gets one should report it and keep serving: the message is dropped whole.
    """


WireError.__module__ = "dtorch_core.ir.wire"  # its public home (as before the split into a package)


def _type_name(v) -> str:
    t = type(v)
    if t.__module__ == "builtins" or t in _CLASSES:
        return t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(v) -> str:
    if isinstance(v, torch.Tensor):  # a subclass's repr may read data (a DTensor would sync)
        return f"<{type(v).__name__} of {v.dtype}>"
    try:
        r = repr(v)
    except Exception:
        r = "<unrepresentable>"
    return r if len(r) <= 80 else r[:77] + "..."

