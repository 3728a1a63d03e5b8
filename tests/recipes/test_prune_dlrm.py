from __future__ import annotations

import copy
import json
import struct

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.trainer import TrainConfig, Trainer
from recipes.cli import foreign_entries
from recipes.prune_dlrm import (
    OUTPUTS,
    SWEEP,
    PruneDLRMConfig,
    _fine_tune,
    main,
    parse_args,
    prune_config,
)
from tilesparse import OneShotSchedule
from tilesparse.schedule import end_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def _shrunk(tmp_path, **kw) -> PruneDLRMConfig:
    base = dict(
        batch_size=64,
        dense_steps=40,
        steps=30,
        eval_batches=4,
        progress=False,
        out=str(tmp_path / "run"),
        speed_batch=0,
        serve_batches=0,
    )
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
    assert {"auc_vs_sparsity.png", "layer_sparsity.png", "mask_top_mlp_0.png"} == set(
        on_disk["plots"]
    )
    md = (out / "report.md").read_text()
    assert "| TW | 75%" in md and "`top_mlp.0`" in md
    # the speed half: the same pattern on the full-width DLRM-DCNv2 dense part, condensed
    sp = on_disk["speed"]
    assert (sp["pattern"], sp["sparsity"], sp["tile"], sp["batch"], sp["threads"]) == (
        "tw",
        0.75,
        128,
        32,
        1,
    )
    assert abs(sp["achieved_sparsity"] - 0.75) <= 0.01
    assert sp["max_abs_err"] < 1e-4  # the condensed model computes the masked dense one
    assert sp["speedup"] == pytest.approx(sp["dense_ms"] / sp["pruned_ms"]) and sp[
        "ideal"
    ] == pytest.approx(4.0)
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
    # the compressed-tables half (--quant-budget 0.25 by default) on the main run "tw 75%"
    q = on_disk["quantized"]
    assert (q["pruned"], q["budget_fraction"]) == ("tw 75%", 0.25)
    assert set(q["variants"]) == {
        "dense",
        "dense + int8",
        "tw 75%",
        "tw 75% + int8",
        "tw 75% + int4",
        "tw 75% + plan",
    }
    assert "## Compressed tables" in md
    # every entry is one a later --overwrite may remove
    assert foreign_entries([p.name for p in out.iterdir()], OUTPUTS) == []


def test_sweep_covers_the_table(tmp_path) -> None:
    report = main(
        _shrunk(tmp_path, dense_steps=10, steps=24, eval_batches=2, schedule="oneshot", sweep=True)
    )
    got = {(r["pattern"], r["sparsity"]) for r in report["runs"]}
    assert got == set(SWEEP)
    assert set(report["results"]) == {"tw", "ew", "bw", "nm"}
    assert set(report["results"]["ew"]) == {"0.5", "0.75", "0.9"}
    for r in report["runs"]:
        assert abs(r["achieved_sparsity"] - r["sparsity"]) <= 0.01, r["pattern"]


def test_bad_knobs_and_recipe_files(tmp_path, capsys) -> None:
    for argv, msg in (
        (["--sparsity", "1.5"], "--sparsity must be a finite number in [0, 1), got 1.5"),
        (["--tile", "0"], "--tile must be an integer >= 1, got 0"),
        (["--tile", "big"], "invalid int value: 'big'"),
        (["--pattern", "xyz"], "invalid choice: 'xyz'"),
        (["--serve-batches", "-1"], "--serve-batches must be an integer >= 0, got -1"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="--importance must be one of"):
        PruneDLRMConfig(importance="foo")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pattern: tw\nsparsity: 0.5\nthreshold: global\n")
    cfg = _shrunk(tmp_path, recipe=str(bad))
    with pytest.raises(
        ValueError, match=r"bad.yaml: TileSparseConfig: unknown key\(s\) \['threshold'\]"
    ):
        main(cfg)
    assert not (tmp_path / "run").exists()  # failed before anything was written
    slow = tmp_path / "slow.yaml"
    slow.write_text(
        "pattern: tw\nsparsity: 0.75\nschedule: {kind: multistage, steps_per_stage: 1000}\n"
    )
    with pytest.raises(
        ValueError, match=r"slow.yaml: the tw schedule reaches 0.75 at step \d+, but --steps is 30"
    ):
        main(_shrunk(tmp_path, recipe=str(slow)))
    assert not (tmp_path / "run").exists()  # before any training


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "-0.05"], "--lr must be a finite number > 0, got -0.05"),
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--scale", "nan"], "--scale must be a finite number >= 1, got nan"),
        (["--scale", "inf"], "--scale must be a finite number >= 1, got inf"),
        (["--scale", "0.5"], "--scale must be a finite number >= 1, got 0.5"),
    ],
)
def test_bad_lr_and_scale_are_usage_errors_before_any_output(tmp_path, capsys, argv, msg) -> None:
    """NaN passed the old ``scale < 1`` check and --lr was not checked at all: both failed
    late (or never), after the output folder was made. Now parse_args refuses them."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--out", str(out)])
    assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    assert not out.exists()
    with pytest.raises(ValueError, match=msg.split(",")[0]):
        PruneDLRMConfig(**{argv[0][2:]: float(argv[1])})


BAD_RECIPE_TEXTS = {
    "broken.yaml": ("pattern: [tw\n", "not valid YAML: expected ',' or ']'"),
    "truncated.json": ('{"pattern": "tw", ', "not valid JSON: Expecting property name"),
    "stages.yaml": (
        "schedule: {kind: multistage, stages: 0.5}\n",
        "TileSparseConfig.schedule: MultiStageSchedule.stages must be a list",
    ),
    "overrides.yaml": ("overrides: [fc1, 0.5]\n", "TileSparseConfig.overrides must be a mapping"),
}


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--seed", "-1"], "--seed must be an integer in [0, 4294967295], got -1"),
        (["--seed", str(2**32)], f"--seed must be an integer in [0, 4294967295], got {2**32}"),
        (
            ["--pattern", "tew", "--sparsity", "0.96"],
            "--sparsity must be < 0.95 for --pattern tew (it prunes sparsity + tew_delta = 0.05 first",
        ),
        (["--steps", "5"], "the tw schedule reaches 0.75 at step 6, but --steps is 5"),
        (
            ["--recipe", "{tmp}/missing.yaml"],
            "--recipe {tmp}/missing.yaml: cannot read it: No such file or directory",
        ),
        *(
            (["--recipe", f"{{tmp}}/{name}"], f"recipe file {{tmp}}/{name}: {msg}")
            for name, (_, msg) in BAD_RECIPE_TEXTS.items()
        ),
    ],
)
def test_bad_seed_tew_sparsity_and_recipe_files_are_usage_errors_before_any_output(
    tmp_path, capsys, argv, msg
) -> None:
    """--seed -1 passed parsing, made the --out folder and died in numpy; --pattern tew
    --sparsity 0.96 and malformed --recipe files failed in main with a traceback (a TypeError
    or a parser error without the file's name for some recipes). All are usage errors now."""
    for name, (text, _) in BAD_RECIPE_TEXTS.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "run"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {msg.replace('{tmp}', str(tmp_path))}" in err, err
    assert not out.exists()


def test_bad_recipe_on_the_command_line_exits_2_without_a_traceback(tmp_path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("pattern: [tw\n")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.prune_dlrm", "--recipe", str(bad), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("prune_dlrm.py: error: recipe file ") and "bad.yaml: not valid YAML" in last
    )


@pytest.mark.parametrize("schedule", ["multistage", "cubic", "oneshot"])
def test_nm_prunes_once_when_the_other_50_percent_runs_reach_their_target(schedule) -> None:
    """2:4 masks ignore a stage's sparsity: a staged schedule only re-picked the same 50 % mask
    from step 0 on. nm is pruned once, where tw/ew/bw at 50 % reach 50 %."""
    cfg = PruneDLRMConfig(steps=600, schedule=schedule, progress=False)
    nm = prune_config(cfg, "nm", 0.5).schedule
    assert isinstance(nm, OneShotSchedule)
    for p in ("tw", "ew", "bw"):
        other = prune_config(cfg, p, 0.5).schedule
        assert nm.step == end_step(other, 0.5), p
    assert nm.step > 0 or schedule == "oneshot"


def test_runs_do_not_share_optimizer_state() -> None:
    """Each fine-tuning run starts from the same copy of the dense trainer's Adagrad state:
    two identical runs give identical weights, and the shared state is left untouched."""
    w = get_workload("tiny")
    data = SyntheticCTR(w, batch_size=32, seed=0)
    dense = build_model(w, seed=0)
    trainer = Trainer(dense, TrainConfig(lr=0.05, seed=0))
    trainer.fit(data.batches(5), 5, progress=False)
    state = trainer.optimizer.state_dict()
    before = copy.deepcopy(state)
    batches = list(data.batches(4, start=5))
    runs = [
        _fine_tune(
            copy.deepcopy(dense), TrainConfig(lr=0.05, seed=0), state, batches, None, False, "x"
        )
        for _ in range(2)
    ]
    for a, b in zip(runs[0].model.state_dict().values(), runs[1].model.state_dict().values()):
        assert torch.equal(a, b)
    for k, v in before["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(state["state"][k][name]), torch.as_tensor(t)), (
                k,
                name,
            )


def test_recipe_file_drives_the_run(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("pattern: tew\nsparsity: 0.6\ntile: 8\nschedule: {kind: oneshot, step: 0}\n")
    cfg = parse_args(
        [
            "--recipe",
            str(recipe),
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
            "--dense-steps",
            "10",
            "--steps",
            "10",
            "--eval-batches",
            "2",
            "--batch-size",
            "64",
        ]
    )
    report = main(cfg)
    (run,) = report["runs"]
    assert run["pattern"] == "tew" and run["config"]["tile"] == 8
    assert "TW family" in report["speed"]["skipped"]  # TEW has no fast condensed path to time
    assert (
        "Not measured: speed is measured for the TW family"
        in (tmp_path / "run" / "report.md").read_text()
    )
    assert abs(run["achieved_sparsity"] - 0.6) <= 0.01


def test_measure_speed_rejects_bad_settings() -> None:
    from recipes.prune_speed import measure_speed

    for kw in ({"batch": 0}, {"threads": 0}, {"repeats": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            measure_speed(**kw)
    with pytest.raises(ValueError, match="--speed-batch"):
        PruneDLRMConfig(speed_batch=-1)


def test_calibration_batches_add_the_oneshot_rows(tmp_path) -> None:
    report = main(_shrunk(tmp_path, calibration_batches=2))
    (row,) = report["oneshot"]
    assert (row["pattern"], row["sparsity"], row["calibration_batches"]) == ("tw", 0.75, 2)
    assert row["auc"].keys() == {"magnitude", "calibrated", "calibrated_finetuned"}
    for k, auc in row["auc"].items():
        assert 0.0 <= auc <= 1.0
        assert row["auc_drop"][k] == pytest.approx(report["dense_auc"] - auc)
    assert abs(row["achieved_sparsity"] - 0.75) < 0.02
    # the damped solve may sit a hair above the masked error on a layer already near optimal
    assert sum(r["reconstructed"] for r in row["reconstruction"]) < sum(
        r["masked"] for r in row["reconstruction"]
    )
    assert "## One-shot with calibration" in (tmp_path / "run" / "report.md").read_text()
