"""Tables served from quantized rows end to end through ``ps.json``
(``tilerec_row_format_per_table``): every tier stores the table's format, lookups return the
dequantized rows (also after a cache miss moved the bytes up, and after an online update
quantized on apply), and formats or versions that cannot be served are refused naming the
field, the table and the files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.config import ConfigError
from hps.parameter_server import HierarchicalParameterServer
from hps.rowformat import RowDtype, RowFormatError, dequantize_rows, quantize_rows
from hps.storage.sparse_files import write_table
from hps.storage.volatile import HashMapBackend
from hps.updates import FileLogPublisher

N, DIM = 200, 8


def _deq(w: np.ndarray, dtype: RowDtype) -> torch.Tensor:
    return dequantize_rows(quantize_rows(torch.from_numpy(w), dtype), dtype, DIM)


def _ps_json(tmp_path: Path, formats: list[str], version: object = 1, **model: object) -> Path:
    g = np.random.default_rng(0)
    rows = (g.standard_normal((N, DIM)) * 2).astype(np.float32)
    write_table(tmp_path / "sparse" / "t", np.arange(N, dtype=np.int64), rows)
    np.save(tmp_path / "rows.npy", rows)
    m: dict[str, object] = {
        "model": "m",
        "max_batch_size": 256,
        "sparse_files": ["sparse/t"],
        "embedding_table_names": ["t"],
        "embedding_vecsize_per_table": [DIM],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "tilerec_row_format_per_table": formats,
        "gpucacheper": 0.25,
        "hit_rate_threshold": 1.0,
        "cache_exact": True,
        **model,
    }
    if version is not None:
        m["tilerec_row_format_version"] = version
    doc = {
        "volatile_db": {
            "type": "parallel_hash_map",
            "num_partitions": 2,
            "initial_cache_rate": 0.5,
        },
        "persistent_db": {"type": "rocks_db", "path": "pdb"},
        "update_source": {"type": "file_log", "path": "u.log"},
        "models": [m],
    }
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    return tmp_path / "ps.json"


@pytest.mark.parametrize("dtype", [RowDtype.INT8, RowDtype.INT4], ids=lambda d: d.value)
def test_every_tier_serves_the_tables_quantized_rows(tmp_path: Path, dtype: RowDtype) -> None:
    ps = HierarchicalParameterServer.from_config(_ps_json(tmp_path, [dtype.value]))
    try:
        rows = np.load(tmp_path / "rows.npy")
        expect = _deq(rows, dtype)
        s = ps.session("m")
        c = s.tables["t"].cache
        assert c is not None and c.row_format is dtype and ps.persistent is not None
        assert isinstance(ps.volatile, HashMapBackend) and ps.volatile.row_format("t") is dtype
        keys = np.arange(N, dtype=np.int64)
        for _ in range(2):  # misses (hash map, RocksDB) then hits
            assert torch.equal(s.lookup("t", torch.from_numpy(keys)), expect)
        q = quantize_rows(torch.from_numpy(rows), dtype).numpy()
        cached = c.slot_keys.keys.view(-1)[c.slot_keys.keys.view(-1) >= 0]
        assert cached.numel() > 0
        slots = c._slots(cached)[1]
        assert np.array_equal(c.storage[slots].numpy(), q[cached.numpy()])  # the same bytes
        for db, held in ((ps.volatile, N // 2), (ps.persistent, N)):
            raw, found = db.lookup_rows("t", keys)  # initial_cache_rate 0.5: half in the map
            assert found.sum() >= held and np.array_equal(raw[found], q[found])
        upd = np.full((4, DIM), 0.5, np.float32)
        upd[:, 0] = -1.0
        FileLogPublisher(tmp_path / "u.log").publish({"t": (keys[:4], upd)})
        assert ps.update_applier().poll() == 1
        assert torch.equal(s.lookup("t", torch.from_numpy(keys[:4])), _deq(upd, dtype))
    finally:
        ps.close()


def test_row_formats_that_cannot_be_served_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\[0\].tilerec_row_format_per_table\[0\]"):
        HierarchicalParameterServer.from_config(_ps_json(tmp_path / "a", ["int3"]))
    with pytest.raises(ConfigError, match=r"tilerec_row_format_version is 2; .* version 1 only"):
        HierarchicalParameterServer.from_config(_ps_json(tmp_path / "b", ["int8"], version=2))
    with pytest.raises(ConfigError, match=r"tilerec_row_format_version is missing"):
        HierarchicalParameterServer.from_config(_ps_json(tmp_path / "c", ["int8"], version=None))
    # a row float16 scales cannot hold (a span past 65504): the table and its files named
    path = _ps_json(tmp_path / "big", ["int8"])
    rows = np.load(tmp_path / "big" / "rows.npy")
    rows[3, 0] = -1e6
    write_table(
        tmp_path / "big" / "sparse" / "t", np.arange(N, dtype=np.int64), rows, overwrite=True
    )
    with pytest.raises(
        RowFormatError,
        match=r"table 't', sparse folder '.*sparse/t': .*magnitude 1e\+06 does not fit int8",
    ):
        HierarchicalParameterServer.from_config(path)
