"""Tabular sources: a pandas DataFrame, an Arrow table, a Parquet or CSV file → :class:`Batch`es.

A :class:`TabularSource` streams the rows of its input in chunks of ``chunk_rows`` (a Parquet
file row group by row group, a CSV file block by block: a file larger than memory reads in
bounded memory), splits them deterministically (:class:`~embark.data.tabular_spec.Splits`),
and :meth:`TabularSource.fit` learns, from the training rows only, what a model needs: a
:class:`~embark.data.vocabulary.Vocabulary` per categorical column, the largest bag of each
(its ``hotness``), and the dense columns' mean and standard deviation. The result, a
:class:`Preprocessor`, turns rows into batches the same way in training, evaluation and
export, sizes the :class:`~embark.models.workloads.Workload`, and is saved beside the model::

    rows ──split──▶ train rows ──fit──▶ Preprocessor ──workload()──▶ Workload ─▶ build_model
                                          │  save(folder): vocabulary.json + tabular.json
    rows ──split──▶ any split ─────────── encode ──▶ Batch(dense, JaggedBatch, labels)

Batches of a split are global batches of ``batch_size`` rows in stream order (shuffled within
windows of ``shuffle_window`` rows by ``(seed, epoch, window)`` when asked); rank ``r`` of
``world_size`` gets :func:`~embark.data.batch.local_range` of each global batch, as
:class:`~embark.data.binary.CriteoBinary` cuts them, so ranks are disjoint and cover every row.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embark.data.batch import Batch, local_range
from embark.data.hotness import check_or_truncate
from embark.data.jagged import JaggedBatch
from embark.data.synthetic import Split
from embark.data.tabular_spec import Categorical, ColumnTransform, TabularSpec
from embark.data.vocabulary import (
    FILE_NAME,
    Vocabulary,
    count_keys,
    load_vocabularies,
    save_vocabularies,
)
from embark.models.workloads import Interaction, Workload
from embark.outputs import write_text_atomic
from embark.types import TableConfig

__all__ = ["Preprocessor", "SourceKind", "TabularSource"]

DEFAULT_CHUNK_ROWS = 1 << 16
STATE_FORMAT = "tilerec.tabular"
STATE_VERSION = 1
STATE_FILE = "tabular.json"
_GOLDEN = 0x9E3779B97F4A7C15


class SourceKind(StrEnum):
    """Where a :class:`TabularSource` reads its rows from."""

    ARROW = "arrow"
    PARQUET = "parquet"
    CSV = "csv"


def _mix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class TabularSource:
    """Rows of a table, streamed in chunks, with a :class:`TabularSpec`.

    Build one with :meth:`from_pandas`, :meth:`from_arrow`, :meth:`from_parquet` or
    :meth:`from_csv`; every constructor takes ``chunk_rows``, the rows read at a time.
    """

    def __init__(
        self, spec: TabularSpec, kind: SourceKind, source: Any, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.spec, self.kind, self._source, self.chunk_rows = spec, kind, source, chunk_rows
        self._time_cuts: tuple[float, float] | None = spec.splits.time_cuts

    @classmethod
    def from_pandas(
        cls, df: Any, spec: TabularSpec, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> TabularSource:
        """A DataFrame (converted to Arrow once; list columns stay lists)."""
        import pyarrow as pa

        return cls(
            spec, SourceKind.ARROW, pa.Table.from_pandas(df, preserve_index=False), chunk_rows
        )

    @classmethod
    def from_arrow(
        cls, table: Any, spec: TabularSpec, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> TabularSource:
        """A ``pyarrow.Table``."""
        return cls(spec, SourceKind.ARROW, table, chunk_rows)

    @classmethod
    def from_parquet(
        cls, path: str | Path, spec: TabularSpec, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> TabularSource:
        """A Parquet file, read a row group at a time (only the spec's columns)."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"Parquet file {str(path)!r} does not exist")
        return cls(spec, SourceKind.PARQUET, Path(path), chunk_rows)

    @classmethod
    def from_csv(
        cls,
        path: str | Path,
        spec: TabularSpec,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        delimiter: str = ",",
    ) -> TabularSource:
        """A CSV file with a header line, streamed (``pyarrow.csv.open_csv``)."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"CSV file {str(path)!r} does not exist")
        return cls(spec, SourceKind.CSV, (Path(path), delimiter), chunk_rows)

    # ------------------------------------------------------------------ reading
    def chunks(self) -> Iterator[Any]:
        """``pyarrow.RecordBatch``es of the spec's columns, in stream order.

        Raises:
            KeyError: naming the columns the input lacks.
        """
        cols = self.spec.columns
        if self.kind is SourceKind.PARQUET:
            import pyarrow.parquet as pq

            # pre_buffer would cache every column chunk read (the whole file, by the end)
            pf = pq.ParquetFile(self._source, pre_buffer=False)
            self._check_columns(pf.schema_arrow.names)
            yield from pf.iter_batches(batch_size=self.chunk_rows, columns=cols, use_threads=False)
        elif self.kind is SourceKind.CSV:
            import pyarrow.csv as pacsv

            path, delimiter = self._source
            parse = pacsv.ParseOptions(delimiter=delimiter)
            header = pacsv.open_csv(path, parse_options=parse)  # reads the first block only
            self._check_columns(header.schema.names)
            header.close()
            reader = pacsv.open_csv(
                path,
                read_options=pacsv.ReadOptions(use_threads=False, block_size=1 << 22),
                parse_options=parse,
                convert_options=pacsv.ConvertOptions(include_columns=cols),
            )
            for rb in reader:
                for start in range(0, rb.num_rows, self.chunk_rows):
                    yield rb.slice(start, self.chunk_rows)
        else:
            self._check_columns(self._source.column_names)
            yield from self._source.select(cols).to_batches(max_chunksize=self.chunk_rows)

    def _check_columns(self, present: list[str]) -> None:
        missing = [c for c in self.spec.columns if c not in present]
        if missing:
            raise KeyError(
                f"the {self.kind.value} source has no column(s) {missing}; it has {present}"
            )

    def _split_of(self, chunk: Any, first_row: int) -> np.ndarray:
        """``(n,) int8`` split of each row of ``chunk`` (0 train, 1 validation, 2 test)."""
        s = self.spec.splits
        f_train, f_valid, _ = s.fractions
        if s.time_column is None:
            idx = np.arange(first_row, first_row + chunk.num_rows, dtype=np.uint64)
            with np.errstate(over="ignore"):
                h = _mix64(idx + np.uint64((s.seed * _GOLDEN) % 2**64))
            u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
            lo, hi = f_train, f_train + f_valid
        else:
            u = _column_numbers(chunk, s.time_column)
            lo, hi = self.time_cuts()
        return np.where(u < lo, 0, np.where(u < hi, 1, 2)).astype(np.int8)

    def time_cuts(self) -> tuple[float, float]:
        """The time split's cuts: given, or the ``fractions`` quantiles of the time column."""
        if self._time_cuts is None:
            col = self.spec.splits.time_column
            t = np.concatenate([_column_numbers(c, str(col)) for c in self.chunks()])
            f_train, f_valid, _ = self.spec.splits.fractions
            q = np.quantile(t, [f_train, f_train + f_valid]) if t.size else np.zeros(2)
            self._time_cuts = (float(q[0]), float(q[1]))
        return self._time_cuts

    def split_chunks(self, split: Split) -> Iterator[Any]:
        """The record batches of one split (``TRAIN``, ``EVAL`` = validation, ``TEST``)."""
        import pyarrow as pa

        want = {Split.TRAIN: 0, Split.EVAL: 1, Split.TEST: 2}.get(Split(split))
        if want is None:
            raise ValueError(f"a tabular source has splits train, eval and test, not {split!r}")
        row = 0
        for chunk in self.chunks():
            mask = self._split_of(chunk, row) == want
            row += chunk.num_rows
            if mask.any():
                yield chunk.filter(pa.array(mask))

    # ------------------------------------------------------------------ fitting
    def fit(self) -> Preprocessor:
        """Fit vocabularies, bag sizes and dense statistics on the training split only.

        Raises:
            ValueError: an empty training split.
        """
        spec = self.spec
        counts: dict[str, Counter] = {c.table_name: Counter() for c in spec.categorical}
        max_bag = {c.table_name: 1 for c in spec.categorical}
        d = len(spec.dense)
        s1, s2, n = np.zeros(d), np.zeros(d), 0
        for chunk in self.split_chunks(Split.TRAIN):
            for c in spec.categorical:
                values, lengths = _raw_bags(chunk, c)
                count_keys([values], counts[c.table_name])
                if lengths.size:
                    max_bag[c.table_name] = max(max_bag[c.table_name], int(lengths.max()))
            x = _dense_raw(chunk, spec)
            s1 += x.sum(0)
            s2 += (x * x).sum(0)
            n += x.shape[0]
        if n == 0:
            raise ValueError("the training split is empty; check the split fractions or time cuts")
        mean = s1 / n
        std = np.sqrt(np.maximum(s2 / n - mean * mean, 0.0))
        vocabularies = {
            c.table_name: Vocabulary.fit(
                counts[c.table_name], c.min_count, c.max_size, c.oov, c.oov_buckets
            )
            for c in spec.categorical
        }
        hotness = {c.table_name: c.hotness or max_bag[c.table_name] for c in spec.categorical}
        return Preprocessor(
            spec, vocabularies, hotness, tuple(mean), tuple(np.where(std > 0, std, 1.0)), n
        )

    # ------------------------------------------------------------------ batches
    def batches(
        self,
        prep: Preprocessor,
        split: Split,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        shuffle_window: int = 1 << 16,
        drop_last: bool = False,
    ) -> Iterator[Batch]:
        """This rank's slice of each global batch of ``split``.

        Args:
            prep: the fitted :class:`Preprocessor`.
            split: ``Split.TRAIN``, ``Split.EVAL`` (validation) or ``Split.TEST``.
            batch_size: rows of one global batch.
            rank, world_size: this rank's :func:`~embark.data.batch.local_range` of each.
            shuffle: permute rows within windows of ``shuffle_window`` rows, by
                ``(seed, epoch, window)`` — the same order on every rank.
            drop_last: skip a last global batch shorter than ``batch_size``.

        Yields:
            :class:`Batch` of ``local_range(B, rank, world_size)`` rows.
        """
        import pyarrow as pa

        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, {rank}, {world_size}"
            )
        pending: list[Any] = []
        held = window = 0
        for chunk in self.split_chunks(split):
            pending.append(chunk)
            held += chunk.num_rows
            limit = shuffle_window if shuffle else batch_size
            if held < limit:
                continue
            table = pa.Table.from_batches(pending)
            if shuffle:
                table = table.take(_permutation(table.num_rows, seed, epoch, window))
                window += 1
            full = table.num_rows - table.num_rows % batch_size
            for start in range(0, full, batch_size):
                yield self._rank_batch(prep, table.slice(start, batch_size), rank, world_size)
            pending = table.slice(full).to_batches()
            held = table.num_rows - full
        if held:
            table = pa.Table.from_batches(pending)
            if shuffle:
                table = table.take(_permutation(table.num_rows, seed, epoch, window))
            for start in range(0, table.num_rows, batch_size):
                part = table.slice(start, batch_size)
                if part.num_rows < batch_size and drop_last:
                    break
                yield self._rank_batch(prep, part, rank, world_size)

    @staticmethod
    def _rank_batch(prep: Preprocessor, table: Any, rank: int, world_size: int) -> Batch:
        lo, hi = local_range(table.num_rows, rank, world_size)
        return prep.encode(table.slice(lo, hi - lo))


def _permutation(n: int, seed: int, epoch: int, window: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, window]).permutation(n)


def _column_numbers(chunk: Any, name: str) -> np.ndarray:
    """One column as ``float64`` (a timestamp as seconds), nulls as 0."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = chunk.column(name)
    if pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
        col = pc.cast(pc.cast(col, pa.timestamp("s")), pa.int64())
    return np.asarray(pc.fill_null(pc.cast(col, pa.float64()), 0.0).to_numpy(zero_copy_only=False))


def _raw_bags(chunk: Any, c: Categorical) -> tuple[np.ndarray, np.ndarray]:
    """``(raw ids (nnz,), lengths (n,) int64)`` of one categorical column: integers as
    ``int64``, strings as ``object``; a null is an empty bag."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = chunk.column(c.column)
    if not c.multi_hot:
        valid = pc.is_valid(col)
        values = pc.filter(col, valid)
        lengths = np.asarray(valid.to_numpy(zero_copy_only=False), dtype=np.int64)
        return _ids(values), lengths
    if c.separator is not None:
        col = pc.split_pattern(pc.cast(col, pa.string()), c.separator)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(
            f"categorical column {c.column!r} is multi_hot but holds {col.type}; expected a "
            "list column or a string column with a separator"
        )
    flat = pc.list_flatten(col)
    parents = np.asarray(pc.list_parent_indices(col).to_numpy(zero_copy_only=False), dtype=np.int64)
    keep = pc.is_valid(flat)
    if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type):
        keep = pc.and_(keep, pc.greater(pc.utf8_length(flat), 0))
    keep_np = np.asarray(pc.fill_null(keep, False).to_numpy(zero_copy_only=False), dtype=bool)
    lengths = np.bincount(parents[keep_np], minlength=len(col)).astype(np.int64)
    return _ids(pc.filter(flat, keep)), lengths


def _ids(values: Any) -> np.ndarray:
    import pyarrow as pa

    if pa.types.is_integer(values.type):
        return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return np.asarray(values.to_pylist(), dtype=object)
    raise ValueError(f"categorical ids must be integers or strings, got {values.type}")


def _record_batch(rows: Any) -> Any:
    """A ``pyarrow.RecordBatch`` of ``rows`` (a record batch, an Arrow table or a DataFrame)."""
    import pyarrow as pa

    if isinstance(rows, pa.RecordBatch):
        return rows
    if not isinstance(rows, pa.Table):
        rows = pa.Table.from_pandas(rows, preserve_index=False)
    batches = rows.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=rows.schema)


def _dense_raw(chunk: Any, spec: TabularSpec) -> np.ndarray:
    """``(n, D) float64`` dense columns after ``log1p`` where asked (before standardising)."""
    cols = []
    for d in spec.dense:
        x = _column_numbers(chunk, d.column)
        if d.transform in (ColumnTransform.LOG1P, ColumnTransform.LOG1P_STANDARDIZE):
            x = np.log1p(np.maximum(x, 0.0))
        cols.append(x)
    return np.stack(cols, axis=1) if cols else np.zeros((chunk.num_rows, 0))


@dataclass(frozen=True)
class Preprocessor:
    """What :meth:`TabularSource.fit` learnt from the training rows; turns rows into batches.

    Attributes:
        spec: the columns.
        vocabularies: ``{table: Vocabulary}``.
        hotness: ``{table: maximum bag size}`` (declared, else the training split's largest).
        dense_mean, dense_std: per dense column, of the training rows (after ``log1p`` where
            asked); used by the ``*STANDARDIZE`` transforms.
        train_rows: rows of the training split.
    """

    spec: TabularSpec
    vocabularies: Mapping[str, Vocabulary]
    hotness: Mapping[str, int]
    dense_mean: tuple[float, ...]
    dense_std: tuple[float, ...]
    train_rows: int
    _tables: dict[str, TableConfig] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._tables.update({t.name: t for t in self.tables(dim=1)})

    def tables(self, dim: int = 16) -> tuple[TableConfig, ...]:
        """One table per categorical column: rows from its vocabulary, its hotness and policy;
        ``dim`` unless the column declares one."""
        return tuple(
            TableConfig(
                name=c.table_name,
                num_rows=self.vocabularies[c.table_name].num_rows,
                dim=c.dim or dim,
                hotness=self.hotness[c.table_name],
                combiner=c.combiner,
                hotness_policy=c.hotness_policy,
            )
            for c in self.spec.categorical
        )

    def workload(
        self,
        name: str = "tabular",
        dim: int = 16,
        bottom_mlp: tuple[int, ...] = (64, 16),
        top_mlp: tuple[int, ...] = (64, 32, 1),
        interaction: Interaction | None = None,
        table_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Workload:
        """A :class:`Workload` sized from the data: tables from :meth:`tables`, the dense width
        from the spec.

        Args:
            table_overrides: ``{table: {field: value}}`` replacing fields of a table
                (``dim``, ``hotness``, ``hotness_policy``, ``combiner``); ``num_rows`` cannot be
                overridden (the vocabulary decides it).

        Raises:
            ValueError: an override for an unknown table, of ``num_rows`` or ``name``.
        """
        tables = {t.name: t for t in self.tables(dim)}
        for tname, fields_ in (table_overrides or {}).items():
            if tname not in tables:
                raise ValueError(f"table_overrides: no table {tname!r}; tables are {list(tables)}")
            bad = sorted(set(fields_) & {"num_rows", "name"})
            if bad:
                raise ValueError(f"table {tname!r}: {bad} come from the vocabulary, not overrides")
            tables[tname] = replace(tables[tname], **fields_)
        return Workload(
            name=name,
            tables=tuple(tables.values()),
            dense_features=len(self.spec.dense),
            bottom_mlp=bottom_mlp,
            top_mlp=top_mlp,
            interaction=interaction or Interaction(type="dot"),
            source="embark.data.tabular",
        )

    def serving_inputs(self, rows: Any) -> dict[str, np.ndarray]:
        """A v2 inference request for ``rows``: what a client of the server sends.

        Dense columns are transformed as in training; ids stay raw (the server maps them with
        ``vocabulary.json``, and applies each table's hotness policy itself).

        Returns:
            ``{"dense": (B, D) float32, "ids_<table>": (B, w) int64}`` with ``w`` the largest
            bag of ``rows`` (at least 1) and ``-1`` padding a shorter bag.

        Raises:
            ValueError: a table whose ids are strings (the v2 server takes integer ids).
        """
        rows = _record_batch(rows)
        out = {"dense": self._dense(rows)}
        for c in self.spec.categorical:
            raw, lengths = _raw_bags(rows, c)
            if raw.dtype == object:
                raise ValueError(
                    f"table {c.table_name!r}: string ids cannot be sent to the v2 server (it "
                    "takes INT64 ids); map them to integer keys before fitting"
                )
            width = max(1, int(lengths.max()) if lengths.size else 1)
            ids = np.full((lengths.size, width), -1, dtype=np.int64)
            starts = np.cumsum(lengths) - lengths
            pos = np.arange(raw.size) - np.repeat(starts, lengths)
            ids[np.repeat(np.arange(lengths.size), lengths), pos] = raw
            out[f"ids_{c.table_name}"] = ids
        return out

    def _dense(self, rows: Any) -> np.ndarray:
        """``(n, D) float32`` transformed dense columns of a record batch."""
        x = _dense_raw(rows, self.spec)
        for j, d in enumerate(self.spec.dense):
            if d.transform in (ColumnTransform.STANDARDIZE, ColumnTransform.LOG1P_STANDARDIZE):
                x[:, j] = (x[:, j] - self.dense_mean[j]) / self.dense_std[j]
        return x.astype(np.float32)

    def encode(self, rows: Any) -> Batch:
        """Rows (a ``pyarrow`` table or record batch, or a pandas DataFrame) → a :class:`Batch`:
        ids through the vocabularies (unknown ids by the OOV policy), every bag under its
        table's hotness policy, dense columns transformed, labels ``float32``.

        Raises:
            HotnessError: a bag over its hotness under ``REFUSE``.
            KeyError: a missing column.
        """
        rows = _record_batch(rows)
        per_key = {}
        for c in self.spec.categorical:
            raw, lengths = _raw_bags(rows, c)
            table = self._tables[c.table_name]
            raw, lens = check_or_truncate(table, raw, lengths)
            ids = self.vocabularies[c.table_name].lookup(raw)
            per_key[c.table_name] = (torch.from_numpy(ids), torch.from_numpy(lens.astype(np.int32)))
        x = self._dense(rows)
        y = _column_numbers(rows, self.spec.label)
        if self.spec.label_threshold is not None:
            y = (y >= self.spec.label_threshold).astype(np.float64)
        return Batch(
            torch.from_numpy(x),
            JaggedBatch.from_per_key(per_key),
            torch.from_numpy(y.astype(np.float32)),
        )

    # ------------------------------------------------------------------ artifact
    def save(self, folder: str | Path) -> Path:
        """Write ``vocabulary.json`` (the vocabularies, hotness and policies: the artifact
        export and the server read) and ``tabular.json`` (spec and dense statistics) into
        ``folder``, each published whole. Returns ``folder``."""
        folder = Path(folder)
        save_vocabularies(folder / FILE_NAME, self.tables(dim=1), self.vocabularies)
        doc = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "spec": self.spec.to_dict(),
            "dense_mean": list(self.dense_mean),
            "dense_std": list(self.dense_std),
            "train_rows": self.train_rows,
        }
        write_text_atomic(folder / STATE_FILE, json.dumps(doc))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Preprocessor:
        """Read what :meth:`save` wrote.

        Raises:
            ValueError: another format or version, or files that disagree.
        """
        folder = Path(folder)
        doc = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
            raise ValueError(
                f"{folder / STATE_FILE}: format {doc.get('format')!r} version "
                f"{doc.get('version')!r}; expected {STATE_FORMAT!r} version {STATE_VERSION}"
            )
        vf = load_vocabularies(folder / FILE_NAME)
        return cls(
            TabularSpec.from_dict(doc["spec"]),
            dict(vf.vocabularies),
            {t.name: t.hotness for t in vf.tables},
            tuple(doc["dense_mean"]),
            tuple(doc["dense_std"]),
            int(doc["train_rows"]),
        )
