"""Raw ids of a request → table rows, with the vocabulary and hotness policy training used.

Reads the ``vocabulary.json`` of serving artifacts (format ``tilerec.vocabulary`` version 1,
written by ``embark.data.vocabulary`` and ``export.write_serving_artifacts``; described there)
without importing embark. For each table it knows the maximum bag size (``hotness``), what a
longer bag gets (``refuse`` or ``truncate``: keep the first ``hotness`` ids), and, when the
table has a vocabulary, how a raw key becomes a row::

    keys = [42, 7, 19]   oov "reserved": 42→0 7→1 19→2, any other key → 3
                         oov "hash", k buckets: any other key x → 3 + mix64(x) % k

``mix64`` is SplitMix64's finaliser of the key as an unsigned 64-bit integer; string keys
hash as the first 8 bytes (little-endian) of BLAKE2b-64 of their UTF-8 text. These are the
rules ``embark.data.vocabulary.Vocabulary.lookup`` applies, so an id the training data never
held scores the same in-process and served (``tests/embark/data/test_tabular_serving.py``).

A request's ``ids_<t> (B, w)`` holds raw keys with ``-1`` padding a short bag (so ``-1`` is
never a raw key of a served integer vocabulary). :meth:`ServingVocabulary.apply` returns rows
``(B, min(w, hotness))`` with the same padding, ready for the lookup.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FILE_NAME", "FORMAT", "FORMAT_VERSION", "ServingVocabulary", "TableVocabulary"]

FORMAT = "tilerec.vocabulary"
FORMAT_VERSION = 1
FILE_NAME = "vocabulary.json"  # beside the dense graph in the artifact folder
POLICIES = ("refuse", "truncate")
OOV_POLICIES = ("reserved", "hash")


def _mix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _string_hash(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class TableVocabulary:
    """One table's entry: rows, maximum bag size, policy and (optionally) its key mapping."""

    name: str
    rows: int
    hotness: int
    hotness_policy: str  # one of POLICIES
    keys: tuple[Any, ...] | None  # None: raw ids are rows
    oov: str = "reserved"
    oov_buckets: int = 1

    def rows_of(self, raw: np.ndarray) -> np.ndarray:
        """``(n,)`` raw keys → ``(n,) int64`` rows (identity without a vocabulary)."""
        if self.keys is None:
            return np.asarray(raw).astype(np.int64, copy=False)
        n = len(self.keys)
        if raw.dtype == object or raw.dtype.kind in "US":
            index = {k: i for i, k in enumerate(self.keys)}
            out = np.array([index.get(str(k), -1) for k in raw.tolist()], dtype=np.int64)
            unknown = out < 0
            if self.oov == "hash" and unknown.any():
                h = np.array([_string_hash(str(k)) for k in raw[unknown].tolist()], np.uint64)
                out[unknown] = n + (h % np.uint64(self.oov_buckets)).astype(np.int64)
            else:
                out[unknown] = n
            return out
        keys = np.asarray(self.keys, dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        ints = raw.astype(np.int64, copy=False)
        pos = np.searchsorted(sorted_keys, ints)
        pos_c = np.minimum(pos, max(n - 1, 0))
        found = (pos < n) & (sorted_keys[pos_c] == ints) if n else np.zeros(ints.shape, bool)
        out = np.empty(ints.shape, dtype=np.int64)
        out[found] = order[pos_c[found]]
        if self.oov == "hash":
            h = _mix64(ints[~found].view(np.uint64))
            out[~found] = n + (h % np.uint64(self.oov_buckets)).astype(np.int64)
        else:
            out[~found] = n
        return out


class ServingVocabulary:
    """The ``vocabulary.json`` of one model's artifacts (see the module docstring)."""

    def __init__(self, tables: dict[str, TableVocabulary], where: str) -> None:
        self.tables, self.where = tables, where

    @classmethod
    def load(cls, path: str | Path) -> ServingVocabulary:
        """Read ``path``.

        Raises:
            ValueError: not this format or version, or a malformed entry (naming the file).
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
                f"{where}: {FORMAT} version {doc.get('version')!r}; this hps reads version "
                f"{FORMAT_VERSION}: export the model again"
            )
        tables = {}
        for i, t in enumerate(doc.get("tables", [])):
            try:
                v = t["vocabulary"]
                entry = TableVocabulary(
                    name=str(t["name"]),
                    rows=int(t["rows"]),
                    hotness=int(t["hotness"]),
                    hotness_policy=str(t["hotness_policy"]),
                    keys=None if v is None else tuple(v["keys"]),
                    oov="reserved" if v is None else str(v["oov"]),
                    oov_buckets=1 if v is None else int(v["oov_buckets"]),
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: tables[{i}] is malformed: {e!r}") from None
            if entry.hotness_policy not in POLICIES or entry.oov not in OOV_POLICIES:
                raise ValueError(
                    f"{where}: table {entry.name!r}: hotness_policy {entry.hotness_policy!r} "
                    f"(expected one of {POLICIES}), oov {entry.oov!r} (one of {OOV_POLICIES})"
                )
            if entry.keys is not None and len(entry.keys) + entry.oov_buckets != entry.rows:
                raise ValueError(
                    f"{where}: table {entry.name!r} has {entry.rows} rows but its vocabulary "
                    f"maps to {len(entry.keys)} keys + {entry.oov_buckets} buckets"
                )
            tables[entry.name] = entry
        return cls(tables, where)

    @classmethod
    def beside(cls, network_file: str | Path) -> ServingVocabulary | None:
        """The ``vocabulary.json`` in the folder of ``network_file`` (the dense graph), or
        ``None`` when there is none (artifacts without one take row ids, and refuse a bag
        over ``maxnum_catfeature_query_per_table_per_sample``)."""
        path = Path(network_file).parent / FILE_NAME
        return cls.load(path) if path.is_file() else None

    def apply(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Map every ``ids_<t>`` input through its table's entry; other inputs pass as they are.

        Each row's non-padding keys are kept in order, a bag over ``hotness`` is refused or
        truncated by the table's policy, and the keys become rows.

        Returns:
            the inputs with each ``ids_<t>`` as ``(B, min(w, hotness)) int64`` rows, ``-1``
            padding.

        Raises:
            ValueError: a bag over ``hotness`` under ``refuse``, naming the input, the sample
                and the sizes; an ids input that is not ``(B, w)``.
        """
        out = dict(inputs)
        for name, t in self.tables.items():
            key = f"ids_{name}"
            if key in inputs:
                out[key] = self._rows(t, key, np.asarray(inputs[key]))
        return out

    @staticmethod
    def _rows(t: TableVocabulary, key: str, ids: np.ndarray) -> np.ndarray:
        if ids.ndim != 2:
            raise ValueError(f"input {key!r} must be (B, w), got shape {list(ids.shape)}")
        is_text = ids.dtype == object or ids.dtype.kind in "US"
        if not is_text and ids.dtype.kind not in "iu":
            raise ValueError(f"input {key!r} must hold integer keys, got {ids.dtype}")
        if is_text:
            pad = np.array([k is None or k == "" for k in ids.ravel().tolist()], dtype=bool)
            pad = pad.reshape(ids.shape)
        else:
            pad = ids == -1
        counts = (~pad).sum(axis=1)
        if counts.size and int(counts.max()) > t.hotness and t.hotness_policy == "refuse":
            b = int(np.argmax(counts > t.hotness))
            raise ValueError(
                f"input {key!r}: sample {b} has a bag of {int(counts[b])} ids but table "
                f"{t.name!r} allows at most {t.hotness} (hotness_policy 'refuse', as in training)"
            )
        width = min(ids.shape[1], t.hotness)
        # position of each kept key within its row's bag (padding skipped), keep the first `width`
        pos = np.cumsum(~pad, axis=1) - 1
        keep = ~pad & (pos < width)
        rows_out = np.full((ids.shape[0], width), -1, dtype=np.int64)
        if keep.any():
            r = np.nonzero(keep)[0]
            rows_out[r, pos[keep]] = t.rows_of(ids[keep])
        return rows_out
