"""One embedding table's configuration: its shape, bag size and pooling
(:class:`TableConfig`), with the enums it is made of."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from embark.names import check_name

__all__ = ["Combiner", "HotnessPolicy", "TableConfig"]


class Combiner(StrEnum):
    """How the embedding rows of one bag (at most ``hotness`` of them) are pooled into one
    vector."""

    SUM = "sum"
    MEAN = "mean"


class HotnessPolicy(StrEnum):
    """What happens to a bag longer than its table's ``hotness`` (the maximum bag size).

    The same policy is applied wherever a bag enters a model: the tabular sources
    (:mod:`embark.data.tabular`), :class:`~embark.models.dlrm.DLRM`'s forward (training and
    evaluation; :func:`embark.data.hotness.enforce_hotness`) and the v2 server (the artifact's
    ``vocabulary.json``, read by :mod:`hps.vocabulary`), so a request is never refused in
    serving that training accepted.

    ``REFUSE`` raises :class:`~embark.data.hotness.HotnessError` naming the table, the bag size
    and the limit; ``TRUNCATE`` keeps the first ``hotness`` ids of the bag, in order.
    """

    REFUSE = "refuse"
    TRUNCATE = "truncate"


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique table name, e.g. ``"t3"`` (ASCII letters, digits, ``_``, ``-``: see
            :mod:`embark.names`).
        num_rows: number of rows (ids ``0 .. num_rows-1``); must be > 0.
        dim: embedding dimension; must be > 0.
        hotness: the maximum number of ids in one sample's bag of this table (HugeCTR's
            ``maxnum_catfeature_query_per_table_per_sample``, which export writes it as); must
            be > 0. A bag may be shorter (down to empty); a longer one is handled by
            ``hotness_policy``, the same way in training, evaluation, export and serving.
        combiner: pooling of a bag (``sum`` or ``mean``).
        hotness_policy: what a bag longer than ``hotness`` gets (:class:`HotnessPolicy`:
            refused, the default, or truncated to its first ``hotness`` ids).

    Raises:
        ValueError: naming the field when a value is out of range.
    """

    name: str
    num_rows: int
    dim: int
    hotness: int = 1
    combiner: Combiner = Combiner.SUM
    hotness_policy: HotnessPolicy = HotnessPolicy.REFUSE

    def __post_init__(self) -> None:
        check_name(self.name, "TableConfig.name")
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
        try:
            object.__setattr__(self, "hotness_policy", HotnessPolicy(self.hotness_policy))
        except ValueError:
            raise ValueError(
                f"table {self.name!r}: hotness_policy must be one of "
                f"{[p.value for p in HotnessPolicy]}, got {self.hotness_policy!r}"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["combiner"] = self.combiner.value
        d["hotness_policy"] = self.hotness_policy.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableConfig:
        allowed = {"name", "num_rows", "dim", "hotness", "combiner", "hotness_policy"}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"TableConfig: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        missing = sorted({"name", "num_rows", "dim"} - set(d))
        if missing:
            raise ValueError(f"table {d.get('name', '?')!r}: missing field(s) {missing}")
        return cls(**d)
