"""Rows stored in the table's row format in every tier (hps.rowformat, FBGEMM's layouts): the
cache's storage, the hash map, Redis and RocksDB hold the same bytes and dequantize to the same
float32 rows; a cache of INT8 rows holds D + 4 bytes per row; bad formats are refused naming
the table."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.rowformat import RowDtype, RowFormatError, dequantize_rows, quantize_rows, row_bytes
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import RedisClusterBackend
from hps.storage.volatile import HashMapBackend, KeyLayout
from hps.types import CorruptRowError

DIM = 8
QUANTIZED = [RowDtype.INT8, RowDtype.INT4]


def _rows(n: int, dtype: RowDtype, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` keys and their rows as ``dtype`` bytes (quantized from random float32 rows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, DIM, generator=g) * 3
    keys = (np.arange(n, dtype=np.int64) * 7919) % 100_003
    return keys, quantize_rows(w, dtype).numpy()


def _check_same_rows(backend, name: str, cache: EmbeddingCache, keys, q, dtype) -> None:
    """``backend`` returns the bytes ``q`` and the float32 rows the cache returns, exactly."""
    raw, found = backend.lookup_rows(name, keys)
    assert found.all() and np.array_equal(raw, q)
    values, found = backend.lookup(name, keys)
    cached, hit = cache.query(torch.from_numpy(keys))
    assert found.all() and hit.all()
    assert torch.equal(torch.from_numpy(values), cached)
    assert torch.equal(cached, dequantize_rows(torch.from_numpy(q), dtype, DIM))


def _cache_of(keys: np.ndarray, q: np.ndarray, dtype: RowDtype) -> EmbeddingCache:
    cache = EmbeddingCache(keys.size, DIM, ways=keys.size, row_format=dtype)  # one set
    assert (
        cache.insert(torch.from_numpy(keys), torch.empty(0), rows=torch.from_numpy(q)) == keys.size
    )
    assert torch.equal(cache.storage[cache._slots(torch.from_numpy(keys))[1]], torch.from_numpy(q))
    return cache


def _refuses_malformed_rows(
    backend, where: str, keys, q, dtype: RowDtype, table: str = "t"
) -> None:
    """Stored bytes of the wrong width, dtype or count are refused naming the tier, the table
    and the layout, and nothing is written (the rows read back unchanged)."""
    rb = row_bytes(dtype, DIM)
    bad = {
        "narrow": q[:, :-1],
        "float": q.astype(np.float32),
        "short": q[:-1],
        "list": q.tolist(),
    }
    for what, rows in bad.items():
        with pytest.raises(
            ValueError, match=rf"{where}.*{table}.*must be \({keys.size}, {rb}\) uint8"
        ):
            backend.insert_rows(table, keys, rows)
        assert np.array_equal(backend.lookup_rows(table, keys)[0], q), what


@pytest.mark.parametrize("dtype", QUANTIZED, ids=lambda d: d.value)
def test_hash_map_and_rocksdb_hold_the_cache_tiers_bytes(tmp_path: Path, dtype: RowDtype) -> None:
    keys, q = _rows(300, dtype)
    cache = _cache_of(keys, q, dtype)
    v = HashMapBackend(num_partitions=4)
    v.create_table("t", DIM, row_format=dtype)
    v.insert_rows("t", keys, q)
    pdb = RocksDBBackend(tmp_path / "pdb")
    pdb.create_table("t", DIM, row_format=dtype)
    pdb.insert_rows("t", keys, q)
    for backend in (v, pdb):
        _check_same_rows(backend, "t", cache, keys, q, dtype)
    _refuses_malformed_rows(v, "volatile db", keys, q, dtype)
    _refuses_malformed_rows(pdb, "persistent db", keys, q, dtype)
    # bytes per stored row: the format's row + the key index (a uint32 key, its row in the slot
    # of its rank: the keys are spread over 100 k); one load fills the pools exactly
    assert v.key_layout("t") is KeyLayout.SORTED_U32
    assert keys.size * (row_bytes(dtype, DIM) + 4) == v.nbytes("t")
    pdb.close()
    reopened = RocksDBBackend(tmp_path / "pdb")  # the format is recorded with the table
    assert reopened.row_format("t") is dtype
    _check_same_rows(reopened, "t", cache, keys, q, dtype)
    with pytest.raises(ValueError, match=rf"table 't' holds {dtype.value} rows, not fp32"):
        reopened.create_table("t", DIM)
    reopened.close()


@pytest.mark.redis
@pytest.mark.parametrize("dtype", QUANTIZED, ids=lambda d: d.value)
def test_redis_holds_the_cache_tiers_bytes(redis_cluster, dtype: RowDtype) -> None:
    keys, q = _rows(300, dtype, seed=1)
    cache = _cache_of(keys, q, dtype)
    r = RedisClusterBackend(redis_cluster.addresses, num_partitions=4)
    name = f"q_{uuid.uuid4().hex[:8]}"
    r.create_table(name, DIM, row_format=dtype)
    r.insert_rows(name, keys, q)
    r.mark_loaded(name)
    try:
        _check_same_rows(r, name, cache, keys, q, dtype)
        _refuses_malformed_rows(r, "redis table", keys, q, dtype, name)
        read = r.read(name, keys)  # the session's read: dequantized, nothing failed
        assert read.found.all() and not read.failed.any()
        assert np.array_equal(read.values, dequantize_rows(torch.from_numpy(q), dtype, DIM).numpy())
    finally:
        r.clear(name)
        r.close()


def test_an_int8_cache_holds_d_plus_4_bytes_per_row_and_dequantizes() -> None:
    cap, dim = 64, 128
    c8 = EmbeddingCache(cap, dim, ways=8, row_format=RowDtype.INT8)
    c32 = EmbeddingCache(cap, dim, ways=8)
    assert c8.storage.shape == (cap, dim + 4) and c8.row_bytes == row_bytes(RowDtype.INT8, dim)
    meta = cap * (4 + 1 + 1) + cap // 8  # int32 key, counter, tag; a homed bit
    assert c8.nbytes() == cap * (dim + 4) + meta and c32.nbytes() == cap * 4 * dim + meta
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, dim, generator=g)
    keys = torch.arange(32)
    c8.insert(keys, w)
    got, hit = c8.query(keys)
    expect = dequantize_rows(quantize_rows(w, RowDtype.INT8), RowDtype.INT8, dim)
    assert hit.all() and torch.equal(got, expect)
    scale = c8.storage[c8._slots(keys)[1], :2].contiguous().view(torch.float16).float()
    assert bool(((got - w).abs() <= scale / 2 + 1e-6).all())  # within half a step
    with pytest.raises(ValueError, match="int8 rows has no float32 view"):
        _ = c8.values


def test_exclusive_tiers_move_quantized_bytes_unchanged() -> None:
    dtype = RowDtype.INT4
    keys, q = _rows(64, dtype, seed=2)
    v = HashMapBackend(num_partitions=2)
    v.create_table("t", DIM, row_format=dtype)
    v.insert_rows("t", keys, q)
    c = EmbeddingCache(16, DIM, ways=16, row_format=dtype)
    v.attach_cache("t", c)
    raw, _ = v.lookup_rows("t", keys[:16])
    c.insert(torch.from_numpy(keys[:16]), torch.empty(0), rows=torch.from_numpy(raw))
    assert c.homed_rows() == 16 and v.stored_rows("t") == 48  # moved up
    c._clock += 1
    c.insert(torch.from_numpy(keys[16:32]), torch.empty(0), rows=torch.from_numpy(q[16:32]))
    assert c.homed_rows() == 16 and v.stored_rows("t") == 48  # 16 moved back down, 16 up
    raw, found = v.lookup_rows("t", keys)
    assert found.all() and np.array_equal(raw, q)


def test_formats_a_tier_cannot_hold_are_refused_naming_the_table(tmp_path: Path) -> None:
    v = HashMapBackend()
    with pytest.raises(RowFormatError, match=r"volatile db table 'odd': int4 packs 2 values"):
        v.create_table("odd", 7, row_format=RowDtype.INT4)
    v.create_table("t", DIM, row_format=RowDtype.INT8)
    with pytest.raises(ValueError, match=r"exists with dim 8, not 8 \(int8 rows, not fp32\)"):
        v.create_table("t", DIM)
    with pytest.raises(ValueError, match=r"has dim 8 \(int8 rows\), the cache 8 \(fp32 rows\)"):
        v.attach_cache("t", EmbeddingCache(8, DIM))
    bad = np.ones((2, DIM), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(RowFormatError, match=r"volatile db table .t.: row 1 holds nan at column 3"):
        v.insert("t", np.array([1, 2], np.int64), bad)
    assert v.size("t") == 0  # nothing of the call inserted
    with pytest.raises(ValueError, match=r"int8 rows of dim 8 must be \(2, 12\) uint8"):
        v.insert_rows("t", np.array([1, 2], np.int64), np.zeros((2, 11), np.uint8))
    pdb = RocksDBBackend(tmp_path / "pdb")
    pdb.create_table("t", DIM, row_format=RowDtype.INT4)
    pdb._cf["t"].put(np.int64(5).tobytes(), b"\x00" * 7)  # a damaged value
    with pytest.raises(CorruptRowError, match=r"key 5 holds 7 bytes, not one 8-byte int4 row"):
        pdb.lookup("t", np.array([5], np.int64))
    pdb.close()
