"""The persistent database: RocksDB (``rocksdict``) holding every row of every table.

One column family per table, named by the table's database name
(:meth:`hps.config.PSConfig.db_table`: ``t0``, or ``foo.t0`` and ``bar.t0`` where models ``foo``
and ``bar`` name a table ``t0`` with other rows); key = the int64 key's 8 little-endian bytes,
value = the row's bytes in the table's row format (:mod:`hps.rowformat`: ``dim``
little-endian float32s for FP32, ``D + 4`` bytes for INT8, ...). HugeCTR names its column families
``hps_et.<model>.<table>`` and keeps no dims or offsets beside them, so a RocksDB HugeCTR filled
is not read: the tables are loaded again from their sparse files
(``docs/migrating-from-hugectr.md``). A ``__hps_meta__`` column family holds each table's dim and the
online-update offset, written in the same atomic ``WriteBatch`` as the rows of an update,
and the row format of each table that is not FP32 (``fmt:<table>``).
Reads are chunked multi-gets of ``max_batch_size`` keys.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from hps.rowformat import RowDtype
from hps.storage.row_codec import RowCodec
from hps.types import CorruptRowError, StorageBackend, check_keys, check_values

log = logging.getLogger(__name__)

META_CF = "__hps_meta__"
_RESERVED = frozenset({"default", META_CF})  # column families that are not tables


def encode_keys(keys: np.ndarray) -> list[bytes]:
    """``(n,) int64`` → ``n`` 8-byte little-endian ``bytes`` (one numpy call, no Python loop)."""
    return keys.astype("<i8", copy=False).view("V8").tolist()


def decode_rows(
    res: list[bytes | None], codec: RowCodec, what: str, keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Multi-get results (``None`` = missing) → ``(rows (n, row_bytes) uint8, found (n,) bool)``,
    the stored bytes (``codec.decode`` makes float32 of them).

    Args:
        res: ``n`` stored values, ``codec.row_bytes`` each, or ``None``.
        codec: the table's row format.
        what: the database and table, for errors.
        keys: ``(n,)`` the keys looked up, to name a damaged row.

    Raises:
        CorruptRowError: a stored value is not one row, naming the first such key.
    """
    n, rb = len(res), codec.row_bytes
    found = np.fromiter((r is not None for r in res), dtype=bool, count=n)
    out = np.zeros((n, rb), np.uint8)
    if found.any():
        sizes = np.fromiter((len(r) if r is not None else rb for r in res), dtype=np.int64, count=n)
        bad = np.flatnonzero(sizes != rb)
        if bad.size:
            i = int(bad[0])
            key = f"key {int(keys[i])}" if keys is not None else f"entry {i} of the batch"
            row = (
                f"{codec.dim} float32s"
                if codec.dtype is RowDtype.FP32
                else f"one {rb}-byte {codec.dtype.value} row of dim {codec.dim}"
            )
            raise CorruptRowError(
                f"{what}: {key} holds {int(sizes[i])} bytes, not {row} "
                f"({bad.size} such rows in this batch of {n}; corrupted database?)"
            )
        out[found] = np.frombuffer(b"".join(r for r in res if r is not None), np.uint8).reshape(
            -1, rb
        )
    return out, found


def encode_rows(rows: np.ndarray) -> list[bytes]:
    """``(n, row_bytes) uint8`` → ``n`` ``bytes`` values (one numpy call)."""
    return np.ascontiguousarray(rows).view(f"V{rows.shape[1]}").reshape(-1).tolist()


class RocksDBBackend(StorageBackend):
    """RocksDB persistent tier.

    Args:
        path: database folder (created unless ``read_only``).
        read_only: open read-only (many processes may share it); writes raise ``ValueError``.
        max_batch_size: keys per multi-get call.
    """

    name = "rocks_db"

    def __init__(
        self, path: str | Path, read_only: bool = False, max_batch_size: int = 65536
    ) -> None:
        from rocksdict import AccessType, Options, Rdict

        self.path = str(path)
        self.read_only = read_only
        self.max_batch_size = max_batch_size
        self._lock = threading.Lock()
        opts = Options(raw_mode=True)
        opts.create_if_missing(not read_only)
        exists = Path(self.path, "CURRENT").exists()
        if read_only and not exists:
            raise ValueError(
                f"persistent_db.path {self.path!r}: no RocksDB there to open read-only"
            )
        cfs = Rdict.list_cf(self.path, Options(raw_mode=True)) if exists else ["default"]
        families = {n: Options(raw_mode=True) for n in cfs if n != "default"}
        access = AccessType.read_only() if read_only else AccessType.read_write()
        self._db: Any = Rdict(self.path, opts, column_families=families or None, access_type=access)
        self._cf: dict[str, Any] = {n: self._db.get_column_family(n) for n in families}
        if META_CF not in self._cf and not read_only:
            self._cf[META_CF] = self._db.create_column_family(META_CF, Options(raw_mode=True))
        self._codecs: dict[str, RowCodec] = {}
        if META_CF in self._cf:
            for n in self._cf:
                raw = self._cf[META_CF].get(f"dim:{n}".encode())
                if raw is not None:
                    fmt = self._cf[META_CF].get(f"fmt:{n}".encode())
                    dtype = RowDtype(fmt.decode()) if fmt is not None else RowDtype.FP32
                    self._codecs[n] = RowCodec(int(raw), dtype, f"persistent db table {n!r}")

    # ------------------------------------------------------------------ tables and metadata
    def create_table(self, table: str, dim: int, row_format: RowDtype = RowDtype.FP32) -> None:
        """Declare ``table`` (its own column family) with rows of ``dim`` values stored as
        ``row_format``.

        Raises:
            ValueError: another dim or row format than the stored one (a format changed since the
                database was loaded: reload it from the sparse files); a table the read-only
                database lacks;
                a name RocksDB or this backend holds already (``default``, ``__hps_meta__``).
        """
        from rocksdict import Options

        if table in _RESERVED:
            raise ValueError(
                f"persistent db table name {table!r} is reserved (RocksDB's own column families "
                f"and ours: {sorted(_RESERVED)}); rename the table"
            )
        codec = RowCodec(dim, RowDtype(row_format), f"persistent db table {table!r}")
        with self._lock:
            if table in self._codecs:
                had = self._codecs[table]
                if had.dim != dim:
                    raise ValueError(f"persistent db table {table!r} has dim {had.dim}, not {dim}")
                if had.dtype is not codec.dtype:
                    raise ValueError(
                        f"persistent db {self.path!r}: table {table!r} holds {had.dtype.value} "
                        f"rows, not {codec.dtype.value}; delete the database to load it again"
                    )
                return
            if self.read_only:
                raise ValueError(
                    f"persistent db {self.path!r} is read-only and has no table {table!r}"
                )
            if table not in self._cf:
                self._cf[table] = self._db.create_column_family(table, Options(raw_mode=True))
            self._cf[META_CF].put(f"dim:{table}".encode(), str(dim).encode())
            if codec.dtype is not RowDtype.FP32:
                self._cf[META_CF].put(f"fmt:{table}".encode(), codec.dtype.value.encode())
            self._codecs[table] = codec

    def has_table(self, table: str) -> bool:
        return table in self._codecs

    def get_meta(self, name: str) -> bytes | None:
        """A metadata value (e.g. the last applied update offset), ``None`` when unset."""
        if META_CF not in self._cf:
            return None
        return self._cf[META_CF].get(f"user:{name}".encode())

    def _codec(self, table: str) -> RowCodec:
        try:
            return self._codecs[table]
        except KeyError:
            raise ValueError(
                f"persistent db has no table {table!r}; tables: {sorted(self._codecs)}"
            ) from None

    def row_format(self, table: str) -> RowDtype:
        """How ``table``'s rows are stored."""
        return self._codec(table).dtype

    # -------------------------------------------------------------------------- reads
    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(values (n, dim) float32, found (n,) bool)``, dequantized; zeros where not found."""
        rows, found = self.lookup_rows(table, keys)
        return self._codec(table).decode(rows), found

    def lookup_rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows (n, row_bytes) uint8, found (n,) bool)``: the stored bytes."""
        keys = check_keys(keys)
        codec = self._codec(table)
        cf = self._cf[table]
        what = f"persistent db table {table!r}"
        if keys.size <= self.max_batch_size:
            return decode_rows(cf.get(encode_keys(keys)), codec, what, keys)
        out = np.zeros((keys.size, codec.row_bytes), np.uint8)
        found = np.zeros(keys.size, bool)
        for s in range(0, keys.size, self.max_batch_size):
            chunk = keys[s : s + self.max_batch_size]
            v, f = decode_rows(cf.get(encode_keys(chunk)), codec, what, chunk)
            out[s : s + v.shape[0]], found[s : s + v.shape[0]] = v, f
        return out, found

    def size(self, table: str) -> int:
        """Rows in ``table`` (RocksDB's estimate; exact right after a bulk load)."""
        self._codec(table)
        return int(self._cf[table].property_int_value("rocksdb.estimate-num-keys") or 0)

    # -------------------------------------------------------------------------- writes
    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        self.write_batch([(table, keys, values)])

    def insert_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Write stored bytes, ``rows (n, row_bytes) uint8``, as they are."""
        self.write_batch([], rows_bytes=[(table, keys, rows)])

    def write_batch(
        self,
        rows: list[tuple[str, np.ndarray, np.ndarray]],
        meta: dict[str, bytes] | None = None,
        rows_bytes: list[tuple[str, np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        """Write rows of several tables and metadata in ONE atomic RocksDB ``WriteBatch``.

        Args:
            rows: ``[(table, keys (n,) int64, values (n, dim) float32), ...]`` (quantized to
                each table's row format).
            meta: metadata to set in the same batch (``{"update_offset": b"..."}``).
            rows_bytes: ``[(table, keys (n,) int64, rows (n, row_bytes) uint8), ...]``, stored
                bytes written as they are.

        Raises:
            ValueError: in read-only mode, or for an unknown table / bad shapes / a row the
                table's format cannot hold (nothing written).
        """
        from rocksdict import WriteBatch

        if self.read_only:
            raise ValueError(f"persistent db {self.path!r} was opened read-only; cannot write")
        encoded: list[tuple[str, np.ndarray, np.ndarray]] = []
        for table, keys, values in rows:
            keys = check_keys(keys)
            codec = self._codec(table)
            encoded.append((table, keys, codec.encode(check_values(values, keys.size, codec.dim))))
        for table, keys, raw in rows_bytes or []:
            keys = check_keys(keys)
            raw = self._codec(table).check_stored(raw, keys.size, f"persistent db table {table!r}")
            encoded.append((table, keys, raw))
        wb = WriteBatch(raw_mode=True)
        for table, keys, raw in encoded:
            handle = self._db.get_column_family_handle(table)
            for k, v in zip(encode_keys(keys), encode_rows(raw)):  # no bulk put; write path only
                wb.put(k, v, handle)
        if meta:
            handle = self._db.get_column_family_handle(META_CF)
            for name, value in meta.items():
                wb.put(f"user:{name}".encode(), value, handle)
        with self._lock:
            self._db.write(wb)

    def bulk_load(
        self,
        table: str,
        keys: np.ndarray,
        values: np.ndarray,
        chunk: int = 262144,
        source: Any = None,
    ) -> None:
        """Load a whole table in chunks of ``chunk`` rows (each chunk one atomic batch), then
        record it as loaded, with ``source`` (JSON: which files the rows came from, see
        :mod:`hps.storage.sparse_source`; :meth:`loaded_source` returns it). ``values`` are
        ``(n, dim) float32`` (quantized to the table's format) or, ``uint8``, the stored bytes
        ``(n, row_bytes)`` written as they are."""
        for s in range(0, keys.shape[0], chunk):
            k = np.ascontiguousarray(keys[s : s + chunk], dtype=np.int64)
            if values.dtype == np.uint8:
                self.write_batch(
                    [], rows_bytes=[(table, k, np.ascontiguousarray(values[s : s + chunk]))]
                )
            else:
                v = np.ascontiguousarray(values[s : s + chunk], dtype=np.float32)
                self.write_batch([(table, k, v)])
        record = {"rows": int(keys.shape[0]), "source": source}
        self._db.put(f"loaded:{table}".encode(), json.dumps(record).encode())

    def _load_record(self, table: str) -> dict[str, Any] | None:
        raw = self._db.get(f"loaded:{table}".encode())
        return None if raw is None else dict(json.loads(raw))

    def holds_every_row(self, table: str) -> bool:
        """True once :meth:`bulk_load` loaded ``table`` whole: a key it lacks is in no tier."""
        return self.loaded_rows(table) is not None

    def loaded_rows(self, table: str) -> int | None:
        """Row count recorded by :meth:`bulk_load`, ``None`` when the table was never loaded."""
        record = self._load_record(table)
        return None if record is None else int(record["rows"])

    def loaded_source(self, table: str) -> Any:
        """The ``source`` recorded by :meth:`bulk_load` (``None`` when none was given or the
        table was never loaded)."""
        record = self._load_record(table)
        return None if record is None else record.get("source")

    def drop_table(self, table: str) -> None:
        """Delete ``table``: its rows, its dim and its load record (a new :meth:`create_table`
        and :meth:`bulk_load` start from nothing). The load record goes first, so a drop cut
        short leaves a table that is loaded again. The update offset is kept.

        Raises:
            ValueError: in read-only mode.
        """
        if self.read_only:
            raise ValueError(f"persistent db {self.path!r} was opened read-only; cannot drop")
        with self._lock:
            self._db.delete(f"loaded:{table}".encode())
            if table in self._cf:
                del self._cf[table]  # its handle keeps the column family alive
                self._db.drop_column_family(table)
            self._cf[META_CF].delete(f"dim:{table}".encode())
            self._cf[META_CF].delete(f"fmt:{table}".encode())
            self._codecs.pop(table, None)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._cf.clear()  # column-family handles keep the DB (and its LOCK) alive
                self._db.close()
                self._db = None
