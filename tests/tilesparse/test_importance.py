from __future__ import annotations

import math

import pytest
import torch

from tilesparse.config import Importance
from tilesparse.importance import (
    MagnitudeScore,
    MovementScore,
    TaylorScore,
    make_tracker,
    segment_scores,
)


def test_magnitude() -> None:
    w = {"a": torch.tensor([[1.0, -2.0], [0.0, 3.0]])}
    assert torch.equal(MagnitudeScore().scores(w)["a"], torch.tensor([[1.0, 2.0], [0.0, 3.0]]))


def test_taylor_accumulates_squared_first_order_terms() -> None:
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randint(-3, 4, (3, 5), generator=g).float()}
    grads = [torch.randint(-3, 4, (3, 5), generator=g).float() for _ in range(4)]
    t = TaylorScore(max_steps=3)
    for gr in grads:
        t.observe(w, {"a": gr})
    expected = sum((gr * w["a"]) ** 2 for gr in grads[:3])  # the 4th is past max_steps
    assert torch.equal(t.scores(w)["a"], expected)
    t.reset()
    with pytest.raises(RuntimeError, match="no backward pass yet"):
        t.scores(w)


def test_taylor_matches_loss_change_to_first_order() -> None:
    # (g·w)² is the square of the first-order change of the loss when w is zeroed
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4, bias=False)
    x = torch.randn(32, 6)
    loss = lin(x).pow(2).sum()
    loss.backward()
    w_kn, g_kn = lin.weight.detach().T.clone(), lin.weight.grad.T.clone()
    t = TaylorScore()
    t.observe({"l": w_kn}, {"l": g_kn})
    score = t.scores({"l": w_kn})["l"]
    with torch.no_grad():
        k, n = 2, 1
        lin.weight[n, k] = 0.0
        delta = loss.item() - lin(x).pow(2).sum().item()
        # loss is quadratic: exact change = g·w - ½·h·w², h = 2·Σx_k²
        h = 2 * float((x[:, k] ** 2).sum())
        first_order = delta + 0.5 * h * float(w_kn[k, n]) ** 2
    assert score[k, n].item() == pytest.approx(first_order**2, rel=1e-4)


def test_movement_shifted_to_non_negative_across_layers() -> None:
    m = MovementScore()
    w = {"a": torch.tensor([[1.0, 2.0]]), "b": torch.tensor([[-1.0]])}
    m.observe(w, {"a": torch.tensor([[1.0, -1.0]]), "b": torch.tensor([[-3.0]])})
    s = m.scores(w)
    # raw -g·w: a = [-1, 2], b = [-3]; shifted by the global min -3
    assert torch.equal(s["a"], torch.tensor([[2.0, 5.0]])) and torch.equal(
        s["b"], torch.tensor([[0.0]])
    )


def test_segment_scores_are_rms_over_the_tile() -> None:
    """‖S[k, cols_t]‖₂ / sqrt(|cols_t|): the 2-wide segment (3, 4) scores 5/sqrt(2), the 1-wide
    ones their element (the old ``/ |cols_t|`` gave 2.5 and 1)."""
    S = torch.tensor([[3.0, 4.0, 1.0], [0.0, 0.0, 2.0]])
    seg = segment_scores(S, [torch.tensor([0, 1]), torch.tensor([2])])
    assert torch.equal(
        seg, torch.tensor([[5.0 / math.sqrt(2.0), 1.0], [0.0, 2.0]], dtype=torch.float64)
    )
    # a segment of equal elements v scores v, whatever its width
    flat = torch.full((2, 19), 7.0)
    seg = segment_scores(flat, [torch.arange(16), torch.arange(16, 18), torch.tensor([18])])
    assert torch.allclose(seg, torch.full((2, 3), 7.0, dtype=torch.float64), rtol=0, atol=1e-12)


def test_make_tracker() -> None:
    assert isinstance(make_tracker("magnitude"), MagnitudeScore)
    assert (
        isinstance(make_tracker(Importance.TAYLOR, 7), TaylorScore)
        and make_tracker("taylor", 7).max_steps == 7
    )
    assert isinstance(make_tracker("movement"), MovementScore)
    with pytest.raises(ValueError):
        make_tracker("random")


def test_summed_scores_round_trip_their_state_and_magnitude_keeps_none() -> None:
    w = {"a": torch.tensor([[1.0, -2.0]])}
    for tracker in (TaylorScore(), MovementScore()):
        tracker.observe(w, {"a": torch.tensor([[0.5, 0.25]])})
        steps, sums = tracker.state()
        again = type(tracker)()
        again.load_state(steps, sums)
        assert again.state()[0] == steps == 1
        assert torch.equal(again.scores(w)["a"], tracker.scores(w)["a"])
        sums["a"].zero_()  # state() hands out copies
        assert torch.equal(again.scores(w)["a"], tracker.scores(w)["a"])
    assert MagnitudeScore().state() == (0, {})
    with pytest.raises(ValueError, match=r"MagnitudeScore keeps no observations, got 1 step"):
        MagnitudeScore().load_state(1, {"a": torch.ones(1, 2)})


@pytest.mark.parametrize(("cls", "kind"), [(TaylorScore, "Taylor"), (MovementScore, "movement")])
def test_a_layer_without_gradients_is_named(cls, kind) -> None:
    """A selected layer that no backward pass reached (frozen): movement raised a bare
    KeyError; both gradient scores now say which layer has no gradients."""
    w = {"a": torch.tensor([[1.0, -2.0]]), "b": torch.tensor([[3.0]]), "c": torch.tensor([[1.0]])}
    t = cls()
    t.observe({"a": w["a"]}, {"a": torch.tensor([[1.0, 1.0]])})
    with pytest.raises(
        RuntimeError, match=rf"{kind} importance has no gradients for layer\(s\) \['b', 'c'\]"
    ):
        t.scores(w)
    assert set(t.scores({"a": w["a"]})) == {"a"}
