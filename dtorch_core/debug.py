"""Debugging aids: count the communication a block of code issues (``dt.debug.comm_mode``).

    with dt.debug.comm_mode() as comm:
        loss = model(x).sum()
        loss.backward()
    comm.counts()            # {"all_reduce": 4, "all_gather": 2}
    comm.counts_by_op()      # {"aten.mm.default": {"all_gather": 2}, ...}
    comm.counts_by_module()  # {"Global": {...}, "MyModel.fc1": {...}}
    comm.bytes()             # {"all_reduce": 65536, ...}

Like torch DTensor's ``CommDebugMode``, but counted on the controller as the collectives are
planned (nothing waits for the workers). What is counted: every collective that moves data
between workers (all-gather, all-reduce, reduce-scatter, all-to-all) issued for an op's inputs,
an explicit ``redistribute``, a ``full_tensor`` of a Partial tensor, and ``dt.nn.data_parallel``'s
merged gradient all-reduce (one exchange, counted once). Local chunks and re-labelled placements
move nothing and are not counted. A replay of a ``dt.compile`` step counts the collectives its
recording issued (merged small all-reduces count as they were issued eagerly).
``bytes`` is the global size of the tensor each collective works on.
"""

from __future__ import annotations

import collections
import contextlib

import attrs
from torch.utils.module_tracker import ModuleTracker

from .controller.session import current_session
from .planner.emit import CommEvent

__all__ = ["CommCounts", "comm_mode"]


@attrs.define
class CommCounts:
    """The collectives recorded by one :func:`comm_mode` block (readable during and after it)."""

    events: list = attrs.field(factory=list)  # (CommEvent, modules it ran under)
    _tracker: ModuleTracker | None = None

    def record(self, event: CommEvent) -> None:
        modules = tuple(sorted(self._tracker.parents)) if self._tracker is not None else ("Global",)
        self.events.append((event, modules))

    def counts(self) -> dict[str, int]:
        """Collectives by kind."""
        return dict(collections.Counter(e.kind for e, _ in self.events))

    def total(self) -> int:
        """Every collective counted."""
        return len(self.events)

    def bytes(self) -> dict[str, int]:
        """Global bytes of the tensors the collectives worked on, by kind."""
        out: collections.Counter = collections.Counter()
        for e, _ in self.events:
            out[e.kind] += e.nbytes
        return dict(out)

    def counts_by_op(self) -> dict[str, dict[str, int]]:
        """Collectives by the op that needed them (``aten.mm.default``, ``redistribute``, ...)."""
        out: dict = collections.defaultdict(collections.Counter)
        for e, _ in self.events:
            out[e.op][e.kind] += 1
        return {op: dict(c) for op, c in out.items()}

    def counts_by_module(self) -> dict[str, dict[str, int]]:
        """Collectives by the ``nn.Module`` (fully qualified name) running when they were issued,
        forward or backward; a collective counts for every enclosing module and ``"Global"``."""
        out: dict = collections.defaultdict(collections.Counter)
        for e, modules in self.events:
            for m in modules:
                out[m][e.kind] += 1
        return {m: dict(c) for m, c in out.items()}


@contextlib.contextmanager
def comm_mode(*, track_modules: bool = True):
    """Count the collectives the block issues on the current session (see the module doc).

    ``track_modules=False`` skips the module hooks (``counts_by_module`` then has ``"Global"``
    only), for code where torch's module tracking is unwanted.
    """
    session = current_session()
    counts = CommCounts()
    tracker = ModuleTracker() if track_modules else None
    with tracker if tracker is not None else contextlib.nullcontext():
        counts._tracker = tracker
        session.comm_counters.append(counts)
        try:
            yield counts
        finally:
            session.comm_counters.remove(counts)
            counts._tracker = None
