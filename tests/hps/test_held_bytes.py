"""``session.stats()[table]["bytes"]``: the bytes every tier holds for a table, counted in its
row format (exact byte counts for an FP32 and an INT8 table side by side), and the split per
tier over a model's tables."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.rowformat import RowDtype
from hps.session import LookupSession, SessionTable
from hps.session_stats import TierBytes, bytes_per_tier, held_bytes
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.volatile import HashMapBackend
from hps.types import StorageBackend, Tier
from tests.hps.hps_helpers import make_table

DIM = 8
N = 100
SLOTS = 64
LOOKED_UP = 10
FORMATS = {"f": RowDtype.FP32, "q": RowDtype.INT8}
ROW_BYTES = {"f": 4 * DIM, "q": DIM + 4}  # FBGEMM's rows: D float32; D int8 + fp16 scale, bias


def _session(tmp_path: Path) -> tuple[LookupSession, HashMapBackend, RocksDBBackend]:
    """Tables ``f`` (FP32) and ``q`` (INT8) of ``N`` rows each (keys ``0..N-1``: a direct
    index) in a hash map (loaded: no slack) and a RocksDB, each with a one-set cache of
    ``SLOTS`` slots that ``LOOKED_UP`` lookups filled."""
    vdb = HashMapBackend(num_partitions=2)
    pdb = RocksDBBackend(tmp_path / "pdb")
    tables, looked_up = [], {}
    for name, fmt in FORMATS.items():
        keys, rows = make_table(N, DIM, seed=len(tables), key_space=N)
        looked_up[name] = torch.from_numpy(keys[:LOOKED_UP].copy())
        for db in (vdb, pdb):
            db.create_table(name, DIM, fmt)
        vdb.insert(name, keys, rows)
        vdb.mark_loaded(name)
        pdb.bulk_load(name, keys, rows)
        cache = EmbeddingCache(SLOTS, DIM, ways=SLOTS, row_format=fmt)
        tables.append(SessionTable(name, DIM, 0.0, 1000, cache))
    s = LookupSession(tables, vdb, pdb, hit_rate_threshold=1.0, record_key_stats=False)
    for name, keys in looked_up.items():
        s.lookup(name, keys)
    return s, vdb, pdb


def test_stats_count_bytes_per_tier_in_each_tables_row_format(tmp_path: Path) -> None:
    s, vdb, pdb = _session(tmp_path)
    try:
        assert all("bytes" not in st for st in s.stats().values())  # type: ignore[union-attr]
        stats = s.stats(with_bytes=True)
        for name, fmt in FORMATS.items():
            rb = ROW_BYTES[name]
            b = stats[name]["bytes"]  # type: ignore[index]
            assert b["row_format"] == fmt.value and b["row_bytes_per_row"] == rb
            cache = b["tiers"]["cache"]
            assert cache == {
                "rows": LOOKED_UP,
                "row_bytes": LOOKED_UP * rb,
                # every slot: row + 6.125 B metadata; the keys' one high word: 8 B
                "bytes": SLOTS * rb + SLOTS * 49 // 8 + 8,
                "slots": SLOTS,
            }
            vol = b["tiers"]["volatile"]
            assert vol["rows"] == N and vol["row_bytes"] == N * rb and vol["slots"] is None
            assert vol["bytes"] == N * (rb + 4)  # the rows and a direct index over [0, N)
            assert b["tiers"]["persistent"] == {
                "rows": N,
                "row_bytes": N * rb,
                "bytes": N * rb,
                "slots": None,
            }
            assert b["bytes"] == cache["bytes"] + vol["bytes"] + N * rb
            assert s.stats(name, with_bytes=True)["bytes"] == b
            assert "bytes" not in s.stats(name)
        # the INT8 table's rows are (D + 4) / 4D of the FP32 table's in every tier
        f, q = (stats[n]["bytes"]["tiers"] for n in FORMATS)  # type: ignore[index]
        assert q["persistent"]["bytes"] * 4 * DIM == f["persistent"]["bytes"] * (DIM + 4)
        per_tier = bytes_per_tier([s.held_bytes(n) for n in FORMATS])
        assert per_tier == {
            "cache": f["cache"]["bytes"] + q["cache"]["bytes"],
            "volatile": N * (ROW_BYTES["f"] + ROW_BYTES["q"] + 2 * 4),
            "persistent": N * (ROW_BYTES["f"] + ROW_BYTES["q"]),
        }
    finally:
        s.close()
        pdb.close()


class _Broken(HashMapBackend):
    name = "broken"

    def held(self, table: str, dim: int) -> tuple[int, int]:
        raise RuntimeError("node 127.0.0.1:1 down")


def test_a_tier_that_cannot_say_is_reported_not_raised() -> None:
    vdb = _Broken(num_partitions=1)
    vdb.create_table("t", DIM, RowDtype.INT4)
    got = held_bytes(None, vdb, None, "t", DIM)
    assert got.row_format is RowDtype.INT4 and got.row_bytes == DIM // 2 + 4
    assert got.tiers == {Tier.VOLATILE: "broken: RuntimeError: node 127.0.0.1:1 down"}
    assert got.total == 0 and bytes_per_tier([got]) == {}
    assert got.to_dict()["tiers"] == {"volatile": {"error": got.tiers[Tier.VOLATILE]}}
    assert TierBytes(1, 2, 3).to_dict() == {"rows": 1, "row_bytes": 2, "bytes": 3, "slots": None}


class _Down(StorageBackend):
    """A tier known to be down: asking it for anything fails the test."""

    name = "down"

    @property
    def available(self) -> bool:
        return False

    def create_table(self, table: str, dim: int, row_format: RowDtype = RowDtype.FP32) -> None:
        raise AssertionError("not asked")

    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("not asked")

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        raise AssertionError("not asked")

    def size(self, table: str) -> int:
        raise AssertionError("a tier that is down is not asked")

    def row_format(self, table: str) -> RowDtype:
        return RowDtype.INT8


def test_tiers_are_asked_through_the_storage_interface_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Any backend that says it is down is not asked; a volatile DB lacking the table is
    that tier's error (the persistent tier still answers, and names the row format), logged
    as a warning once however often stats are read."""
    got = held_bytes(None, _Down(), None, "t", DIM)
    assert got.tiers == {Tier.VOLATILE: "down is down (retrying)"}
    vdb = HashMapBackend(num_partitions=1)  # holds no table "t"
    pdb = RocksDBBackend(tmp_path / "pdb")
    try:
        pdb.create_table("t", DIM, RowDtype.INT8)
        keys, rows = make_table(N, DIM, seed=0)
        pdb.bulk_load("t", keys, rows)
        warned: set[tuple[str, str]] = set()
        with caplog.at_level(logging.DEBUG, logger="hps.session_stats"):
            for _ in range(3):
                got = held_bytes(None, vdb, pdb, "t", DIM, warned)
        assert got.row_format is RowDtype.INT8 and got.row_bytes == DIM + 4
        assert isinstance(got.tiers[Tier.VOLATILE], str) and "no table 't'" in str(
            got.tiers[Tier.VOLATILE]
        )
        assert got.tiers[Tier.PERSISTENT] == TierBytes(N, N * (DIM + 4), N * (DIM + 4))
        assert got.total == N * (DIM + 4)
        levels = [r.levelno for r in caplog.records]
        assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG], levels
    finally:
        pdb.close()
