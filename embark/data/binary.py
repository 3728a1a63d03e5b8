"""Memory-mapped reading of TorchRec's binary Criteo layout (:mod:`embark.data.convert`), each
rank reading only its share of every batch.

The files of a folder are one stream of ``N`` samples, in the manifest's order (or, for a
folder TorchRec wrote, its ``<stem>_dense.npy`` files in natural order: ``day_2`` before
``day_10``). Global batch ``i`` is samples ``i*B .. (i+1)*B - 1`` of the stream and rank ``r``
reads :func:`~embark.data.batch.local_range` of it — the same slice
:func:`~embark.data.batch.local_batch` cuts, so ranks are disjoint and cover every sample::

    stream   | day_0: 0 1 2 3 4 5 6 | day_1: 7 8 9 ...      B = 4, world 2
    batch    |   0: 0 1 | 2 3   |   1: 4 5 | 6 7  |   2: 8 9 | ...
    rank     |      0   |  1    |      0   |  1    |      0   | ...

With ``shuffle=True`` the stream is permuted within windows of ``shuffle_window`` samples
(window ``w`` by a generator seeded ``(seed, epoch, w)``), so memory stays bounded and every
rank computes the same order without talking to the others. Only the rows a rank needs are
mapped (a window at most), so a file far larger than memory reads in bounded memory.

Preprocessing equals :class:`~embark.data.criteo.CriteoTSV`'s: ids become rows
``id % num_rows`` (ids read as unsigned 64-bit), labels ``float32``. Dense features are used
as stored: our converter stores ``log(1 + max(x, 0))`` (MLPerf's, what ``CriteoTSV`` computes);
TorchRec's ``tsv_to_npys`` stores ``log(x - min + 2)`` with ``min`` its file's smallest
value — :attr:`CriteoBinary.dense_transform` says which.

A folder is read only through its manifest (:mod:`embark.data.manifest`), which the converter
writes last: a folder without one is refused, naming it, and every file is checked against it
on open (rows, size and, unless ``verify=False``, the sha256 of its rows), so files of an
interrupted or another conversion are never read. Labels are checked to be 0 or 1 as they
are read. Files TorchRec's ``tsv_to_npys`` wrote (no manifest) are read by passing their
``<folder>/<stem>`` prefixes with ``dense_transform=DenseTransform.TORCHREC``.

Multi-hot (``multi_hot=True``): a one-hot id is expanded to its table's ``hotness`` ids as
MLPerf DLRM-DCNv2's materialised multi-hot dataset does — each row ``r`` of table ``t`` has a
fixed bag, its first id ``r`` and the others drawn uniformly over the table — with the draws
a hash of ``(seed, t, r, k)`` (:func:`expand_multi_hot`) instead of a stored table, so every
rank and every pass see the same bag for the same row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from embark.data.batch import Batch, local_range
from embark.data.jagged import JaggedBatch
from embark.data.manifest import (
    ArrayKind,
    DenseTransform,
    check_labels,
    read_manifest,
    verify_folder,
)
from embark.data.npy import NpyArray
from embark.models.workloads import Workload

DEFAULT_SHUFFLE_WINDOW = 1 << 16  # samples; 17 MiB of Criteo rows


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over ``uint64`` (a bijection with good avalanche)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def expand_multi_hot(
    rows: np.ndarray, num_rows: int, hotness: int, seed: int, table: int
) -> np.ndarray:
    """Expand one-hot rows to bags of ``hotness`` rows.

    Args:
        rows: ``(n,) int64`` row ids in ``[0, num_rows)``.
        num_rows: the table's rows.
        hotness: ids per bag, >= 1.
        seed, table: select the fixed bag of each row.

    Returns:
        ``(n, hotness) int64``: column 0 is ``rows``; column ``k`` is
        ``mix64(mix64(seed·φ + table) ^ (rows·hotness + k)) % num_rows`` — a function of the row
        alone, so equal rows get equal bags.
    """
    with np.errstate(over="ignore"):
        key = _mix64(np.array([(seed * 0x9E3779B97F4A7C15 + table) % 2**64], dtype=np.uint64))[0]
        k = np.arange(hotness, dtype=np.uint64)[None, :]
        h = _mix64(key ^ (rows.astype(np.uint64)[:, None] * np.uint64(hotness) + k))
    out = (h % np.uint64(num_rows)).astype(np.int64)
    out[:, 0] = rows
    return out


class _Part:
    """One input's three arrays, checked against each other and the workload."""

    def __init__(
        self, dense: NpyArray, sparse: NpyArray, labels: NpyArray, num_dense: int, num_sparse: int
    ) -> None:
        self.dense, self.sparse, self.labels = dense, sparse, labels
        n = self.dense.num_rows
        checks = [
            (self.dense, (n, num_dense), ("float32",)),
            (self.sparse, (n, num_sparse), ("int64", "int32")),
            (self.labels, (n, 1), ("int32", "int64", "float32")),
        ]
        for arr, shape, dtypes in checks:
            got = arr.shape if arr is not self.labels or len(arr.shape) == 2 else (*arr.shape, 1)
            if got != shape or arr.dtype.name not in dtypes:
                raise ValueError(
                    f"{arr.path}: expected shape {shape} of {'/'.join(dtypes)}, "
                    f"got {arr.shape} {arr.dtype}"
                )
        self.rows = n

    @classmethod
    def at(cls, base: Path, num_dense: int, num_sparse: int) -> _Part:
        """The arrays ``<base>_<kind>.npy``."""
        dense, sparse, labels = (NpyArray.open(f"{base}_{k.value}.npy") for k in ArrayKind)
        return cls(dense, sparse, labels, num_dense, num_sparse)

    def labels_of(self, lo: int, hi: int) -> np.ndarray:
        """``(hi - lo,)`` labels of rows ``lo:hi``, checked to be 0 or 1."""
        labels = self.labels.rows(lo, hi).reshape(hi - lo)
        check_labels(labels, self.labels.path, lo)
        return labels


def _folder_parts(
    folder: Path, workload: Workload, verify: bool
) -> tuple[list[_Part], DenseTransform]:
    """The parts of a converted folder, checked against its manifest."""
    if not folder.is_dir():
        raise FileNotFoundError(f"Criteo binary folder {str(folder)!r} does not exist")
    manifest = read_manifest(folder)
    arrays = verify_folder(folder, manifest, checksums=verify)
    d, t = workload.dense_features, len(workload.tables)
    parts = [
        _Part(
            arrays[(f.stem, ArrayKind.DENSE)],
            arrays[(f.stem, ArrayKind.SPARSE)],
            arrays[(f.stem, ArrayKind.LABELS)],
            d,
            t,
        )  # fmt: skip
        for f in manifest.files
    ]
    return parts, manifest.dense_transform


class CriteoBinary:
    """Batches of a converted Criteo folder for one rank (module docstring).

    Args:
        path: a folder written by :func:`~embark.data.convert.convert_criteo` (its manifest
            is required), or a sequence of ``<folder>/<stem>`` prefixes, read in order (files
            TorchRec's ``tsv_to_npys`` wrote, for one; nothing records their row counts).
        workload: ``D = workload.dense_features`` and one table per sparse column, in order;
            their ``num_rows`` hash the ids, their ``hotness`` is the bag size with
            ``multi_hot``.
        batch_size: GLOBAL samples per batch, > 0; rank ``r`` gets ``local_range`` of it.
        rank, world_size: this rank, ``0 <= rank < world_size``.
        shuffle: permute samples within windows of ``shuffle_window`` (by ``seed`` and epoch).
        seed: the shuffle's and the multi-hot expansion's seed.
        drop_last: drop a final partial global batch.
        multi_hot: expand each id to its table's ``hotness`` ids (:func:`expand_multi_hot`).
        shuffle_window: samples per shuffle window, > 0.
        dense_transform: what the dense arrays of prefixes hold (a folder's manifest says).
        verify: check the sha256 of every file of a folder on open (one read of the folder;
            rows, sizes and labels are checked always).

    Raises:
        FileNotFoundError: naming a missing folder or file, or a folder without a manifest.
        ValueError: for bad sizes or ranks, a manifest that cannot be read (naming it),
            files that differ from their manifest, or whose shapes or dtypes do not fit the
            workload (naming the file); when reading, a label other than 0 or 1.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        workload: Workload,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        multi_hot: bool = False,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        dense_transform: DenseTransform = DenseTransform.LOG1P_CLIP0,
        verify: bool = True,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("world_size", world_size),
            ("shuffle_window", shuffle_window),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        d, t = workload.dense_features, len(workload.tables)
        self.dense_transform: DenseTransform
        if isinstance(path, str | os.PathLike):
            self._parts, self.dense_transform = _folder_parts(Path(path), workload, verify)
        else:
            self._parts = [_Part.at(Path(p), d, t) for p in path]
            self.dense_transform = DenseTransform(dense_transform)
        self.workload, self.batch_size = workload, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.multi_hot, self.shuffle_window = multi_hot, shuffle_window
        self._starts = np.cumsum([0] + [p.rows for p in self._parts])
        self._rows = np.array([t.num_rows for t in workload.tables], dtype=np.uint64)
        self._window: tuple[tuple[int, int], np.ndarray] | None = (
            None  # ((epoch, window), permutation)
        )

    @property
    def num_samples(self) -> int:
        """``N``: samples in the stream."""
        return int(self._starts[-1])

    def __len__(self) -> int:
        """Global batches per pass."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    # ------------------------------------------------------------------ reading
    def _order(self, lo: int, hi: int, epoch: int) -> np.ndarray:
        """``(hi - lo,) int64`` stream positions of shuffled positions ``lo:hi``."""
        out = []
        w = self.shuffle_window
        for win in range(lo // w, (hi - 1) // w + 1):
            if self._window is None or self._window[0] != (epoch, win):
                start, stop = win * w, min((win + 1) * w, self.num_samples)
                rng = np.random.default_rng([self.seed, epoch, win])
                self._window = ((epoch, win), start + rng.permutation(stop - start))
            perm = self._window[1]
            a, b = max(lo, win * w) - win * w, min(hi, (win + 1) * w) - win * w
            out.append(perm[a:b])
        return np.concatenate(out)

    def _empty(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.empty((n, self.workload.dense_features), dtype=np.float32),
            np.empty((n, len(self.workload.tables)), dtype=np.int64),
            np.empty(n, dtype=np.float32),
        )

    def _copy(self, part: _Part, lo: int, hi: int, out: tuple[np.ndarray, ...], at: slice) -> None:
        """Rows ``lo:hi`` of ``part`` into ``out[k][at]``."""
        dense, ids, labels = out
        dense[at] = part.dense.rows(lo, hi)
        ids[at] = part.sparse.rows(lo, hi)
        labels[at] = part.labels_of(lo, hi)

    def _read_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense (n, D), ids (n, T), labels (n,))`` of stream positions ``lo:hi``."""
        out = self._empty(hi - lo)
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        for k in range(first, len(self._parts)):
            start = int(self._starts[k])
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, int(self._starts[k + 1]))
            if a < b:
                self._copy(self._parts[k], a - start, b - start, out, slice(a - lo, b - lo))
        return out

    def _gather(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense (n, D), ids (n, T), labels (n,))`` of stream positions, in their order;
        each file maps only the span of rows asked of it."""
        out = self._empty(positions.size)
        part_of = np.searchsorted(self._starts, positions, side="right") - 1
        for k in np.unique(part_of):
            sel = np.flatnonzero(part_of == k)
            local = positions[sel] - self._starts[k]
            lo, hi = int(local.min()), int(local.max()) + 1
            part = self._parts[k]
            dense, ids, labels = out
            dense[sel] = part.dense.rows(lo, hi)[local - lo]
            ids[sel] = part.sparse.rows(lo, hi)[local - lo]
            labels[sel] = part.labels_of(lo, hi)[local - lo]
        return out

    def _batch(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> Batch:
        hashed = (ids.view(np.uint64) % self._rows).astype(np.int64)  # (n, T), ids as unsigned
        n, tables = hashed.shape[0], self.workload.tables
        if self.multi_hot:
            bags = [
                expand_multi_hot(hashed[:, j], t.num_rows, t.hotness, self.seed, j).reshape(-1)
                for j, t in enumerate(tables)
            ]
            values = np.concatenate(bags) if bags else np.zeros(0, np.int64)
            lengths = np.repeat(np.array([t.hotness for t in tables], dtype=np.int32), n)
        else:
            values = np.ascontiguousarray(hashed.T).reshape(-1)  # key-major
            lengths = np.ones(n * len(tables), dtype=np.int32)
        sparse = JaggedBatch(
            [t.name for t in tables], torch.from_numpy(values), torch.from_numpy(lengths)
        )
        return Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels))

    def batch(self, index: int, epoch: int = 0) -> Batch:
        """This rank's slice of global batch ``index`` of pass ``epoch``.

        Raises:
            IndexError: for an index outside ``[0, len(self))``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is outside [0, {len(self)})")
        start = index * self.batch_size
        size = min(self.batch_size, self.num_samples - start)
        lo, hi = local_range(size, self.rank, self.world_size)
        if not self.shuffle:
            return self._batch(*self._read_range(start + lo, start + hi))
        return self._batch(*self._gather(self._order(start + lo, start + hi, epoch)))

    def batches(self, start: int = 0, epoch: int = 0) -> Iterator[Batch]:
        """This rank's slices of global batches ``start, start+1, ...`` to the end of a pass."""
        for i in range(start, len(self)):
            yield self.batch(i, epoch)

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()
