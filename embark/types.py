"""Data types shared by the embark packages: tables (and, in the planner, topologies and plans).

Only dataclasses and enums live here; strategies live in ``embark.planner``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class Combiner(str, Enum):
    """How the ``hotness`` embedding rows of one bag are pooled into one vector."""

    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique table name, e.g. ``"t3"``.
        num_rows: number of rows (ids ``0 .. num_rows-1``); must be > 0.
        dim: embedding dimension; must be > 0.
        hotness: average number of ids per sample in this table's bag (multi-hot); must be > 0.
        combiner: pooling of a bag (``sum`` or ``mean``).

    Raises:
        ValueError: naming the field when a value is out of range.
    """

    name: str
    num_rows: int
    dim: int
    hotness: int = 1
    combiner: Combiner = Combiner.SUM

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableConfig.name must be a non-empty string, got {self.name!r}")
        for field in ("num_rows", "dim", "hotness"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"table {self.name!r}: {field} must be a positive integer, got {value!r}"
                )
        try:
            object.__setattr__(self, "combiner", Combiner(self.combiner))
        except ValueError:
            raise ValueError(
                f"table {self.name!r}: combiner must be one of "
                f"{[c.value for c in Combiner]}, got {self.combiner!r}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["combiner"] = self.combiner.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableConfig:
        allowed = {"name", "num_rows", "dim", "hotness", "combiner"}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"TableConfig: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}")
        return cls(**d)
