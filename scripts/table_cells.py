"""How the generated tables of docs/ write one cell: the formats scripts/bench_tables.py and
scripts/sweep_tables.py share."""

from __future__ import annotations


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of `rows` under `header`."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def cell(x: float | None, spec: str, missing: str = "n/a") -> str:
    """`x` formatted by `spec`, or `missing` where a row has no figure."""
    return missing if x is None else f"{x:{spec}}"


def seconds(t: float | None) -> str:
    """A time to a reward, or "never" where the run did not reach it."""
    return f"{t:.0f} s" if t else "never"


def sooner(span: float | None, t: float | None) -> str:
    """How much sooner a run reached a reward: the other run's evaluation span over its time."""
    return f"{span / t:.2f}x" if t and span else "never"


def measured_on(row: dict) -> str:
    """The machine and commit a learning row was measured on, where the row records them; a row
    kept from a benchmark's printed output names the commit that recorded it instead."""
    where = [row[k] for k in ("machine", "commit") if row.get(k)]
    if row.get("recorded_in"):
        where.append(f"recorded in {row['recorded_in']}")
    return ", ".join(where) or "not recorded"
