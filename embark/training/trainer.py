"""The trainer: Adagrad (MLPerf's choice) or SGD over one model, callbacks, evaluation, and
checkpoints that resume bit-identically — in one process or sharded over many.

A :class:`Trainer` holds a model, its optimizer, a :class:`~embark.training.state.TrainState`
(step, data-stream identity, generator, history) and a
:class:`~embark.training.sync.GradientSync`: :class:`~embark.training.sync.LocalSync` for a
single-process model, the model's own for a sharded one (``embark.sharding.ShardedDLRM``:
each rank trains its slice of the global batch and the replicated gradients are summed), so
one training step reads the same in both::

    loss, n = sync.loss(batch)     forward; n = samples of the step (all processes)
    state.admit(n)                 a batch larger than the stream's is refused
    sync.global_loss(loss)         a loss that is not finite stops here, nothing changed
    sync.backward(loss)            embedding tables: touched rows updated inside backward
                                   (a sharded sync starts its all-reduces inside it too)
    sync.reduce                    gradients of the global mean loss everywhere
    on_after_backward → optimizer.step() (dense part) and embedding_updates.step()
                                   (replicated tables) → on_step_end

Resuming. The data stream position equals ``trainer.step`` (one batch per step), so

>>> t = Trainer.load_checkpoint(ckpt)                             # doctest: +SKIP
>>> t.fit(data.batches(total - t.step, start=t.step), total - t.step)  # doctest: +SKIP

ends with exactly the weights of an uninterrupted ``total``-step run. The checkpoint format
is :mod:`embark.training.checkpoint`'s; a sharded trainer is saved and loaded through
``embark.sharding.checkpoint`` (each rank writes its shards; a load reshards).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

import embark.training.checkpoint.store as checkpoint
from embark.data.batch import Batch
from embark.models.dlrm import build_model
from embark.models.tables import TableModel
from embark.training.callbacks import Callback
from embark.training.config import OptimizerKind, TrainConfig, build_optimizer
from embark.training.fused import EmbeddingUpdates
from embark.training.metrics import auc, log_loss
from embark.training.report import FitReport
from embark.training.state import TrainState
from embark.training.sync import GradientSync, SupportsGradientSync, sync_for

EvalData = Iterable[Batch] | Callable[[], Iterable[Batch]]


class TrainingDiverged(RuntimeError):
    """A training step's loss is not finite: the run diverged (a learning rate far too high,
    exploding inputs). Raised by :meth:`Trainer.train_step` before the optimizer applies the
    step, on every process of a sharded run alike (the loss is the global one), so the trainer
    still holds the weights and optimizer state after step ``step - 1``.

    Attributes:
        step: the 1-based step whose loss is not finite.
        loss: that loss (``nan`` or ``±inf``).
    """

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(
            f"training diverged at step {step}: its loss is {loss} (the weights are those "
            f"after step {step - 1}; a lower learning rate may train)"
        )
        self.step, self.loss = step, loss


class Trainer:
    """Train a model whose ``forward(dense, sparse)`` returns ``(B,)`` logits with binary
    cross-entropy on ``Batch.labels``.

    Args:
        model: typically :class:`embark.models.dlrm.DLRM` (its ``workload`` attribute is written
            into checkpoints so :meth:`load_checkpoint` can rebuild it) or a sharded
            ``embark.sharding.ShardedDLRM`` (every rank builds its trainer and calls every
            method in step, each with its own local batch).
        cfg: hyper-parameters.
        callbacks: called in order at each hook.
        sync: the collective parts of a step; ``None``: the model's own
            (:class:`~embark.training.sync.SupportsGradientSync`), else one process's.
        state: the run's state; ``None``: a fresh one seeded by ``cfg.seed``.

    Embedding tables (a :class:`~embark.models.tables.TableModel`: ``DLRM``, ``ShardedDLRM``)
    train through the fused sparse update of :mod:`embark.training.fused`
    (``embedding_updates``); ``optimizer`` is the dense part's.

    Raises:
        ValueError: for ``cfg.embedding_kernel='fbgemm'`` without FBGEMM.

    Attributes:
        model, cfg, callbacks, sync, state, optimizer: as given or built.
        embedding_updates: the fused tables' handle (``None`` for a model without tables).
        ``step``,
        ``batch_size``, ``data_stream``, ``generator`` and ``history`` read and write
        :attr:`state`'s fields (see :class:`~embark.training.state.TrainState`).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        callbacks: Iterable[Callback] = (),
        sync: GradientSync | None = None,
        state: TrainState | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.callbacks: list[Callback] = list(callbacks)
        # the tables first: taking them over may store them in cfg.table_dtype (new parameters)
        self.embedding_updates: EmbeddingUpdates | None = None
        if isinstance(model, TableModel):
            self.embedding_updates = EmbeddingUpdates(model, cfg)
        self.sync = sync_for(model) if sync is None else sync
        self.state = TrainState.seeded(cfg.seed) if state is None else state
        self.optimizer = self._make_optimizer()
        self._begun: set[int] = set()  # id() of the callbacks whose on_train_begin ran
        self._stop_reason: str | None = None  # request_stop's, for the running fit

    # ------------------------------------------------------------------ state
    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def batch_size(self) -> int | None:
        return self.state.batch_size

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:
        self.state.batch_size = value

    @property
    def data_stream(self) -> dict[str, Any] | None:
        return self.state.data_stream

    @data_stream.setter
    def data_stream(self, value: dict[str, Any] | None) -> None:
        self.state.data_stream = value

    @property
    def generator(self) -> torch.Generator:
        return self.state.generator

    @property
    def history(self) -> list[dict[str, float]]:
        return self.state.history

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    # -------------------------------------------------------------- optimizer
    def _make_optimizer(self) -> torch.optim.Optimizer:
        emb: list[nn.Parameter] = []
        dense: list[nn.Parameter] = []
        grouped: dict[str, list[nn.Parameter]] = {g.name: [] for g in self.cfg.param_groups}
        fused = self.embedding_updates.weights.values() if self.embedding_updates else ()
        skip = {id(p) for p in fused}
        # the tables' parameters that no fused update holds (none for a DLRM whose float
        # tables are all fused) step in the "embeddings" group
        tables = self.model.embedding_store() if isinstance(self.model, TableModel) else None
        in_tables = set() if tables is None else {id(p) for p in tables.parameters()}
        for name, p in self.model.named_parameters():
            if not p.requires_grad or id(p) in skip:
                continue
            group = self.cfg.group_of(name)
            if group is not None:
                grouped[group.name].append(p)
            else:
                (emb if id(p) in in_tables else dense).append(p)
        return build_optimizer(self.cfg, emb, dense, grouped)

    def rebuild_optimizer(self) -> None:
        """Build a new optimizer over the model's current parameters (call after modules were
        replaced or parametrized). State (e.g. Adagrad sums) is kept for every parameter
        tensor still in the model — ``torch.nn.utils.parametrize`` keeps the original tensor
        as ``...parametrizations.weight.original``; new parameters start fresh. When the
        model's float tables changed (``embark.quant.quantize_embeddings_`` replaced some),
        the fused tables' update is rebuilt over the tables left (their rows state kept)."""
        if self.embedding_updates is not None and self._stale_tables():
            self.embedding_updates = EmbeddingUpdates(self.embedding_updates.model, self.cfg)
        old = self.optimizer
        self.optimizer = self._make_optimizer()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p in old.state:
                    self.optimizer.state[p] = old.state[p]

    def _stale_tables(self) -> list[str]:
        """The fused tables whose weight is no longer the model's table (replaced, e.g.
        quantized)."""
        if self.embedding_updates is None:
            return []
        now = self.embedding_updates.store.trainable_weights()
        return [t for t, w in self.embedding_updates.weights.items() if now.get(t) is not w]

    def _warm_up(self, step: int) -> None:
        """Learning rates of 1-based ``step`` under ``cfg.warmup_steps``
        (:meth:`TrainConfig.lr_scale`); after the warm-up they are left as they are."""
        if step > self.cfg.warmup_steps:
            return
        scale = self.cfg.lr_scale(step)
        base = {"embeddings": self.cfg.embedding_lr or self.cfg.lr, "dense": self.cfg.lr}
        base |= {g.name: g.lr for g in self.cfg.param_groups}
        for group in self.optimizer.param_groups:
            group["lr"] = base[group.get("name", "dense")] * scale
        if self.embedding_updates is not None:
            self.embedding_updates.scale_lr(scale)

    def add_callback(self, cb: Callback) -> None:
        self.callbacks.append(cb)

    # --------------------------------------------------------------- training
    def train_step(self, batch: Batch) -> float:
        """One optimizer step on ``batch`` (this process's part of the step) with the
        callbacks' hooks; returns the step's mean loss (over all processes).

        Raises:
            ValueError: for a batch larger than :attr:`batch_size` (later batches of a stream
                may be shorter, never longer), before the weights or the step change.
            TrainingDiverged: when the step's loss is not finite, before the weights, the
                optimizer state or the step change.
        """
        self.model.train()
        batch = batch.to(self.device)
        # before the forward: FBGEMM's kernel takes the tables' lr when the lookup runs; a
        # function of the step alone, so a refused or diverged step leaves it as a retry sets it
        self._warm_up(self.state.step + 1)
        loss, n = self.sync.loss(batch)
        self.state.admit(n, self.sync.batch_scope)
        step = self.state.step + 1
        for cb in self.callbacks:
            if id(cb) not in self._begun:
                begin = getattr(cb, "on_train_begin", None)
                if begin is not None:
                    begin(self)
                self._begun.add(id(cb))
        self.optimizer.zero_grad(set_to_none=True)
        if self.embedding_updates is not None:
            self.embedding_updates.zero_grad()
        # checked before backward: the fused tables update their rows inside backward
        value = self.sync.global_loss(loss)
        if not math.isfinite(value):
            raise TrainingDiverged(step, value)
        self.sync.backward(loss)
        self.sync.reduce(loss)
        for cb in self.callbacks:
            cb.on_after_backward(self, step)
        self.optimizer.step()
        if self.embedding_updates is not None:
            self.embedding_updates.step()
        self.state.advance(n)
        for cb in self.callbacks:
            cb.on_step_end(self, step, value)
        return value

    def fit(
        self,
        batches: Iterable[Batch],
        steps: int,
        progress: bool = True,
        eval_batches: EvalData | None = None,
    ) -> FitReport:
        """Run ``steps`` optimizer steps, one batch each, taken from ``batches``.

        Args:
            batches: training batches; at least ``steps`` of them.
            steps: number of steps in this call (not a total: a resumed trainer continues from
                ``self.step``).
            progress: show a tqdm bar.
            eval_batches: for periodic evaluation every ``cfg.eval_every`` steps; a re-iterable
                (e.g. a list) or a zero-argument callable returning an iterable.

        Returns:
            this call's :class:`~embark.training.report.FitReport`; it ends early when a
            callback calls :meth:`request_stop` (e.g.
            :class:`~embark.training.callbacks.EarlyStopping`).

        Raises:
            ValueError: when ``steps < 0`` or ``batches`` runs out first; before the first
                step, when ``cfg.checkpoint_every`` is set and ``cfg.checkpoint_dir`` cannot
                be written (:func:`embark.training.checkpoint.check_save_target`).
            TrainingDiverged: at the first step whose loss is not finite (that step not
                applied).
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        report = self._begin_fit()
        it = iter(batches)
        with tqdm(total=steps, disable=not progress, desc="train", unit="step") as bar:
            for i in range(steps):
                try:
                    batch = next(it)
                except StopIteration:
                    raise ValueError(f"batches ran out after {i} of {steps} steps") from None
                if not self._fit_step(batch, report, bar, eval_batches):
                    break
        return report

    def fit_epochs(
        self,
        epoch_batches: Callable[[int], Iterable[Batch]],
        epochs: int,
        progress: bool = True,
        eval_batches: EvalData | None = None,
    ) -> FitReport:
        """Train ``epochs`` passes over the data, one step per batch.

        Args:
            epoch_batches: ``epoch -> that epoch's batches`` (0-based); reshuffling is the data's
                (e.g. :func:`~embark.training.epochs.reshuffled` with the epoch as its seed).
            epochs: number of passes (>= 0).
            progress, eval_batches: as :meth:`fit` (evaluation every ``cfg.eval_every`` steps,
                counted across epochs).

        Returns:
            the :class:`~embark.training.report.FitReport` of every step of the call
            (``epochs``: the passes whose every batch was trained).

        Raises:
            ValueError: for ``epochs < 0``, as :meth:`fit` for the checkpoint folder.
            TrainingDiverged: as :meth:`fit`.
        """
        if epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs}")
        report = self._begin_fit()
        with tqdm(disable=not progress, desc="train", unit="step") as bar:
            for epoch in range(epochs):
                it = iter(epoch_batches(epoch))
                batch = next(it, None)
                while batch is not None:
                    go_on = self._fit_step(batch, report, bar, eval_batches)
                    batch = next(it, None)  # a stop at an epoch's last batch ends that epoch
                    if not go_on:
                        report.epochs += batch is None
                        return report
                report.epochs += 1
        return report

    def request_stop(self, reason: str) -> None:
        """Stop the running :meth:`fit` after the current step (its evaluation and checkpoint
        done); ``reason`` goes into the report. In a sharded run every rank must ask at the same
        step (a decision on evaluation metrics, which are the same on every rank, is)."""
        self._stop_reason = reason

    def _begin_fit(self) -> FitReport:
        if self.cfg.checkpoint_every and self.cfg.checkpoint_dir is not None:
            checkpoint.check_save_target(self.cfg.checkpoint_dir, "checkpoint_dir")
        self._stop_reason = None
        return FitReport()

    def _fit_step(
        self, batch: Batch, report: FitReport, bar: Any, eval_batches: EvalData | None
    ) -> bool:
        """One step of :meth:`fit`, counted in ``report``; whether to go on."""
        t0 = time.perf_counter()
        loss = self.train_step(batch)
        report.seconds += time.perf_counter() - t0
        report.samples += batch.batch_size
        report.loss_sum += loss
        report.steps += 1
        bar.update(1)
        if report.steps % 20 == 1:
            bar.set_postfix(loss=f"{loss:.4f}")
        metrics = self._after_fit_step(eval_batches)
        if metrics is not None:
            report.evaluations.append(metrics)
        report.stop_reason = self._stop_reason
        return self._stop_reason is None

    def _after_fit_step(self, eval_batches: EvalData | None) -> dict[str, float] | None:
        """The periodic evaluation and checkpoint of :meth:`fit`; the evaluation's metrics."""
        metrics = None
        if (
            self.cfg.eval_every
            and eval_batches is not None
            and self.step % self.cfg.eval_every == 0
        ):
            metrics = self.evaluate(eval_batches)
            self.history.append(metrics)
            for cb in self.callbacks:
                cb.on_eval(self, self.step, metrics)
        if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
            assert self.cfg.checkpoint_dir is not None  # checked in TrainConfig
            self.save_checkpoint(self.cfg.checkpoint_dir)
        return metrics

    @torch.no_grad()
    def predict(self, batches: EvalData) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (N,) float32, labels (N,) float32)`` over ``batches``, in eval mode; in a
        sharded run every rank's batches concatenated in rank order, on every rank (each rank
        must pass the same number of batches).

        Raises:
            ValueError: when ``batches`` is empty.
        """
        data = batches() if callable(batches) else batches
        was_training = self.model.training
        self.model.eval()
        try:
            logits, labels = [], []
            for b in data:
                b = b.to(self.device)
                logits.append(self.model(b.dense, b.sparse).float().cpu())
                labels.append(b.labels.float().cpu())
        finally:
            self.model.train(was_training)
        if not logits:
            raise ValueError("evaluate: no batches")
        return self.sync.gather(torch.cat(logits)), self.sync.gather(torch.cat(labels))

    def evaluate(self, batches: EvalData) -> dict[str, float]:
        """``{"step", "auc", "logloss", "num_samples", "positive_rate"}`` over ``batches``
        (over every rank's, the same on every rank, in a sharded run)."""
        logits, labels = self.predict(batches)
        return {
            "step": self.step,
            "auc": auc(logits, labels),
            "logloss": log_loss(logits, labels, from_logits=True),
            "num_samples": int(labels.numel()),
            "positive_rate": float(labels.mean()),
        }

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint folder at ``path`` (replacing a checkpoint there, atomically;
        :func:`embark.training.checkpoint.save_checkpoint`).

        A model whose modules were replaced (a pruner's ``compress()``,
        ``embark.quant.quantize_embeddings_``) is saved after :meth:`rebuild_optimizer`, and loaded with :meth:`load_checkpoint` into a model of the
        same structure (``model=``; a module that loads its own state, such as a condensed
        sparse layer, takes the saved sizes).

        Raises:
            ValueError: when ``path`` exists and is not a checkpoint folder (nothing is
                touched), for a trainer of a sharded model (its ranks save together with
                ``embark.sharding.save_sharded_checkpoint``), or when the optimizer holds
                parameters the model no longer has, or fused tables the model replaced
                (e.g. quantized: call :meth:`rebuild_optimizer` first).
        """
        if isinstance(self.model, SupportsGradientSync):
            raise ValueError(
                f"save_checkpoint: this trainer's model ({type(self.model).__name__}) is "
                "distributed; save it with embark.sharding.save_sharded_checkpoint"
            )
        own = {id(p) for p in self.model.parameters()}
        stale = [
            tuple(p.shape)
            for g in self.optimizer.param_groups
            for p in g["params"]
            if id(p) not in own
        ]
        replaced = self._stale_tables()
        if replaced:
            raise ValueError(
                f"save_checkpoint: tables {replaced} were replaced since this trainer took them "
                "over (e.g. embark.quant.quantize_embeddings_); call trainer.rebuild_optimizer() "
                "before saving"
            )
        if stale:
            raise ValueError(
                f"save_checkpoint: the optimizer holds {len(stale)} parameter(s) the model no "
                f"longer has (shapes {stale[:3]}): modules were replaced (e.g. a pruner's "
                "compress()); call trainer.rebuild_optimizer() before saving"
            )
        return checkpoint.save_checkpoint(
            path, self.model, self.optimizer, self.cfg, self.state, self.embedding_updates
        )

    @staticmethod
    def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
        """``state.json`` of a checkpoint, checked (:func:`embark.training.checkpoint.read_state`)."""
        return checkpoint.read_state(path)

    @classmethod
    def load_checkpoint(
        cls,
        path: str | os.PathLike[str],
        model: nn.Module | None = None,
        callbacks: Iterable[Callback] = (),
    ) -> Trainer:
        """Restore a trainer (weights, optimizer state, step, generator, history).

        Args:
            path: a folder written by :meth:`save_checkpoint`.
            model: load into this model (e.g. one already parametrized by a pruner); ``None``
                builds a :class:`~embark.models.dlrm.DLRM` from the stored workload.
            callbacks: for the new trainer.

        Raises:
            ValueError: for a missing, truncated or altered file, a ``state.json`` of another
                format version or that breaks the schema (naming the file and field), or a
                model whose state-dict names, shapes or dtypes differ from the checkpoint's.
                Everything is checked before ``model`` is written: it is left untouched when
                an error is raised.
        """
        ckpt = checkpoint.read_checkpoint(path)
        if model is None:
            model = build_model(ckpt.workload(), table_dtype=ckpt.cfg.table_dtype)
        trainer = cls(model, ckpt.cfg, callbacks, state=ckpt.train_state())
        checkpoint.check_fits(ckpt, model, trainer.optimizer, trainer.embedding_updates)
        checkpoint.restore(ckpt, model, trainer.optimizer, trainer.embedding_updates)
        return trainer


__all__ = [
    "Callback",
    "EvalData",
    "FitReport",
    "OptimizerKind",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainingDiverged",
]
