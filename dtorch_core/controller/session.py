"""The controller session: ids, the instruction stream, batching, reads."""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import signal
import threading

import attrs
import structlog
import torch

from ..errors import CaptureError, NotInitializedError, WorkerError
from ..ir.instructions import (Call, DefineMesh, DefineProgram, Delete, DropProgram, Fetch, Put, RunProgram, Stats,
                               program_seed)
from ..ir.program import Program, Recording
from ..planner.emit import mark_consumed, note_comm
from ..planner.source import format_source, user_source

log = structlog.get_logger(__name__)

_session = None


def current_session() -> "Session":
    if _session is None:
        raise NotInitializedError("dtorch is not initialised; call dt.init(world_size=...) first")
    return _session


def set_session(session) -> None:
    global _session, _exit_hook
    _session = session
    if session is not None and not _exit_hook:
        # registered after the runners' own exit hooks (their modules are imported by then), so
        # it runs before them: workers stop while the interpreter is whole, never with worker
        # threads still inside torch when C++ static destructors run (that aborted with
        # "terminate called without an active exception")
        atexit.register(_close_at_exit)
        _exit_hook = True
    if session is not None:
        _guard_interrupts()


_exit_hook = False


# -- Ctrl-C: never lost in a finalizer -----------------------------------------------------------
# Every DTensor handle frees its id from ``__del__``. A KeyboardInterrupt that lands while a
# finalizer runs is printed as "Exception ignored in ... __del__" and dropped, so the program
# went on (a controller that ignored Ctrl-C once). While a session runs, SIGINT (if it still has
# Python's default handler) is delivered again just after the finalizer instead.
def _guard_interrupts() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_interrupt)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        pass


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _on_interrupt(signum, frame):
    if _in_finalizer(frame):
        main = threading.main_thread().ident
        threading.Timer(0.01, signal.pthread_kill, (main, signal.SIGINT)).start()
        return
    signal.default_int_handler(signum, frame)


def _close_at_exit() -> None:
    session = _session
    if session is None:
        return
    try:
        session.close()
    except BaseException as exc:  # noqa: BLE001 - exiting anyway; say why the workers were not stopped cleanly
        log.warning("could not stop the workers at exit", error=repr(exc))


@attrs.frozen
class FlushPolicy:
    """When the session hands batches to the runner (a runner's ``flush_policy`` attribute)."""

    batch_size: int = 256  # flush as soon as this many instructions wait
    interval: float = 0.002  # timer period (s); 0: only size and sync points flush
    when_idle: bool = False  # timer flushes only after a tick with no new instruction
    # after a sync point the workers are idle: the first batch leaves at this size and each next
    # one at ``growth`` times the last, up to batch_size (0: batch_size from the start)
    first_batch: int = 0
    growth: int = 8


class Session:
    """Owns the runner and everything the controller tracks between ops."""

    def __init__(self, runner, *, ops, kernels, strict=False, track_source=True, timeout=300.0):
        """``ops``/``kernels``: the registries the plugins filled (resolved once, by ``dt.init``)."""
        self.runner = runner
        self.world_size = runner.world_size
        self.ops = ops
        self.kernels = kernels
        self.strict = strict
        self.track_source = track_source and os.environ.get("DTORCH_TRACK_SOURCE", "1") != "0"
        # How batches leave: a runner whose workers share the controller's GIL (thread) flushes
        # when the controller pauses or the backlog is large, so workers and controller do not
        # trade the GIL op by op; other runners flush small batches on a short timer.
        policy = getattr(runner, "flush_policy", FlushPolicy())
        self.batch_size = policy.batch_size
        self.first_batch = policy.first_batch or policy.batch_size
        self._flush_at = self.first_batch
        self.flush_growth = policy.growth
        self.flush_when_idle = policy.when_idle
        # the workers' "taken everything and the device ran dry" flags (runners/process.py):
        # while one is up, what is pending goes at once (the native hot path reads the words)
        self._hungry_words: tuple = getattr(runner, "hunger_words", tuple)()
        flush_interval = policy.interval
        self.timeout = timeout
        self.plans: dict = {}
        self.plan_names: dict = {}  # plan id -> DefinePlan, for messages about captured steps
        self.pure_plans: set = set()  # plan ids whose calls write only their fresh outputs
        # program id -> the plan ids its Calls run: the bounded plan cache never drops them
        # while the program lives (planner/cache.py)
        self.program_plans: dict = {}
        self.collective_hints = getattr(runner, "collective_hints", False)
        self.view_writes = 0  # in-place writes through views so far (they invalidate moved copies)
        self.consumable = 0  # collectives emitted since the last flush whose source may die first
        self.fallback_counts: collections.Counter = collections.Counter()
        self.comm_counters: list = []  # objects with record(CommEvent): dt.debug.comm_mode, recordings
        self.closed = False
        self._recording: Recording | None = None
        self._recorders = None  # while recording: (recording methods, shadowed ones, comm recorder)
        self._tid = 0
        self._plan = 0
        self._program = 0
        self._request = 0
        self._meshes: dict = {}
        self._pending: collections.deque = collections.deque()
        self._releases: collections.deque = collections.deque()
        self._lock = threading.RLock()
        self._seed = 0
        self._seed_counter = 0
        self._flusher = None
        if flush_interval and runner.name != "inline":
            self._stop = threading.Event()
            self._flusher = threading.Thread(
                target=self._flush_loop, args=(flush_interval,), name="dtorch-flush", daemon=True
            )
            self._flusher.start()

    # -- ids ------------------------------------------------------------------------------
    def new_tid(self) -> int:
        self._tid += 1
        return self._tid

    def new_plan_id(self) -> int:
        self._plan += 1
        return self._plan

    def define_plan(self, define, *, pure: bool) -> None:
        """Send a plan definition; ``pure`` plans may be dropped from captured steps when unused."""
        self.plan_names[define.plan_id] = define
        if pure:
            self.pure_plans.add(define.plan_id)
        self.emit(define)

    @property
    def root_meshes(self) -> tuple:
        """The root meshes defined in this session so far, in order."""
        return tuple(self._meshes)

    def mesh_id(self, mesh) -> int:
        mid = self._meshes.get(mesh)
        if mid is None:
            mid = self.define_mesh(mesh)
        return mid

    def define_mesh(self, mesh) -> int:
        mesh = mesh.root
        mid = self._meshes.get(mesh)
        if mid is None:
            mid = self._meshes[mesh] = len(self._meshes) + 1
            self.emit(DefineMesh(mid, mesh.shape, mesh.ranks))
        return mid

    def kernel_is_seeded(self, name: str) -> bool:
        return self.kernels.is_seeded(name)

    # -- random ---------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._seed = int(seed)
        self._seed_counter = 0

    def next_seed(self) -> int:
        self._seed_counter += 1
        return program_seed(self._seed, self._seed_counter)

    # -- stream ---------------------------------------------------------------------------
    # ``_pending`` and ``_releases`` are deques: append and popleft are atomic, so the hot path
    # takes no lock and a concurrent flush (the timer thread) never loses an entry.
    def emit(self, ins) -> None:
        self._pending.append(ins)
        if len(self._pending) >= self._flush_at or (self._hungry_words and self.runner.any_hungry()):
            self.flush()

    def release(self, tid: int) -> None:
        self._releases.append(tid)

    def release_many(self, tids) -> None:
        self._releases.extend(tids)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    @staticmethod
    def _drain(queue) -> list:
        # the entries there now, oldest first, popped one by one in C (no Python loop): others
        # only append meanwhile, and only a flush (under the lock) takes entries out
        return list(map(collections.deque.popleft, itertools.repeat(queue, len(queue))))

    def _flush_locked(self, then=None) -> None:
        # ``then``: one more instruction after everything pending (a request), in the same batch
        if self.closed:
            self._pending.clear()
            self._releases.clear()
            return
        # releases first: every use of a released id was emitted before its release, so it is
        # in the pending instructions drained next, ahead of the Delete
        freed = self._drain(self._releases)
        batch = self._drain(self._pending)
        if self.consumable:
            self.consumable = 0
            if freed:
                batch = mark_consumed(batch, freed)  # sources freed before they left: reused in place
        if freed:
            batch.append(Delete(tuple(freed)))
        if then is not None:
            batch.append(then)
        if batch:
            self.runner.submit(batch)
            self._flush_at = min(self._flush_at * self.flush_growth, self.batch_size)

    def _flush_loop(self, interval: float) -> None:
        seen = -1
        while not self._stop.wait(interval):
            waiting = len(self._pending)
            if not waiting and len(self._releases) <= 64:
                continue
            if self.flush_when_idle and waiting != seen:
                seen = waiting  # the controller is still issuing: wait for a quiet tick
                continue
            seen = -1
            try:
                self.flush()
            except Exception as exc:  # reported at the next sync point by the runner
                log.warning("background flush failed", error=repr(exc))

    # -- recording and programs (dt.compile, dt.capture) ---------------------------------
    @contextlib.contextmanager
    def recording(self):
        """Record what this session emits and frees while the block runs; value reads are noted
        (their user source lines, in ``Recording.reads``) and so are collectives (``.comm``).

        The methods are shadowed on the instance for the duration, so the eager hot path pays
        nothing for recording support when none is running.
        """
        if self._recording is not None:
            raise CaptureError("a capture is already running; captures do not nest")
        rec = Recording(self._tid, self._seed, self._seed_counter)
        emit, release, release_many, request = self.emit, self.release, self.release_many, self.request

        def rec_emit(ins):
            # a Put's data becomes the program's constant, but in-process workers store the very
            # tensors sent and the step may write into them: the recording keeps its own copy
            rec.instructions.append(ins if type(ins) is not Put else _copied_put(ins))
            emit(ins)

        def rec_release(tid):
            rec.released.append(tid)
            release(tid)

        def rec_release_many(tids):
            rec.released.extend(tids)
            release_many(tids)

        def rec_request(make, count):
            rec.reads.append(user_source(2))
            return request(make, count)

        recorder = _CommRecorder(rec.comm)
        shadowed = {name: vars(self).get(name) for name in ("emit", "release", "release_many", "request")}
        recording = {"emit": rec_emit, "release": rec_release, "release_many": rec_release_many, "request": rec_request}
        self._recorders = (recording, shadowed, recorder)
        self._start_recording(rec)
        try:
            yield rec
        finally:
            self._stop_recording()
            self._recorders = None
            rec.seeds_drawn = self._seed_counter - rec.seed_counter

    def _start_recording(self, rec) -> None:
        recording, _, recorder = self._recorders
        for name, method in recording.items():
            setattr(self, name, method)
        self._recording = rec
        self.comm_counters.append(recorder)

    def _stop_recording(self) -> None:
        _, shadowed, recorder = self._recorders
        self._recording = None
        self.comm_counters.remove(recorder)
        for name, previous in shadowed.items():
            if previous is None:
                vars(self).pop(name, None)
            else:
                setattr(self, name, previous)

    @property
    def is_recording(self) -> bool:
        """True while a capture (``dt.compile``, ``dt.capture``) records what this session emits."""
        return self._recording is not None

    @contextlib.contextmanager
    def unrecorded(self):
        """Emit the block's work eagerly, outside the running recording (if any).

        What the block makes is state that exists before the captured step (a replay reads and
        updates it, never makes it again): its ids go to ``Recording.outside``.
        """
        rec = self._recording
        if rec is None:
            yield
            return
        first = self._tid
        self._stop_recording()
        try:
            yield
        finally:
            rec.outside.update(range(first + 1, self._tid + 1))
            self._start_recording(rec)

    def define_program(self, program: Program) -> int:
        """Send ``program`` to the workers; its id for :meth:`run_program`."""
        self._program += 1
        self.program_plans[self._program] = frozenset(ins.plan_id for ins in program.instructions if type(ins) is Call)
        self.emit(DefineProgram(self._program, program.instructions, program.inputs, program.outputs,
                                program.fusable, program.constants))
        return self._program

    def run_program(self, program_id: int, program: Program, inputs: tuple, outputs: tuple) -> None:
        """Replay a defined program on ``inputs`` (tensor ids) into fresh ``outputs`` ids, with the
        seeds an eager run would draw now, and start the workers on it at once."""
        self.emit(RunProgram(program_id, inputs, outputs, self._seed, self._seed_counter))
        self._seed_counter += program.seeds
        for event in program.comm:
            note_comm(self, event)
        self.flush()  # a whole step: the workers should start now, not at the next timer tick

    def drop_program(self, program_id: int) -> None:
        """Free a defined program (its constants too) on the workers (nothing to do once the
        session has ended). Safe from a finalizer: it only queues the instruction (an atomic
        append, as ``release`` does), which goes with the next batch."""
        if not self.closed:
            self._pending.append(DropProgram(program_id))
            self.program_plans.pop(program_id, None)

    # -- reads ----------------------------------------------------------------------------
    def put(self, shards: dict, mesh) -> int:
        tid = self.new_tid()
        self.emit(Put(tid, self.mesh_id(mesh), shards))
        return tid

    def put_replicated(self, tensor: torch.Tensor, mesh) -> int:
        value = tensor.detach().clone()
        return self.put({r: value for r in mesh.root.ranks}, mesh)

    def request(self, make, count: int) -> list:
        """Emit ``make(request_id)``, flush, and wait for ``count`` replies."""
        with self._lock:
            self._request += 1
            rid = self._request
            # everything issued before the read, frees included, goes first: in the same batch
            self._flush_locked(make(rid))
        replies = self.runner.wait_replies(rid, count, self.timeout)
        self._flush_at = self.first_batch
        return replies

    def fetch(self, tid: int, ranks) -> dict:
        """Local tensors of ``tid`` on ``ranks``; raises WorkerError if any of them failed."""
        ranks = tuple(ranks)
        # where a failure on one rank can leave its peers with wrong values (collectives without
        # headers, comm/dist.py) every rank answers, so that failure is never missed
        everyone = self.collective_hints
        count = self.world_size if everyone else len(ranks)
        replies = self.request(lambda rid: Fetch(tid, rid, ranks, everyone), count)
        _raise_first_error(replies)
        return {r.rank: r.value for r in sorted(replies, key=lambda r: r.rank) if r.rank in ranks}

    def synchronize(self) -> None:
        """Wait until every worker has run everything issued so far."""
        _raise_first_error(self.request(lambda rid: Stats(rid, memory=False), self.world_size))

    def memory_stats(self) -> list[dict]:
        replies = self.request(lambda rid: Stats(rid), self.world_size)
        _raise_first_error(replies)
        return [r.value for r in sorted(replies, key=lambda r: r.rank)]

    # -- fallback bookkeeping -------------------------------------------------------------
    def count_fallback(self, name: str) -> bool:
        """Count one replicated run of op ``name``; True the first time (time to warn the user)."""
        self.fallback_counts[name] += 1
        return self.fallback_counts[name] == 1

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        except Exception as exc:  # lost workers: shutting down must still succeed
            log.warning("could not flush at shutdown", error=str(exc))
        finally:
            self.closed = True
            self._hungry_words = ()  # the words live in the channels the runner unmaps
            if self._flusher is not None:
                self._stop.set()
                self._flusher.join(timeout=5)
            self.runner.shutdown()


def _copied_put(put: Put) -> Put:
    """``put`` with copies of its shards (ranks sharing one tensor share its copy)."""
    copies: dict = {}
    shards = {}
    for rank, shard in put.shards.items():
        if id(shard) not in copies:
            copies[id(shard)] = shard.clone() if isinstance(shard, torch.Tensor) else shard
        shards[rank] = copies[id(shard)]
    return Put(put.tid, put.mesh_id, shards)


@attrs.frozen
class _CommRecorder:
    """Keeps the collectives a recording issued, for its program's replays to report."""

    events: list

    def record(self, event) -> None:
        self.events.append(event)


def _raise_first_error(replies) -> None:
    for reply in sorted(replies, key=lambda r: r.rank):
        if reply.error is not None:
            f = reply.error
            where = f" issued at {format_source(f.source)}" if f.source else ""
            raise WorkerError(f"{f.op} failed on rank {f.rank}{where}: {f.message}", rank=f.rank, op=f.op,
                              source=format_source(f.source))
