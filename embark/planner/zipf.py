"""Expected number of distinct keys in a batch drawn from a Zipf distribution.

A table of ``N`` rows whose ids follow Zipf(α) (``p_i ∝ i^-α``, ``i = 1..N``) receives ``n``
independent ids per batch. The expected number of distinct ids is

    E[U] = Σ_i 1 − (1 − p_i)^n.

The first ``exact_terms`` ranks are summed exactly (vectorised); the tail, where
``p_i`` is tiny and ``(1 − p)^n ≈ exp(−n p)``, is integrated on a log-spaced grid:
``∫_{K+½}^{N+½} 1 − exp(−n x^-α / H) dx``; ``H`` is summed the same way. The relative error
against the exact sum is below 1e-3 (tested).
"""

from __future__ import annotations

import math

import numpy as np

EXACT_TERMS = 1 << 12
TAIL_POINTS = 2048


def _power_integral(a: float, b: float, alpha: float) -> float:
    """∫_a^b x^-α dx."""
    if abs(alpha - 1.0) < 1e-12:
        return math.log(b / a)
    return (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)


def zipf_normaliser(num_rows: int, alpha: float, exact_terms: int = EXACT_TERMS) -> float:
    """H(N, α) = Σ_{i=1..N} i^-α (exact head, midpoint-corrected integral tail)."""
    k = min(num_rows, exact_terms)
    head = float(np.sum(np.arange(1, k + 1, dtype=np.float64) ** -alpha))
    if num_rows > k:
        head += _power_integral(k + 0.5, num_rows + 0.5, alpha)
    return head


def expected_distinct(
    num_rows: int, alpha: float, n: float, exact_terms: int = EXACT_TERMS
) -> float:
    """Expected distinct ids among ``n`` Zipf(α) draws over ``num_rows`` rows.

    Args:
        num_rows: rows of the table (N ≥ 1).
        alpha: Zipf exponent (> 0).
        n: draws per batch (≥ 0; fractional values interpolate).
        exact_terms: ranks summed exactly before the integral tail.

    Returns:
        E[U], between ``min(1, n)`` and ``min(N, n)``.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return 0.0
    h = zipf_normaliser(num_rows, alpha, exact_terms)
    k = min(num_rows, exact_terms)
    p = np.arange(1, k + 1, dtype=np.float64) ** -alpha / h
    total = float(np.sum(-np.expm1(n * np.log1p(-np.minimum(p, 1 - 1e-16)))))
    if num_rows > k:
        u = np.linspace(math.log(k + 0.5), math.log(num_rows + 0.5), TAIL_POINTS)
        x = np.exp(u)
        f = -np.expm1(-n * x**-alpha / h) * x  # dx = x du
        total += float(np.sum((f[1:] + f[:-1]) * np.diff(u)) / 2)
    return min(total, float(num_rows), float(n))
