"""Train a DLRM on synthetic teacher data and report how close it gets to the teacher.

    python -m recipes.train_dlrm                 # tiny default, CPU, well under a minute
    python -m recipes.train_dlrm --help          # every knob with its default and range
    python -m recipes.train_dlrm --workload dlrm_dcnv2 --scale 20000 --steps 200
    python -m recipes.train_dlrm --out runs/a --steps 8000 --resume   # continue runs/a

Writes into ``--out`` (default ``runs/train_dlrm-<UTC timestamp>`` under the current folder):
``config.json`` (the knobs, first), ``results.json`` (``eval_auc``, ``eval_logloss``,
``teacher_auc``, ``train_auc``, ``samples_per_s``, ...) and ``checkpoint/`` (a trainer
checkpoint that :meth:`embark.training.trainer.Trainer.load_checkpoint` restores; also saved
every ``--checkpoint-every`` steps). A non-empty ``--out`` is refused unless ``--overwrite``
(clear it) or ``--resume`` (continue its checkpoint to ``--steps`` total steps, with the
knobs it was trained with) is given.

A run whose loss stops being finite (``--lr 1e30``) stops at that step: the last finite state
is saved as ``checkpoint/``, ``results.json`` records ``diverged``, and the command exits 1
saying at which step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embark import (
    MAX_BATCH_SIZE,
    MAX_SEED,
    MAX_THREADS,
    PRESETS,
    OptimizerKind,
    SyntheticCTR,
    TrainConfig,
    Trainer,
    TrainingDiverged,
    Workload,
    build_model,
    get_workload,
    read_state,
)
from recipes.cli import OutFolder, check_knobs, knob, parse_knobs, run_recipe

log = logging.getLogger("recipes.train_dlrm")

CHECKPOINT = "checkpoint"  # the checkpoint's folder inside --out
#: what a run writes into --out (its checkpoint's temporary siblings included): all that
#: --overwrite of such a run's folder removes
OUTPUTS = ("config.json", "results.json", CHECKPOINT, f".{CHECKPOINT}.*")


@dataclass(frozen=True)
class TrainDLRMKnobs:
    """Train a DLRM on synthetic data labelled by a planted teacher DLRM."""

    workload: str = knob("tiny", f"workload preset, one of {', '.join(PRESETS)}")
    scale: float = knob(1.0, "divide every table's rows by this to fit the machine", ge=1)
    batch_size: int = knob(512, "samples per step", ge=1, le=MAX_BATCH_SIZE)
    steps: int = knob(4000, "optimizer steps in all (one fresh batch each)", ge=1)
    optimizer: OptimizerKind | None = knob(None, "adagrad or sgd; none = the workload's choice")
    lr: float = knob(0.02, "learning rate of the dense part", gt=0)
    embedding_lr: float = knob(0.1, "learning rate of the embedding tables", gt=0)
    seed: int = knob(0, "seed of the model, the data stream and the teacher", ge=0, le=MAX_SEED)
    eval_batches: int = knob(32, "held-out batches for the final eval AUC and teacher AUC", ge=1)
    eval_every: int = knob(0, "also evaluate every this many steps (0 = only at the end)", ge=0)
    train_eval_batches: int = knob(8, "last training batches re-scored for train_auc", ge=1)
    label_sharpness: float = knob(2.0, "teacher logit scale; higher = easier labels", gt=0)
    ragged: bool = knob(False, "variable bag sizes (0..hotness) instead of fixed hotness")
    threads: int = knob(
        1, "torch intra-op threads (1 is fastest for the tiny model)", ge=1, le=MAX_THREADS
    )
    out: str | None = knob(None, "output folder; none = runs/train_dlrm-<timestamp>")
    overwrite: bool = knob(False, "clear a non-empty --out that holds an earlier run")
    resume: bool = knob(False, "continue the checkpoint in --out to --steps steps in all")
    checkpoint: bool = knob(True, "save the final trainer checkpoint under <out>/checkpoint")
    checkpoint_every: int = knob(
        0, "also save it every this many steps (0 = only at the end)", ge=0
    )
    progress: bool = knob(True, "show a tqdm progress bar")

    def __post_init__(self) -> None:
        # Everything TrainConfig and SyntheticCTR would reject is checked here, so a bad knob
        # is a usage error (exit 2) before main() creates --out.
        check_knobs(self)
        if self.workload not in PRESETS:
            raise ValueError(f"--workload must be one of {list(PRESETS)}, got {self.workload!r}")
        if self.train_eval_batches > self.steps:
            raise ValueError(
                f"--train-eval-batches must be in 1..steps={self.steps}, got {self.train_eval_batches}"
            )
        if self.checkpoint_every and not self.checkpoint:
            raise ValueError("--checkpoint-every needs the checkpoint (drop --no-checkpoint)")
        if self.optimizer is not None:
            try:
                object.__setattr__(self, "optimizer", OptimizerKind(self.optimizer))
            except ValueError:
                raise ValueError(
                    f"--optimizer must be one of {[o.value for o in OptimizerKind]} or None, "
                    f"got {self.optimizer!r}"
                ) from None

    @property
    def folder(self) -> OutFolder:
        """The run's ``--out`` with its ``--overwrite`` / ``--resume``."""
        return OutFolder("train_dlrm", self.out, self.overwrite, self.resume, OUTPUTS)


def _workload(cfg: TrainDLRMKnobs) -> Workload:
    workload = get_workload(cfg.workload)
    return workload.scaled(cfg.scale) if cfg.scale > 1 else workload


def _train_config(cfg: TrainDLRMKnobs, workload: Workload, ckpt: Path | None) -> TrainConfig:
    return TrainConfig(
        lr=cfg.lr,
        embedding_lr=cfg.embedding_lr,
        optimizer=OptimizerKind(cfg.optimizer or workload.optimizer),
        eval_every=cfg.eval_every,
        checkpoint_every=cfg.checkpoint_every if ckpt is not None else 0,
        checkpoint_dir=str(ckpt) if ckpt is not None and cfg.checkpoint_every else None,
        seed=cfg.seed,
    )


def build(cfg: TrainDLRMKnobs) -> tuple[Workload, SyntheticCTR, Trainer]:
    """The workload, data and a fresh trainer for ``cfg`` (reused by other recipes; no
    periodic checkpoint: :func:`main` sets it once the folder is known)."""
    workload = _workload(cfg)
    data = SyntheticCTR(
        workload,
        cfg.batch_size,
        seed=cfg.seed,
        ragged=cfg.ragged,
        label_sharpness=cfg.label_sharpness,
    )
    train_cfg = _train_config(cfg, workload, None)
    trainer = Trainer(build_model(workload, seed=cfg.seed), train_cfg)
    trainer.data_stream = data.stream_config()  # checkpoints record it; a resume checks it
    return workload, data, trainer


# -- resuming -----------------------------------------------------------------------------
def check_resume(cfg: TrainDLRMKnobs) -> None:
    """Check that ``<out>/checkpoint`` continues the run ``cfg`` describes: the same
    workload, optimizer, learning rates, seed, batch size and data stream, at most
    ``--steps`` steps in (only the file's ``state.json`` is read and checked).

    Raises:
        ValueError: naming the checkpoint and the knob that differs.
    """
    path = Path(cfg.out or ".") / CHECKPOINT
    try:
        state = read_state(path)
    except ValueError as err:
        raise ValueError(f"--resume: {err}") from None
    workload = _workload(cfg)
    if state["workload"] != workload.to_dict():
        saved = (state["workload"] or {}).get("name")
        raise ValueError(
            f"--resume: {str(path)!r} is a checkpoint of workload {saved!r}, not of "
            f"--workload {cfg.workload} --scale {cfg.scale:g}"
        )
    saved_cfg, this = state["train_config"], _train_config(cfg, workload, None).to_dict()
    stream = state["data_stream"] or {}
    for name, was, given in (
        *((k, saved_cfg.get(k), this[k]) for k in ("optimizer", "lr", "embedding_lr", "seed")),
        ("batch_size", state["batch_size"], cfg.batch_size),  # None: saved at step 0
        ("ragged", stream.get("ragged"), cfg.ragged),
        ("label_sharpness", stream.get("label_sharpness"), cfg.label_sharpness),
    ):
        if was is not None and was != given:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"--resume: {str(path)!r} was trained with {flag} {was}, not {given}: give "
                "the run's knobs (its config.json), or start a new run"
            )
    if state["step"] > cfg.steps:
        raise ValueError(
            f"--resume: {str(path)!r} is at step {state['step']}, past --steps {cfg.steps} "
            "(the total number of steps)"
        )


def _check_run(cfg: TrainDLRMKnobs) -> None:
    """What the command line checks before anything runs: ``--out`` and ``--resume``."""
    cfg.folder.check()
    if cfg.resume:
        check_resume(cfg)


def _resumed(trainer: Trainer, path: Path) -> Trainer:
    """``trainer`` continued from the checkpoint at ``path`` (loaded into its model)."""
    resumed = Trainer.load_checkpoint(path, model=trainer.model)
    resumed.cfg = trainer.cfg  # the same run (check_resume); this run's eval/save cadence
    return resumed


# -- divergence ---------------------------------------------------------------------------
def _all_finite(trainer: Trainer) -> bool:
    """Whether every weight and optimizer state tensor of ``trainer`` is finite."""
    tensors = [*trainer.model.state_dict().values()]
    tensors += [v for st in trainer.optimizer.state.values() for v in st.values()]
    return all(
        bool(torch.isfinite(t).all())
        for t in tensors
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _record_divergence(
    cfg: TrainDLRMKnobs, out: Path, trainer: Trainer, err: TrainingDiverged
) -> None:
    """Save the last finite state as the checkpoint (when there is one to save), write
    ``results.json`` with ``diverged`` and add what was saved to ``err``'s notes."""
    ckpt: Path | None = None
    if not cfg.checkpoint:
        note = "nothing saved (--no-checkpoint)"
    elif trainer.step == 0:
        note = "nothing was trained, nothing saved"
    elif not _all_finite(trainer):
        note = f"the state after step {trainer.step} is not finite either; nothing saved"
    else:
        ckpt = trainer.save_checkpoint(out / CHECKPOINT)
        note = f"saved the last finite state (step {trainer.step}) to {ckpt}"
    results = {
        "recipe": "train_dlrm",
        "diverged": {"step": err.step, "loss": str(err.loss)},
        "steps": trainer.step,
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "history": trainer.history,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    err.add_note(note)


# -- the run ------------------------------------------------------------------------------
def main(cfg: TrainDLRMKnobs) -> dict[str, Any]:
    """Train, evaluate, write ``results.json`` (and the checkpoint); return the results.

    Raises:
        ValueError: for an ``--out`` the run cannot use, or a checkpoint ``--resume`` cannot
            continue (before anything is trained or written).
        TrainingDiverged: when the loss stops being finite (after saving the last finite
            state and ``results.json``; its notes say what was saved).
    """
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    _check_run(cfg)
    workload, data, trainer = build(cfg)  # before the folder: a failure leaves none behind
    out = cfg.folder.open()
    trainer.cfg = _train_config(cfg, workload, out / CHECKPOINT)  # its periodic saves
    knobs = dataclasses.asdict(cfg) | {"optimizer": trainer.cfg.optimizer.value}
    (out / "config.json").write_text(json.dumps(knobs, indent=1) + "\n")
    if cfg.resume:
        trainer = _resumed(trainer, out / CHECKPOINT)
    eval_set = list(data.batches(cfg.eval_batches, split="eval"))
    teacher_auc = data.teacher_auc(cfg.eval_batches, split="eval")

    start = trainer.step
    try:
        fit = trainer.fit(
            data.batches(cfg.steps - start, start=start),
            cfg.steps - start,
            progress=cfg.progress,
            eval_batches=eval_set,
        )
    except TrainingDiverged as err:
        _record_divergence(cfg, out, trainer, err)
        raise
    final = trainer.evaluate(eval_set)
    train = trainer.evaluate(
        data.batches(cfg.train_eval_batches, start=cfg.steps - cfg.train_eval_batches)
    )
    ckpt = trainer.save_checkpoint(out / CHECKPOINT) if cfg.checkpoint else None
    results = {
        "recipe": "train_dlrm",
        "workload": workload.name,
        "eval_auc": final["auc"],
        "eval_logloss": final["logloss"],
        "teacher_auc": teacher_auc,
        "auc_gap": teacher_auc - final["auc"],
        "train_auc": train["auc"],
        "train_logloss": train["logloss"],
        "samples_per_s": fit.samples_per_s,
        "steps": trainer.step,
        "resumed_at": start if cfg.resume else None,
        "samples": fit.samples,
        "train_seconds": fit.seconds,
        "wall_seconds": time.perf_counter() - t_start,
        "eval_samples": final["num_samples"],
        "positive_rate": final["positive_rate"],
        "threads": cfg.threads,
        "history": trainer.history,
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "torch_version": torch.__version__,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"train_dlrm [{workload.name}, {len(workload.tables)} tables, {trainer.step} steps × "
        f"{cfg.batch_size}]\n"
        f"  eval AUC     {final['auc']:.4f}   (teacher {teacher_auc:.4f}, gap "
        f"{teacher_auc - final['auc']:+.4f})\n"
        f"  eval logloss {final['logloss']:.4f}\n"
        f"  train AUC    {train['auc']:.4f}\n"
        f"  throughput   {fit.samples_per_s:,.0f} samples/s ({fit.seconds:.1f} s training, "
        f"{results['wall_seconds']:.1f} s total)\n"
        f"  results      {out / 'results.json'}"
    )
    return results


def parse_args(argv: Sequence[str] | None = None) -> TrainDLRMKnobs:
    """The knobs from the command line; a bad value, an ``--out`` the run cannot use or a
    checkpoint ``--resume`` cannot continue is a usage error (exit 2) naming it, before
    anything is created."""
    return parse_knobs(TrainDLRMKnobs, argv, check=_check_run)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_recipe(main, parse_args()))
