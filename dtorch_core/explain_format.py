"""The text of a ``dt.explain`` Explanation: a table per module, then the totals.

Records that are the same op from the same line with the same placements and moves are one row
with their count (a training loop shows each op once, with the number of steps), so the text of
a whole script stays as long as its distinct ops.
"""

from __future__ import annotations

import collections

from .placement import Partial, Replicate, Shard
from .planner import gathers

PHASES = {"forward": "fwd", "backward": "bwd"}
_LEGEND = ("(bytes: the global size of the tensor each collective works on; a row is every record of the "
           "same op, line, placements and moves: 'calls' counts them)")


def short_placement(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return repr(p)


def short_placements(placements) -> str:
    return "[" + ", ".join(short_placement(p) for p in placements) + "]"


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def group_rows(ops) -> dict[str, list]:
    """Per module (first seen first), the distinct rows of its records, first seen first, each
    ``[count, record]`` (records that differ only in index count as one row)."""
    out: dict = collections.defaultdict(dict)
    for r in ops:
        key = (r.op, r.phase, r.source, r.depth, r.inputs, r.outputs, tuple(r.redistributions), r.requested,
               r.fallback, r.surprising_gather, r.error)
        rows = out[r.module]
        if key in rows:
            rows[key][0] += 1
        else:
            rows[key] = [1, r]
    return {m: list(rows.values()) for m, rows in out.items()}



def short_op(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def _moves_text(moves: dict) -> str:
    if not moves:
        return "-"
    return ", ".join(f"{kind} x{c['count']} ({format_bytes(c['bytes'])})" for kind, c in moves.items())


def _notes(record) -> str:
    notes = []
    if record.requested:
        notes.append("requested")
    if record.fallback:
        notes.append("replicated fallback")
    if record.surprising_gather:
        notes.append("SURPRISING GATHER")
    if record.error:
        notes.append(f"raised {record.error.splitlines()[0][:120]}")
    return "; ".join(notes)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_explanation(ex) -> str:
    ops = ex.ops
    modules = ex.modules()
    n_ops = sum(1 for r in ops if not r.requested)
    head = (f"dt.explain: {n_ops} ops, {len(ops) - n_ops} requested moves, in {len(modules)} modules; "
            f"collectives: {_moves_text(ex.collectives())}")
    lines = [head, _LEGEND]
    for module, rows in group_rows(ops).items():
        entry = modules[module]
        lines.append("")
        lines.append(f"{module}: {entry['ops']} ops; collectives: {_moves_text(entry['collectives'])}")
        table = [["calls", "op", "phase", "at", "inputs -> outputs", "redistributions", "notes"]]
        for count, r in rows:
            ins = ", ".join(map(str, r.inputs)) or "-"
            outs = ", ".join(map(str, r.outputs)) or "-"
            table.append([str(count), "  " * r.depth + short_op(r.op), PHASES.get(r.phase, r.phase),
                          r.source or "-", f"{ins} -> {outs}",
                          "; ".join(map(str, r.redistributions)) or "-", _notes(r)])
        lines.extend(_table(table))
    lines.append("")
    lines.append("totals by module:")
    lines.extend(_table([["module", "ops", "collectives"]]
                        + [[m, str(e["ops"]), _moves_text(e["collectives"])] for m, e in modules.items()]))
    lines.append("totals by collective:")
    kinds = ex.collectives()
    if kinds:
        lines.extend(_table([["kind", "count", "bytes"]]
                            + [[k, str(c["count"]), format_bytes(c["bytes"])] for k, c in kinds.items()]))
    else:
        lines.append("  none")
    seen = set()
    for r in ex.surprising_gathers():
        key = (r.op, r.module, r.source)
        if key in seen:
            continue
        if not seen:
            lines.append("surprising gathers (docs/explain.md):")
        seen.add(key)
        lines.append(f"  {short_op(r.op)} in {r.module} at {r.source or '?'}: {gathers.advice(r.op)}")
    return "\n".join(lines) + "\n"
