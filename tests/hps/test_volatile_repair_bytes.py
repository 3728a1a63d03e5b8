"""The Redis partition repair moves stored row bytes as they are: an INT8 / INT4 partition
written back from the persistent DB or from row-format sparse files holds bit-identical bytes,
never a dequantize / quantize round trip (a real 3-node Redis cluster). The rows are made by
hand so that such a round trip would change them, and the codec's quantizer is replaced by
one that fails: the repair must not call it."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.config import TableSpec
from hps.rowformat import RowDtype, dequantize_rows, quantize_rows, row_bytes
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import RedisClusterBackend, partition_name
from hps.storage.row_codec import RowCodec
from hps.storage.sparse_files import write_table, write_table_rows
from hps.storage.volatile import partition_of
from hps.volatile_repair import VolatileRepair

pytestmark = pytest.mark.redis

DIM = 8
N = 300
PARTS = 4


def _hand_made_rows(dtype: RowDtype, n: int, seed: int) -> np.ndarray:
    """``(n, row_bytes) uint8`` rows that are NOT the canonical quantization of their values:
    scale and bias are arbitrary float16s and every q lies strictly inside ``[1, levels - 1]``
    (the canonical row of those values has q = 0 at its minimum, bias = that minimum), so a
    dequantize / quantize round trip changes the bytes."""
    g = np.random.default_rng(seed)
    levels = (1 << dtype.bits) - 1
    q = g.integers(1, levels, size=(n, DIM), dtype=np.uint8)
    per_byte = 8 // dtype.bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * dtype.bits)[None, None, :]
    packed = (q.reshape(n, DIM // per_byte, per_byte) << shifts).sum(-1, dtype=np.uint8)
    sb = np.empty((n, 2), np.float16)
    sb[:, 0] = g.uniform(0.01, 0.1, n)
    sb[:, 1] = g.uniform(-1.0, 1.0, n)
    return np.concatenate([sb.view(np.uint8), packed], axis=1)


@pytest.mark.parametrize("dtype", [RowDtype.INT8, RowDtype.INT4])
def test_hand_made_rows_are_not_canonical(dtype: RowDtype) -> None:
    """The premise of the repair test: re-quantizing these rows' values changes their bytes."""
    rows = _hand_made_rows(dtype, N, seed=1)
    assert rows.shape == (N, row_bytes(dtype, DIM))
    again = quantize_rows(dequantize_rows(torch.from_numpy(rows), dtype, DIM), dtype).numpy()
    assert (again != rows).any(axis=1).all()


@pytest.mark.parametrize("source", ["persistent_db", "sparse_files"])
@pytest.mark.parametrize("dtype", [RowDtype.INT8, RowDtype.INT4])
def test_a_repaired_partition_holds_the_same_bytes(
    redis_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: RowDtype, source: str
) -> None:
    name = f"t_{uuid.uuid4().hex[:8]}"
    keys = np.random.default_rng(2).choice(10 * N, N, replace=False).astype(np.int64)
    rows = _hand_made_rows(dtype, N, seed=3)
    vdb = RedisClusterBackend(redis_cluster.addresses, num_partitions=PARTS)
    pdb = None
    try:
        vdb.create_table(name, DIM, dtype)
        vdb.insert_rows(name, keys, rows)
        vdb.mark_loaded(name)
        if source == "persistent_db":  # its rows (online updates publish quantized rows)
            pdb = RocksDBBackend(tmp_path / "pdb")
            pdb.create_table(name, DIM, dtype)
            pdb.bulk_load(name, keys, rows)
            # float32 sparse files (an export quantized on load): the repair reads RocksDB's
            # bytes, never these values quantized again
            values = dequantize_rows(torch.from_numpy(rows), dtype, DIM).numpy()
            write_table(tmp_path / name, keys, values)
        else:
            write_table_rows(tmp_path / name, keys, rows)
        spec = TableSpec(name, str(tmp_path / name), DIM, 1, 0.0, dtype)
        lost = [0, 2]
        for p in lost:  # the partitions a node restarted empty would lose, their mark too
            vdb._client.delete(partition_name(name, p))
        in_lost = np.isin(partition_of(keys, PARTS), lost)
        assert in_lost.sum() > 20
        assert not vdb.read_rows(name, keys).failed[~in_lost].any()
        assert vdb.read_rows(name, keys).failed[in_lost].all() and vdb.unmarked_reads

        def no_quantizing(*args: object, **kw: object) -> None:
            raise AssertionError("the repair quantized rows")

        monkeypatch.setattr(RowCodec, "encode", no_quantizing)
        monkeypatch.setattr("hps.storage.row_codec.quantize_rows", no_quantizing)
        assert VolatileRepair(vdb, pdb, [spec], []).repair_once() == len(lost)
        back = vdb.read_rows(name, keys)
        assert back.found.all() and not back.failed.any()
        assert np.array_equal(back.values, rows)  # bit-identical, the repaired partitions too
    finally:
        vdb.clear(name)
        vdb.close()
        if pdb is not None:
            pdb.close()
