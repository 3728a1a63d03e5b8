"""Argument types and limits shared by the command lines (``python -m embark.plan``,
``torchrun -m embark.sharded_train`` and the recipes): a bad value is a usage error (exit 2)
naming it.

The limits refuse values no run can use before they reach an allocation or a C library that
would fail with a traceback (a ``(10**9, 13)`` float64 array, a seed torch cannot unpack,
100,000 OpenMP threads):

* :data:`MAX_SEED` ``2**32 - 1``: numpy's legacy seed range; the data stream derives its
  teacher's seeds as ``seed + 2_000_003``, which must stay under torch's ``2**64``.
* :data:`MAX_BATCH_SIZE` ``2**20`` samples per step: 16× the planner's default global batch
  (65,536); the tiny recipes train with 256-512.
* :data:`MAX_THREADS` 512 intra-op threads: one per hardware thread of a two-socket
  128-core server with SMT (AMD EPYC 9754); torch starts one OS thread for each.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from embark.outputs import check_output_file
from knobs import shown

MAX_SEED = 2**32 - 1
MAX_BATCH_SIZE = 2**20  # samples per step
MAX_THREADS = 512

_SHOWN = 40  # characters of a number echoed back as typed (longer ones are shortened)


def _echo(text: str) -> str:
    """A number as typed (unquoted), or :func:`shown` when it is long."""
    return text if len(text) <= _SHOWN else shown(text)


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number >= ``low``; anything else (nan, inf, less) is a
    usage error (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number >= {low:g}, got {shown(text)}"
            ) from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(
                f"expected a finite number >= {low:g}, got {_echo(text)}"
            )
        return value

    return parse


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``low..high`` (``high`` ``None``: no upper
    limit); anything else is a usage error (exit 2) stating the range."""
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also a number past int()'s 4,300-digit limit
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown(text)}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {_echo(text)}")
        return value

    parse.__name__ = "integer"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= ``low``; anything else is a usage error (exit 2)."""
    return int_in(low)


def output_file(text: str) -> str:
    """An argparse ``type`` for a file a run will write: a folder, a path under a file or one
    whose folder cannot be written is a usage error (exit 2) before the run starts
    (:func:`embark.outputs.check_output_file`)."""
    try:
        check_output_file(text, "path")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text
