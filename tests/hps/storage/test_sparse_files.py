from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.storage.sparse_files import (
    SparseFormat,
    convert_checkpoint,
    detect_format,
    read_table,
    write_table,
)
from tests.hps.hps_helpers import make_table


@pytest.mark.parametrize("fmt", list(SparseFormat))
def test_round_trip(tmp_path: Path, fmt: SparseFormat) -> None:
    keys, rows = make_table(100, 6, seed=0)
    write_table(tmp_path / "t", keys, rows, fmt=fmt)
    assert detect_format(tmp_path / "t") is fmt
    k, v = read_table(tmp_path / "t", 6)
    assert np.array_equal(k, keys) and np.array_equal(v, rows)


def test_hugectr_layout_is_raw_little_endian(tmp_path: Path) -> None:
    write_table(tmp_path / "t", np.array([7, 3], np.int64), np.array([[1, 2], [3, 4]], np.float32))
    assert (tmp_path / "t/key").read_bytes() == np.array([7, 3], "<i8").tobytes()
    assert (tmp_path / "t/emb_vector").read_bytes() == np.array([1, 2, 3, 4], "<f4").tobytes()


def test_existing_folder_is_not_overwritten(tmp_path: Path) -> None:
    keys, rows = make_table(10, 2, seed=0)
    write_table(tmp_path / "t", keys, rows)
    with pytest.raises(ValueError, match="exists"):
        write_table(tmp_path / "t", keys, rows + 1)
    assert np.array_equal(read_table(tmp_path / "t", 2)[1], rows)
    write_table(tmp_path / "t", keys, rows + 1, overwrite=True)
    assert np.array_equal(read_table(tmp_path / "t", 2)[1], rows + 1)


def test_truncated_emb_vector(tmp_path: Path) -> None:
    keys, rows = make_table(10, 4, seed=1)
    write_table(tmp_path / "t", keys, rows)
    data = (tmp_path / "t/emb_vector").read_bytes()
    (tmp_path / "t/emb_vector").write_bytes(data[:-6])
    with pytest.raises(ValueError, match="not a whole number of rows of dim 4"):
        read_table(tmp_path / "t", 4)


def test_key_count_differs_from_row_count(tmp_path: Path) -> None:
    keys, rows = make_table(10, 4, seed=1)
    write_table(tmp_path / "t", keys, rows)
    (tmp_path / "t/key").write_bytes(keys[:9].tobytes())
    with pytest.raises(ValueError, match="9 keys in 'key' but 10 rows"):
        read_table(tmp_path / "t", 4)


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="found neither"):
        read_table(tmp_path, 4)
    with pytest.raises(ValueError, match="int64"):
        write_table(tmp_path / "a", np.arange(3, dtype=np.int32), np.zeros((3, 2), np.float32))
    with pytest.raises(
        ValueError, match=r"1 key\(s\) occur more than once .* key 1 .*Keys must be unique"
    ):
        write_table(tmp_path / "b", np.array([1, 1], np.int64), np.zeros((2, 2), np.float32))
    write_table(
        tmp_path / "c",
        np.arange(3, dtype=np.int64),
        np.zeros((3, 2), np.float32),
        fmt="safetensors",
    )
    with pytest.raises(ValueError, match="dim 2, the config says 3"):
        read_table(tmp_path / "c", 3)
    (tmp_path / "c/embedding.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        read_table(tmp_path / "c", 2)


@pytest.mark.parametrize("mmap", [True, False])
def test_duplicate_keys_are_refused_hugectr(tmp_path: Path, mmap: bool) -> None:
    (tmp_path / "t").mkdir()
    np.array([9, 5, 6, 5, 6, 5], "<i8").tofile(tmp_path / "t/key")  # 5 three times, 6 twice
    np.zeros((6, 2), "<f4").tofile(tmp_path / "t/emb_vector")
    want = (
        rf"sparse folder {tmp_path / 't'}: 2 key\(s\) occur more than once \(3 extra rows\); "
        r"the first is key 5 \(3 times, first at row 1\)"
    )
    with pytest.raises(ValueError, match=want):
        read_table(tmp_path / "t", 2, mmap=mmap)


def test_duplicate_keys_are_refused_safetensors(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    (tmp_path / "t").mkdir()
    save_file(
        {"key": np.array([1, 2, 2], np.int64), "emb_vector": np.zeros((3, 2), np.float32)},
        str(tmp_path / "t/embedding.safetensors"),
    )
    with pytest.raises(
        ValueError, match=r"1 key\(s\) occur more than once .* key 2 \(2 times, first at row 1\)"
    ):
        read_table(tmp_path / "t", 2)


def test_duplicate_sparse_keys_never_reach_the_tiers(tmp_path: Path) -> None:
    from hps.config import parse_config
    from hps.parameter_server import HierarchicalParameterServer

    (tmp_path / "sparse/t0").mkdir(parents=True)
    np.array([5, 5, 6], "<i8").tofile(tmp_path / "sparse/t0/key")
    np.array([[1, 1], [2, 2], [3, 3]], "<f4").tofile(tmp_path / "sparse/t0/emb_vector")
    doc = {
        "volatile_db": {"type": "parallel_hash_map", "num_partitions": 1},
        "persistent_db": {"type": "rocks_db", "path": "pdb"},
        "models": [
            {
                "model": "m",
                "max_batch_size": 8,
                "sparse_files": ["sparse/t0"],
                "embedding_table_names": ["t0"],
                "embedding_vecsize_per_table": [2],
                "maxnum_catfeature_query_per_table_per_sample": [1],
                "gpucache": False,
            }
        ],
    }
    with pytest.raises(ValueError, match=r"sparse/t0: 1 key\(s\) occur more than once .* key 5"):
        HierarchicalParameterServer(parse_config(doc, tmp_path))


def _write_checkpoint(folder: Path, tables: dict[str, torch.Tensor]) -> None:
    """A checkpoint folder in the trainer's checkpoint layout (written by hand)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    state = {f"embeddings.{n}.weight": w for n, w in tables.items()}
    state["bottom_mlp.0.weight"] = torch.zeros(3, 3)
    save_file(state, str(folder / "model.safetensors"))
    wl = {
        "name": "x",
        "tables": [
            {"name": n, "num_rows": w.shape[0], "dim": w.shape[1], "hotness": 1, "combiner": "sum"}
            for n, w in tables.items()
        ],
    }
    (folder / "state.json").write_text(json.dumps({"step": 3, "workload": wl}))


@pytest.mark.parametrize("fmt", list(SparseFormat))
def test_convert_checkpoint(tmp_path: Path, fmt: SparseFormat) -> None:
    w = {"t0": torch.randn(50, 8), "t1": torch.randn(7, 4)}
    _write_checkpoint(tmp_path / "ckpt", w)
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "sparse", fmt=fmt)
    assert sorted(out) == ["t0", "t1"]
    for n, wt in w.items():
        k, v = read_table(out[n], wt.shape[1])
        assert np.array_equal(k, np.arange(wt.shape[0])) and np.array_equal(v, wt.numpy())


def test_convert_checkpoint_errors(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "ckpt", {"t0": torch.randn(5, 2)})
    with pytest.raises(ValueError, match=r"unknown table\(s\) \['t9'\]"):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "o", tables=["t9"])
    state = json.loads((tmp_path / "ckpt/state.json").read_text())
    state["workload"]["tables"][0]["num_rows"] = 6
    (tmp_path / "ckpt/state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"shape \(5, 2\), workload says \(6, 2\)"):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "o")
    with pytest.raises(ValueError, match="missing state.json"):
        convert_checkpoint(tmp_path / "nothing", tmp_path / "o")


@pytest.mark.parametrize("name", ["../victim", "/abs/victim", "a/b", ".."])
def test_convert_checkpoint_refuses_a_table_name_that_is_not_a_name(tmp_path: Path, name) -> None:
    """Table names come from the checkpoint's state.json and are joined to the output folder."""
    _write_checkpoint(tmp_path / "ckpt", {"t0": torch.randn(5, 2), name: torch.randn(5, 2)})
    with pytest.raises(ValueError, match=r"state.json: table name .* is not a valid name"):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "o", overwrite=True)
    assert not (tmp_path / "o").exists()


def test_convert_real_trainer_checkpoint(tmp_path: Path) -> None:
    from embark import TrainConfig, Trainer, build_model, get_workload

    wl = get_workload("tiny")
    trainer = Trainer(build_model(wl, seed=0), TrainConfig())
    trainer.save_checkpoint(tmp_path / "ckpt")
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "sparse")
    for t in wl.tables:
        k, v = read_table(out[t.name], t.dim)
        w = trainer.model.embeddings[t.name].weight.detach()
        assert np.array_equal(k, np.arange(t.num_rows)) and np.array_equal(v, w.numpy())
