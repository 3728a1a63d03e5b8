"""Train a DLRM-DCNv2, prune it with tile-wise sparsity under a schedule with fine-tuning, and
report what it cost in AUC and what it gained in speed.

    python -m recipes.prune_dlrm                       # tiny default: TW 75%, ~45 s on 2 cores
    python -m recipes.prune_dlrm --sweep               # dense vs TW/EW/BW at 50/75/90% and 2:4
    python -m recipes.prune_dlrm --pattern tew --sparsity 0.9 --importance taylor
    python -m recipes.prune_dlrm --recipe my_recipe.yaml   # a TileSparseConfig file
    python -m recipes.prune_dlrm --calibration-batches 8   # + one-shot with calibration

The story: a dense model is trained once (``dense_steps``); every run — the dense baseline
included — starts from a deep copy of it and gets the same fine-tuning budget (``steps``
batches, the same batches, each with its own copy of the dense trainer's Adagrad state), pruned
runs following their schedule (2:4, whose masks have one sparsity, is pruned once, at the step
where the other 50 % runs reach 50 %). So
``auc_drop = dense_auc - eval_auc`` compares equal training, not a pruned model against an
under-trained one. Each pruned model is then compressed into ``TileSparseLinear`` layers and
evaluated again (``compressed_auc``: the condensed format computes the same model).
Speed (``--speed-batch``, 0 skips): the same pattern and sparsity on the DLRM-DCNv2 dense part at
full MLPerf widths, condensed with G=128, timed against dense (``recipes.prune_speed``).

One-shot (``--calibration-batches N``, 0 skips): every config is also pruned once, with no
schedule — by magnitude alone, with calibration on N training batches (activation importance
and least-squares reconstruction), and with calibration then the same fine-tuning budget
(``recipes.prune_oneshot``); ``report.json`` ``oneshot`` and a section of ``report.md``.

Compressed tables (``--quant-budget F``, 0 skips): the dense baseline and the main run with
their embedding tables stored as int8, int4 and as the compression planner chooses for F of the
fp32 tables' bytes (choices on validation batches), each model's whole size (tables + dense
part) and test AUC (``recipes.prune_quant``); ``report.json`` ``quantized`` and a section of
``report.md``.

Serving (``--serve-batches``, 0 skips): the main run's condensed model is exported to
``<out>/serving`` (sparse files, ``dense.onnx``, ``ps.json``), served by the v2 inference server
(``hps.serving.http_server``) on a free local port, and that many eval batches are scored through it with
``tritonclient`` and compared with the eager model (``recipes.prune_serve``).

Output folder (``--out``, default a fresh ``runs/prune_dlrm-<timestamp>``): ``report.json``,
``report.md``, ``auc_vs_sparsity.png``, ``mask_<layer>.png``, ``layer_sparsity.png``,
``serving/``. A non-empty ``--out`` (an earlier run) is refused unless ``--overwrite`` is
given, which clears it first (:class:`recipes.cli.OutFolder`).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from embark import (
    DLRM,
    MAX_BATCH_SIZE,
    MAX_SEED,
    MAX_THREADS,
    PRESETS,
    Batch,
    Callback,
    SyntheticCTR,
    TrainConfig,
    Trainer,
    build_model,
    get_workload,
)
from recipes.cli import OutFolder, check_knobs, knob, parse_knobs, run_recipe
from recipes.prune_oneshot import oneshot_rows, oneshot_section
from recipes.prune_quant import quant_report, quant_section, quant_summary
from recipes.prune_report import terminal_summary, write_markdown, write_plots
from recipes.prune_serve import serve_check
from recipes.prune_speed import measure_speed
from tilesparse import (
    CubicSchedule,
    Importance,
    MultiStageSchedule,
    OneShotSchedule,
    Pattern,
    PruningCallback,
    ScheduleConfig,
    TileSparseConfig,
    TileSparsePruner,
    end_step,
    stages_for,
)

log = logging.getLogger("recipes.prune_dlrm")

# The sweep of the acceptance table: (pattern, sparsity), beside the dense baseline.
SWEEP: tuple[tuple[str, float], ...] = (
    *((p, s) for p in ("tw", "ew", "bw") for s in (0.5, 0.75, 0.9)),
    ("nm", 0.5),
)


# Patterns whose condensed layers have few, wide tiles: the ones the speed half times.
SPEED_PATTERNS = ("tw", "tw_rows")
#: what a run writes into --out (the serving artifacts' temporary siblings included): all that
#: --overwrite of such a run's folder removes
OUTPUTS = (
    "report.json",
    "report.md",
    "auc_vs_sparsity.png",
    "layer_sparsity.png",
    "mask_*.png",
    "serving",
    ".serving.*",
)

# The tew_delta of the knob-built configs (TileSparseConfig's default).
_TEW_DELTA: float = TileSparseConfig().tew_delta


@dataclass(frozen=True)
class PruneDLRMConfig:
    """Every knob of the recipe, with its default (each is a ``--flag`` of the same name)."""

    workload: str = knob("tiny", f"embark preset, one of {', '.join(PRESETS)}")
    scale: float = knob(
        1.0, "divide every table's rows by this to fit a big preset on a laptop", ge=1
    )
    batch_size: int = knob(
        256, "samples per step (and per served request)", ge=1, le=MAX_BATCH_SIZE
    )
    # tiny: AUC still rising slowly after 3000 steps
    dense_steps: int = knob(3000, "dense training steps before pruning", ge=0)
    steps: int = knob(600, "fine-tuning budget of EVERY run, the dense baseline included", ge=1)
    eval_batches: int = knob(
        64, "held-out eval batches; every run is scored on the same ones", ge=1
    )
    # 0.2 diverges on tiny, 0.1 learns slower
    lr: float = knob(0.05, "Adagrad learning rate", gt=0)
    # Adagrad's first steps move every weight by ~lr whatever its gradient: at a full 0.05 they
    # can push every unit of the bottom MLP's last ReLU negative for all inputs within 5 steps
    # (seed 0: all 16 dead, the dense features lost for good). 100 of 3000 steps ramps past it.
    warmup_steps: int = knob(
        100, "linear lr warm-up of the dense training (the fine-tuning continues at lr)", ge=0
    )
    pattern: Literal["tw", "tw_rows", "tew", "ew", "nm", "bw"] = knob("tw", "sparsity pattern")
    sparsity: float = knob(0.75, "target sparsity (nm: always 2:4 = 0.5)", ge=0, lt=1)
    # tiny's layers are 13-144 wide (top MLP 144x128, cross layers 144x32): G=128 would put a
    # whole layer in one tile and leave nothing for the per-tile row step to choose; G=16 gives
    # each big layer 4-8 tiles at 75%. (G=128, the library default, matches tensor-core tiles
    # of the full-size dlrm_dcnv2 layers, 512-1024 wide.)
    tile: int = knob(16, "TW tile width G (output columns per tile)", ge=1)
    block: int = knob(16, "BW block side (bk = bn), the same scale as the tile on tiny", ge=1)
    importance: Literal["magnitude", "taylor", "movement"] = knob("magnitude", "importance score")
    schedule: Literal["multistage", "cubic", "oneshot"] = knob(
        "multistage", "pruning schedule (multistage: the paper's stages with fine-tuning between)"
    )
    recipe: str | None = knob(None, "a TileSparseConfig YAML/JSON file: replaces pattern..schedule")
    sweep: bool = knob(False, "run dense vs TW/EW/BW at 50/75/90%% and 2:4 instead of one run")
    seed: int = knob(0, "seed of the model, the data and the teacher", ge=0, le=MAX_SEED)
    out: str | None = knob(None, "output folder; none = runs/prune_dlrm-<UTC timestamp>")
    overwrite: bool = knob(False, "clear a non-empty --out that holds an earlier run")
    progress: bool = knob(True, "tqdm progress bars")
    # 1: these layers are too small to split, and on a shared 2-core machine 2 threads measured
    # ~30x slower per step (thread contention), 1 thread ~4 ms/step.
    threads: int = knob(1, "torch intra-op threads for training", ge=1, le=MAX_THREADS)
    speed_batch: int = knob(
        4096,
        "speed half: batch of the full-width DLRM-DCNv2 dense part, "
        "dense vs condensed (0 skips it)",
        ge=0,
        le=MAX_BATCH_SIZE,
    )
    speed_threads: int = knob(2, "speed half: torch threads while timing", ge=1, le=MAX_THREADS)
    calibration_batches: int = knob(
        0,
        "also prune each config one-shot: magnitude, with calibration on this many training "
        "batches (activation importance + reconstruction), and that fine-tuned (0 skips)",
        ge=0,
    )
    quant_budget: float = knob(
        0.25,
        "compressed tables: int8, int4 and the planner's choice for this fraction of the fp32 "
        "tables' bytes (0 skips)",
        ge=0,
        le=1,
    )
    serve_batches: int = knob(
        8,
        "serving half: eval batches scored through the v2 server after "
        "exporting the condensed model (0 skips it)",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_knobs(self)  # types and bounds of the numeric knobs, naming the flag
        if self.workload not in PRESETS:
            raise ValueError(f"--workload must be one of {list(PRESETS)}, got {self.workload!r}")
        # tew prunes sparsity + tew_delta, then restores tew_delta of single weights
        if (
            self.pattern == "tew"
            and not (self.recipe or self.sweep)
            and self.sparsity + _TEW_DELTA >= 1.0
        ):
            raise ValueError(
                f"--sparsity must be < {1 - _TEW_DELTA:g} for --pattern tew (it prunes sparsity + "
                f"tew_delta = {_TEW_DELTA:g} first, then restores the best tew_delta), got {self.sparsity}"
            )
        for name, allowed in (
            ("pattern", [p.value for p in Pattern]),
            ("importance", [i.value for i in Importance]),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.schedule not in ("multistage", "cubic", "oneshot"):
            raise ValueError(
                f"--schedule must be multistage, cubic or oneshot, got {self.schedule!r}"
            )

    @property
    def folder(self) -> OutFolder:
        """The run's ``--out`` with its ``--overwrite``."""
        return OutFolder("prune_dlrm", self.out, self.overwrite, outputs=OUTPUTS)


# -- building the pruning configs ---------------------------------------------------------
def _schedule(kind: str, steps: int, warmup: int, target: float) -> ScheduleConfig:
    """The schedule over a fine-tuning budget of ``steps`` reaching ``target`` with about a
    fifth of the budget (or more) left to recover at the target. ``warmup`` steps come first
    (gradient importances need observed backward passes before the first update)."""
    body = max(1, steps - warmup)
    if kind == "oneshot":
        return OneShotSchedule(step=warmup)
    if kind == "cubic":
        end = warmup + max(1, (4 * body) // 5)
        return CubicSchedule(
            begin_step=warmup, end_step=end, frequency=max(1, (end - warmup) // 10)
        )
    # the paper's stages up to the target; the last one holds for two stages' worth of steps
    n_stages = len(stages_for(MultiStageSchedule(), target))
    return MultiStageSchedule(
        stages=None, steps_per_stage=max(1, body // (n_stages + 1)), start=warmup
    )


def prune_config(cfg: PruneDLRMConfig, pattern: str, sparsity: float) -> TileSparseConfig:
    """The TileSparseConfig of one run from the knobs, its schedule fitted to the target."""
    importance = Importance(cfg.importance)
    warmup = 0 if importance is Importance.MAGNITUDE else min(100, cfg.steps // 6)
    p = Pattern(pattern)
    target = sparsity if p is not Pattern.NM else 1.0 - 2 / 4
    schedule = _schedule(cfg.schedule, cfg.steps, warmup, target)
    if p is Pattern.NM and not isinstance(schedule, OneShotSchedule):
        # 2:4 has one sparsity (the N:M masks ignore a stage's), so stages would only re-pick the
        # same-sparsity mask: prune once, at the step where the 50 % runs of the other patterns
        # reach their target, so every 50 % run fine-tunes at its target as long.
        schedule = OneShotSchedule(step=end_step(schedule, target))
    return TileSparseConfig(
        pattern=p,
        sparsity=target,
        tile=cfg.tile,
        block=(cfg.block, cfg.block),
        importance=importance,
        taylor_steps=max(1, warmup),
        schedule=schedule,
    )


def run_configs(cfg: PruneDLRMConfig) -> list[TileSparseConfig]:
    """The pruning configs to run: ``--recipe`` (one, or the sweep on its other settings),
    else the knobs; ``--sweep`` runs :data:`SWEEP`."""
    if cfg.recipe:
        base = TileSparseConfig.load(cfg.recipe)
        if not cfg.sweep:
            return _check_schedules([base], cfg)
        return _check_schedules(
            [
                replace(base, pattern=Pattern(p), sparsity=None if p == "nm" else s)
                for p, s in SWEEP
            ],
            cfg,
        )
    configs = (
        [prune_config(cfg, cfg.pattern, cfg.sparsity)]
        if not cfg.sweep
        else [prune_config(cfg, p, s) for p, s in SWEEP]
    )
    return _check_schedules(configs, cfg)


def _check_schedules(
    configs: list[TileSparseConfig], cfg: PruneDLRMConfig
) -> list[TileSparseConfig]:
    """Every schedule must reach its target within ``--steps`` (checked before any training)."""
    for c in configs:
        end = end_step(c.schedule, c.target_sparsity)
        if end >= cfg.steps:
            where = f"{cfg.recipe}: " if cfg.recipe else ""
            raise ValueError(
                f"{where}the {c.pattern.value} schedule reaches {c.target_sparsity:g} "
                f"at step {end}, but --steps is {cfg.steps}; raise --steps or shorten "
                "the schedule"
            )
    return configs


# -- the runs -----------------------------------------------------------------------------
class _PruneHooks(PruningCallback, Callback):
    """The pruner's duck-typed callback, typed as the trainer's Callback."""


def _linear_params(model: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))


def _fine_tune(
    model: nn.Module,
    train_cfg: TrainConfig,
    optimizer_state: dict[str, Any],
    batches: Sequence[Batch],
    pruner: TileSparsePruner | None,
    progress: bool,
    desc: str,
) -> Trainer:
    """Continue training a deep copy of the dense model, with the dense trainer's optimizer
    state (a fresh Adagrad restarts with large steps and costs AUC), pruning if asked."""
    trainer = Trainer(model, train_cfg)
    # a copy: load_state_dict keeps same-device tensors as they are, and Adagrad updates them in
    # place, so without it each run would start from the state the previous run left behind
    trainer.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    if pruner is not None:
        pruner.prepare(model)
        trainer.rebuild_optimizer()  # keeps the state: the weights moved under parametrizations
        trainer.add_callback(_PruneHooks(pruner))
    with tqdm(total=len(batches), disable=not progress, desc=desc, unit="step", leave=False) as bar:
        for b in batches:
            trainer.train_step(b)
            bar.update(1)
    return trainer


@dataclass
class PruneRun:
    """One pruning run: its report row (JSON-able), its final masks and compressed model.

    Attributes:
        row: ``{"pattern", "sparsity", "config", "eval_auc", "compressed_auc", ...}`` as
            written under ``runs`` in ``report.json``.
        masks: ``{layer fqn: bool mask shaped like the layer's weight}``.
        model: the pruned model, compressed into ``TileSparseLinear`` layers.
    """

    row: dict[str, Any]
    masks: dict[str, torch.Tensor]
    model: DLRM


def run_one(
    dense_model: DLRM,
    pcfg: TileSparseConfig,
    train_cfg: TrainConfig,
    optimizer_state: dict[str, Any],
    ft_batches: Sequence[Batch],
    eval_batches: Sequence[Batch],
    progress: bool,
) -> PruneRun:
    """Prune a deep copy of ``dense_model`` along ``pcfg``'s schedule while fine-tuning on
    ``ft_batches``; evaluate masked and compressed."""
    t0 = time.perf_counter()
    model = copy.deepcopy(dense_model)
    pruner = TileSparsePruner(pcfg)
    label = f"{pcfg.pattern.value} {pcfg.target_sparsity:.0%}"
    trainer = _fine_tune(
        model, train_cfg, optimizer_state, ft_batches, pruner, progress, f"fine-tune {label}"
    )
    if pruner.current_sparsity != pcfg.target_sparsity:
        raise ValueError(
            f"the schedule did not reach {pcfg.target_sparsity} within {len(ft_batches)} steps "
            f"(at {pruner.current_sparsity}); raise --steps or shorten the schedule"
        )
    metrics = trainer.evaluate(eval_batches)
    stats = pruner.stats()
    masks = pruner.masks()
    pruner.compress()
    compressed = trainer.evaluate(eval_batches)
    kept = sum(s.kept for s in stats)
    row = {
        "pattern": pcfg.pattern.value,
        "sparsity": pcfg.target_sparsity,
        "config": pcfg.to_dict(),
        "eval_auc": metrics["auc"],
        "eval_logloss": metrics["logloss"],
        "compressed_auc": compressed["auc"],
        "achieved_sparsity": pruner.overall_sparsity(),
        "pruned_params": pruner.total_params,
        "kept_params": kept,
        "mask_updates": pruner.updates,
        "layers": [s.to_dict() for s in stats],
        "seconds": time.perf_counter() - t0,
    }
    return PruneRun(row, masks, model)


def main(cfg: PruneDLRMConfig) -> dict[str, Any]:
    """Run the recipe; returns the report (also written to ``cfg.out``)."""
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    cfg.folder.check()
    configs = run_configs(cfg)  # bad recipe files fail here, before any training
    out = cfg.folder.open()
    workload = get_workload(cfg.workload)
    if cfg.scale > 1:
        workload = workload.scaled(cfg.scale)
    data = SyntheticCTR(workload, batch_size=cfg.batch_size, seed=cfg.seed)
    eval_batches = list(data.batches(cfg.eval_batches, split="eval"))
    # the fine-tuning continues the dense trainer's Adagrad state: no second warm-up
    train_cfg = TrainConfig(lr=cfg.lr, seed=cfg.seed)

    dense = build_model(workload, seed=cfg.seed)
    trainer = Trainer(dense, replace(train_cfg, warmup_steps=cfg.warmup_steps))
    t0 = time.perf_counter()
    trainer.fit(data.batches(cfg.dense_steps), cfg.dense_steps, progress=cfg.progress)
    dense_train_s = time.perf_counter() - t0
    pretrain = trainer.evaluate(eval_batches)
    ft_batches = list(data.batches(cfg.steps, start=cfg.dense_steps))

    baseline = copy.deepcopy(dense)
    opt_state = trainer.optimizer.state_dict()
    bt = _fine_tune(
        baseline, train_cfg, opt_state, ft_batches, None, cfg.progress, "fine-tune dense"
    )
    dense_auc = bt.evaluate(eval_batches)["auc"]

    runs: list[PruneRun] = []
    for pcfg in configs:
        r = run_one(dense, pcfg, train_cfg, opt_state, ft_batches, eval_batches, cfg.progress)
        r.row["auc_drop"] = dense_auc - r.row["eval_auc"]
        runs.append(r)
        log.info(
            "%s %.2f: AUC %.4f (drop %+.4f)",
            r.row["pattern"],
            r.row["sparsity"],
            r.row["eval_auc"],
            r.row["auc_drop"],
        )

    rows = [r.row for r in runs]
    report: dict[str, Any] = {
        "recipe": "prune_dlrm",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "knobs": asdict(cfg),
        "workload": workload.to_dict(),
        "teacher_auc": data.teacher_auc(cfg.eval_batches),
        "dense_pretrain_auc": pretrain["auc"],
        "dense_auc": dense_auc,
        "dense_linear_params": _linear_params(dense),
        "results": _results_table(rows),
        "runs": rows,
        "seconds": {"dense_train": dense_train_s},
    }
    if cfg.calibration_batches:
        t0 = time.perf_counter()
        report["oneshot"] = oneshot_rows(
            dense, configs, train_cfg, opt_state, ft_batches, eval_batches,
            cfg.calibration_batches, dense_auc, cfg.progress,
        )  # fmt: skip
        report["seconds"]["oneshot"] = time.perf_counter() - t0
    main_i = _main_run_index(rows, cfg)
    _compress_tables(report, cfg, data, baseline, runs[main_i], eval_batches)
    _measure_speed(report, cfg, rows[main_i])
    _check_serving(report, cfg, runs[main_i].model, out / "serving", eval_batches)
    report["plots"] = write_plots(out, report, runs[main_i].masks, rows[main_i])
    report["seconds"]["total"] = time.perf_counter() - t_start
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    md = write_markdown(report, main_i)
    if "oneshot" in report:
        md += "\n" + oneshot_section(report["oneshot"])
    if "quantized" in report:
        md += "\n" + quant_section(report["quantized"])
    (out / "report.md").write_text(md)
    print(terminal_summary(report, main_i, out))
    if "quantized" in report:
        print(quant_summary(report["quantized"]))
    return report


def _results_table(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{pattern: {sparsity: {"eval_auc", "auc_drop", "compressed_auc",
    "achieved_sparsity"}}}`` from the runs' rows."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        table.setdefault(r["pattern"], {})[f"{r['sparsity']:g}"] = {
            "eval_auc": r["eval_auc"],
            "auc_drop": r["auc_drop"],
            "compressed_auc": r["compressed_auc"],
            "achieved_sparsity": r["achieved_sparsity"],
        }
    return table


def _compress_tables(
    report: dict[str, Any],
    cfg: PruneDLRMConfig,
    data: SyntheticCTR,
    baseline: DLRM,
    main_run: PruneRun,
    eval_batches: list[Batch],
) -> None:
    """``report["quantized"]``: the dense baseline's and the main run's tables compressed
    (``recipes.prune_quant``; ``--quant-budget`` 0 skips)."""
    if not cfg.quant_budget:
        return
    label = f"{main_run.row['pattern']} {main_run.row['sparsity']:.0%}"
    # the planner's choices: on other eval batches than the reported figures' (a quarter
    # as many: each table × dtype is scored alone on them)
    n_val = max(1, cfg.eval_batches // 4)
    validation = list(data.batches(n_val, split="eval", start=cfg.eval_batches))
    report["quantized"] = quant_report(
        baseline, main_run.model, label, eval_batches, validation, cfg.quant_budget
    )


def _measure_speed(report: dict[str, Any], cfg: PruneDLRMConfig, main_row: dict[str, Any]) -> None:
    """``report["speed"]``: the main run's pattern and sparsity on the DLRM-DCNv2 dense part
    against dense (``--speed-batch`` 0 skips; non-TW patterns are recorded as skipped)."""
    if not cfg.speed_batch:
        return
    if main_row["pattern"] not in SPEED_PATTERNS:
        report["speed"] = {
            "skipped": (
                f"speed is measured for the TW family ({', '.join(SPEED_PATTERNS)}); a condensed "
                f"{main_row['pattern']} mask has about one tile per column and no fast path"
            )
        }
        return
    t0 = time.perf_counter()
    report["speed"] = measure_speed(
        main_row["pattern"],
        main_row["sparsity"],
        tile=128,
        batch=cfg.speed_batch,
        threads=cfg.speed_threads,
        seed=cfg.seed,
    )
    report["seconds"]["speed"] = time.perf_counter() - t0
    torch.set_num_threads(cfg.threads)


def _check_serving(
    report: dict[str, Any],
    cfg: PruneDLRMConfig,
    model: DLRM,
    folder: Path,
    eval_batches: Sequence[Batch],
) -> None:
    """``report["serving"]``: ``model`` exported to ``folder``, served, and scored on the first
    ``--serve-batches`` eval batches against eager (0 skips)."""
    if not cfg.serve_batches:
        return
    t0 = time.perf_counter()
    report["serving"] = serve_check(
        model, folder, eval_batches[: cfg.serve_batches], request_batch=cfg.batch_size
    )
    report["seconds"]["serving"] = time.perf_counter() - t0
    log.info(
        "served %d samples: max |logit diff| %.2e",
        report["serving"]["samples"],
        report["serving"]["max_abs_logit_diff"],
    )


def _main_run_index(runs: list[dict[str, Any]], cfg: PruneDLRMConfig) -> int:
    """The run whose layers and mask are pictured: TW at the knob sparsity when swept."""
    for i, r in enumerate(runs):
        if r["pattern"] == cfg.pattern and math.isclose(r["sparsity"], cfg.sparsity):
            return i
    return 0


# -- command line -------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> PruneDLRMConfig:
    """The knobs from the command line; a bad value is a usage error (exit 2) naming it, and
    so is a ``--recipe`` file that does not load or a config that cannot run (a schedule
    longer than ``--steps``): :func:`run_configs` is checked before anything is created."""
    return parse_knobs(
        PruneDLRMConfig, argv, description=__doc__.split("\n\n")[0], check=_check_runnable
    )


def _check_runnable(cfg: PruneDLRMConfig) -> None:
    """``--out`` (:class:`~recipes.cli.OutFolder`) and :func:`run_configs` (loads
    ``--recipe``), an unreadable recipe file a ``ValueError`` naming the flag."""
    cfg.folder.check()
    try:
        run_configs(cfg)
    except OSError as e:
        raise ValueError(f"--recipe {cfg.recipe}: cannot read it: {e.strerror or e}") from None


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_recipe(main, parse_args()))
