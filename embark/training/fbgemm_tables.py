"""FBGEMM's table-batched embedding kernel (``fbgemm_gpu``'s
``SplitTableBatchedEmbeddingBagsCodegen`` on CPU) as the fast path of one fused table.

The kernel's backward reduces the bag gradients to the distinct touched rows and applies the
optimizer to those rows (``EXACT_ADAGRAD``, ``EXACT_ROWWISE_ADAGRAD``, ``EXACT_SGD``), the same
update as :class:`embark.training.sparse_rows.RowOptimizer`. The weights and the optimizer
state stay ours (the model's parameter, the update module's buffers): the kernel is built
over them (``preallocated_host_buffers``, where FBGEMM takes it), so building it allocates
and writes no table-sized buffer; for each call they are bound as the kernel's host storage
(``weights_host``, ``momentum1_host``, flat views, no copy) and unbound after the forward
(the autograd node keeps what backward needs), so a deep copy or a ``state_dict`` of the
model never sees a second copy of a table.

``fbgemm_gpu`` is imported only here and only when a table is first trained with this kernel
(:func:`fbgemm_available` checks it without failing).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from types import ModuleType

import torch

from embark.training.config import EmbeddingOptimizerKind, TableRounding
from embark.training.sparse_rows import RowOptimizer

log = logging.getLogger(__name__)

_TBE_MODULE = "fbgemm_gpu.split_table_batched_embeddings_ops_training"


@functools.cache
def _fbgemm() -> tuple[ModuleType, ModuleType, ModuleType] | None:
    """``(training ops, common ops, configs)`` modules of ``fbgemm_gpu``, or ``None`` (with one
    logged warning naming the import error) when it does not import."""
    try:
        return (
            importlib.import_module(_TBE_MODULE),
            importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_common"),
            importlib.import_module("fbgemm_gpu.split_embedding_configs"),
        )
    except (ImportError, OSError, RuntimeError) as err:
        log.warning(
            "fbgemm_gpu does not import (%s): embedding tables train on the reference path "
            "(pure torch, slower); install fbgemm-gpu-cpu (CPU) or fbgemm-gpu (CUDA)",
            err,
        )
        return None


def fbgemm_available() -> bool:
    """Whether FBGEMM's table-batched kernels import (a failure is logged once)."""
    return _fbgemm() is not None


class FbgemmTable:
    """One table's lookup through FBGEMM, optimizer applied in its backward.

    Args:
        weight: the table's (or shard's) ``(num_rows, dim)`` weight, float32 or float16
            (:meth:`supports`), contiguous.
        state: the update's state (``sum`` ``(num_rows, dim)`` or ``row_sum`` ``(num_rows,)``
            float32, contiguous; empty for SGD).
        optimizer: the row update (its kind, lr, eps).
        mean: bags are averaged (``PoolingMode.MEAN``), else summed.

    The kernel is built over ``weight`` and ``state`` (no table-sized allocation where FBGEMM
    takes ``preallocated_host_buffers``); each call binds the tensors it is given.

    Raises:
        RuntimeError: when ``fbgemm_gpu`` does not import.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        optimizer: RowOptimizer,
        mean: bool,
    ) -> None:
        mods = _fbgemm()
        if mods is None:
            raise RuntimeError(
                "embedding_kernel='fbgemm' but fbgemm_gpu does not import; install "
                "fbgemm-gpu-cpu or use embedding_kernel='reference'"
            )
        ops, common, configs = mods
        optim = {
            EmbeddingOptimizerKind.ADAGRAD: configs.EmbOptimType.EXACT_ADAGRAD,
            EmbeddingOptimizerKind.ROWWISE_ADAGRAD: configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            EmbeddingOptimizerKind.SGD: configs.EmbOptimType.EXACT_SGD,
        }[optimizer.kind]
        self.kind = optimizer.kind
        num_rows, dim = weight.shape
        cls = ops.SplitTableBatchedEmbeddingBagsCodegen
        extra: dict[str, dict[str, torch.Tensor]] = {}
        if _takes_host_buffers(cls):
            extra["preallocated_host_buffers"] = _host_views(weight, state)
        precision = {torch.float32: "FP32", torch.float16: "FP16"}[weight.dtype]
        self.tbe = cls(
            [(num_rows, dim, common.EmbeddingLocation.HOST, ops.ComputeDevice.CPU)],
            optimizer=optim,
            weights_precision=getattr(configs.SparseType, precision),
            # its CPU kernel rounds updated FP16 rows to nearest whatever this flag says
            # (measured, fbgemm-gpu-cpu 1.8): ask for what it does
            stochastic_rounding=False,
            output_dtype=configs.SparseType.FP32,
            learning_rate=optimizer.lr,
            eps=optimizer.eps,
            pooling_mode=common.PoolingMode.MEAN if mean else common.PoolingMode.SUM,
            # ids are range-checked (naming the table) before any lookup
            bounds_check_mode=common.BoundsCheckMode.NONE,
            **extra,
        )
        self._unbind()

    @staticmethod
    def supports(
        dim: int,
        dtype: torch.dtype = torch.float32,
        rounding: TableRounding = TableRounding.NEAREST,
    ) -> bool:
        """Whether the CPU kernel trains rows of ``dim`` values stored as ``dtype`` rounded by
        ``rounding``: rows a multiple of 4 wide (a column shard may not be), float32 weights,
        or float16 ones rounded to nearest (its CPU kernel has no stochastic rounding and no
        bfloat16 weights)."""
        if dim % 4:
            return False
        if dtype == torch.float32:
            return True
        return dtype == torch.float16 and rounding is TableRounding.NEAREST

    def set_lr(self, lr: float) -> None:
        """Set the learning rate the kernel's backward applies."""
        self.tbe.set_learning_rate(lr)

    def _unbind(self) -> None:
        params = self.tbe._parameters
        for name in ("weights_host", "momentum1_host"):
            if name in params:
                params[name] = torch.empty(0)
        # the kernel keeps no reference to a table between calls
        self.tbe._preallocated_host_buffers = None

    def __call__(
        self,
        weight: torch.Tensor,
        state: dict[str, torch.Tensor],
        ids: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """``(B, dim)`` pooled bags; backward updates ``weight`` and ``state`` in place.

        Args:
            weight: ``(num_rows, dim) float32`` contiguous.
            state: the update's state (``sum`` or ``row_sum``, contiguous; none for SGD).
            ids: ``(nnz,) int64``; offsets: ``(B,) int64`` bag starts.
        """
        params = self.tbe._parameters
        for key, view in _host_views(weight, state).items():
            params[f"{key}_host"] = view
        ends = torch.cat([offsets, offsets.new_tensor([ids.numel()])])
        try:
            return self.tbe(ids, ends)
        finally:
            self._unbind()


def _host_views(weight: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"weights": weight, "momentum1": state}`` as flat views (no copy): FBGEMM's names of
    a table's host storage, less the ``_host`` suffix (an SGD update has no state)."""
    views = {"weights": weight.detach().view(-1)}
    for tensor in state.values():
        views["momentum1"] = tensor.view(-1)
    return views


@functools.cache
def _takes_host_buffers(cls: type) -> bool:
    """Whether this FBGEMM's kernel class can be built over given host tensors
    (``preallocated_host_buffers``); an older one allocates (and zeroes) its own, which the
    first call replaces."""
    return "preallocated_host_buffers" in inspect.signature(cls).parameters
