"""What a table of your own data means to a DLRM: categorical columns (one embedding table
each), dense columns with a transform, a label, and a deterministic split.

>>> spec = TabularSpec(
...     categorical=(Categorical("user_id"), Categorical("genres", multi_hot=True)),
...     dense=(Dense("age", ColumnTransform.STANDARDIZE),),
...     label="rating", label_threshold=4.0,
...     splits=Splits(fractions=(0.8, 0.1, 0.1), seed=0))
>>> [c.table_name for c in spec.categorical]
['user_id', 'genres']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from embark.data.vocabulary import OOVPolicy
from embark.names import check_name
from embark.types import Combiner, HotnessPolicy

__all__ = ["Categorical", "Dense", "ColumnTransform", "Splits", "TabularSpec"]


class ColumnTransform(StrEnum):
    """How a dense column becomes a model input (a null is 0 before the transform).

    ``LOG1P`` is ``log(1 + max(x, 0))`` (what a converted Criteo folder's
    ``DenseTransform.LOG1P_CLIP0`` names: that enum says what stored arrays hold, this one what
    a tabular column gets). ``STANDARDIZE`` subtracts the training rows' mean and divides by
    their standard deviation (statistics fitted on the training split only);
    ``LOG1P_STANDARDIZE`` does that after ``LOG1P``.
    """

    NONE = "none"
    LOG1P = "log1p"
    STANDARDIZE = "standardize"
    LOG1P_STANDARDIZE = "log1p_standardize"


@dataclass(frozen=True)
class Categorical:
    """A categorical column: one embedding table whose rows come from a fitted vocabulary.

    Args:
        column: the column: integer or string ids (one per row; a null is an empty bag), or,
            with ``multi_hot``, a list column (or a string column split by ``separator``).
        table: the table's name (default: ``column``); see :mod:`embark.names`.
        multi_hot: the column holds a bag of ids per row.
        separator: with ``multi_hot``, split a string column on this text (empty tokens
            dropped), e.g. ``"|"`` for ``"Action|Comedy"``.
        min_count: keep ids seen at least this often in the training split.
        max_size: keep at most this many ids (the most frequent).
        oov: where an id the vocabulary lacks goes (one reserved row, or ``oov_buckets``
            hashed rows).
        oov_buckets: rows for unknown ids (1 with ``RESERVED``).
        hotness: the maximum bag size (``None``: the largest bag of the training split).
        hotness_policy: what a longer bag gets, everywhere (refused or truncated).
        dim: the embedding width (``None``: the workload's default).
        combiner: pooling of a bag.

    Raises:
        ValueError: naming the column for a bad value.
    """

    column: str
    table: str | None = None
    multi_hot: bool = False
    separator: str | None = None
    min_count: int = 1
    max_size: int | None = None
    oov: OOVPolicy = OOVPolicy.RESERVED
    oov_buckets: int = 1
    hotness: int | None = None
    hotness_policy: HotnessPolicy = HotnessPolicy.REFUSE
    dim: int | None = None
    combiner: Combiner = Combiner.SUM

    def __post_init__(self) -> None:
        what = f"categorical column {self.column!r}"
        check_name(self.table_name, f"{what}: table name")
        object.__setattr__(self, "oov", OOVPolicy(self.oov))
        object.__setattr__(self, "hotness_policy", HotnessPolicy(self.hotness_policy))
        object.__setattr__(self, "combiner", Combiner(self.combiner))
        if self.separator is not None and (not self.multi_hot or not self.separator):
            raise ValueError(f"{what}: separator needs multi_hot=True and a non-empty text")
        for f in ("min_count", "oov_buckets"):
            _positive(getattr(self, f), f"{what}: {f}")
        for f in ("max_size", "hotness", "dim"):
            if getattr(self, f) is not None:
                _positive(getattr(self, f), f"{what}: {f}")
        if not self.multi_hot and self.hotness not in (None, 1):
            raise ValueError(f"{what}: a single-id column has hotness 1, got {self.hotness}")
        if self.oov is OOVPolicy.RESERVED and self.oov_buckets != 1:
            raise ValueError(f"{what}: oov 'reserved' has 1 bucket, got {self.oov_buckets}")

    @property
    def table_name(self) -> str:
        return self.table if self.table is not None else self.column


@dataclass(frozen=True)
class Dense:
    """A dense (continuous) column and its transform."""

    column: str
    transform: ColumnTransform = ColumnTransform.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "transform", ColumnTransform(self.transform))


@dataclass(frozen=True)
class Splits:
    """A deterministic train / validation / test split.

    Random (``time_column=None``): row ``i`` of the source (counted from 0 over the whole
    stream) goes by ``u = mix64(seed, i) / 2**64`` — train if ``u < f_train``, validation if
    below ``f_train + f_valid``, else test; the same split whatever the chunking or the rank.
    By time: rows whose ``time_column`` is below ``time_cuts[0]`` train, below
    ``time_cuts[1]`` validate, the rest test; with ``time_cuts=None`` the cuts are the
    ``fractions`` quantiles of the column (one pass reading that column alone, 8 bytes a row).

    Raises:
        ValueError: fractions that are not three non-negative numbers summing to 1, or cuts
            that are not increasing.
    """

    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    time_column: str | None = None
    time_cuts: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        f = tuple(float(x) for x in self.fractions)
        if len(f) != 3 or min(f) < 0 or not math.isclose(sum(f), 1.0, abs_tol=1e-9):
            raise ValueError(
                f"split fractions must be (train, validation, test) >= 0 summing to 1, got "
                f"{self.fractions!r}"
            )
        object.__setattr__(self, "fractions", f)
        if self.time_cuts is not None:
            if self.time_column is None:
                raise ValueError("time_cuts need a time_column")
            a, b = self.time_cuts
            if not a <= b:
                raise ValueError(f"time_cuts must be increasing, got {self.time_cuts!r}")


@dataclass(frozen=True)
class TabularSpec:
    """Columns and split of a tabular source.

    Args:
        categorical: the categorical columns (≥ 1), one table each, in table order.
        dense: the dense columns (≥ 1), in feature order.
        label: the label column: 0/1, or any number with ``label_threshold``.
        label_threshold: the label is ``value >= label_threshold`` (e.g. a rating ≥ 4).
        splits: see :class:`Splits`.

    Raises:
        ValueError: no categorical or dense column, duplicate table names or columns.
    """

    categorical: tuple[Categorical, ...]
    dense: tuple[Dense, ...]
    label: str
    label_threshold: float | None = None
    splits: Splits = Splits()

    def __post_init__(self) -> None:
        object.__setattr__(self, "categorical", tuple(self.categorical))
        object.__setattr__(self, "dense", tuple(self.dense))
        if not self.categorical or not self.dense:
            raise ValueError(
                "a tabular spec needs at least one categorical and one dense column, got "
                f"{len(self.categorical)} and {len(self.dense)}"
            )
        names = [c.table_name for c in self.categorical]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names {names}")
        dense = [d.column for d in self.dense]
        if len(set(dense)) != len(dense):
            raise ValueError(f"duplicate dense columns {dense}")

    @property
    def columns(self) -> list[str]:
        """Every column the source reads, each once."""
        cols = [c.column for c in self.categorical] + [d.column for d in self.dense]
        cols.append(self.label)
        if self.splits.time_column is not None:
            cols.append(self.splits.time_column)
        return list(dict.fromkeys(cols))

    def to_dict(self) -> dict[str, Any]:
        return {
            "categorical": [
                {k: (v.value if isinstance(v, StrEnum) else v) for k, v in c.__dict__.items()}
                for c in self.categorical
            ],
            "dense": [{"column": d.column, "transform": d.transform.value} for d in self.dense],
            "label": self.label,
            "label_threshold": self.label_threshold,
            "splits": {
                "fractions": list(self.splits.fractions),
                "seed": self.splits.seed,
                "time_column": self.splits.time_column,
                "time_cuts": list(self.splits.time_cuts) if self.splits.time_cuts else None,
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TabularSpec:
        s = d["splits"]
        return cls(
            categorical=tuple(Categorical(**c) for c in d["categorical"]),
            dense=tuple(Dense(**x) for x in d["dense"]),
            label=d["label"],
            label_threshold=d["label_threshold"],
            splits=Splits(
                fractions=tuple(s["fractions"]),
                seed=s["seed"],
                time_column=s["time_column"],
                time_cuts=tuple(s["time_cuts"]) if s["time_cuts"] else None,
            ),
        )


def _positive(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
