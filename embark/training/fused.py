"""Fused sparse embedding training: a table's lookup whose backward updates only the rows the
batch touched, inside backward (no dense gradient of a table, no full-table optimizer step).

A model opts in by being a :class:`~embark.models.tables.TableModel`: its
:meth:`~embark.models.tables.TableModel.embedding_store` is a
:class:`~embark.models.tables.TableStore` (a single-process model's whole tables, or a rank's
shards and replicas) that pools a table through the fused update installed for it.
:class:`EmbeddingUpdates` (built by the trainer) installs one :class:`SparseTableUpdate` per
table and turns the tables' ``requires_grad`` off, so the dense optimizer never sees them. A
table whose weight has ``requires_grad`` off when the trainer takes it over is frozen
(:attr:`SparseTableUpdate.frozen`: looked up, never updated, its optimizer state untouched);
:meth:`EmbeddingUpdates.set_frozen` freezes or thaws a table later::

    forward   pooled = update(weight, ids, offsets, mode)        (B, dim)
    backward  rows, grads = distinct touched rows and their summed gradients
              optimizer applied to weight[rows] and its state[rows]
              (FBGEMM; for FP16/BF16 tables rounded stochastically our compiled fused
              backward, :mod:`embark.training.half_kernel`; else the reference)

A replicated (DP) table keeps a dense gradient (its replicas are summed over the ranks after
backward); :meth:`EmbeddingUpdates.step` then applies the same row update to the rows whose
summed gradient is non-zero (a zero gradient moves neither a row nor its state under any of
the three updates, so this equals updating the touched rows).

The optimizer state lives in the update modules as non-persistent buffers: it follows the
model through ``.to()`` and ``copy.deepcopy`` and stays out of ``model.state_dict()`` (the
weights alone, as exported). Checkpoints name it ``"<weight name>::<state key>"``
(:data:`embark.training.sparse_rows.STATE_KEYS`), whatever the sharding.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from embark.models.tables import FusedLookup, TableModel
from embark.training.config import EmbeddingKernel, TableRounding, TrainConfig
from embark.training.fbgemm_tables import FbgemmTable, fbgemm_available
from embark.training.half_kernel import fits_sort_key, fused_half_backward, load_extension
from embark.training.rounding import draw_key
from embark.training.sparse_rows import STATE_KEYS, RowOptimizer, row_gradients

log = logging.getLogger(__name__)

#: the state key of a stochastically rounded table's generator state in checkpoints
ROUNDING_GENERATOR = "rounding_generator"


def resolve_kernel(kernel: EmbeddingKernel) -> EmbeddingKernel:
    """``FBGEMM`` or ``REFERENCE`` for ``kernel`` (``AUTO``: FBGEMM when it imports).

    Raises:
        ValueError: for ``FBGEMM`` when ``fbgemm_gpu`` does not import.
    """
    if kernel is EmbeddingKernel.REFERENCE:
        return kernel
    if fbgemm_available():
        return EmbeddingKernel.FBGEMM
    if kernel is EmbeddingKernel.FBGEMM:
        raise ValueError(
            "TrainConfig.embedding_kernel='fbgemm' but fbgemm_gpu does not import; install "
            "fbgemm-gpu-cpu (CPU) or fbgemm-gpu (CUDA), or use 'auto' or 'reference'"
        )
    return EmbeddingKernel.REFERENCE


class _ReferenceBag(torch.autograd.Function):
    """``F.embedding_bag`` forward; backward applies the row update and returns no gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        weight: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        mean: bool,
        update: SparseTableUpdate,
    ) -> torch.Tensor:
        ctx.save_for_backward(ids, offsets)
        ctx.weight, ctx.mean, ctx.update = weight, mean, update
        return F.embedding_bag(ids, weight, offsets, mode="mean" if mean else "sum").float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ids, offsets = ctx.saved_tensors
        ctx.update.apply_bags(ctx.weight, grad, ids, offsets, ctx.mean)
        return (None,) * 6


class SparseTableUpdate(FusedLookup):
    """The fused lookup and row update of one table (or shard) of ``num_rows × dim``.

    Args:
        table: the table's name (for messages).
        num_rows, dim: the weight's shape.
        optimizer: the row update.
        kernel: ``FBGEMM`` or ``REFERENCE`` (:func:`resolve_kernel`); a shard whose width
            or storage FBGEMM does not take (:meth:`FbgemmTable.supports`: BF16 weights, FP16
            weights with stochastic rounding on CPU) runs on the reference path — or, for
            FP16/BF16 rounded stochastically on CPU, on the compiled fused backward whenever
            it is built (:mod:`embark.training.half_kernel`; ``EMBARK_DISABLE_EXT=1`` forces
            the reference).
        rounding: how FP16/BF16 rows are rounded after an update (:class:`TableRounding`).
        seed: seeds the random bits of stochastic rounding (with the table's name).

    Buffers (non-persistent): the optimizer state, ``sum (num_rows, dim)`` or
    ``row_sum (num_rows,)`` float32, none for SGD.

    Attributes:
        frozen: the table is looked up but never updated (a plain ``embedding_bag``).
    """

    def __init__(
        self,
        table: str,
        num_rows: int,
        dim: int,
        optimizer: RowOptimizer,
        kernel: EmbeddingKernel,
        rounding: TableRounding = TableRounding.STOCHASTIC,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.table, self.num_rows, self.dim = table, num_rows, dim
        self.optimizer, self.kernel = optimizer, kernel
        self.rounding, self.seed = rounding, seed
        # stochastic rounding's bits: a function of the seed and the table alone
        self.generator = torch.Generator().manual_seed(
            (seed * 1_000_003 + zlib.crc32(table.encode())) & (2**63 - 1)
        )
        for key, value in optimizer.new_state(num_rows, dim).items():
            self.register_buffer(key, value, persistent=False)
        self._kernels: dict[bool, FbgemmTable] = {}
        self.frozen = False

    def state(self) -> dict[str, torch.Tensor]:
        """``{state key: tensor}`` (the buffers themselves, updated in place)."""
        return {k: getattr(self, k) for k in STATE_KEYS[self.optimizer.kind]}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{state key: shape}`` this update holds."""
        return {k: tuple(v.shape) for k, v in self.state().items()}

    def apply_rows(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """The row update (:meth:`RowOptimizer.apply_`) of ``weight`` at the distinct ``rows``
        ``(U,) int64`` with gradients ``grads`` ``(U, dim)``, this table's rounding."""
        if rows.numel() == 0:
            return
        offsets = torch.arange(rows.numel(), device=rows.device)  # each row a bag of its own
        if not self._fused_half(weight, grads, rows, offsets, False):
            key = draw_key(self.generator) if self._rounds_stochastically(weight) else 0
            self.optimizer.apply_(weight, self.state(), rows, grads, self.rounding, key)

    def apply_bags(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        mean: bool,
    ) -> None:
        """The update of ``weight`` from the gradient ``grad`` ``(B, dim)`` of the bags
        ``ids`` ``(nnz,) int64`` starting at ``offsets`` ``(B,) int64``: the compiled fused
        backward for a stochastically rounded FP16/BF16 table on CPU
        (:func:`~embark.training.half_kernel.fused_half_backward`), else
        :func:`row_gradients` then :meth:`apply_rows`. Both draw one rounding key a call
        from :attr:`generator`, so the two paths round with the same bits."""
        if ids.numel() == 0:
            return
        if not self._fused_half(weight, grad, ids, offsets, mean):
            rows, row_grads = row_gradients(grad, ids, offsets, mean)
            self.apply_rows(weight, rows, row_grads)

    def _rounds_stochastically(self, weight: torch.Tensor) -> bool:
        return weight.dtype != torch.float32 and self.rounding is TableRounding.STOCHASTIC

    def _fused_half(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        mean: bool,
    ) -> bool:
        """Run the compiled fused backward when it applies and is built; whether it ran.

        It does not apply (the reference runs, nothing raised from backward) unless the weight
        is a contiguous CPU FP16/BF16 table rounded stochastically, the state contiguous
        float32, the ids and offsets int64 and ``num_rows × nnz`` within the kernel's 63-bit
        sort key (:func:`~embark.training.half_kernel.fits_sort_key`)."""
        states = list(self.state().values())
        if not (
            self._rounds_stochastically(weight)
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and all(s.dtype == torch.float32 and s.is_contiguous() for s in states)
            and ids.dtype == torch.int64
            and offsets.dtype == torch.int64
            and fits_sort_key(weight.shape[0], ids.numel())
            and load_extension() is not None
        ):
            return False
        key = draw_key(self.generator)
        return fused_half_backward(
            grad,
            ids,
            offsets,
            mean,
            weight.detach(),
            states[0] if states else None,
            self.optimizer.kind.value,
            self.optimizer.lr,
            self.optimizer.eps,
            key,
            self.table,
        )

    def uses_fbgemm(self, weight: torch.Tensor) -> bool:
        """Whether a training lookup of ``weight`` runs FBGEMM's kernel."""
        return (
            self.kernel is EmbeddingKernel.FBGEMM
            and weight.device.type == "cpu"
            and FbgemmTable.supports(self.dim, weight.dtype, self.rounding)
        )

    def forward(
        self, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mode: str
    ) -> torch.Tensor:
        """Pool ``ids`` (``(nnz,) int64``, bags starting at ``offsets`` ``(B,) int64``) from
        ``weight`` ``(num_rows, dim)`` by ``mode`` (``"sum"``/``"mean"``) → ``(B, dim)``; with
        autograd on, its backward updates the touched rows of ``weight`` and the state.

        Ids must already be range-checked (the models check them, naming the table, before
        any lookup): FBGEMM's kernel does not check them. The compiled FP16/BF16 backward
        does (its error names the table, the id and the row count), and so does the reference
        (torch's ``embedding_bag``).
        """
        if mode not in ("sum", "mean"):
            raise ValueError(
                f"table {self.table!r}: pooling mode must be sum or mean, got {mode!r}"
            )
        if self.frozen or not torch.is_grad_enabled():
            return F.embedding_bag(ids, weight, offsets, mode=mode)
        mean = mode == "mean"
        if self.uses_fbgemm(weight):
            if mean not in self._kernels:
                self._kernels[mean] = FbgemmTable(weight, self.state(), self.optimizer, mean)
            return self._kernels[mean](weight, self.state(), ids, offsets)
        anchor = torch.empty(0, requires_grad=True)  # makes autograd call backward
        out: torch.Tensor = _ReferenceBag.apply(anchor, weight, ids, offsets, mean, self)
        return out

    def set_lr(self, lr: float) -> None:
        """Set the row update's learning rate (the FBGEMM kernels' too)."""
        self.optimizer = replace(self.optimizer, lr=lr)
        for kernel in self._kernels.values():
            kernel.set_lr(lr)

    def __getstate__(self) -> dict[str, Any]:
        """The module's state without the kernel objects (FBGEMM's hold local functions that
        cannot be pickled): ``torch.save(model)`` works after training; a loaded copy rebuilds
        its kernels on first use. The rounding generator is kept as its state tensor."""
        state: dict[str, Any] = super().__getstate__()
        return state | {"_kernels": {}, "generator": self.generator.get_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Undo :meth:`__getstate__` (the rounding generator rebuilt from its state)."""
        generator = torch.Generator()
        generator.set_state(state.pop("generator"))
        super().__setstate__(state | {"generator": generator})

    def __deepcopy__(self, memo: dict[int, Any]) -> SparseTableUpdate:
        """A copy with copied state; the kernel objects are rebuilt on first use."""
        new = SparseTableUpdate(
            self.table, 0, 0, self.optimizer, self.kernel, self.rounding, self.seed
        )
        new.num_rows, new.dim, new.frozen = self.num_rows, self.dim, self.frozen
        new.generator.set_state(self.generator.get_state())
        for key, value in self.state().items():
            new.register_buffer(key, value.clone(), persistent=False)
        new.train(self.training)
        memo[id(self)] = new
        return new


class EmbeddingUpdates:
    """The trainer's handle on the fused tables of ``model`` (see the module docstring).

    Args:
        model: the model whose store's tables (:meth:`TableModel.embedding_store`) are
            taken over.
        cfg: ``embedding_update``, ``embedding_lr or lr``, ``adagrad_eps``,
            ``initial_accumulator_value`` and ``embedding_kernel`` fix the update.

    Raises:
        ValueError: for ``embedding_kernel='fbgemm'`` without FBGEMM.

    Updates already installed in the store for the same table shape and update kind keep
    their state (a trainer over a deep copy of a trained model continues it); others start
    fresh. A table is frozen (:attr:`SparseTableUpdate.frozen`) when its weight has
    ``requires_grad`` off and no trainer took it over yet, or when the update already there
    is frozen.
    """

    def __init__(self, model: TableModel, cfg: TrainConfig) -> None:
        self.model = model
        self.store = store = model.embedding_store()
        kernel = resolve_kernel(cfg.embedding_kernel)
        # before any update is built over a weight (a new dtype is a new parameter)
        store.set_storage_dtype_(cfg.table_dtype)
        self.optimizer = RowOptimizer(
            cfg.embedding_update,
            cfg.embedding_lr or cfg.lr,
            cfg.adagrad_eps,
            cfg.initial_accumulator_value,
        )
        tables = store.trainable_weights()
        replicated = store.replicated()
        names = {id(p): n for n, p in model.named_parameters()}
        self.weights: dict[str, nn.Parameter] = dict(tables)
        self.param_names = {t: names[id(w)] for t, w in tables.items()}
        self.replicated = frozenset(replicated)
        #: the tables' learning rate before the warm-up, and each table's (a ParamGroup's)
        self.default_lr = self.optimizer.lr
        self.base_lr: dict[str, float] = {}
        for t, w in tables.items():
            group = cfg.group_of(self.param_names[t])
            self.base_lr[t] = self.optimizer.lr if group is None else group.lr
            row_opt = replace(self.optimizer, lr=self.base_lr[t])
            upd = SparseTableUpdate(
                t, w.shape[0], w.shape[1], row_opt, kernel, cfg.table_rounding, cfg.seed
            )
            old = store.update_of(t)
            # a table taken over before had its requires_grad turned off here: its update says
            upd.frozen = old.frozen if isinstance(old, SparseTableUpdate) else not w.requires_grad
            if (
                isinstance(old, SparseTableUpdate)
                and old.optimizer.kind is row_opt.kind
                and old.state_shapes() == upd.state_shapes()
            ):
                for key, value in old.state().items():
                    getattr(upd, key).copy_(value)
                upd.generator.set_state(old.generator.get_state())
            store.install_update(t, upd.to(w.device))
            w.requires_grad_(t in self.replicated and not upd.frozen)
        log.debug("fused embedding updates: %d table(s), %s kernel", len(tables), kernel.value)

    @property
    def updates(self) -> Mapping[str, SparseTableUpdate]:
        """``{table: its update}``."""
        out: dict[str, SparseTableUpdate] = {}
        for t in self.weights:
            upd = self.store.update_of(t)
            assert isinstance(upd, SparseTableUpdate), f"table {t!r} lost its fused update"
            out[t] = upd
        return out

    @property
    def frozen(self) -> frozenset[str]:
        """The frozen tables."""
        return frozenset(t for t, upd in self.updates.items() if upd.frozen)

    def set_frozen(self, table: str, frozen: bool = True) -> None:
        """Freeze ``table`` (looked up, never updated) or let it train again.

        Raises:
            KeyError: naming the tables, for a table this trainer does not hold.
        """
        if table not in self.weights:
            raise KeyError(f"no fused table {table!r}; this trainer holds {sorted(self.weights)}")
        self.updates[table].frozen = frozen
        self.weights[table].requires_grad_(table in self.replicated and not frozen)

    def scale_lr(self, scale: float) -> None:
        """Set each table's learning rate to ``scale`` times its :attr:`base_lr` (the
        trainer's warm-up); :attr:`optimizer` (the tables' default update) is scaled too."""
        self.optimizer = replace(self.optimizer, lr=self.default_lr * scale)
        for t, upd in self.updates.items():
            upd.set_lr(self.base_lr[t] * scale)

    def set_lr(self, lr: float) -> None:
        """Set every table's learning rate to ``lr``."""
        self.optimizer = replace(self.optimizer, lr=lr)
        for upd in self.updates.values():
            upd.set_lr(lr)

    @torch.no_grad()
    def step(self) -> None:
        """Apply the row update to the replicated tables from their (summed) dense gradients,
        at the rows whose gradient is non-zero; clear those gradients."""
        for t in sorted(self.replicated):
            w = self.weights.get(t)
            if w is None or w.grad is None:
                continue
            grad = w.grad
            rows = grad.ne(0).any(dim=1).nonzero().squeeze(1)
            self.updates[t].apply_rows(w, rows, grad[rows])
            w.grad = None

    def zero_grad(self) -> None:
        """Drop the replicated tables' gradients."""
        for t in self.replicated:
            if t in self.weights:
                self.weights[t].grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``{"<weight name>::<state key>": tensor}`` of every table (the live buffers), and
        for an FP16/BF16 table rounded stochastically ``"<weight name>::rounding_generator"``
        (its generator's state, ``uint8``: a resumed run draws the same rounding bits)."""
        out = {
            f"{self.param_names[t]}::{k}": v
            for t, upd in self.updates.items()
            for k, v in upd.state().items()
        }
        for t, upd in self.updates.items():
            if self._draws_rounding(t):
                out[f"{self.param_names[t]}::{ROUNDING_GENERATOR}"] = upd.generator.get_state()
        return out

    def _draws_rounding(self, table: str) -> bool:
        upd = self.updates[table]
        return (
            self.weights[table].dtype != torch.float32 and upd.rounding is TableRounding.STOCHASTIC
        )

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"<weight name>::<state key>": shape}`` this trainer's state has."""
        return {k: tuple(v.shape) for k, v in self.state_tensors().items()}

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (keys and shapes as :meth:`state_shapes`, checked by the caller)
        into the state."""
        own = self.state_tensors()
        tables = {name: t for t, name in self.param_names.items()}
        for key, value in tensors.items():
            name, _, what = key.partition("::")
            if what == ROUNDING_GENERATOR:
                self.updates[tables[name]].generator.set_state(value.clone())
            else:
                own[key].copy_(value)
