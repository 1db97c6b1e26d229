"""Walking the nested arguments and results of an op: lists, tuples, dicts of tensors."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from ..errors import OpError


def map_structure(x, fn):
    """Apply ``fn`` to every tensor in nested lists/tuples/dicts (dict values) of ``x``."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) is tuple or type(x) is list:
        return type(x)(map_structure(a, fn) for a in x)
    if type(x) is dict:
        return {k: map_structure(v, fn) for k, v in x.items()}
    return x


def substitute(args, kwargs, fn):
    """``args``/``kwargs`` with the i-th tensor (in flattening order) replaced by ``fn(i)``."""
    counter = [0]
    new_args = _replace_tensors(tuple(args), fn, counter)
    new_kwargs = {k: _replace_tensors(v, fn, counter) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _replace_tensors(x, fn, counter):
    if isinstance(x, torch.Tensor):
        i = counter[0]
        counter[0] += 1
        return fn(i)
    if type(x) is tuple or type(x) is list:
        return type(x)(_replace_tensors(a, fn, counter) for a in x)
    return x


def count_tensors(v) -> int:
    if isinstance(v, torch.Tensor):
        return 1
    if type(v) in (list, tuple):
        return sum(count_tensors(a) for a in v)
    return 0


def first_output(flat: list):
    """The rebuild of a single-tensor output (the native hot path knows it by identity)."""
    return flat[0]


@attrs.frozen
class Rebuild:
    """The rebuild of a tuple or list of outputs (tensors, None, and sizes the controller knows):
    ``sizes`` holds (index, value) of the sizes, whose flat entries are None. The native hot path
    reads ``kind`` and ``sizes`` to build the same structure in C."""

    kind: type  # tuple or list
    sizes: tuple = ()

    def __call__(self, outs):
        if self.sizes:
            outs = list(outs)
            for k, v in self.sizes:
                outs[k] = v
        return self.kind(outs)


def flatten_outputs(out) -> tuple[list, Callable]:
    """Flat list of output tensors (None kept) and a function that rebuilds the structure."""
    if isinstance(out, torch.Tensor):
        return [out], first_output
    if out is None:
        return [], lambda flat: None
    if type(out) in (tuple, list):
        kind = type(out)
        flat, sizes = [], {}
        for k, o in enumerate(out):
            if o is None or isinstance(o, torch.Tensor):
                flat.append(o)
            elif isinstance(o, (int, torch.SymInt)) and not isinstance(o, bool):
                # sizes (flash attention's max_q/max_k): the controller knows them from the
                # global shapes, the workers' values are not needed
                sizes[k] = o
                flat.append(None)
            else:
                raise OpError(f"output {o!r} is not a tensor")
        return flat, Rebuild(kind, tuple(sizes.items()))
    raise OpError(f"op returned {type(out).__name__}, which dtorch cannot distribute")


def same_arguments(a, b) -> bool:
    """Whether two ranks' arguments are the same, so one copy can serve both.

    Compared structurally: containers element by element, tensors by identity (``==`` on tensors
    is elementwise, ``repr`` truncates large ones), everything else by type and ``==``.
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is tuple or type(a) is list:
        return len(a) == len(b) and all(same_arguments(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same_arguments(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return False
    return bool(a == b)
