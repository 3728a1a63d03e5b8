from __future__ import annotations

import json
import struct

import pytest

from recipes.prune_dlrm import SWEEP, PruneDLRMConfig, main, parse_args

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def _shrunk(tmp_path, **kw) -> PruneDLRMConfig:
    base = dict(batch_size=64, dense_steps=40, steps=30, eval_batches=4, progress=False, out=str(tmp_path / "run"),
                speed_batch=0, serve_batches=0)
    return PruneDLRMConfig(**(base | kw))


def test_main_writes_report_and_plots(tmp_path) -> None:
    report = main(_shrunk(tmp_path, speed_batch=32, speed_threads=1, serve_batches=2))
    out = tmp_path / "run"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["dense_auc"] == pytest.approx(report["dense_auc"])
    assert 0.0 < on_disk["dense_auc"] < 1.0
    res = on_disk["results"]["tw"]["0.75"]
    assert res["auc_drop"] == pytest.approx(on_disk["dense_auc"] - res["eval_auc"])
    # the condensed TileSparseLinear layers compute the same model as the masks
    assert res["compressed_auc"] == pytest.approx(res["eval_auc"], abs=1e-3)
    assert abs(res["achieved_sparsity"] - 0.75) <= 0.01
    (run,) = on_disk["runs"]
    assert {s["fqn"] for s in run["layers"]} >= {"bottom_mlp.0", "interaction.v.0", "top_mlp.0"}
    assert run["kept_params"] == sum(s["kept"] for s in run["layers"])
    assert run["config"]["schedule"]["kind"] == "multistage" and run["mask_updates"] == 7
    for name in on_disk["plots"]:
        w, h = _png_size(out / name)
        assert w > 100 and h > 100
    assert {"auc_vs_sparsity.png", "layer_sparsity.png", "mask_top_mlp_0.png"} == set(on_disk["plots"])
    md = (out / "report.md").read_text()
    assert "| TW | 75%" in md and "`top_mlp.0`" in md
    # the speed half: the same pattern on the full-width DLRM-DCNv2 dense part, condensed
    sp = on_disk["speed"]
    assert (sp["pattern"], sp["sparsity"], sp["tile"], sp["batch"], sp["threads"]) == ("tw", 0.75, 128, 32, 1)
    assert abs(sp["achieved_sparsity"] - 0.75) <= 0.01
    assert sp["max_abs_err"] < 1e-4  # the condensed model computes the masked dense one
    assert sp["speedup"] == pytest.approx(sp["dense_ms"] / sp["pruned_ms"]) and sp["ideal"] == pytest.approx(4.0)
    assert sp["pruned_weight_bytes"] <= (0.25 + 0.03) * sp["dense_weight_bytes"]
    assert "## Speed: dlrm_dcnv2 dense part" in md
    # the serving half: the condensed model exported, served over HTTP, scored like the eager one
    sv = on_disk["serving"]
    assert (sv["samples"], sv["requests"], sv["request_batch"]) == (128, 2, 64)
    assert sv["max_abs_logit_diff"] < 1e-4
    assert sv["served_auc"] == pytest.approx(sv["eager_auc"], abs=1e-6)
    assert 0 < sv["latency_ms_p50"] <= sv["latency_ms_p99"]
    art = out / "serving"
    assert {"ps.json", "dense.onnx", "sparse"} <= {p.name for p in art.iterdir()}
    assert "## Serving" in md


def test_sweep_covers_the_table(tmp_path) -> None:
    report = main(_shrunk(tmp_path, dense_steps=10, steps=24, eval_batches=2, schedule="oneshot", sweep=True))
    got = {(r["pattern"], r["sparsity"]) for r in report["runs"]}
    assert got == set(SWEEP)
    assert set(report["results"]) == {"tw", "ew", "bw", "nm"}
    assert set(report["results"]["ew"]) == {"0.5", "0.75", "0.9"}
    for r in report["runs"]:
        assert abs(r["achieved_sparsity"] - r["sparsity"]) <= 0.01, r["pattern"]


def test_bad_knobs_and_recipe_files(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--sparsity must be in \[0, 1\), got 1.5"):
        parse_args(["--sparsity", "1.5"])
    with pytest.raises(ValueError, match="--tile must be an integer >= 1, got 0"):
        parse_args(["--tile", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--tile", "big"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("pattern: tw\nsparsity: 0.5\nthreshold: global\n")
    cfg = _shrunk(tmp_path, recipe=str(bad))
    with pytest.raises(ValueError, match=r"bad.yaml: TileSparseConfig: unknown key\(s\) \['threshold'\]"):
        main(cfg)
    assert not (tmp_path / "run").exists()  # failed before anything was written


def test_recipe_file_drives_the_run(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("pattern: tew\nsparsity: 0.6\ntile: 8\nschedule: {kind: oneshot, step: 0}\n")
    cfg = parse_args(["--recipe", str(recipe), "--out", str(tmp_path / "run"), "--no-progress",
                      "--dense-steps", "10", "--steps", "10", "--eval-batches", "2", "--batch-size", "64"])
    report = main(cfg)
    (run,) = report["runs"]
    assert run["pattern"] == "tew" and run["config"]["tile"] == 8
    assert "TW family" in report["speed"]["skipped"]  # TEW has no fast condensed path to time
    assert "Not measured: speed is measured for the TW family" in (tmp_path / "run" / "report.md").read_text()
    assert abs(run["achieved_sparsity"] - 0.6) <= 0.01


def test_measure_speed_rejects_bad_settings() -> None:
    from recipes.prune_speed import measure_speed

    for kw in ({"batch": 0}, {"threads": 0}, {"repeats": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            measure_speed(**kw)
    with pytest.raises(ValueError, match="--speed-batch"):
        PruneDLRMConfig(speed_batch=-1)
