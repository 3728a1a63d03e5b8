"""Sparse (embedding) files: HugeCTR's folder-per-table layout and a safetensors variant.

HugeCTR layout, one folder per table::

    t0/
      key          n × int64, little-endian          e.g. 00 00 .. 00 | 01 00 .. 00 | ...
      emb_vector   n × dim × float32, little-endian  row i belongs to key[i]

    keys   = [  7,   3,  42]                     (n = 3, dim = 2)
    vectors= [[.1, .2], [.3, .4], [.5, .6]]      key 7 -> [.1, .2], key 3 -> [.3, .4], ...

A table stored in a quantized row format (``tilerec_row_format_per_table`` in ``ps.json``:
FP16, INT8, INT4, ...) has ``emb_rows`` in place of ``emb_vector``: ``n`` rows of
``hps.rowformat.row_bytes(dtype, dim)`` bytes in :mod:`hps.rowformat`'s layout (row ``i``
belongs to ``key[i]``), read and written by :func:`read_table_rows` / :func:`write_table_rows`.
Its dtype is recorded in ``ps.json`` only (the file has no header): HugeCTR reads only the
float32 layout.

The safetensors variant is one file ``t0/embedding.safetensors`` holding the tensors ``key``
``(n,) int64`` and ``emb_vector`` ``(n, dim) float32`` (self-describing: dim is in the header).

:func:`convert_checkpoint` turns a trainer checkpoint folder (``embeddings.<table>.weight``
``(num_rows, dim) float32`` whole in ``model.safetensors`` or, saved sharded by any number of
ranks, in chunks of ``shards-<rank>.safetensors``; ``state.json["workload"]["tables"]``) into
one sparse folder per table, keys ``0..num_rows-1``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

import numpy as np

from hps.names import check_name, entry, entry_exists, hidden_sibling, remove_entry
from hps.rowformat import RowDtype, RowFormatError, read_row_file, row_bytes
from hps.storage.checkpoint_tables import STATE_FILE, read_table_weight

log = logging.getLogger(__name__)

KEY_FILE = "key"
VECTOR_FILE = "emb_vector"
ROWS_FILE = "emb_rows"
SAFETENSORS_FILE = "embedding.safetensors"
_KEY_BYTES = 8  # int64
_FLOAT_BYTES = 4  # float32
_FINITE_CHUNK = 1 << 16  # rows checked for NaN / inf at a time (16 MiB of bools at dim 256)


class SparseFormat(StrEnum):
    """On-disk layout of one table's sparse folder."""

    HUGECTR = "hugectr"
    SAFETENSORS = "safetensors"


def detect_format(folder: str | Path) -> SparseFormat:
    """Which layout ``folder`` holds.

    Raises:
        ValueError: when it holds neither ``key``+``emb_vector`` nor ``embedding.safetensors``.
    """
    folder = Path(folder)
    if (folder / KEY_FILE).exists() or (folder / VECTOR_FILE).exists():
        return SparseFormat.HUGECTR
    if (folder / SAFETENSORS_FILE).exists():
        return SparseFormat.SAFETENSORS
    raise ValueError(
        f"sparse folder {folder}: found neither '{KEY_FILE}'+'{VECTOR_FILE}' (HugeCTR layout) "
        f"nor '{SAFETENSORS_FILE}'"
    )


def write_table(
    folder: str | Path,
    keys: np.ndarray,
    vectors: np.ndarray,
    fmt: SparseFormat | str = SparseFormat.HUGECTR,
    overwrite: bool = False,
) -> Path:
    """Write one table.

    Args:
        folder: the table's folder (created; must not exist unless ``overwrite``). It is
            written beside itself first and renamed into place; an existing one (a folder, a
            file or a symlink, never followed) is replaced only with ``overwrite``.
        keys: ``(n,) int64``, unique.
        vectors: ``(n, dim) float32``.
        fmt: ``hugectr`` or ``safetensors``.
        overwrite: replace an existing folder.

    Raises:
        ValueError: on bad dtype/shape, duplicate keys, an existing folder, or a ``folder``
            whose last component is ``..`` (it would not name an entry of its parent).
    """
    fmt = SparseFormat(fmt)
    folder = entry(Path(folder).parent, Path(folder).name, "sparse folder")
    keys, vectors = _checked(keys, vectors, np.float32, "vectors", "dim")

    def write(tmp: Path) -> None:
        if fmt is SparseFormat.HUGECTR:
            keys.astype("<i8", copy=False).tofile(tmp / KEY_FILE)
            vectors.astype("<f4", copy=False).tofile(tmp / VECTOR_FILE)
        else:
            from safetensors.numpy import save_file

            save_file(
                {"key": np.ascontiguousarray(keys), "emb_vector": np.ascontiguousarray(vectors)},
                str(tmp / SAFETENSORS_FILE),
            )

    return _publish(folder, keys, overwrite, write)


def _checked(
    keys: np.ndarray, values: np.ndarray, dtype: type, what: str, width: str
) -> tuple[np.ndarray, np.ndarray]:
    """``keys (n,) int64`` and ``values (n, W) dtype`` as arrays, or a ``ValueError`` naming
    what is wrong."""
    keys, values = np.asarray(keys), np.asarray(values)
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise ValueError(f"keys must be (n,) int64, got {keys.dtype} {tuple(keys.shape)}")
    if values.dtype != dtype or values.ndim != 2 or values.shape[0] != keys.shape[0]:
        raise ValueError(
            f"{what} must be ({keys.shape[0]}, {width}) {np.dtype(dtype).name}, "
            f"got {values.dtype} {tuple(values.shape)}"
        )
    return keys, values


def _publish(
    folder: Path, keys: np.ndarray, overwrite: bool, write: Callable[[Path], None]
) -> Path:
    """Write a table's files with ``write(staging folder)``, then swap the staging folder in
    whole (:func:`_swap_in`); on any failure the staging folder is removed and ``folder`` is
    as it was."""
    _check_unique_keys(folder, keys)
    if entry_exists(folder) and not overwrite:
        raise ValueError(f"sparse folder {folder} exists; pass overwrite=True to replace it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(folder, "tmp")
    tmp.mkdir()
    try:
        write(tmp)
        _swap_in(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def write_table_rows(
    folder: str | Path, keys: np.ndarray, rows: np.ndarray, overwrite: bool = False
) -> Path:
    """Write one table whose rows are stored in a row format: ``key`` and ``emb_rows``
    (the module docstring), published whole as :func:`write_table` publishes.

    Args:
        keys: ``(n,) int64``, unique.
        rows: ``(n, row_bytes) uint8`` in :mod:`hps.rowformat`'s layout (its dtype goes into
            ``ps.json``).

    Raises:
        ValueError: as :func:`write_table`, or ``rows`` that are not ``(n, W) uint8``.
    """
    folder = entry(Path(folder).parent, Path(folder).name, "sparse folder")
    keys, rows = _checked(keys, rows, np.uint8, "rows", "row_bytes")

    def write(tmp: Path) -> None:
        keys.astype("<i8", copy=False).tofile(tmp / KEY_FILE)
        np.ascontiguousarray(rows).tofile(tmp / ROWS_FILE)

    return _publish(folder, keys, overwrite, write)


def has_table_rows(folder: str | Path) -> bool:
    """Whether ``folder`` holds rows in a row format (``emb_rows``) rather than float32."""
    return (Path(folder) / ROWS_FILE).is_file()


def read_table_rows(
    folder: str | Path, dtype: RowDtype, dim: int, table: str
) -> tuple[np.ndarray, np.ndarray]:
    """Read a table written by :func:`write_table_rows`.

    Returns:
        ``(keys (n,) int64, rows (n, row_bytes(dtype, dim)) uint8)``.

    Raises:
        RowFormatError: naming ``table`` and the file: ``emb_rows`` is not a whole number of
            rows of ``dtype`` and ``dim`` (truncated, or of another dtype or width), holds
            another number of rows than ``key`` holds keys, or a row's scale or bias is NaN
            or infinite; a missing file, or a key held twice.
    """
    folder = Path(folder)
    kpath, rpath = folder / KEY_FILE, folder / ROWS_FILE
    for f in (kpath, rpath):
        if not f.is_file():
            raise RowFormatError(
                f"table {table!r}: sparse folder {folder}: missing file '{f.name}'"
            )
    kbytes = kpath.stat().st_size
    if kbytes % _KEY_BYTES:
        raise RowFormatError(
            f"table {table!r} ({kpath}): {kbytes} bytes is not a whole number of int64 keys"
        )
    rows = read_row_file(rpath, dtype, dim, table).numpy()  # length and scales checked
    keys = np.fromfile(kpath, dtype="<i8").astype(np.int64, copy=False)
    if keys.size != rows.shape[0]:
        raise RowFormatError(
            f"table {table!r} ({rpath}): {rows.shape[0]} rows of {row_bytes(dtype, dim)} bytes "
            f"but {keys.size} keys in '{KEY_FILE}'"
        )
    _check_unique_keys(folder, keys)
    return keys, rows


def _swap_in(new: Path, dest: Path) -> None:
    """Rename the folder ``new`` to ``dest`` (a sibling). Whatever is at ``dest`` (a folder, a
    file, a symlink: never followed) is first renamed aside and removed once ``new`` is in
    place; it is put back when the rename fails."""
    if not entry_exists(dest):
        os.rename(new, dest)
        return
    old = hidden_sibling(dest, "old")
    os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    remove_entry(old)


def read_table(
    folder: str | Path, dim: int | None = None, mmap: bool = True, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Read one table's keys and rows.

    Args:
        folder: the table's folder (either layout, detected).
        dim: row width; required for the HugeCTR layout (the files carry no header), checked
            against the safetensors header otherwise.
        mmap: memory-map the HugeCTR files instead of reading them (large tables).
        check_finite: refuse a row holding a NaN or infinite value (one pass over the rows;
            off only for a caller that needs the row count, not the rows).

    Returns:
        ``(keys (n,) int64, vectors (n, dim) float32)``.

    Raises:
        ValueError: for a truncated ``emb_vector``, a key count that differs from the row
            count, a wrong dim, a missing file, a key that occurs more than once (the
            tiers would hold two rows for it), or (``check_finite``) a non-finite row, naming
            its key (served, it would turn every score it touches into NaN).
    """
    folder = Path(folder)
    if has_table_rows(folder):
        raise ValueError(
            f"sparse folder {folder} holds rows in a row format ('{ROWS_FILE}'), not float32 "
            "rows: its dtype is in ps.json (tilerec_row_format_per_table); read it with "
            "read_table_rows"
        )
    if detect_format(folder) is SparseFormat.SAFETENSORS:
        keys, vec = _read_safetensors(folder, dim)
    else:
        keys, vec = _read_hugectr(folder, dim, mmap)
    _check_unique_keys(folder, keys)
    if check_finite:
        _check_finite_rows(folder, keys, vec)
    return keys, vec


def _check_finite_rows(folder: Path, keys: np.ndarray, vec: np.ndarray) -> None:
    """Raise ``ValueError`` naming the first key whose row of ``vec (n, dim)`` holds a NaN or
    an infinity. Checked in chunks of ``_FINITE_CHUNK`` rows: a memory-mapped table is never
    read whole into memory."""
    bad_rows = 0
    first: int | None = None
    for s in range(0, vec.shape[0], _FINITE_CHUNK):
        ok = np.isfinite(vec[s : s + _FINITE_CHUNK]).all(axis=1)
        if not ok.all():
            bad = np.flatnonzero(~ok)
            bad_rows += int(bad.size)
            if first is None:
                first = s + int(bad[0])
    if first is None:
        return
    row = np.asarray(vec[first])
    raise ValueError(
        f"sparse folder {folder}: the row of key {int(keys[first])} (row {first} of "
        f"'{VECTOR_FILE}') holds a non-finite value ({row[~np.isfinite(row)][0]}); "
        f"{bad_rows} such row(s). Rows must be finite: a NaN row would be served"
    )


def _read_safetensors(folder: Path, dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, vectors)`` of ``folder/embedding.safetensors``, dtypes and shapes checked."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        d = load_file(str(folder / SAFETENSORS_FILE))
    except SafetensorError as e:
        raise ValueError(
            f"{folder / SAFETENSORS_FILE}: not a readable safetensors file ({e})"
        ) from None
    if "key" not in d or "emb_vector" not in d:
        raise ValueError(
            f"{folder / SAFETENSORS_FILE}: needs tensors 'key' and 'emb_vector', has {sorted(d)}"
        )
    keys, vec = d["key"], d["emb_vector"]
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise ValueError(f"{folder}: 'key' must be (n,) int64, got {keys.dtype} {keys.shape}")
    if vec.dtype != np.float32 or vec.ndim != 2:
        raise ValueError(
            f"{folder}: 'emb_vector' must be (n, dim) float32, got {vec.dtype} {vec.shape}"
        )
    if dim is not None and vec.shape[1] != dim:
        raise ValueError(f"{folder}: rows have dim {vec.shape[1]}, the config says {dim}")
    if vec.shape[0] != keys.shape[0]:
        raise ValueError(f"{folder}: {keys.shape[0]} keys but {vec.shape[0]} rows in emb_vector")
    return keys, vec


def _read_hugectr(folder: Path, dim: int | None, mmap: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, vectors)`` of HugeCTR's ``key`` + ``emb_vector`` files (headerless: their sizes
    are checked against ``dim``), memory-mapped when ``mmap``."""
    if dim is None or dim <= 0:
        raise ValueError(f"{folder}: the HugeCTR layout needs the row width; got dim={dim!r}")
    kpath, vpath = folder / KEY_FILE, folder / VECTOR_FILE
    for p in (kpath, vpath):
        if not p.exists():
            raise ValueError(f"sparse folder {folder}: missing file '{p.name}'")
    kbytes, vbytes = kpath.stat().st_size, vpath.stat().st_size
    if kbytes % _KEY_BYTES:
        raise ValueError(
            f"{kpath}: {kbytes} bytes is not a whole number of int64 keys (truncated?)"
        )
    row_bytes = dim * _FLOAT_BYTES
    if vbytes % row_bytes:
        raise ValueError(
            f"{vpath}: {vbytes} bytes is not a whole number of rows of dim {dim} "
            f"({row_bytes} bytes each): truncated or wrong dim"
        )
    n_keys, n_rows = kbytes // _KEY_BYTES, vbytes // row_bytes
    if n_keys != n_rows:
        raise ValueError(
            f"{folder}: {n_keys} keys in '{KEY_FILE}' but {n_rows} rows of dim {dim} in '{VECTOR_FILE}'"
        )
    if n_keys == 0:
        return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
    if mmap:
        keys = np.memmap(kpath, dtype="<i8", mode="r", shape=(n_keys,))
        vec = np.memmap(vpath, dtype="<f4", mode="r", shape=(n_rows, dim))
        return keys, vec
    return np.fromfile(kpath, dtype="<i8"), np.fromfile(vpath, dtype="<f4").reshape(n_rows, dim)


def _check_unique_keys(folder: Path, keys: np.ndarray) -> None:
    """Raise ``ValueError`` naming the duplicates unless every key of ``keys (n,)`` is unique.

    One sort when the keys are unique (the common case, millions of them); the details (how
    many keys repeat, which comes first in the file) are worked out only on the error path.
    """
    # np.sort, not np.unique(keys).size: numpy 2.4's plain unique takes a hash-table path that
    # took 12 s for 10M distinct int64 keys where the sort took 0.19 s (measured on the dev box,
    # one thread).
    s = np.sort(keys)
    if not (s[1:] == s[:-1]).any():
        return
    uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
    dup = counts > 1
    i = int(np.argmin(np.where(dup, first, keys.size)))  # the repeated key met first in the file
    raise ValueError(
        f"sparse folder {folder}: {int(dup.sum())} key(s) occur more than once "
        f"({keys.size - uniq.size} extra rows); the first is key {int(uniq[i])} "
        f"({int(counts[i])} times, first at row {int(first[i])}). Keys must be unique"
    )


def convert_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    fmt: SparseFormat | str = SparseFormat.HUGECTR,
    tables: list[str] | None = None,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Convert a trainer checkpoint folder to sparse folders ``out_dir/<table>``.

    Args:
        ckpt_dir: a trainer checkpoint folder: ``state.json`` and ``model.safetensors``, plus
            ``shards-<rank>.safetensors`` per rank when a sharded run (any world size) saved
            it; each table is read whole or assembled from its chunks
            (:mod:`hps.storage.checkpoint_tables`).
        out_dir: receives one folder per table, ``out_dir/<table>``; table names must follow
            the name rule (:mod:`hps.names`), so nothing is written outside ``out_dir``.
        fmt: sparse layout to write.
        tables: subset of table names (default: every table of the workload).
        overwrite: replace existing table folders.

    Returns:
        ``{table name: folder}``.

    Raises:
        ValueError: when a file is missing or differs from its recorded size and sha256, a
            table is unknown or its name is not a valid name (``../victim``, ``/abs/path``:
            checked before anything is written), a weight's shape disagrees with the
            workload's ``num_rows``/``dim``, or a sharded table's chunks do not tile it.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    state_path = ckpt_dir / STATE_FILE
    if not state_path.exists():
        raise ValueError(f"checkpoint {ckpt_dir}: missing {state_path.name}")
    state = json.loads(state_path.read_text())
    try:
        specs = {t["name"]: t for t in state["workload"]["tables"]}
    except (KeyError, TypeError):
        raise ValueError(
            f"{state_path}: expected state['workload']['tables'] (a list of tables)"
        ) from None
    for n in specs:  # before anything is written: a name is joined to out_dir below
        check_name(n, f"{state_path}: table name")
    names = list(specs) if tables is None else list(tables)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(
            f"checkpoint {ckpt_dir}: unknown table(s) {unknown}; it has {sorted(specs)}"
        )
    folders = {n: entry(out_dir, n, "table name") for n in names}
    out: dict[str, Path] = {}
    for name in names:
        shape = (int(specs[name]["num_rows"]), int(specs[name]["dim"]))
        w = read_table_weight(ckpt_dir, state, name, shape)
        keys = np.arange(w.shape[0], dtype=np.int64)
        out[name] = write_table(folders[name], keys, w, fmt=fmt, overwrite=overwrite)
        log.info("converted table %s: %d rows of dim %d -> %s", name, *w.shape, out[name])
    return out
