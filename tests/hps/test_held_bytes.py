"""``session.stats()[table]["bytes"]``: the bytes every tier holds for a table, counted in its
row format (exact byte counts for an FP32 and an INT8 table side by side), and the split per
tier over a model's tables."""

from __future__ import annotations

from pathlib import Path

import torch

from hps.advisor import cache_slot_bytes
from hps.rowformat import RowDtype
from hps.session import LookupSession, SessionTable
from hps.session_stats import TierBytes, bytes_per_tier, held_bytes
from hps.storage.cache import EmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.volatile import HashMapBackend
from hps.types import Tier
from tests.hps.hps_helpers import make_table

DIM = 8
N = 100
SLOTS = 64
LOOKED_UP = 10
FORMATS = {"f": RowDtype.FP32, "q": RowDtype.INT8}
ROW_BYTES = {"f": 4 * DIM, "q": DIM + 4}  # FBGEMM's rows: D float32; D int8 + fp16 scale, bias


def _session(tmp_path: Path) -> tuple[LookupSession, HashMapBackend, RocksDBBackend]:
    """Tables ``f`` (FP32) and ``q`` (INT8) of ``N`` rows each in a hash map and a RocksDB,
    each with a one-set cache of ``SLOTS`` slots that ``LOOKED_UP`` lookups filled."""
    vdb = HashMapBackend(num_partitions=2)
    pdb = RocksDBBackend(tmp_path / "pdb")
    tables, looked_up = [], {}
    for name, fmt in FORMATS.items():
        keys, rows = make_table(N, DIM, seed=len(tables))
        looked_up[name] = torch.from_numpy(keys[:LOOKED_UP].copy())
        for db in (vdb, pdb):
            db.create_table(name, DIM, fmt)
        vdb.insert(name, keys, rows)
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
        stats = s.stats()
        for name, fmt in FORMATS.items():
            rb = ROW_BYTES[name]
            b = stats[name]["bytes"]  # type: ignore[index]
            assert b["row_format"] == fmt.value and b["row_bytes_per_row"] == rb
            cache = b["tiers"]["cache"]
            assert cache == {
                "rows": LOOKED_UP,
                "row_bytes": LOOKED_UP * rb,
                "bytes": SLOTS * cache_slot_bytes(DIM, fmt),  # every slot: row + metadata
                "slots": SLOTS,
            }
            vol = b["tiers"]["volatile"]
            assert vol["rows"] == N and vol["row_bytes"] == N * rb and vol["slots"] is None
            assert vol["bytes"] == vdb.nbytes(name) >= N * rb  # slots, counters, key index
            assert b["tiers"]["persistent"] == {
                "rows": N,
                "row_bytes": N * rb,
                "bytes": N * rb,
                "slots": None,
            }
            assert b["bytes"] == cache["bytes"] + vol["bytes"] + N * rb
            assert s.stats(name)["bytes"] == b
        # the INT8 table's rows are (D + 4) / 4D of the FP32 table's in every tier
        f, q = (stats[n]["bytes"]["tiers"] for n in FORMATS)  # type: ignore[index]
        assert q["persistent"]["bytes"] * 4 * DIM == f["persistent"]["bytes"] * (DIM + 4)
        per_tier = bytes_per_tier([s.held_bytes(n) for n in FORMATS])
        assert per_tier == {
            "cache": f["cache"]["bytes"] + q["cache"]["bytes"],
            "volatile": vdb.nbytes("f") + vdb.nbytes("q"),
            "persistent": N * (ROW_BYTES["f"] + ROW_BYTES["q"]),
        }
    finally:
        s.close()
        pdb.close()


class _Broken(HashMapBackend):
    name = "broken"

    def stored_rows(self, table: str) -> int:
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
