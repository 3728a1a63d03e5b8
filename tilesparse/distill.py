"""Distillation without labels: fine-tune a pruned student toward its dense teacher.

The student is a model whose layers a :class:`~tilesparse.pruner.TileSparsePruner` has
prepared (masks as parametrizations); the teacher is the dense model, frozen. Each step runs
both on one unlabelled batch and minimises a loss between their outputs — ``"mse"`` (e.g.
sentence embeddings) or ``"kl"`` (logits, at a temperature) — then calls the pruner's
:meth:`~tilesparse.pruner.TileSparsePruner.observe` and
:meth:`~tilesparse.pruner.TileSparsePruner.step`, so pruned weights stay exactly zero and the
pruner's schedule (a one-shot mask holds; a multi-stage one rises) runs as in supervised
fine-tuning::

    pruner = tilesparse.prune_(student, config, filter_fn, calibration=calib)
    report = tilesparse.distill_(student, teacher, batches, pruner, seconds=300,
                                 outputs=embed)   # embed(model, batch) -> (B, D)
    pruner.compress()
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from tilesparse.pruner import TileSparsePruner

__all__ = ["DistillLoss", "DistillReport", "distill_", "distill_loss"]

OutputsFn = Callable[[nn.Module, Any], torch.Tensor]


class DistillLoss(StrEnum):
    """The loss between student and teacher outputs."""

    MSE = "mse"  # mean squared error (embeddings, hidden states)
    KL = "kl"  # KL(teacher || student) of softmax(logits / T), times T² (Hinton et al. 2015)


@dataclass
class DistillReport:
    """What a distillation did.

    Attributes:
        steps: optimizer steps taken.
        seconds: wall-clock time of the loop.
        losses: the loss at each step.
    """

    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def _call(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(*batch)`` for a tuple, ``model(batch)`` otherwise."""
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def distill_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    kind: DistillLoss | str = DistillLoss.MSE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The scalar loss between ``(B, ...)`` student and teacher outputs of one shape.

    Raises:
        ValueError: for different shapes, an unknown kind or a temperature <= 0.
    """
    if student.shape != teacher.shape:
        raise ValueError(
            f"student outputs {tuple(student.shape)} and teacher outputs {tuple(teacher.shape)} differ"
        )
    kind = DistillLoss(kind)
    if kind is DistillLoss.MSE:
        return nn.functional.mse_loss(student.float(), teacher.float())
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    t = temperature
    log_p = nn.functional.log_softmax(student.float() / t, dim=-1)
    log_q = nn.functional.log_softmax(teacher.float() / t, dim=-1)
    return nn.functional.kl_div(log_p, log_q, log_target=True, reduction="batchmean") * t * t


def _step(
    student: nn.Module,
    teacher: nn.Module,
    batch: Any,
    opt: torch.optim.Optimizer,
    pruner: TileSparsePruner,
    kind: DistillLoss,
    temperature: float,
    outputs: OutputsFn,
) -> float:
    """One distillation step; returns its loss. A non-finite loss changes nothing."""
    with torch.no_grad():
        want = outputs(teacher, batch)
    value = distill_loss(outputs(student, batch), want, kind, temperature)
    loss_value = float(value.detach())
    if not math.isfinite(loss_value):
        return loss_value
    opt.zero_grad(set_to_none=True)
    value.backward()
    pruner.observe()
    opt.step()
    pruner.step()
    return loss_value


def _check_budget(seconds: float | None, steps: int | None) -> None:
    """At least one budget, each in range (``ValueError`` naming it)."""
    if seconds is None and steps is None:
        raise ValueError("distill_ needs a budget: seconds= or steps=")
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def distill_(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Any],
    pruner: TileSparsePruner,
    *,
    seconds: float | None = None,
    steps: int | None = None,
    lr: float = 1e-4,
    loss: DistillLoss | str = DistillLoss.MSE,
    temperature: float = 1.0,
    outputs: OutputsFn = _call,
    train_mode: bool = False,
    progress: bool = False,
) -> DistillReport:
    """Fine-tune ``student`` (in place) to reproduce ``teacher`` on unlabelled ``batches``,
    cycling through them until ``seconds`` or ``steps`` runs out (whichever first).

    Args:
        student: the pruned model, ``pruner`` prepared on it (not compressed).
        teacher: the dense model (run in eval mode without gradients; not changed).
        batches: unlabelled inputs; each ``outputs(model, batch)`` gives ``(B, ...)``.
        pruner: its ``observe``/``step`` run after each backward pass / optimizer step.
        seconds: wall-clock budget (> 0), or ``None``.
        steps: step budget (>= 1), or ``None``; at least one budget is required.
        lr: AdamW learning rate.
        loss: :class:`DistillLoss`.
        temperature: for ``kl``.
        outputs: ``(model, batch) -> tensor``; default ``model(*batch)`` / ``model(batch)``.
        train_mode: run the student in train mode (dropout on, batch-norm statistics
            updated). Default off: the student runs in eval mode like the teacher, so it is
            fitted to the teacher's deterministic outputs without dropout noise (on the
            packaged MiniLM, TW 50 %, 300 steps, lr 1e-4: cosine to dense 0.846 against 0.834
            with dropout on, on text it was not distilled on; docs/benchmarks.md). The
            student is left in eval mode, the teacher's modes are restored.
        progress: a tqdm bar over steps.

    Returns:
        a :class:`DistillReport`.

    Raises:
        ValueError: for no budget, a bad budget, an empty ``batches``, a compressed or
            unprepared pruner, or a non-finite loss (naming the step).
    """
    _check_budget(seconds, steps)
    if pruner.model is not student or pruner.compressed:
        raise ValueError("pruner must be prepared on student and not compressed")
    data = list(batches)
    if not data:
        raise ValueError("distill_ got no batches")
    kind = DistillLoss(loss)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    teacher_modes = [(m, m.training) for m in teacher.modules()]
    teacher.eval()
    student.train(train_mode)
    report = DistillReport()
    t0 = time.perf_counter()
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, desc="distill", unit="step", disable=not progress)
    try:
        for batch in itertools.cycle(data):
            loss_value = _step(student, teacher, batch, opt, pruner, kind, temperature, outputs)
            if not math.isfinite(loss_value):
                raise ValueError(f"distillation loss is {loss_value} at step {report.steps}")
            report.steps += 1
            report.losses.append(loss_value)
            bar.update(1)
            elapsed = time.perf_counter() - t0
            if (steps is not None and report.steps >= steps) or (
                seconds is not None and elapsed >= seconds
            ):
                break
    finally:
        bar.close()
        student.eval()
        for m, mode in teacher_modes:
            m.training = mode
    report.seconds = time.perf_counter() - t0
    return report
