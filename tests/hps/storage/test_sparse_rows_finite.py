"""A NaN or infinite value in a sparse file's rows is refused at load, naming the table and the
key: served, it would turn every score it touches into NaN (and NaN is not JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hps.storage.sparse_files as sparse_files
from hps.config import parse_config
from hps.parameter_server import HierarchicalParameterServer
from hps.storage.sparse_files import read_table, write_table

DIM = 4


def _table(bad: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Keys ``100..139`` (row ``i`` for key ``100 + i``), row ``i`` holding ``bad[i]`` in its
    last column."""
    keys = np.arange(100, 140, dtype=np.int64)
    rows = np.arange(40 * DIM, dtype=np.float32).reshape(40, DIM)
    for i, v in bad.items():
        rows[i, -1] = v
    return keys, rows


@pytest.mark.parametrize("fmt", ["hugectr", "safetensors"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_row_is_refused_naming_its_key(tmp_path: Path, fmt: str, value: float) -> None:
    keys, rows = _table({17: value, 30: value})
    write_table(tmp_path / "t0", keys, rows, fmt=fmt)
    with pytest.raises(ValueError) as e:
        read_table(tmp_path / "t0", DIM)
    assert str(e.value) == (
        f"sparse folder {tmp_path / 't0'}: the row of key 117 (row 17 of 'emb_vector') holds a "
        f"non-finite value ({value}); 2 such row(s). Rows must be finite: a NaN row would be served"
    )


def test_rows_are_checked_in_chunks_and_every_bad_row_counted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sparse_files, "_FINITE_CHUNK", 8)  # 40 rows: five chunks
    keys, rows = _table({9: float("nan"), 10: float("nan"), 39: float("inf")})
    write_table(tmp_path / "t0", keys, rows)
    with pytest.raises(ValueError, match=r"key 109 \(row 9 of 'emb_vector'\) .*; 3 such row\(s\)"):
        read_table(tmp_path / "t0", DIM)
    k, v = read_table(tmp_path / "t0", DIM, check_finite=False)  # the row count alone
    assert k.shape == (40,) and np.isnan(v[9]).any()
    good_keys, good_rows = _table({})
    write_table(tmp_path / "t0", good_keys, good_rows, overwrite=True)
    k, v = read_table(tmp_path / "t0", DIM)
    assert np.array_equal(k, good_keys) and np.array_equal(v, good_rows)


def test_the_parameter_server_refuses_to_load_it_naming_the_table(tmp_path: Path) -> None:
    keys, rows = _table({17: float("nan")})
    write_table(tmp_path / "sparse" / "t0", keys, rows)
    doc = {
        "volatile_db": {"type": "parallel_hash_map"},
        "persistent_db": {"type": "none"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 8,
                "sparse_files": ["sparse/t0"],
                "embedding_table_names": ["t0"],
                "embedding_vecsize_per_table": [DIM],
                "maxnum_catfeature_query_per_table_per_sample": [1],
            }
        ],
    }
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"^table 't0': sparse folder .*key 117 .*non-finite"):
        HierarchicalParameterServer(parse_config(doc, tmp_path))
