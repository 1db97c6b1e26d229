"""Instructions: attrs values that a runner carries from the controller to every worker.

Every worker receives the same stream. Per-rank differences (uneven shard sizes, regions) are
inside the values, keyed by rank, so the stream itself never forks. Tensor ids are ints chosen
by the controller. ``Slot(i)`` in a plan's argument template stands for the i-th input tensor.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Slot:
    """Placeholder for the ``index``-th tensor input of a ``Call``."""

    index: int


@attrs.frozen
class Number:
    """Placeholder for the ``index``-th entry of a ``Call``'s ``numbers``: a Python number the
    user passes that changes from call to call (``x * scale``), sent with each Call so that one
    plan serves every value (see dtorch_core/planner/numbers.py)."""

    index: int


def fill_slots(x, values):
    """``x`` with every ``Slot(i)`` (inside tuples and lists too) replaced by ``values[i]``."""
    if type(x) is Slot:
        return values[x.index]
    if type(x) is tuple or type(x) is list:
        return type(x)(fill_slots(a, values) for a in x)
    return x


@attrs.frozen
class DefineMesh:
    mesh_id: int
    shape: tuple
    ranks: tuple


@attrs.frozen
class DefinePlan:
    """A local call template: ``target`` (an op name or kernel name) with arguments.

    ``rank_args`` maps rank -> (args, kwargs) where a rank's arguments differ from the template.
    """

    plan_id: int
    mesh_id: int
    target: str
    args: tuple
    kwargs: dict
    rank_args: dict | None
    op_name: str  # the user-level op, for error messages
    seeded: bool = False  # the kernel takes ``seed=`` from each Call


@attrs.frozen
class Call:
    plan_id: int
    inputs: tuple
    outputs: tuple  # tensor ids of the flattened outputs (-1: not kept)
    source: tuple | str | None = None  # (file, line) of the user's call
    seed: int | None = None
    numbers: tuple = ()  # the values of the plan's ``Number`` placeholders, in index order


@attrs.frozen
class Collective:
    """One redistribution step along one mesh dim (``kind`` in COLLECTIVE_KINDS).

    ``shift`` is a cyclic permutation within each group: member i receives member
    ``(i + offset) mod n``'s tensor (shapes may differ per member); no tensor dim is involved.
    """

    kind: str
    mesh_id: int
    mesh_dim: int
    src: int
    dst: int
    dim: int = 0  # tensor dim for gather/scatter/chunk kinds
    reduce_op: str = "sum"
    dim2: int = 0  # destination tensor dim for all_to_all
    # the source's dtype, and for runners whose communicators exchange no headers (see
    # comm/dist.py) its local shape on every rank of the mesh, in the mesh's rank order
    shapes: tuple = ()
    dtype: Any = None
    offset: int = 0  # shift: which member each member receives from (its index + offset)
    # the source dies with this step (the controller frees ``src`` after it and no other id it
    # handed out names the same memory): a worker may build the result in the source's buffer
    # instead of a copy, where it finds no other holder of that memory itself
    consume: bool = False


@attrs.frozen
class MergedAllReduce:
    """All-reduces of several tensors along one mesh dim as one exchange per dtype.

    Made by the program optimiser from small all-reduces that a captured step can run together
    (``srcs[i]`` -> ``dsts[i]``); the values equal those of the separate all-reduces.
    """

    mesh_id: int
    mesh_dim: int
    reduce_op: str
    srcs: tuple
    dsts: tuple
    shapes: tuple = ()  # per rank of the mesh, the local shape of every src (see Collective)
    dtypes: tuple = ()  # per src


def merge_hints(per_source_shapes, dtypes) -> tuple[tuple, tuple]:
    """A MergedAllReduce's ``(shapes, dtypes)`` from per-source hints (each per rank): turned per
    rank (each per source); no shapes unless every source has them."""
    dtypes = tuple(dtypes) if all(d is not None for d in dtypes) else ()
    if not per_source_shapes or any(not s for s in per_source_shapes):
        return (), dtypes
    return tuple(zip(*per_source_shapes)), dtypes


COLLECTIVE_KINDS = ("alias", "all_gather", "all_reduce", "reduce_scatter", "local_chunk", "to_partial", "all_to_all",
                    "shift")
COMMUNICATING_KINDS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "shift"})


@attrs.frozen
class Put:
    """Store a tensor per rank (``shards`` maps rank -> tensor) under ``tid``."""

    tid: int
    mesh_id: int
    shards: dict


@attrs.frozen
class Constant:
    """Inside a program: store the program's constant ``tid`` (its ``DefineProgram.constants``
    entry, already on the device) under ``tid``. ``copy``: a fresh copy on every replay, for a
    tensor the program may write into, keeps or returns; otherwise the constant itself."""

    tid: int
    copy: bool


@attrs.frozen
class Delete:
    tids: tuple


@attrs.frozen
class Fetch:
    """Reply with the local tensor ``tid`` from each rank in ``ranks``; with ``everyone`` the
    other ranks reply too, with nothing or their standing failure (see comm/dist.py)."""

    tid: int
    request_id: int
    ranks: tuple
    everyone: bool = False


@attrs.frozen
class Stats:
    """Reply once everything issued before has run: with the worker's memory statistics, or
    with nothing (``memory=False``, ``dt.synchronize()``: reading the device's counters costs more
    than the round trip)."""

    request_id: int
    memory: bool = True


@attrs.frozen
class DefineProgram:
    """A captured step, kept by the workers until ``DropProgram``.

    ``instructions`` are Calls, Collectives, MergedAllReduces, Constants and Deletes. Inside
    them the explicit inputs are named by ``inputs`` and the explicit outputs by ``outputs`` (ids
    above VIRTUAL_BASE that the controller never hands out); every other id is the program's own (temporaries and the
    state it updates in place). A Call's ``seed`` is its index among the program's seeded calls.

    ``fusable`` lists the positions of Calls the workers may run together as one compiled
    function (``dt.compile(fuse_local=True)``): unseeded aten calls that write only their fresh
    outputs. Empty: every instruction runs as sent.

    ``constants`` are the tensors the step sent from the controller (``Put``s recorded inside
    it: a replay does not run the Python that made them, so their values are those of the
    capture). Workers move them to the device once and keep them until ``DropProgram``; a
    ``Constant`` step of the body names each one where its ``Put`` was.
    """

    program_id: int
    instructions: tuple
    inputs: tuple
    outputs: tuple
    fusable: tuple = ()
    constants: tuple = ()  # Puts


@attrs.frozen
class RunProgram:
    """Replay a program: bind ``inputs`` (tensor ids) to its inputs, name its outputs ``outputs``.

    The k-th seeded call draws with the seed the controller's k-th ``next_seed`` after
    ``seed_counter`` would give, so a replay draws what the same step run eagerly would.
    """

    program_id: int
    inputs: tuple
    outputs: tuple
    seed: int
    seed_counter: int


@attrs.frozen
class DropProgram:
    program_id: int


@attrs.frozen
class DropPlans:
    """Forget these plan definitions: the controller's plan cache evicted them (it is bounded)
    and no Call after this one names them (ids a live captured program calls are never dropped)."""

    plan_ids: tuple


VIRTUAL_BASE = 1 << 60


def program_seed(seed: int, counter: int) -> int:
    """The seed of the ``counter``-th seeded op after ``manual_seed(seed)`` (controller and workers)."""
    return (seed * 1_000_003 + counter * 7_919) % (2**62)


@attrs.frozen
class WorkerFailure:
    """Why a tensor on a worker is not available: the failing op, its source line, the error."""

    rank: int
    op: str
    source: tuple | str | None
    message: str


@attrs.frozen
class Reply:
    """What a worker sends back: ``value`` or ``error`` (a WorkerFailure)."""

    request_id: int
    rank: int
    value: Any = None
    error: WorkerFailure | None = None
