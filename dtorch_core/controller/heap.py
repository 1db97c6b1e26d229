"""The controller's Python heap and the cyclic garbage collector.

A controller allocates a few Python objects per op (the distributed tensor, its instruction)
that live until the batch that carries them is sent, so they outlive the young generations, and
CPython then runs full collections now and again. A full collection walks every object the
process holds: with torch imported about 180,000 (80 ms on this project's CPU machine), with
diffusers and transformers about 390,000 (230 ms), a pause in the middle of a step. Almost all
of those are the libraries' own objects, which live as long as the process.

So a session freezes the heap it starts with (``gc.freeze()``, after collecting the young
generations): what existed before ``dt.init`` is left out of every later collection, and is
still freed the usual way when nothing refers to it. Only an object from before ``dt.init`` that
becomes part of unreachable cycles during the session stays until ``dt.shutdown()``, which
unfreezes the heap. ``DTORCH_GC_FREEZE=0`` turns it off.

A worker process does the same once it is ready (:func:`freeze_worker`): it imported torch (and
the plugins) too, and lives only as long as its session, so its heap stays frozen to the end. Without
it, one CPU process worker running 30 small DiT training steps (``bench/model_steps.py``) made a
full collection over its ~200,000 objects and spent 135 ms collecting in all.
"""

from __future__ import annotations

import gc

from .settings import setting

_froze = False


def freeze_on_start() -> None:
    global _froze
    if _froze:
        return
    gc.collect(1)  # the young generations' garbage (cheap); the old one is left as it is
    gc.freeze()
    _froze = True


def freeze_worker() -> None:
    """A worker process's heap, frozen when it is ready (``DTORCH_GC_FREEZE=0``: left alone)."""
    if setting("gc_freeze", None, "DTORCH_GC_FREEZE", True, "flag"):
        freeze_on_start()


def unfreeze_on_end() -> None:
    global _froze
    if _froze:
        gc.unfreeze()
        _froze = False
