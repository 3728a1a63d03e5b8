from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps.storage.persistent import RocksDBBackend
from tests.hps.hps_helpers import make_table


def test_rocksdb_round_trip_chunked_multiget(tmp_path: Path) -> None:
    db = RocksDBBackend(tmp_path / "db", max_batch_size=64)
    db.create_table("t", 5)
    keys, rows = make_table(300, 5, seed=0)
    db.bulk_load("t", keys, rows, chunk=100)
    assert db.loaded_rows("t") == 300
    q = np.concatenate([keys[::-1], np.array([-1, 2**62], np.int64)])
    v, f = db.lookup("t", q)  # 302 keys, 5 multi-get chunks
    assert f[:300].all() and not f[300:].any()
    assert np.array_equal(v[:300], rows[::-1]) and not v[300:].any()
    db.close()


def test_write_batch_is_atomic_with_metadata(tmp_path: Path) -> None:
    db = RocksDBBackend(tmp_path / "db")
    db.create_table("a", 2)
    db.create_table("b", 3)
    good = ("a", np.array([1, 2], np.int64), np.ones((2, 2), np.float32))
    bad = ("b", np.array([1], np.int64), np.ones((1, 2), np.float32))  # wrong dim
    with pytest.raises(ValueError, match=r"shape \(1, 3\)"):
        db.write_batch([good, bad], meta={"off": b"7"})
    assert not db.lookup("a", good[1])[1].any() and db.get_meta("off") is None  # nothing written
    db.write_batch([good], meta={"off": b"7"})
    assert db.lookup("a", good[1])[1].all() and db.get_meta("off") == b"7"
    db.close()


def test_read_only_mode(tmp_path: Path) -> None:
    db = RocksDBBackend(tmp_path / "db")
    db.create_table("t", 2)
    keys, rows = make_table(20, 2, seed=1)
    db.insert("t", keys, rows)
    db.close()
    ro = RocksDBBackend(tmp_path / "db", read_only=True)
    ro2 = RocksDBBackend(tmp_path / "db", read_only=True)  # many readers may share it
    v, f = ro.lookup("t", keys)
    assert f.all() and np.array_equal(v, rows) and ro2.lookup("t", keys)[1].all()
    with pytest.raises(ValueError, match="read-only"):
        ro.insert("t", keys, rows)
    with pytest.raises(ValueError, match="read-only and has no table 'u'"):
        ro.create_table("u", 2)
    with pytest.raises(ValueError, match="dim 2, not 4"):
        ro.create_table("t", 4)
    ro.close()
    ro2.close()
    with pytest.raises(ValueError, match="no RocksDB there"):
        RocksDBBackend(tmp_path / "missing", read_only=True)


def test_reopen_keeps_tables(tmp_path: Path) -> None:
    db = RocksDBBackend(tmp_path / "db")
    db.create_table("t", 2)
    db.insert("t", np.array([4], np.int64), np.array([[1, 2]], np.float32))
    db.close()
    db = RocksDBBackend(tmp_path / "db")
    assert db.has_table("t")
    v, f = db.lookup("t", np.array([4], np.int64))
    assert f.all() and v.tolist() == [[1.0, 2.0]]
    db.close()


def test_a_damaged_row_is_named_even_when_the_total_length_fits(tmp_path: Path) -> None:
    """Two damaged rows whose lengths cancel (+4 and -4 bytes) must not decode into shifted
    values: the error names the first bad key, and it is a CorruptRowError (the server's 500,
    not the client's 400)."""
    from rocksdict import WriteBatch

    from hps.storage.persistent import encode_keys
    from hps.types import CorruptRowError

    db = RocksDBBackend(tmp_path / "pdb", max_batch_size=2)
    db.create_table("t0", 2)
    keys = np.array([1, 2, 3], np.int64)
    db.insert("t0", keys, np.array([[1, 2], [3, 4], [5, 6]], np.float32))
    h = db._db.get_column_family_handle("t0")
    wb = WriteBatch(raw_mode=True)
    k2, k3 = encode_keys(keys[1:])
    wb.put(k2, np.array([3, 4, 9], "<f4").tobytes(), h)
    wb.put(k3, np.array([5], "<f4").tobytes(), h)
    db._db.write(wb)
    try:
        v, f = db.lookup("t0", keys[:1])
        assert f.all() and v.tolist() == [[1.0, 2.0]]
        with pytest.raises(
            CorruptRowError, match=r"'t0': key 2 holds 12 bytes, not 2 float32s \(2 such rows"
        ):
            db.lookup("t0", np.array([2, 3], np.int64))
        with pytest.raises(CorruptRowError, match=r"key 3 holds 4 bytes"):
            db.lookup("t0", np.array([1, 3, 1], np.int64))  # chunked multi-get (max_batch_size 2)
    finally:
        db.close()


def test_drop_table_forgets_rows_dim_and_load_record_but_keeps_the_offset(tmp_path: Path) -> None:
    db = RocksDBBackend(tmp_path / "db")
    db.create_table("t", 2)
    db.create_table("u", 2)
    keys, rows = make_table(20, 2, seed=1)
    db.bulk_load("t", keys, rows, source={"files": ["x"]})
    db.bulk_load("u", keys, rows)
    db.write_batch([], meta={"update_offset:log": b"42"})
    assert db.loaded_source("t") == {"files": ["x"]} and db.loaded_source("u") is None
    db.drop_table("t")
    assert not db.has_table("t") and db.loaded_rows("t") is None
    db.close()
    db = RocksDBBackend(tmp_path / "db")  # and after a reopen
    assert not db.has_table("t") and db.loaded_rows("t") is None
    db.create_table("t", 3)  # another dim is fine now
    assert not db.lookup("t", keys)[1].any()
    assert db.lookup("u", keys)[1].all() and db.loaded_rows("u") == 20  # the other table stays
    assert db.get_meta("update_offset:log") == b"42"
    db.close()
    ro = RocksDBBackend(tmp_path / "db", read_only=True)
    with pytest.raises(ValueError, match="read-only; cannot drop"):
        ro.drop_table("u")
    ro.close()


@pytest.mark.parametrize("name", ["default", "__hps_meta__"])
def test_column_family_names_of_rocksdb_and_ours_are_not_tables(tmp_path: Path, name: str) -> None:
    db = RocksDBBackend(tmp_path / "db")
    with pytest.raises(ValueError, match=rf"table name '{name}' is reserved"):
        db.create_table(name, 2)
    db.close()
