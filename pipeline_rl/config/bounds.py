"""Valid ranges declared on the schema's fields: `x: int = bounded(16, ge=1)`.

One checker (`validate.check_bounds`) reads them for every field, and docs/config.md shows them
beside each key; `validate.py` keeps only the checks that span several keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BOUNDS = "bounds"
"""The key of a field's metadata that holds its Bounds."""


@dataclass(frozen=True)
class Bounds:
    """An interval, each end open, closed or absent; `why` says where a bound comes from when
    the key's own docstring does not."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def allows(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        """As the error message and the reference page say it: "must be >= 0 and < 1"."""
        ends = [
            f"{op} {_number(end)}"
            for op, end in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if end is not None
        ]
        return "must be " + " and ".join(ends)


def bounded(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str = "",
) -> Any:
    """A dataclass field with `default` whose values must lie within the given bounds."""
    return field(default=default, metadata={BOUNDS: Bounds(ge, gt, le, lt, why)})


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
