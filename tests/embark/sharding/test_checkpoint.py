"""Sharded checkpoints in one process: chunk reads, row-wise state, a failed or refused save
leaves the previous checkpoint as it was, another format version is refused. (Saves by 2
ranks and loads on 1, 2 and 4 ranks are in test_sharded_training.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import embark.training.checkpoint.store as ckpt
from embark import ShardedDLRM, ShardingPlan, TrainConfig, Trainer
from embark.data import Batch, SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.sharding import load_sharded_checkpoint, save_sharded_checkpoint
from embark.training import FormatVersionError
from embark.training.checkpoint.shards import Chunk, plan_region, read_pieces, read_region
from tests.embark.sharding.plans import uniform_plan

CFG = TrainConfig(optimizer="adagrad", lr=0.05, embedding_lr=0.1)


def _chunked(tmp_path: Path) -> tuple[dict[str, list[Chunk]], torch.Tensor, torch.Tensor]:
    """A (6, 4) and a (6,) tensor stored as rows 0:2 / 2:6 × cols 0:3 / 3:4 in two files."""
    w = torch.arange(24, dtype=torch.float32).view(6, 4)
    v = torch.arange(6, dtype=torch.float32) * 10
    parts = {
        "shards-0.safetensors": [((0, 0), w[0:2, 0:3]), ((2, 3), w[2:6, 3:4])],
        "shards-1.safetensors": [((0, 3), w[0:2, 3:4]), ((2, 0), w[2:6, 0:3])],
    }
    chunks: dict[str, list[Chunk]] = {"w": [], "w::row_sum": []}
    for file, pieces in parts.items():
        entries = {}
        for off, piece in pieces:
            c = Chunk.of("w", file, off, tuple(piece.shape))
            chunks["w"].append(c)
            entries[c.name] = piece.contiguous()
        rows = (0, 2) if file.startswith("shards-0") else (2, 6)
        c = Chunk.of("w::row_sum", file, (rows[0],), (rows[1] - rows[0],))
        chunks["w::row_sum"].append(c)
        entries[c.name] = v[rows[0] : rows[1]].contiguous()
        save_file(entries, str(tmp_path / file))
    return chunks, w, v


@pytest.mark.parametrize(
    "region", [[(0, 6), (0, 4)], [(1, 4), (2, 4)], [(2, 3), (0, 1)], [(5, 6), (3, 4)]]
)
def test_read_region_assembles_the_overlapping_chunks_exactly(tmp_path, region) -> None:
    chunks, w, v = _chunked(tmp_path)
    (r0, r1), (c0, c1) = region
    assert torch.equal(read_region(tmp_path, chunks, "w", region), w[r0:r1, c0:c1])
    assert torch.equal(read_region(tmp_path, chunks, "w::row_sum", [(r0, r1)]), v[r0:r1])


def test_read_region_names_a_key_whose_chunks_leave_a_hole(tmp_path) -> None:
    chunks, _, _ = _chunked(tmp_path)
    holed = {"w": [c for c in chunks["w"] if c.offset != (2, 0)]}
    with pytest.raises(ValueError, match=r"chunks of 'w' cover 12 of the 24 values"):
        read_region(tmp_path, holed, "w", [(0, 6), (0, 4)])


@pytest.mark.parametrize("block_bytes", [1, 20, 1 << 20])
def test_pieces_read_into_a_given_tensor_by_blocks_of_rows(tmp_path, block_bytes) -> None:
    """The region planned from the index alone, read block by block of rows (one row at a
    time, a few, all) into the shard that holds it: the exact values."""
    chunks, w, v = _chunked(tmp_path)
    out, rows = torch.full((5, 3), float("nan")), torch.full((5,), float("nan"))
    pieces = plan_region(tmp_path, chunks, "w", [(1, 6), (1, 4)])
    read_pieces(tmp_path, pieces, out, block_bytes=block_bytes)
    assert torch.equal(out, w[1:6, 1:4])
    row_pieces = plan_region(tmp_path, chunks, "w::row_sum", [(1, 6)])
    read_pieces(tmp_path, row_pieces, rows, block_bytes=block_bytes)
    assert torch.equal(rows, v[1:6])


def test_a_region_outside_a_whole_entry_is_refused_before_reading(tmp_path) -> None:
    """A tensor stored whole (``model.safetensors``): its region is checked on the header."""
    save_file({"embeddings.t.weight": torch.zeros(4, 2)}, str(tmp_path / ckpt.MODEL_FILE))
    whole = plan_region(tmp_path, {}, "embeddings.t.weight", [(1, 4), (0, 2)])
    out = torch.ones(3, 2)
    assert torch.equal(read_pieces(tmp_path, whole, out), torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"'embeddings.t.weight' is \[4, 2\], which does not"):
        plan_region(tmp_path, {}, "embeddings.t.weight", [(0, 5), (0, 2)])


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    """Three batches of the tiny workload (the data set is built once: its teacher's
    calibration costs seconds)."""
    return list(SyntheticCTR(get_workload("tiny"), 32, seed=4).batches(3))


def _one_rank(batches: list[Batch]) -> tuple[Trainer, ShardingPlan]:
    """A one-rank sharded trainer after 2 steps, and its plan."""
    plan = ShardingPlan.from_dict(uniform_plan(1, "table_wise"))
    t = Trainer(ShardedDLRM(build_model(get_workload("tiny"), seed=3), plan, 0), CFG)
    for b in batches[:2]:
        t.train_step(b)
    return t, plan


def test_rowwise_adagrad_state_round_trips_single_to_sharded_and_back(tmp_path, batches) -> None:
    cfg = TrainConfig(optimizer="adagrad", lr=0.05, embedding_optimizer="rowwise_adagrad")
    single = Trainer(build_model(get_workload("tiny"), seed=3), cfg)
    for b in batches[:2]:
        single.train_step(b)
    single.save_checkpoint(tmp_path / "single")
    plan = ShardingPlan.from_dict(uniform_plan(1, "table_wise"))
    sharded = load_sharded_checkpoint(tmp_path / "single", plan, 0)
    save_sharded_checkpoint(sharded, tmp_path / "sharded")
    state = json.loads((tmp_path / "sharded" / "state.json").read_text())
    assert state["shards"]["embeddings.t0.weight::row_sum"][0]["shape"] == [1000]
    back = Trainer.load_checkpoint(tmp_path / "sharded")
    want, got = single.embedding_updates.state_tensors(), back.embedding_updates.state_tensors()
    assert want.keys() == got.keys() and all(k.endswith("::row_sum") for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(
        torch.equal(v, single.model.state_dict()[k]) for k, v in back.model.state_dict().items()
    )


def _snapshot(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, batches) -> None:
    trainer, _ = _one_rank(batches)
    path = tmp_path / "ck"
    save_sharded_checkpoint(trainer, path)
    before = _snapshot(path)
    trainer.train_step(batches[2])
    write = ckpt.write_tensors

    def disk_full(tensors: dict[str, torch.Tensor], fp: Path) -> None:
        if fp.name.startswith("shards-"):
            raise OSError(28, "No space left on device")
        write(tensors, fp)

    monkeypatch.setattr(ckpt, "write_tensors", disk_full)
    with pytest.raises(ValueError, match=r"rank 0 cannot write its shards of .*ck.*No space"):
        save_sharded_checkpoint(trainer, path)
    assert _snapshot(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary folder left
    monkeypatch.setattr(ckpt, "write_tensors", write)
    save_sharded_checkpoint(trainer, path)
    assert json.loads((path / "state.json").read_text())["step"] == 3


def test_a_save_refuses_a_folder_that_is_not_a_checkpoint(tmp_path, batches) -> None:
    trainer, _ = _one_rank(batches)
    path = tmp_path / "notes"
    path.mkdir()
    (path / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to overwrite .*notes.* not a checkpoint"):
        save_sharded_checkpoint(trainer, path)
    assert _snapshot(path) == {"todo.txt": b"keep me"}


def test_a_sharded_load_refuses_another_format_version(tmp_path, batches) -> None:
    trainer, plan = _one_rank(batches)
    path = tmp_path / "ck"
    save_sharded_checkpoint(trainer, path)
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps(state | {"format_version": 2}))
    with pytest.raises(FormatVersionError, match=r"state.json.* has format_version 2, expected 3"):
        load_sharded_checkpoint(path, plan, 0)
