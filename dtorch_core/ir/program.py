"""Programs: a recorded step turned into an instruction list that workers replay.

A ``Recording`` holds what the controller emitted while a step ran eagerly. ``build_program``
names the step's explicit inputs and outputs with ids of their own (so each replay binds new
ones), numbers its seeded calls (so each replay draws fresh, reproducible random numbers),
checks that the step can run again from its own results, and optimises it once:

- dead-instruction elimination: side-effect-free work whose results nothing uses is dropped;
- merging of small all-reduces: all-reduces along the same mesh dim that can be moved to one
  point without crossing a use of their result or a write to their input become one exchange;
- freeing at last use: a temporary is deleted right after the last instruction that touches it,
  instead of when the controller's handle happened to die (lower peak memory than eager);
- constants: tensors the step sent from the controller (``Put``) hold the capture's values on
  every replay (a replay does not run the Python that made them), so they go to the workers once,
  with the program, and a ``Constant`` step names each; the body holds no ``Put``;
- with ``fusable_plan``, marking the calls workers may fuse into compiled segments (the workers
  choose the segments, see ``worker.fused``).

Everything else the step touches is *state*: tensors made before the step (parameters,
optimizer state) are read and written in place under their own ids, and tensors the step makes
and keeps (``.grad``) are rewritten under the same ids on every replay, as with CUDA graphs.
"""

from __future__ import annotations

import attrs

from ..errors import CaptureError
from .instructions import (
    COMMUNICATING_KINDS,
    VIRTUAL_BASE,
    Call,
    Collective,
    Constant,
    Delete,
    MergedAllReduce,
    Put,
    merge_hints,
    program_seed,
)

_OUTPUT_BASE = VIRTUAL_BASE + (1 << 40)
_BODY_TYPES = (Call, Collective, MergedAllReduce, Put, Delete)


@attrs.define
class Recording:
    """What the controller emitted and released while a step ran (see ``dtorch_core.capture``)."""

    first_tid: int  # ids above this one were made during the recording
    seed: int
    seed_counter: int
    instructions: list = attrs.field(factory=list)
    released: list = attrs.field(factory=list)
    reads: list = attrs.field(factory=list)  # user source lines of value reads
    comm: list = attrs.field(factory=list)  # CommEvents issued (what a replay reports to comm counters)
    seeds_drawn: int = 0
    # ids made while the recording ran but outside it (Session.unrecorded): state, like older ids
    outside: set = attrs.field(factory=set)


@attrs.frozen
class _Made:
    """Which tensor ids the recorded step made: those above ``first_tid`` but for ``outside``."""

    first_tid: int
    outside: frozenset

    def __contains__(self, tid) -> bool:
        return self.first_tid < tid < VIRTUAL_BASE and tid not in self.outside

    def state(self, tid) -> bool:
        """Made before the step (or outside it): read and written in place under its own id."""
        return tid <= self.first_tid or tid in self.outside


@attrs.frozen
class Program:
    """A step ready to define on the workers, plus what comparing two recordings needs."""

    instructions: tuple
    inputs: tuple  # the program's ids for the explicit inputs
    outputs: tuple  # per explicit output: the program's id for it
    seeds: int  # seeded ops per replay (the controller's seed counter advances by this)
    signature: tuple  # the recording with ids named by role, for ``check_same``
    recorded: int  # instructions recorded
    eliminated: int  # instructions dead-code elimination removed
    merged: int  # all-reduces merged into others
    fusable: tuple = ()  # positions of the calls workers may run inside fused segments
    comm: tuple = ()  # CommEvents the recording issued, reported again by every replay
    constants: tuple = ()  # the Puts the step recorded, named in the body by Constant steps


def reads_of(ins) -> tuple:
    t = type(ins)
    if t is Call:
        return ins.inputs
    if t is Collective:
        return (ins.src,)
    if t is MergedAllReduce:
        return ins.srcs
    return ()


def writes_of(ins) -> tuple:
    t = type(ins)
    if t is Call:
        return tuple(o for o in ins.outputs if o >= 0)
    if t is Collective:
        return (ins.dst,)
    if t is Put or t is Constant:
        return (ins.tid,)
    if t is MergedAllReduce:
        return ins.dsts
    return ()


def rename(ins, ids: dict):
    """``ins`` with every tensor id looked up in ``ids`` (ids not in it are kept)."""
    get = ids.get
    t = type(ins)
    if t is Call:
        return attrs.evolve(ins, inputs=tuple(get(i, i) for i in ins.inputs),
                            outputs=tuple(get(o, o) for o in ins.outputs))
    if t is Collective:
        return attrs.evolve(ins, src=get(ins.src, ins.src), dst=get(ins.dst, ins.dst))
    if t is Put:
        return attrs.evolve(ins, tid=get(ins.tid, ins.tid))
    if t is Delete:
        return Delete(tuple(get(i, i) for i in ins.tids))
    if t is MergedAllReduce:
        return attrs.evolve(ins, srcs=tuple(get(i, i) for i in ins.srcs), dsts=tuple(get(o, o) for o in ins.dsts))
    return ins


def build_program(rec: Recording, input_tids, output_tids, pure_plans, describe, *, merge: bool = True,
                  fusable_plan=None) -> Program:
    """Turn ``rec`` into a Program whose inputs are ``input_tids`` and outputs ``output_tids``.

    ``pure_plans``: plan ids whose calls write nothing but their fresh outputs (safe to drop when
    unused). ``describe(ins)`` names an instruction for error messages. ``fusable_plan(plan_id)``
    (None: fuse nothing) says whether a plan's unseeded calls may run inside a fused segment.
    """
    body = [ins for ins in rec.instructions if type(ins) in _BODY_TYPES]
    made = _Made(rec.first_tid, frozenset(rec.outside))
    released = set(rec.released)

    ids: dict = {}
    for k, tid in enumerate(input_tids):
        ids.setdefault(tid, VIRTUAL_BASE + k)
    outputs = []
    for k, tid in enumerate(output_tids):
        if tid in ids:
            outputs.append(ids[tid])  # an input (or an output listed twice) returned as is
        elif tid in made:
            ids[tid] = _OUTPUT_BASE + k
            outputs.append(ids[tid])
        else:
            outputs.append(tid)  # state returned as is
    body = [rename(ins, ids) for ins in body]

    body, seeds = _number_seeds(body, rec)
    _check_rerunnable(body, made, released, set(ids.values()), describe)
    signature = _signature(body, made)
    kept = _eliminate_dead(body, made, released, set(outputs), pure_plans)
    merged = _merge_all_reduces(kept, pure_plans) if merge else kept
    freed = _free_at_last_use(merged, made, released, set(outputs))
    final, constants = _constants(freed, made, released, set(outputs), pure_plans)
    fusable = () if fusable_plan is None else tuple(
        i for i, ins in enumerate(final) if type(ins) is Call and ins.seed is None and fusable_plan(ins.plan_id))
    return Program(tuple(final), tuple(VIRTUAL_BASE + k for k in range(len(input_tids))), tuple(outputs),
                   seeds, signature, len(body), len(body) - len(kept), len(kept) - len(merged), fusable,
                   tuple(rec.comm), constants)


def _number_seeds(body, rec):
    out = []
    k = 0
    for ins in body:
        if type(ins) is Call and ins.seed is not None:
            if ins.seed != program_seed(rec.seed, rec.seed_counter + k + 1):
                raise CaptureError(
                    "a random op drew its seed out of order during capture (dt.manual_seed called inside "
                    "the captured function?); seed outside the function"
                )
            ins = attrs.evolve(ins, seed=k)
            k += 1
        out.append(ins)
    if k != rec.seeds_drawn:
        raise CaptureError(f"{rec.seeds_drawn} random seeds were drawn during capture but {k} random ops ran; "
                           "a replay could not reproduce them")
    return out, k


def _check_rerunnable(body, made, released, own_ids, describe) -> None:
    """A replay reads what the step read: state it read must outlive the step."""
    for ins in body:
        for tid in reads_of(ins):
            if made.state(tid) and tid not in own_ids and tid in released:
                raise CaptureError(
                    f"the captured step reads a tensor made before it and then frees it ({describe(ins)}); "
                    "a replay would find it gone. This happens when the step replaces state instead of "
                    "updating it in place (e.g. `p = p - lr * g` instead of `p.sub_(lr * g)`)"
                )


def _signature(body, made) -> tuple:
    """The body with ids named by role: input k, k-th made tensor, or the state's own id."""
    order: dict = {}
    sig = []

    def name(tid):
        if tid >= VIRTUAL_BASE:
            return ("io", tid)
        if tid in made:
            return ("made", order.setdefault(tid, len(order)))
        return ("state", tid)

    for ins in body:
        t = type(ins)
        if t is Delete:
            continue
        if t is Call:
            sig.append(("call", ins.plan_id, tuple(name(i) for i in ins.inputs),
                        tuple(-1 if o < 0 else name(o) for o in ins.outputs), ins.source, ins.seed, ins.numbers))
        elif t is Collective:
            sig.append(("collective", ins.kind, ins.mesh_id, ins.mesh_dim, name(ins.src), name(ins.dst),
                        ins.dim, ins.reduce_op, ins.dim2, ins.offset))
        elif t is MergedAllReduce:
            sig.append(("merged", ins.mesh_id, ins.mesh_dim, ins.reduce_op, tuple(name(i) for i in ins.srcs),
                        tuple(name(o) for o in ins.dsts)))
        else:
            sig.append(("put", name(ins.tid), ins.mesh_id, _PutValue(ins.shards)))
    return tuple(sig)


@attrs.frozen(eq=False)
class _PutValue:
    """Constant tensors a step sent from the controller; equal when every shard's values are."""

    shards: dict

    def __eq__(self, other):
        import torch

        if type(other) is not _PutValue or self.shards.keys() != other.shards.keys():
            return False
        for rank, a in self.shards.items():
            b = other.shards[rank]
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                return False
        return True

    def __hash__(self):
        return hash(tuple(self.shards))


def _eliminate_dead(body, made, released, outputs, pure_plans) -> list:
    """Drop pure work whose results are neither used later, kept, nor returned."""

    def temporary(tid):
        return tid in made and tid in released

    needed = set(outputs)
    for ins in body:
        needed.update(tid for tid in writes_of(ins) if not temporary(tid))  # state, inputs, kept tensors
    kept = []
    for ins in reversed(body):
        t = type(ins)
        if t is not Delete:
            pure = t is not Call or ins.plan_id in pure_plans
            if pure and not any(w in needed for w in writes_of(ins)):
                continue
            needed.update(reads_of(ins))
        kept.append(ins)
    kept.reverse()
    return kept


def _alias_classes(body, pure_plans) -> dict:
    """tensor id -> a representative of the ids that may share its memory.

    Conservative: an impure call (in place, or returning a view) joins all its inputs and
    outputs; alias and local_chunk steps join source and destination.
    """
    parent: dict = {}

    def find(x):
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while x != root:
            parent[x], x = root, parent.get(x, x)
        return root

    def join(ids):
        ids = [find(i) for i in ids if i >= 0]
        for other in ids[1:]:
            parent[other] = ids[0]

    for ins in body:
        t = type(ins)
        if t is Call and ins.plan_id not in pure_plans:
            join(tuple(ins.inputs) + tuple(ins.outputs))
        elif t is Collective and ins.kind in ("alias", "local_chunk"):
            join((ins.src, ins.dst))
    return {tid: find(tid) for tid in list(parent)}


def _merge_all_reduces(body, pure_plans) -> list:
    """Merge all-reduces along one mesh dim that can all run at one point of the program.

    Each all-reduce may move back to just after the last instruction that makes or writes
    (memory shared with) its input, and forward to just before the first instruction that reads
    its result or writes its input. Groups are chosen greedily by the earliest latest point.
    """
    classes = _alias_classes(body, pure_plans)

    def cls(tid):
        return classes.get(tid, tid)

    def written(ins) -> set:
        if type(ins) is Call and ins.plan_id not in pure_plans:
            return {cls(t) for t in ins.inputs} | {cls(t) for t in ins.outputs if t >= 0}
        return {cls(t) for t in writes_of(ins)}

    writes = [written(ins) for ins in body]
    reads = [{cls(t) for t in reads_of(ins)} for ins in body]
    spans = []
    for j, ins in enumerate(body):
        if type(ins) is not Collective or ins.kind != "all_reduce":
            continue
        src, dst = cls(ins.src), cls(ins.dst)
        early = j
        while early > 0 and type(body[early - 1]) is not Delete and src not in writes[early - 1]:
            early -= 1
        late = j + 1
        while late < len(body) and type(body[late]) is not Delete and src not in writes[late] \
                and dst not in reads[late]:
            late += 1
        spans.append((late, early, j))
    if len(spans) < 2:
        return body
    placed: dict = {}  # slot (before body[slot]) -> groups of body indices
    grouped: set = set()
    for late, _, j in sorted(spans):
        if j in grouped:
            continue
        ins = body[j]
        group = [j]
        dsts = {ins.dst}
        for late2, early2, k in sorted(spans):
            other = body[k]
            if k in grouped or k == j or not (early2 <= late <= late2):
                continue
            if (other.mesh_id, other.mesh_dim, other.reduce_op) != (ins.mesh_id, ins.mesh_dim, ins.reduce_op):
                continue
            if other.src in dsts or any(body[g].src == other.dst for g in group):
                continue
            group.append(k)
            dsts.add(other.dst)
        if len(group) > 1:
            grouped.update(group)
            placed.setdefault(late, []).append(sorted(group))
    if not placed:
        return body
    out = []
    for i in range(len(body) + 1):
        for group in placed.get(i, ()):
            members = [body[g] for g in group]
            first = members[0]
            shapes, dtypes = merge_hints([m.shapes for m in members], [m.dtype for m in members])
            out.append(MergedAllReduce(first.mesh_id, first.mesh_dim, first.reduce_op,
                                       tuple(m.src for m in members), tuple(m.dst for m in members), shapes, dtypes))
        if i < len(body) and i not in grouped:
            out.append(body[i])
    return out


def _free_at_last_use(body, made, released, outputs) -> list:
    """Delete each temporary right after its last use; keep deletes of older state as recorded."""
    last: dict = {}
    for i, ins in enumerate(body):
        if type(ins) is Delete:
            continue
        for tid in reads_of(ins) + writes_of(ins):
            if tid in made and tid in released and tid not in outputs:
                last[tid] = i
    frees: dict = {}
    for tid, i in last.items():
        frees.setdefault(i, []).append(tid)
    out = []
    for i, ins in enumerate(body):
        if type(ins) is Delete:
            older = tuple(t for t in ins.tids if made.state(t))
            if older:
                out.append(Delete(older))
            continue
        out.append(ins)
        if i in frees:
            out.append(Delete(tuple(frees[i])))
    return out


def _constants(body, made, released, outputs, pure_plans) -> tuple[list, tuple]:
    """The body with each Put turned into a Constant step, and the Puts (the program's constants).

    A temporary constant that only pure calls and communicating collectives read (they make
    fresh tensors) is never written: every replay shares it, and its step moves to the start
    (binding it costs nothing; a fused segment may then run across where its Put was). Any
    other (an in-place or view op reads it, or the step keeps or returns it) is copied where
    its Put was, so no replay, and no later eager op on a kept tensor, changes what the next
    replay starts from.
    """
    constants = tuple(ins for ins in body if type(ins) is Put)
    if not constants:
        return body, ()
    unsafe = set()
    for ins in body:
        t = type(ins)
        fresh_outputs = (t is Call and ins.plan_id in pure_plans or t is MergedAllReduce
                         or (t is Collective and ins.kind in COMMUNICATING_KINDS))
        if not fresh_outputs:
            unsafe.update(reads_of(ins))

    def shared(tid) -> bool:
        return tid in made and tid in released and tid not in outputs and tid not in unsafe

    first = [Constant(put.tid, False) for put in constants if shared(put.tid)]
    rest = [ins if type(ins) is not Put else Constant(ins.tid, True)
            for ins in body if type(ins) is not Put or not shared(ins.tid)]
    return first + rest, constants


def first_difference(a: Program, b: Program) -> int | None:
    """Index of the first instruction where two recordings of a step differ (None: same)."""
    for i, (x, y) in enumerate(zip(a.signature, b.signature)):
        if x != y:
            return i
    if len(a.signature) != len(b.signature):
        return min(len(a.signature), len(b.signature))
    return None
