"""``convert_checkpoint`` on sharded checkpoints: chunks assembled exactly (row- and
column-wise, several rank files), a real one-rank sharded save, and chunk indexes that do not
tile the table or files that do not match their record refused by name. (Saves by 2 and 4
ranks are converted in tests/embark/sharding/test_sharded_training.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hps.storage import convert_checkpoint, read_table


def _record(fp: Path) -> dict[str, object]:
    return {"bytes": fp.stat().st_size, "sha256": hashlib.sha256(fp.read_bytes()).hexdigest()}


def _write_sharded(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint of 3 ranks: ``r`` (7 × 4, rows 0:2 / 2:5 / 5:7 on ranks 0, 1, 2), ``c``
    (5 × 6, columns 0:4 on rank 2 and 4:6 on rank 0) and ``d`` (3 × 2, whole in
    ``model.safetensors``: a data-parallel table). Integer-valued weights."""
    folder.mkdir(parents=True)
    w = {
        "r": torch.arange(28, dtype=torch.float32).view(7, 4),
        "c": torch.arange(30, dtype=torch.float32).view(5, 6) + 100,
        "d": torch.arange(6, dtype=torch.float32).view(3, 2) - 50,
    }
    pieces = {  # file: [(table, offset, rectangle)]
        "shards-0.safetensors": [("r", (0, 0), w["r"][0:2]), ("c", (0, 4), w["c"][:, 4:6])],
        "shards-1.safetensors": [("r", (2, 0), w["r"][2:5])],
        "shards-2.safetensors": [("r", (5, 0), w["r"][5:7]), ("c", (0, 0), w["c"][:, 0:4])],
    }
    shards: dict[str, list[dict[str, object]]] = {}
    for file, parts in pieces.items():
        entries = {}
        for table, off, rect in parts:
            key = f"embeddings.{table}.weight"
            name = f"{key}@{off[0]},{off[1]}"
            entries[name] = rect.contiguous()
            shards.setdefault(key, []).append(
                {"file": file, "name": name, "offset": [*off], "shape": [*rect.shape]}
            )
        save_file(entries, str(folder / file))
    save_file(
        {"embeddings.d.weight": w["d"], "dense.0.weight": torch.ones(2, 2)},
        str(folder / "model.safetensors"),
    )
    save_file({}, str(folder / "optimizer.safetensors"))
    files = {f.name: _record(f) for f in sorted(folder.iterdir())}
    tables = [
        {"name": n, "num_rows": t.shape[0], "dim": t.shape[1], "hotness": 1, "combiner": "sum"}
        for n, t in w.items()
    ]
    state = {
        "format_version": 3,
        "step": 4,
        "workload": {"name": "x", "tables": tables},
        "files": files,
        "shards": shards,
    }
    (folder / "state.json").write_text(json.dumps(state))
    return w


def _edit_state(folder: Path, edit) -> None:
    sp = folder / "state.json"
    state = json.loads(sp.read_text())
    edit(state)
    sp.write_text(json.dumps(state))


def test_sharded_checkpoint_of_three_ranks_converts_exactly(tmp_path: Path) -> None:
    w = _write_sharded(tmp_path / "ck")
    out = convert_checkpoint(tmp_path / "ck", tmp_path / "sparse")
    assert sorted(out) == ["c", "d", "r"]
    for n, t in w.items():
        keys, rows = read_table(out[n], t.shape[1])
        assert np.array_equal(keys, np.arange(t.shape[0])) and np.array_equal(rows, t.numpy())


def test_a_one_rank_sharded_save_converts_like_the_trainer_holds_it(tmp_path: Path) -> None:
    from embark import ShardedDLRM, ShardingPlan, TrainConfig, Trainer
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload
    from embark.sharding import save_sharded_checkpoint
    from tests.embark.sharding.plans import uniform_plan

    wl = get_workload("tiny")
    plan = ShardingPlan.from_dict(uniform_plan(1, "row_wise"))
    trainer = Trainer(ShardedDLRM(build_model(wl, seed=3), plan, 0), TrainConfig())
    save_sharded_checkpoint(trainer, tmp_path / "ck")
    assert json.loads((tmp_path / "ck/state.json").read_text())["shards"]  # stored in chunks
    held = trainer.model.full_state_dict(dst=None)
    out = convert_checkpoint(tmp_path / "ck", tmp_path / "sparse")
    for t in wl.tables:
        _, rows = read_table(out[t.name], t.dim)
        assert np.array_equal(rows, held[f"embeddings.{t.name}.weight"].numpy()), t.name


def _drop_chunk(state) -> None:
    state["shards"]["embeddings.r.weight"].pop(1)


def _overlap_chunk(state) -> None:
    state["shards"]["embeddings.r.weight"][1]["offset"] = [1, 0]


def _outside_chunk(state) -> None:
    state["shards"]["embeddings.c.weight"][0]["offset"] = [0, 5]


def _misshapen_chunk(state) -> None:
    """Rows 5:7 recorded as two 1-row chunks of one 2-row entry: the tiling holds, the
    entry's stored shape does not."""
    c = state["shards"]["embeddings.r.weight"][2]
    c["shape"] = [1, 4]
    state["shards"]["embeddings.r.weight"].append({**c, "offset": [6, 0]})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_drop_chunk, r"embeddings.r.weight: its chunks cover 16 of the 28 values"),
        (_overlap_chunk, r"chunks 'embeddings.r.weight@0,0' and 'embeddings.r.weight@2,0' overlap"),
        (_outside_chunk, r"'embeddings.c.weight@0,4' at \[0, 5\] of shape \[5, 2\] lies outside"),
        (_misshapen_chunk, r"shards-2.safetensors: embeddings.r.weight@5,0 has shape \(2, 4\)"),
    ],
)
def test_chunks_that_do_not_tile_the_table_are_refused(tmp_path: Path, edit, match) -> None:
    _write_sharded(tmp_path / "ck")
    _edit_state(tmp_path / "ck", edit)
    with pytest.raises(ValueError, match=match):
        convert_checkpoint(tmp_path / "ck", tmp_path / "sparse")


def test_a_shard_file_unlike_its_record_or_missing_is_refused_by_name(tmp_path: Path) -> None:
    _write_sharded(tmp_path / "ck")
    shard = tmp_path / "ck/shards-1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ValueError, match=r"shards-1.safetensors does not match its recorded sha256"
    ):
        convert_checkpoint(tmp_path / "ck", tmp_path / "sparse")
    shard.unlink()
    with pytest.raises(ValueError, match=r"missing shards-1.safetensors"):
        convert_checkpoint(tmp_path / "ck", tmp_path / "sparse")
    assert not (tmp_path / "sparse" / "r").exists()
