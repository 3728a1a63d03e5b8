"""Argument types shared by embark's command lines (``python -m embark.plan``,
``torchrun -m embark.sharded_train``): a bad value is a usage error (exit 2) naming it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number >= ``low``; anything else (nan, inf, less) is a
    usage error (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number >= {low:g}, got {text!r}"
            ) from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"expected a finite number >= {low:g}, got {text}")
        return value

    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= ``low``; anything else is a usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse
