"""The compiled fused backward of FP16/BF16 tables with stochastic rounding: built, loaded,
called — or ``None``, and the pure-torch reference runs instead.

Source: ``embark/csrc/half_rows.cpp``. One call per table and backward reduces the bag
gradient to each touched row, updates the row's optimizer state (SGD, row-wise Adagrad, exact
Adagrad: :class:`~embark.training.sparse_rows.RowOptimizer`'s update, operation for
operation) and writes the row rounded stochastically (:mod:`embark.training.rounding`'s rule)
with the counter-based bits of :func:`~embark.training.rounding.counter_bits` — one pass over
each touched row, where the reference runs ``torch.unique``, ``index_add_``, gathers, the
update and the rounding as separate passes. Given the same key both paths draw the same bits
and run the same float32 operations in the same order (a row's gradient summed in id-position
order; row-wise Adagrad's ``mean(g²)`` in :func:`~embark.training.sparse_rows.row_mean_squares`'
8-lane order; correctly rounded square roots), so they give the same rows and state bit for
bit: a run may switch paths between steps (a checkpoint resumed with or without the build)
and continue bit-identically (``tests/embark/training/test_half_kernel.py``, random
gradients).

Built with the machine's C++ compiler through :func:`extbuild.load` (one
builder per folder at a time) with ``-O3 -march=native -ffp-contract=off`` (no fused
multiply-add: the reference's roundings, step by step) into a cache folder::

    $XDG_CACHE_HOME/tilerec/embark_cpu/<torch version>-<source hash>/   (default ~/.cache)

``make install`` builds it once (``python -m embark.build_ext``); at runtime
:func:`load_extension` loads the cached build (building it first when missing) and returns
``None`` after ONE logged warning when it cannot. Set ``EMBARK_DISABLE_EXT=1`` to force the
reference path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from extbuild import CpuExtension

__all__ = [
    "DISABLE_ENV",
    "EXT",
    "EXT_NAME",
    "build_dir",
    "build_extension",
    "fits_sort_key",
    "fused_half_backward",
    "load_extension",
]

EXT_NAME = "embark_cpu"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
DISABLE_ENV = "EMBARK_DISABLE_EXT"
EXT = CpuExtension(
    name=EXT_NAME,
    label="embark: compiled half-table update",
    sources=(CSRC / "half_rows.cpp",),
    headers=(),
    cflags=("-O3", "-march=native", "-ffp-contract=off", "-fopenmp"),
    disable_env=DISABLE_ENV,
    build_command="python -m embark.build_ext -v",
    logger=__name__,
)


def build_dir() -> Path:
    """The cache folder of this source × checkout × flags × CPU × toolchain
    (:meth:`~extbuild.CpuExtension.build_dir`)."""
    return EXT.build_dir()


def build_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) the extension and import it.

    Raises:
        RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
    """
    return EXT.build(verbose)


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType | None:
    """The compiled module, or ``None`` (with one logged warning) when it cannot be built or
    loaded, or when ``EMBARK_DISABLE_EXT`` is set. Cached: built at most once per process."""
    return EXT.load_or_none()


def fits_sort_key(num_rows: int, nnz: int) -> bool:
    """Whether the kernel's sort keys (``id << pos_bits | position``, ``pos_bits`` the bits of
    a position in ``[0, nnz)``, at least 1) of ``nnz`` ids into ``num_rows`` rows fit 63 bits."""
    pos_bits = max(1, (nnz - 1).bit_length())
    return num_rows <= 1 << (63 - pos_bits)


def fused_half_backward(
    grad: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mean: bool,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    kind: str,
    lr: float,
    eps: float,
    key: int,
    table: str = "<unnamed>",
) -> bool:
    """Update the rows of ``weight`` a bag lookup touched, and their state, in one pass;
    ``False`` (nothing done) when the extension is not available.

    Args:
        grad: ``(B, dim)`` float32 gradient of the pooled bags.
        ids: ``(nnz,) int64`` looked-up rows, in ``[0, num_rows)``.
        offsets: ``(B,) int64`` start of each bag in ``ids`` (the first 0).
        mean: bags were averaged.
        weight: ``(num_rows, dim)`` float16 or bfloat16, contiguous, CPU; updated in place.
        state: the optimizer state (``row_sum (num_rows,)`` / ``sum (num_rows, dim)``
            float32, updated in place), ``None`` for SGD.
        kind: the :class:`~embark.training.config.EmbeddingOptimizerKind`'s value.
        lr, eps: the update's learning rate and Adagrad epsilon.
        key: ``[0, 2^63)``, the call's rounding key (:func:`~embark.training.rounding.counter_bits`).
        table: the table's name, for the kernel's errors.

    Raises:
        RuntimeError: from the kernel, naming the table and the bad value: an id outside
            ``[0, num_rows)``, offsets that do not rise from 0, a tensor of the wrong dtype,
            shape or layout, ``num_rows`` and ``nnz`` past the 63-bit sort key
            (:func:`fits_sort_key`).
        ValueError: ``kind`` is not one of the three updates.
    """
    ext = load_extension()
    if ext is None:
        return False
    g = grad if grad.dtype == torch.float32 and grad.is_contiguous() else grad.float().contiguous()
    ext.fused_backward(
        g, ids.contiguous(), offsets.contiguous(), mean, weight, state, kind, lr, eps, key, table
    )
    return True
