"""The training benchmark (benchmarks/embark/bench_training): both sides start from the same
weights and step through the same batches, the memory estimate and the rows are exact, and
a tiny run end to end writes complete rows whose losses agree at step 0.

No timing thresholds here: speed is what the benchmark measures, not what tests assert."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.embark import bench_training, training_sides
from benchmarks.embark.bench_training import Case, SideRecord
from embark.models.dlrm import SCRATCH_ELEMENTS, build_model
from embark.models.workloads import get_workload

ROW_FIELDS = (
    "workload",
    "scale",
    "rows",
    "weight_mb",
    "batch_size",
    "world",
    "nodes",
    "ranks_per_node",
    "side",
    "plan",
    "embedding_optimizer",
    "dense_optimizer",
    "embedding_kernel",
    "layouts",
    "threads_per_rank",
    "step_ms",
    "steps_timed",
    "samples_per_s",
    "peak_rss_mb",
    "peak_rss_total_mb",
    "setup_rss_mb",
    "losses",
    "estimated_rss_mb",
    "available_mb",
    "interleaved",
)


def test_batches_are_deterministic_and_shaped_like_the_workload():
    w = get_workload("tiny")
    a = training_sides.make_batches(w, 32, 3, seed=7)
    b = training_sides.make_batches(w, 32, 3, seed=7)
    assert len(a) == 3
    for x, y in zip(a, b):
        assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        assert x.sparse.equals(y.sparse)
        assert x.dense.shape == (32, w.dense_features) and x.dense.dtype == torch.float32
        assert set(x.labels.unique().tolist()) <= {0.0, 1.0}
        for t in w.tables:
            ids = x.sparse.values_for(t.name)
            assert ids.numel() == 32 * t.hotness
            assert int(ids.min()) >= 0 and int(ids.max()) < t.num_rows
    assert not torch.equal(a[0].dense, a[1].dense)
    first = training_sides.make_batches(w, 32, 1, seed=7)[0]  # batch i does not depend on n
    assert first.sparse.equals(a[0].sparse) and torch.equal(first.dense, a[0].dense)
    assert not a[0].sparse.equals(training_sides.make_batches(w, 32, 1, seed=8)[0].sparse)


def test_dense_part_and_table_draws_equal_build_model():
    w = get_workload("tiny")
    ref = build_model(w, seed=3)
    drawn: dict[str, torch.Tensor] = {}

    def fill(name: str, bound: float, gen: torch.Generator) -> None:
        t = next(t for t in w.tables if t.name == name)
        drawn[name] = torch.empty(t.num_rows, t.dim).uniform_(-bound, bound, generator=gen)

    dense = training_sides.dense_part_like_build_model(w, 3, fill)
    assert len(dense.embeddings) == 0
    assert list(drawn) == [t.name for t in w.tables]
    for name, weights in drawn.items():
        assert torch.equal(weights, ref.embeddings[name].weight)
    ref_dense = {k: v for k, v in ref.state_dict().items() if not k.startswith("embeddings.")}
    got = dense.state_dict()
    assert list(got) == list(ref_dense)
    for k, v in ref_dense.items():
        assert torch.equal(got[k], v), k


def _cfg(**kw):
    base = {
        "workload": "dlrm_dcnv2",
        "scale": 1000.0,
        "batch_size": 512,
        "world": 1,
        "embedding_optimizer": "adagrad",
    }
    return base | kw


def test_rss_estimate_counts_weights_gradients_and_state_exactly():
    w = get_workload("dlrm_dcnv2").scaled(1000)
    weights = sum(t.num_rows * t.dim * 4 for t in w.tables)
    rows = sum(t.num_rows for t in w.tables)
    base = bench_training.PROCESS_BASE_BYTES + bench_training.ACTIVATION_BYTES_PER_SAMPLE * 512
    est = bench_training.estimate_rss_bytes
    assert est(_cfg(), "ours", fused=False) == pytest.approx(3 * weights + base)
    assert est(_cfg(), "ours", fused=True) == pytest.approx(2 * weights + base)
    assert est(_cfg(), "torchrec", fused=False) == pytest.approx(2 * weights + base)
    rw = _cfg(embedding_optimizer="rowwise_adagrad")
    assert est(rw, "torchrec", fused=False) == pytest.approx(weights + 4 * rows + base)
    assert est(_cfg(embedding_optimizer="sgd"), "ours", fused=False) == pytest.approx(
        2 * weights + base
    )
    # world 2: each rank of ours builds its shards only (and 4 MiB of scratch); TorchRec draws
    # one whole table at a time
    per_rank = bench_training.PROCESS_BASE_BYTES + bench_training.ACTIVATION_BYTES_PER_SAMPLE * 256
    biggest = max(t.num_rows for t in w.tables) * 128 * 4
    assert est(_cfg(world=2), "ours", fused=False) == pytest.approx(
        3 * weights + 2 * 4 * SCRATCH_ELEMENTS + 2 * per_rank
    )
    assert est(_cfg(world=2), "torchrec", fused=False) == pytest.approx(
        2 * weights + 2 * biggest + 2 * per_rank
    )


def test_a_side_that_does_not_fit_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(bench_training, "mem_available_bytes", lambda: 1e9)
    args = bench_training._parse(["--workload", "dlrm_dcnv2", "--scales", "10", "--worlds", "1"])
    rows = bench_training.run_case(Case(10.0, 512, 1), args)
    assert [r["side"] for r in rows] == ["ours", "torchrec"]
    for r in rows:
        assert r["step_ms"] is None and r["peak_rss_mb"] is None
        assert "exceeds 90% of the 1.0 GB available" in r["skipped"]
        assert r["estimated_rss_mb"] > 20_000  # 20.4 M rows × 128 × 4 B, with state
    assert bench_training.case_summary(rows) is None
    lines = bench_training.table_lines(rows, [])
    assert any("skipped ours at S=10 batch 512 world 1" in line for line in lines)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--worlds", "3"], "--worlds must be 1, 2 or 4"),
        (["--scales", "0.5"], "--scales must be >= 1"),
        (["--batches", "512,x"], "--batches must be comma-separated integers"),
        (["--reps", "0"], "--reps must be >= 1"),
    ],
)
def test_bad_arguments_name_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_training._parse(argv)


def test_rows_take_the_median_of_the_slowest_rank_after_warmup():
    rec = SideRecord(
        ready=[
            {
                "embedding_kernel": "dense-grad",
                "torch_threads": 1,
                "rss_setup_mb": 5.0,
                "setup_s": 1.0,
            }
        ],
        step_s=[],
        losses=[],
        done=[{"peak_rss_mb": 10.0}, {"peak_rss_mb": 12.0}],
    )
    rec.ready.append(rec.ready[0] | {"rss_setup_mb": 6.0})
    bench_training._append(
        rec,
        [
            {"seconds": [9.0, 0.1], "losses": [0.7, 0.6]},
            {"seconds": [1.0, 0.3], "losses": [0.7, 0.6]},
        ],
    )
    bench_training._append(
        rec, [{"seconds": [0.2], "losses": [0.5]}, {"seconds": [0.1], "losses": [0.5]}]
    )
    assert rec.step_s == [9.0, 0.3, 0.2] and rec.losses == [0.7, 0.6, 0.5]
    cfg = _cfg(world=2, warmup=1, ours_layouts={"table_wise/reduction": 26})
    row = bench_training.side_row(Case(1000.0, 512, 2), cfg, "ours", rec, {})
    assert row["step_ms"] == pytest.approx(250.0) and row["steps_timed"] == 2
    assert row["samples_per_s"] == pytest.approx(512 / 0.25)
    assert row["peak_rss_mb"] == 12.0 and row["peak_rss_total_mb"] == 22.0
    assert row["setup_rss_mb"] == 6.0 and row["layouts"] == {"table_wise/reduction": 26}
    assert (row["nodes"], row["ranks_per_node"]) == (1, 2)
    other = row | {"side": "torchrec", "samples_per_s": 1024.0, "losses": [0.75, 0.6, 0.5]}
    s = bench_training.case_summary([row, other])
    assert s is not None
    assert s["ours_over_torchrec_samples_per_s"] == pytest.approx(2.0)
    assert s["loss_diff_step0"] == pytest.approx(0.05) and s["loss_max_diff"] == pytest.approx(0.05)


def test_world4_is_two_nodes_of_two():
    t = bench_training.topology_for(4)
    assert (t.num_nodes, t.gpus_per_node, t.world_size) == (2, 2, 4)
    assert bench_training.topology_for(2).world_size == 2
    with pytest.raises(ValueError, match="got 3"):
        bench_training.topology_for(3)


def _torchrec(require) -> None:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        torchrec = None
    require(torchrec is not None, "torchrec")


@pytest.mark.slow  # two worker processes importing torch and torchrec
def test_tiny_run_end_to_end_writes_rows_whose_losses_agree(tmp_path, require):
    _torchrec(require)
    out = tmp_path / "training.json"
    argv = ["--workload", "tiny", "--scales", "1", "--batches", "64", "--worlds", "1"]
    argv += ["--reps", "1", "--steps-per-rep", "2", "--warmup", "1", "--out", str(out)]
    assert bench_training.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "embark_training" and doc["meta"]["git_sha"]
    rows = doc["rows"]
    assert [r["side"] for r in rows] == ["ours", "torchrec"]
    for r in rows:
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, missing
        assert "skipped" not in r and r["interleaved"] is True
        assert r["steps_timed"] == 2 and len(r["losses"]) == 3
        assert r["step_ms"] > 0 and math.isfinite(r["step_ms"]) and r["peak_rss_mb"] > 0
        assert r["samples_per_s"] == pytest.approx(64e3 / r["step_ms"])
    ours, theirs = rows
    assert theirs["embedding_kernel"] == "fbgemm-fused"
    assert theirs["layouts"] == {"table_wise/fused": len(get_workload("tiny").tables)}
    if training_sides.fused_fields_present():  # "auto" resolved to the kernel that ran
        assert ours["embedding_kernel"] in ("fbgemm", "reference")
    else:
        assert ours["embedding_kernel"] == "dense-grad"
    # same weights, same batch, same optimizer: the losses agree at step 0 and after steps
    assert ours["losses"][0] == pytest.approx(theirs["losses"][0], rel=1e-6)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-4)
    (s,) = doc["summaries"]
    assert s["loss_diff_step0"] == abs(ours["losses"][0] - theirs["losses"][0])
    # the loss at step 0 is the loss of the first batch under build_model's weights
    w = get_workload("tiny")
    batch = training_sides.make_batches(w, 64, 1, seed=0)[0]
    with torch.no_grad():
        logits = build_model(w, seed=0)(batch.dense, batch.sparse)
        ref = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    assert ours["losses"][0] == pytest.approx(float(ref), rel=1e-6)
