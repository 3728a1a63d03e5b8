"""When to prune: the sparsity a schedule config asks for at a training step.

Three schedules (their configs live in :mod:`tilesparse.config`):

- one-shot: ``0`` before ``step``, the target from then on;
- multi-stage (the paper's): stage ``i`` from ``start + i · steps_per_stage``; between stages the
  model fine-tunes at the stage's sparsity::

      sparsity
      0.75 |                  ┌───────────   stages (0.25, 0.5, 0.75), steps_per_stage=100
      0.50 |         ┌────────┘
      0.25 |┌────────┘
           +0--------100------200--------→ step

- cubic (Zhu & Gupta 2017): ``s_t = s_f + (s_i - s_f)(1 - (t - t0)/(t1 - t0))³`` sampled every
  ``frequency`` steps — fast pruning early, slow near the target.

>>> from tilesparse.config import MultiStageSchedule, CubicSchedule
>>> [sparsity_at(MultiStageSchedule((0.25, 0.5), steps_per_stage=10), t, 0.75) for t in (0, 9, 10, 20, 99)]
[0.25, 0.25, 0.5, 0.75, 0.75]
>>> [round(sparsity_at(CubicSchedule(0, 100, 50), t, 0.8), 3) for t in (0, 49, 50, 100)]
[0.0, 0.0, 0.7, 0.8]
"""

from __future__ import annotations

from tilesparse.config import (
    PAPER_STAGES,
    CubicSchedule,
    MultiStageSchedule,
    OneShotSchedule,
    ScheduleConfig,
)

__all__ = ["sparsity_at", "stages_for", "end_step", "update_steps"]


def stages_for(schedule: MultiStageSchedule, target: float) -> tuple[float, ...]:
    """The stage sparsities actually used for ``target``: the configured (or paper's) stages
    below the target, then the target itself.

    >>> stages_for(MultiStageSchedule(), 0.75)
    (0.25, 0.4, 0.5, 0.6, 0.65, 0.7, 0.75)
    """
    stages = PAPER_STAGES if schedule.stages is None else schedule.stages
    below = tuple(s for s in stages if s < target)
    return (*below, target) if target > 0 else (0.0,)


def sparsity_at(schedule: ScheduleConfig, step: int, target: float) -> float:
    """The sparsity the masks should have at ``step`` (>= 0) for a final ``target``.

    Raises:
        ValueError: for a negative step, a target outside [0, 1) or an unknown schedule.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target sparsity must be in [0, 1), got {target}")
    if isinstance(schedule, OneShotSchedule):
        return target if step >= schedule.step else 0.0
    if isinstance(schedule, MultiStageSchedule):
        if step < schedule.start:
            return 0.0
        stages = stages_for(schedule, target)
        i = min((step - schedule.start) // schedule.steps_per_stage, len(stages) - 1)
        return stages[i]
    if isinstance(schedule, CubicSchedule):
        if step < schedule.begin_step:
            return 0.0
        s_i = min(schedule.initial_sparsity, target)
        if step >= schedule.end_step:
            return target
        t = (
            schedule.begin_step
            + (step - schedule.begin_step) // schedule.frequency * schedule.frequency
        )
        frac = (t - schedule.begin_step) / (schedule.end_step - schedule.begin_step)
        return target + (s_i - target) * (1.0 - frac) ** 3
    raise ValueError(f"unknown schedule {schedule!r}")


def end_step(schedule: ScheduleConfig, target: float) -> int:
    """The first step at which the target sparsity holds."""
    if isinstance(schedule, OneShotSchedule):
        return schedule.step
    if isinstance(schedule, MultiStageSchedule):
        return schedule.start + (len(stages_for(schedule, target)) - 1) * schedule.steps_per_stage
    if isinstance(schedule, CubicSchedule):
        return schedule.end_step
    raise ValueError(f"unknown schedule {schedule!r}")


def update_steps(schedule: ScheduleConfig, target: float) -> list[int]:
    """The steps at which the sparsity changes (where a pruner recomputes its masks).

    >>> update_steps(MultiStageSchedule((0.25, 0.5), steps_per_stage=10), 0.75)
    [0, 10, 20]
    """
    last = end_step(schedule, target)
    steps, prev = [], 0.0
    if isinstance(schedule, CubicSchedule):
        candidates = [*range(schedule.begin_step, last, schedule.frequency), last]
    elif isinstance(schedule, MultiStageSchedule):
        candidates = list(range(schedule.start, last + 1, schedule.steps_per_stage))
    else:
        candidates = [last]
    for t in candidates:
        s = sparsity_at(schedule, t, target)
        if s != prev:
            steps.append(t)
            prev = s
    return steps
