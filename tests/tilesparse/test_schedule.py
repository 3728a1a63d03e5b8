from __future__ import annotations

import pytest

from tilesparse.config import PAPER_STAGES, CubicSchedule, MultiStageSchedule, OneShotSchedule
from tilesparse.schedule import end_step, sparsity_at, stages_for, update_steps


def test_oneshot() -> None:
    s = OneShotSchedule(step=5)
    assert [sparsity_at(s, t, 0.8) for t in (0, 4, 5, 100)] == [0.0, 0.0, 0.8, 0.8]
    assert update_steps(s, 0.8) == [5] and end_step(s, 0.8) == 5


def test_multistage_paper_stages() -> None:
    s = MultiStageSchedule(steps_per_stage=10, start=3)
    assert stages_for(s, 0.9) == PAPER_STAGES
    assert stages_for(s, 0.72) == (0.25, 0.40, 0.50, 0.60, 0.65, 0.70, 0.72)
    assert sparsity_at(s, 2, 0.72) == 0.0
    assert sparsity_at(s, 3, 0.72) == 0.25
    assert sparsity_at(s, 12, 0.72) == 0.25
    assert sparsity_at(s, 13, 0.72) == 0.40
    assert sparsity_at(s, 63, 0.72) == 0.72 and sparsity_at(s, 10_000, 0.72) == 0.72
    assert update_steps(s, 0.72) == [3 + 10 * i for i in range(7)]
    assert end_step(s, 0.72) == 63


def test_multistage_custom_stages_clipped_to_target() -> None:
    s = MultiStageSchedule(stages=(0.3, 0.6, 0.9), steps_per_stage=5)
    assert stages_for(s, 0.6) == (0.3, 0.6)
    assert [sparsity_at(s, t, 0.6) for t in (0, 5, 10, 50)] == [0.3, 0.6, 0.6, 0.6]


def test_cubic_matches_zhu_gupta() -> None:
    s = CubicSchedule(begin_step=10, end_step=110, frequency=25, initial_sparsity=0.1)
    target = 0.9
    for t in range(0, 130):
        got = sparsity_at(s, t, target)
        if t < 10:
            assert got == 0.0
        elif t >= 110:
            assert got == target
        else:
            q = 10 + (t - 10) // 25 * 25
            expected = target + (0.1 - target) * (1 - (q - 10) / 100) ** 3
            assert got == pytest.approx(expected, abs=1e-12)
    vals = [sparsity_at(s, t, target) for t in range(10, 111)]
    assert all(b >= a for a, b in zip(vals, vals[1:]))  # monotone
    assert update_steps(s, target) == [10, 35, 60, 85, 110]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        sparsity_at(OneShotSchedule(), -1, 0.5)
    with pytest.raises(ValueError, match=r"target sparsity must be in \[0, 1\)"):
        sparsity_at(OneShotSchedule(), 0, 1.0)
