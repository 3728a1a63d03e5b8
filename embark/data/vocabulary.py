"""Feature vocabularies: raw ids (integers or strings) → embedding rows, fitted on training
data, saved as an artifact that training, evaluation, export and the server all apply.

A :class:`Vocabulary` keeps the training keys seen at least ``min_count`` times (at most
``max_size`` of them, the most frequent first; ties by key) and gives key ``keys[i]`` row
``i``. A key it does not hold goes by its out-of-vocabulary policy (:class:`OOVPolicy`)::

    keys = [42, 7, 19]                      n = 3 known keys
    RESERVED (1 bucket):  42→0  7→1  19→2   any other key → row 3          num_rows 4
    HASH (k buckets):     42→0  7→1  19→2   key x → 3 + bucket(x) % k      num_rows 3 + k

``bucket(x)`` is SplitMix64's finaliser of the key as an unsigned 64-bit integer for integer
keys, and the first 8 bytes (little-endian) of BLAKE2b-64 of the UTF-8 text for string keys —
a function of the key alone, the same in every process and in ``hps.vocabulary``.

The artifact, ``vocabulary.json`` (format :data:`FORMAT` version :data:`FORMAT_VERSION`), names
each table with its maximum bag size and policy, and its vocabulary (``null``: the raw ids are
the rows)::

    {"format": "tilerec.vocabulary", "version": 1,
     "tables": [{"name": "user", "hotness": 1, "hotness_policy": "refuse",
                 "vocabulary": {"key_type": "int64", "oov": "reserved", "oov_buckets": 1,
                                "keys": [42, 7, 19]}},
                {"name": "genre", "hotness": 6, "hotness_policy": "truncate",
                 "vocabulary": null}]}

It is written by :func:`save_vocabularies` (a temporary sibling renamed into place) beside the
model and by ``export.write_serving_artifacts`` into the serving artifacts; ``hps`` reads it
without importing embark. Another format or version is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from embark.outputs import write_text_atomic
from embark.types import HotnessPolicy, TableConfig

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KeyType",
    "OOVPolicy",
    "Vocabulary",
    "VocabularyFile",
    "load_vocabularies",
    "save_vocabularies",
]

FORMAT = "tilerec.vocabulary"
FORMAT_VERSION = 1
FILE_NAME = "vocabulary.json"  # its name beside a model and in the serving artifacts


class OOVPolicy(StrEnum):
    """Where a key the vocabulary does not hold goes: one reserved row, or ``k`` hashed rows."""

    RESERVED = "reserved"
    HASH = "hash"


class KeyType(StrEnum):
    """The raw keys of a vocabulary."""

    INT64 = "int64"
    STRING = "string"


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over ``uint64`` (the integer keys' bucket hash)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _string_hash(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Vocabulary:
    """Raw keys → rows ``0 .. num_rows-1`` (see the module docstring).

    Args:
        keys: the known keys, row ``i`` for ``keys[i]``; unique, all ``int`` or all ``str``.
        oov: the out-of-vocabulary policy.
        oov_buckets: rows for unknown keys: 1 for ``RESERVED``, ``k ≥ 1`` for ``HASH``.

    Raises:
        ValueError: duplicate or mixed-type keys, a bad policy or bucket count.
    """

    keys: tuple[int | str, ...]
    oov: OOVPolicy = OOVPolicy.RESERVED
    oov_buckets: int = 1
    _index: dict[int | str, int] = field(default_factory=dict, repr=False, compare=False)
    # integer keys sorted, and the row of each: what lookup() searches
    _sorted: tuple[np.ndarray, np.ndarray] = field(
        default=(np.zeros(0, np.int64), np.zeros(0, np.int64)), repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        try:
            object.__setattr__(self, "oov", OOVPolicy(self.oov))
        except ValueError:
            raise ValueError(
                f"oov must be one of {[p.value for p in OOVPolicy]}, got {self.oov!r}"
            ) from None
        b = self.oov_buckets
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"oov_buckets must be a positive integer, got {b!r}")
        if self.oov is OOVPolicy.RESERVED and b != 1:
            raise ValueError(f"oov 'reserved' has exactly 1 bucket, got oov_buckets={b}")
        kinds = {type(k) for k in self.keys}
        if kinds - {int, str} or len(kinds) > 1:
            raise ValueError(
                f"keys must be all int or all str, got types {sorted(map(str, kinds))}"
            )
        index = {k: i for i, k in enumerate(self.keys)}
        if len(index) != len(self.keys):
            raise ValueError("keys must be unique")
        object.__setattr__(self, "_index", index)
        if self.key_type is KeyType.INT64:
            keys = np.asarray(self.keys, dtype=np.int64)
            order = np.argsort(keys, kind="stable").astype(np.int64)
            object.__setattr__(self, "_sorted", (keys[order], order))

    @property
    def key_type(self) -> KeyType:
        return KeyType.STRING if self.keys and isinstance(self.keys[0], str) else KeyType.INT64

    @property
    def num_rows(self) -> int:
        """Known keys plus the out-of-vocabulary rows: the table's ``num_rows``."""
        return len(self.keys) + self.oov_buckets

    @classmethod
    def fit(
        cls,
        counts: Mapping[int | str, int],
        min_count: int = 1,
        max_size: int | None = None,
        oov: OOVPolicy | str = OOVPolicy.RESERVED,
        oov_buckets: int = 1,
    ) -> Vocabulary:
        """Keep the keys counted at least ``min_count`` times, the ``max_size`` most frequent.

        Args:
            counts: ``{key: occurrences}`` over the *training* rows only.
            min_count: frequency threshold, ≥ 1.
            max_size: the most known keys (``None``: no limit).
            oov, oov_buckets: see the class.

        Returns:
            the vocabulary, keys by descending count, ties by ascending key (deterministic).
        """
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        if max_size is not None and max_size < 0:
            raise ValueError(f"max_size must be >= 0 or None, got {max_size}")
        kept = sorted(((-c, k) for k, c in counts.items() if c >= min_count))
        return cls(tuple(k for _, k in kept[:max_size]), OOVPolicy(oov), oov_buckets)

    def lookup(self, raw: np.ndarray | Sequence[int | str]) -> np.ndarray:
        """Rows of ``raw`` keys.

        Args:
            raw: ``(n,)`` integer keys (any int dtype) or strings (``object``/``str`` array),
                matching :attr:`key_type`.

        Returns:
            ``(n,) int64`` rows in ``[0, num_rows)``.
        """
        n = len(self.keys)
        if self.key_type is KeyType.STRING:
            arr = np.asarray(raw, dtype=object)
            rows = np.fromiter(
                (self._index.get(k, -1) for k in arr.tolist()), dtype=np.int64, count=arr.size
            )
            unknown = rows < 0
            if unknown.any():
                if self.oov is OOVPolicy.RESERVED:
                    rows[unknown] = n
                else:
                    h = np.array(
                        [_string_hash(str(k)) for k in arr[unknown].tolist()], dtype=np.uint64
                    )
                    rows[unknown] = n + (h % np.uint64(self.oov_buckets)).astype(np.int64)
            return rows
        ints = np.asarray(raw).astype(np.int64, copy=False).reshape(-1)
        sorted_keys, order = self._sorted
        pos = np.searchsorted(sorted_keys, ints)
        pos_c = np.minimum(pos, max(n - 1, 0))
        found = (pos < n) & (sorted_keys[pos_c] == ints) if n else np.zeros(ints.shape, bool)
        rows = np.empty(ints.shape, dtype=np.int64)
        rows[found] = order[pos_c[found]]
        if self.oov is OOVPolicy.RESERVED:
            rows[~found] = n
        else:
            h = _mix64(ints[~found].view(np.uint64))
            rows[~found] = n + (h % np.uint64(self.oov_buckets)).astype(np.int64)
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "key_type": self.key_type.value,
            "oov": self.oov.value,
            "oov_buckets": self.oov_buckets,
            "keys": list(self.keys),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "vocabulary") -> Vocabulary:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: naming ``where`` for missing or unknown fields or bad values.
        """
        allowed = {"key_type", "oov", "oov_buckets", "keys"}
        if not isinstance(d, Mapping) or set(d) != allowed:
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"{where}: expected exactly the fields {sorted(allowed)}, got {got}")
        key_type = KeyType(d["key_type"])
        keys = [str(k) if key_type is KeyType.STRING else int(k) for k in d["keys"]]
        try:
            return cls(tuple(keys), OOVPolicy(d["oov"]), int(d["oov_buckets"]))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def count_keys(chunks: Iterable[np.ndarray], counts: Counter[int | str] | None = None) -> Counter:
    """Accumulate ``{key: occurrences}`` over chunks of raw keys (memory: distinct keys)."""
    counts = Counter() if counts is None else counts
    for chunk in chunks:
        arr = np.asarray(chunk)
        if arr.size == 0:
            continue
        if arr.dtype.kind in "iu":
            keys, n = np.unique(arr.astype(np.int64), return_counts=True)
            counts.update(dict(zip(keys.tolist(), n.tolist())))
        else:
            counts.update(str(k) for k in arr.tolist())
    return counts


@dataclass(frozen=True)
class VocabularyFile:
    """The contents of a ``vocabulary.json``: per table its maximum bag size, hotness policy
    and vocabulary (``None``: raw ids are rows)."""

    tables: tuple[TableConfig, ...]
    vocabularies: Mapping[str, Vocabulary]


def vocabulary_document(
    tables: Sequence[TableConfig], vocabularies: Mapping[str, Vocabulary]
) -> dict[str, Any]:
    """The ``vocabulary.json`` document of ``tables`` (see the module docstring).

    Raises:
        ValueError: a vocabulary of a table not in ``tables``, or one whose ``num_rows`` is not
            the table's.
    """
    names = [t.name for t in tables]
    unknown = sorted(set(vocabularies) - set(names))
    if unknown:
        raise ValueError(f"vocabularies for table(s) {unknown} that the model lacks ({names})")
    for t in tables:
        v = vocabularies.get(t.name)
        if v is not None and v.num_rows != t.num_rows:
            raise ValueError(
                f"table {t.name!r} has {t.num_rows} rows but its vocabulary maps to "
                f"{v.num_rows} ({len(v.keys)} keys + {v.oov_buckets} out-of-vocabulary)"
            )
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tables": [
            {
                "name": t.name,
                "rows": t.num_rows,
                "hotness": t.hotness,
                "hotness_policy": t.hotness_policy.value,
                "vocabulary": vocabularies[t.name].to_dict() if t.name in vocabularies else None,
            }
            for t in tables
        ],
    }


def save_vocabularies(
    path: str | Path, tables: Sequence[TableConfig], vocabularies: Mapping[str, Vocabulary]
) -> Path:
    """Publish ``vocabulary.json`` at ``path`` whole (a temporary sibling renamed into place).

    Args:
        path: the file (``<model folder>/vocabulary.json`` by convention).
        tables: the model's tables (their rows, hotness and hotness policy are written).
        vocabularies: ``{table: Vocabulary}``; tables without one take raw ids as rows.
    """
    return write_text_atomic(path, json.dumps(vocabulary_document(tables, vocabularies)))


def load_vocabularies(path: str | Path) -> VocabularyFile:
    """Read a ``vocabulary.json``.

    Raises:
        ValueError: another format or version, or a malformed entry (naming the file).
    """
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT!r} file")
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{where}: {FORMAT} version {doc.get('version')!r}; this embark reads version "
            f"{FORMAT_VERSION}"
        )
    tables, vocabularies = [], {}
    for i, t in enumerate(doc.get("tables", [])):
        try:
            cfg = TableConfig(
                name=t["name"],
                num_rows=t["rows"],
                dim=1,  # the file does not carry the embedding width
                hotness=t["hotness"],
                hotness_policy=HotnessPolicy(t["hotness_policy"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: tables[{i}] is malformed: {e!r}") from None
        tables.append(cfg)
        if t.get("vocabulary") is not None:
            vocabularies[cfg.name] = Vocabulary.from_dict(
                t["vocabulary"], f"{where}: table {cfg.name!r}"
            )
    return VocabularyFile(tuple(tables), vocabularies)
