"""Single-process trainer: Adagrad (MLPerf's choice) or SGD, callbacks, evaluation, and
checkpoints that resume bit-identically.

Resuming. All randomness of a run is in the model's initial weights, the data stream and the
trainer's own ``generator`` (for callbacks that need random numbers; the global RNG is never
used). A checkpoint stores weights, optimizer state, the step and the generator state; the
data stream position equals ``trainer.step`` (one batch per step), so

>>> t = Trainer.load_checkpoint(ckpt)                             # doctest: +SKIP
>>> t.fit(data.batches(total - t.step, start=t.step), total - t.step)  # doctest: +SKIP

ends with exactly the weights of an uninterrupted ``total``-step run.

Checkpoint folder layout (no pickle anywhere)::

    <dir>/model.safetensors      model.state_dict(), names as in the model
    <dir>/optimizer.safetensors  "<param name>::<state key>" -> tensor (e.g. "...weight::sum")
    <dir>/state.json             {"format_version", "step", "data_position", "batch_size",
                                  "data_stream", "workload", "train_config", "rng",
                                  "param_groups", "history", "files"}

``batch_size`` is the samples per step of the data stream that ``data_position`` counts
batches of (:attr:`Trainer.batch_size`), and ``data_stream`` what else fixes that stream's
batches (:attr:`Trainer.data_stream`, e.g. :meth:`embark.data.SyntheticCTR.stream_config`),
so a resume can check it is fed the same stream.

``files`` records each tensor file's size and sha256, so a truncated or altered file is a
clear error on load. A save writes into a temporary sibling folder and renames it into place:
an interrupted save never leaves a half-written checkpoint at ``<dir>``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from embark.data.batch import Batch
from embark.models.workloads import Workload
from embark.training.checkpoint_schema import check_state
from embark.training.metrics import auc, log_loss

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1
_MODEL_FILE = "model.safetensors"
_OPTIMIZER_FILE = "optimizer.safetensors"
_STATE_FILE = "state.json"


class OptimizerKind(StrEnum):
    """Optimizers the trainer builds (one for embeddings and dense part, two param groups)."""

    ADAGRAD = "adagrad"
    SGD = "sgd"


@dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters.

    Args:
        lr: learning rate of the dense part (and of the embeddings unless ``embedding_lr``).
        embedding_lr: learning rate of the embedding tables; ``None`` = ``lr``.
        optimizer: ``adagrad`` or ``sgd``.
        momentum: SGD momentum (ignored by Adagrad).
        adagrad_eps: Adagrad's denominator epsilon.
        initial_accumulator_value: Adagrad's starting squared-gradient sum.
        eval_every: evaluate every this many steps during :meth:`Trainer.fit` when eval
            batches are given; 0 = never during fit.
        checkpoint_every: save a checkpoint to ``checkpoint_dir`` every this many steps; 0 = never.
        checkpoint_dir: folder for periodic checkpoints (replaced atomically each time).
        seed: seed of the trainer's generator (for callbacks needing randomness).

    Raises:
        ValueError: naming the field, for out-of-range values.
    """

    lr: float = 0.05
    embedding_lr: float | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAGRAD
    momentum: float = 0.0
    adagrad_eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "optimizer", OptimizerKind(self.optimizer))
        except ValueError:
            raise ValueError(
                f"TrainConfig.optimizer must be one of {[o.value for o in OptimizerKind]}, "
                f"got {self.optimizer!r}"
            ) from None
        for name in ("lr", "adagrad_eps"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"TrainConfig.{name} must be a finite number > 0, got {v!r}")
        if self.embedding_lr is not None and not (
            math.isfinite(self.embedding_lr) and self.embedding_lr > 0
        ):
            raise ValueError(
                f"TrainConfig.embedding_lr must be > 0 or None, got {self.embedding_lr!r}"
            )
        for name in ("momentum", "initial_accumulator_value"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {v!r}")
        for name in ("eval_every", "checkpoint_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 0, got {v!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("TrainConfig.checkpoint_every > 0 needs checkpoint_dir")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["optimizer"] = self.optimizer.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        allowed = {f.name for f in fields(cls)}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"TrainConfig: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        return cls(**d)


class Callback:
    """Hooks into :meth:`Trainer.fit`. Subclass and override what you need; all are no-ops.

    ``step`` is the 1-based number of the optimizer step in progress (``on_after_backward``)
    or just finished (``on_step_end``, ``on_eval``); both see the same number for one step.
    """

    def on_after_backward(self, trainer: Trainer, step: int) -> None:
        """Gradients are present, ``optimizer.step()`` has not run yet (e.g. Taylor scores)."""

    def on_step_end(self, trainer: Trainer, step: int, loss: float) -> None:
        """After the optimizer step (e.g. mask updates); ``loss`` is this batch's mean loss."""

    def on_eval(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """After a periodic evaluation inside :meth:`Trainer.fit`."""


EvalData = Iterable[Batch] | Callable[[], Iterable[Batch]]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def admit_batch(trainer: Any, n: int, what: str) -> None:
    """The data-stream check of :class:`Trainer` and the sharded trainer, before a step on a
    batch of ``n`` samples: a batch larger than ``trainer.batch_size`` is refused, except the
    second batch after resuming a checkpoint that did not record the size
    (``trainer._batch_size_provisional``: the first one, whose size was recorded, may have been
    a file's short last batch), which raises it with a warning. The second batch settles the
    size either way.

    Raises:
        ValueError: naming both sizes, before anything changes.
    """
    if trainer._batch_size_provisional and trainer.batch_size is not None:
        if n > trainer.batch_size:
            log.warning(
                "train_step: %s of %d samples after %d (the first batch after resuming a "
                "checkpoint that did not record the stream's batch size, e.g. a file's short "
                "last batch); the stream's batch size is now %d",
                what,
                n,
                trainer.batch_size,
                n,
            )
            trainer.batch_size = n
        trainer._batch_size_provisional = False
    if trainer.batch_size is not None and n > trainer.batch_size:
        raise ValueError(
            f"train_step: {what} of {n} samples, but this trainer's data stream has "
            f"{trainer.batch_size} per step (recorded at its first step or in its checkpoint); a "
            "resumed run must be fed the stream it was trained on"
        )


def build_optimizer(
    cfg: TrainConfig, embedding_params: Sequence[nn.Parameter], dense_params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """The trainer's optimizer for ``cfg``: param groups ``"embeddings"`` (``embedding_lr or
    lr``) and ``"dense"`` (``lr``), empty ones left out (also used by sharded training).

    Raises:
        ValueError: when both groups are empty.
    """
    groups: list[dict[str, Any]] = []
    if embedding_params:
        groups.append(
            {
                "params": list(embedding_params),
                "name": "embeddings",
                "lr": cfg.embedding_lr or cfg.lr,
            }
        )
    if dense_params:
        groups.append({"params": list(dense_params), "name": "dense", "lr": cfg.lr})
    if not groups:
        raise ValueError("Trainer: the model has no trainable parameters")
    if cfg.optimizer == OptimizerKind.ADAGRAD:
        return torch.optim.Adagrad(
            groups,
            lr=cfg.lr,
            eps=cfg.adagrad_eps,
            initial_accumulator_value=cfg.initial_accumulator_value,
        )
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


class Trainer:
    """Train a model whose ``forward(dense, sparse)`` returns ``(B,)`` logits with binary
    cross-entropy on ``Batch.labels``.

    Args:
        model: typically :class:`embark.models.dlrm.DLRM`; its ``workload`` attribute, when present,
            is written into checkpoints so :meth:`load_checkpoint` can rebuild it.
        cfg: hyper-parameters.
        callbacks: called in order at each hook.

    Attributes:
        step: optimizer steps taken so far (= training batches consumed).
        batch_size: samples per step of the data stream: the first training batch's size
            (a stream's later batches may be shorter, e.g. a file's last), kept through
            checkpoints; ``None`` before the first step, and after loading a checkpoint
            written before it was recorded (until the next step). A training batch larger
            than it is an error (the stream changed under a resumed run), except after such
            a checkpoint: the size recorded then may be a file's short last batch, so a larger
            second batch raises it (with a warning) instead (:func:`admit_batch`).
        data_stream: a JSON-able mapping of what fixes the data stream besides
            ``batch_size`` (set by the caller, e.g. ``data.stream_config()``), kept through
            checkpoints; ``None`` when unknown.
        generator: a ``torch.Generator`` seeded by ``cfg.seed``, saved in checkpoints.
        history: evaluation records ``{"step", "auc", "logloss", ...}`` from :meth:`fit`.
    """

    def __init__(
        self, model: nn.Module, cfg: TrainConfig, callbacks: Iterable[Callback] = ()
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.callbacks: list[Callback] = list(callbacks)
        self.step = 0
        self.batch_size: int | None = None
        # set by load_checkpoint for a checkpoint without batch_size: the size recorded at the
        # next step is a guess (it may be a short last batch), so a larger batch raises it
        self._batch_size_provisional = False
        self.data_stream: dict[str, Any] | None = None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict[str, float]] = []
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.optimizer = self._make_optimizer()

    # --------------------------------------------------------------- optimizer
    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _make_optimizer(self) -> torch.optim.Optimizer:
        emb, dense = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (emb if name.startswith("embeddings.") else dense).append(p)
        return build_optimizer(self.cfg, emb, dense)

    def rebuild_optimizer(self) -> None:
        """Build a new optimizer over the model's current parameters (call after modules were
        replaced or parametrized). State (e.g. Adagrad sums) is kept for every parameter
        tensor still in the model — ``torch.nn.utils.parametrize`` keeps the original tensor
        as ``...parametrizations.weight.original``; new parameters start fresh."""
        old = self.optimizer
        self.optimizer = self._make_optimizer()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p in old.state:
                    self.optimizer.state[p] = old.state[p]

    def add_callback(self, cb: Callback) -> None:
        self.callbacks.append(cb)

    # ---------------------------------------------------------------- training
    def train_step(self, batch: Batch) -> float:
        """One optimizer step on ``batch`` with the callbacks' hooks; returns the loss.

        Raises:
            ValueError: for a batch larger than :attr:`batch_size` (later batches of a stream
                may be shorter, never longer), before anything changes.
        """
        admit_batch(self, batch.batch_size, "a batch")
        self.model.train()
        batch = batch.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(batch.dense, batch.sparse)
        loss = self.loss_fn(logits, batch.labels)
        loss.backward()
        step = self.step + 1
        for cb in self.callbacks:
            cb.on_after_backward(self, step)
        self.optimizer.step()
        self.step = step
        if self.batch_size is None:
            self.batch_size = batch.batch_size
        value = float(loss.detach())
        for cb in self.callbacks:
            cb.on_step_end(self, step, value)
        return value

    def fit(
        self,
        batches: Iterable[Batch],
        steps: int,
        progress: bool = True,
        eval_batches: EvalData | None = None,
    ) -> dict[str, float]:
        """Run ``steps`` optimizer steps, one batch each, taken from ``batches``.

        Args:
            batches: training batches; at least ``steps`` of them.
            steps: number of steps in this call (not a total: a resumed trainer continues from
                ``self.step``).
            progress: show a tqdm bar.
            eval_batches: for periodic evaluation every ``cfg.eval_every`` steps; a re-iterable
                (e.g. a list) or a zero-argument callable returning an iterable.

        Returns:
            ``{"steps", "samples", "seconds", "samples_per_s", "loss"}`` for this call, ``loss``
            the mean over its steps.

        Raises:
            ValueError: when ``steps < 0`` or ``batches`` runs out first.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        it = iter(batches)
        samples, loss_sum, seconds = 0, 0.0, 0.0
        with tqdm(total=steps, disable=not progress, desc="train", unit="step") as bar:
            for i in range(steps):
                try:
                    batch = next(it)
                except StopIteration:
                    raise ValueError(f"batches ran out after {i} of {steps} steps") from None
                t0 = time.perf_counter()
                loss = self.train_step(batch)
                seconds += time.perf_counter() - t0
                samples += batch.batch_size
                loss_sum += loss
                bar.update(1)
                if i % 20 == 0:
                    bar.set_postfix(loss=f"{loss:.4f}")
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
        return {
            "steps": steps,
            "samples": samples,
            "seconds": seconds,
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            "loss": loss_sum / steps if steps else float("nan"),
        }

    @torch.no_grad()
    def predict(self, batches: EvalData) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (N,) float32, labels (N,) float32)`` over ``batches``, in eval mode."""
        data = batches() if callable(batches) else batches
        was_training = self.model.training
        self.model.eval()
        try:
            logits, labels = [], []
            for b in data:
                b = b.to(self.device)
                logits.append(self.model(b.dense, b.sparse).float().cpu())
                labels.append(b.labels.cpu())
        finally:
            self.model.train(was_training)
        if not logits:
            raise ValueError("evaluate: no batches")
        return torch.cat(logits), torch.cat(labels)

    def evaluate(self, batches: EvalData) -> dict[str, float]:
        """``{"step", "auc", "logloss", "num_samples", "positive_rate"}`` over ``batches``."""
        logits, labels = self.predict(batches)
        return {
            "step": self.step,
            "auc": auc(logits, labels),
            "logloss": log_loss(logits, labels, from_logits=True),
            "num_samples": int(labels.numel()),
            "positive_rate": float(labels.mean()),
        }

    # ------------------------------------------------------------- checkpoints
    def _param_names(self) -> dict[torch.Tensor, str]:
        return {p: n for n, p in self.model.named_parameters()}

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint folder at ``path`` (replacing an older checkpoint there).

        Raises:
            ValueError: when ``path`` exists and is not a checkpoint folder (nothing is touched).
        """
        path = Path(path)
        if path.exists() and (
            not path.is_dir() or (any(path.iterdir()) and not (path / _STATE_FILE).is_file())
        ):
            raise ValueError(
                f"refusing to overwrite {str(path)!r}: it exists and is not a checkpoint folder"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            model_sd = {
                k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()
            }
            save_file(model_sd, tmp / _MODEL_FILE, metadata={"format": "pt"})
            names = self._param_names()
            opt_tensors: dict[str, torch.Tensor] = {}
            opt_scalars: dict[str, Any] = {}
            for p, st in self.optimizer.state.items():
                for k, v in st.items():
                    key = f"{names[p]}::{k}"
                    if isinstance(v, torch.Tensor):
                        opt_tensors[key] = v.detach().cpu().contiguous()
                    else:
                        opt_scalars[key] = v
            save_file(opt_tensors, tmp / _OPTIMIZER_FILE, metadata={"format": "pt"})
            groups = []
            for g in self.optimizer.param_groups:
                groups.append(
                    {k: v for k, v in g.items() if k != "params"}
                    | {"params": [names[p] for p in g["params"]]}
                )
            workload = getattr(self.model, "workload", None)
            state = {
                "format_version": CHECKPOINT_FORMAT_VERSION,
                "step": self.step,
                "data_position": self.step,
                # still a guess after an older checkpoint (maybe a short last batch): not recorded
                "batch_size": None if self._batch_size_provisional else self.batch_size,
                "data_stream": self.data_stream,
                "workload": workload.to_dict() if isinstance(workload, Workload) else None,
                "train_config": self.cfg.to_dict(),
                "rng": {"trainer_generator": self.generator.get_state().numpy().tobytes().hex()},
                "optimizer": type(self.optimizer).__name__,
                "optimizer_scalars": opt_scalars,
                "param_groups": groups,
                "history": self.history,
                "torch_version": torch.__version__,
                "files": {
                    f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
                    for f in (_MODEL_FILE, _OPTIMIZER_FILE)
                },
            }
            with open(tmp / _STATE_FILE, "w") as fh:
                json.dump(state, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(tmp)
            if path.exists():
                old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
                path.rename(old)
                tmp.rename(path)
                shutil.rmtree(old)
            else:
                tmp.rename(path)
            _fsync_dir(path.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("saved checkpoint at step %d to %s", self.step, path)
        return path

    @staticmethod
    def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
        """``state.json`` of a checkpoint, after checking its schema (every field's presence
        and type, see :mod:`embark.training.checkpoint_schema`) and every tensor file's size and hash.

        Raises:
            ValueError: naming the file (and the field), for a missing, truncated or altered
                checkpoint file or a ``state.json`` that breaks the schema.
        """
        path = Path(path)
        sp = path / _STATE_FILE
        if not sp.is_file():
            raise ValueError(f"{str(path)!r} is not a checkpoint folder: {_STATE_FILE} is missing")
        try:
            state = json.loads(sp.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"checkpoint file {str(sp)!r} is corrupt or truncated: {err}") from err
        check_state(state, sp, CHECKPOINT_FORMAT_VERSION)
        for name, info in state["files"].items():
            fp = path / name
            if not fp.is_file():
                raise ValueError(f"checkpoint file {str(fp)!r} is missing")
            size = fp.stat().st_size
            if size != info["bytes"]:
                raise ValueError(
                    f"checkpoint file {str(fp)!r} is {size} bytes but {info['bytes']} were written "
                    f"(truncated or replaced)"
                )
            if _sha256(fp) != info["sha256"]:
                raise ValueError(f"checkpoint file {str(fp)!r} does not match its recorded sha256")
        return state

    @staticmethod
    def _load_tensors(fp: Path) -> dict[str, torch.Tensor]:
        try:
            return load_file(fp)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"checkpoint file {str(fp)!r} cannot be read: {err}") from err

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
            ValueError: for a missing, truncated or altered file, a ``state.json`` that breaks
                the schema (naming the file and field), or a model whose state-dict names,
                shapes or dtypes differ from the checkpoint's. Everything is checked before
                ``model`` is written: it is left untouched when an error is raised.
        """
        path = Path(path)
        sp = path / _STATE_FILE
        state = cls.read_state(path)
        tensors = cls._load_tensors(path / _MODEL_FILE)
        opt_tensors = cls._load_tensors(path / _OPTIMIZER_FILE)
        for key in opt_tensors:
            if key.count("::") != 1:
                raise ValueError(
                    f"checkpoint file {str(path / _OPTIMIZER_FILE)!r}: tensor {key!r} is not "
                    f"named '<param name>::<state key>'"
                )
        try:
            cfg = TrainConfig.from_dict(state["train_config"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"checkpoint file {str(sp)!r}: train_config: {err}") from None
        if model is None:
            if state["workload"] is None:
                raise ValueError(f"checkpoint {str(path)!r} stores no workload: pass model=")
            try:
                workload = Workload.from_dict(state["workload"])
            except ValueError as err:
                raise ValueError(f"checkpoint file {str(sp)!r}: workload: {err}") from None
            from embark.models.dlrm import build_model

            model = build_model(workload)
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {str(path)!r} does not fit the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for k, v in own.items():
            if v.shape != tensors[k].shape or v.dtype != tensors[k].dtype:
                raise ValueError(
                    f"checkpoint tensor {k!r} is {tuple(tensors[k].shape)} {tensors[k].dtype}, "
                    f"the model has {tuple(v.shape)} {v.dtype}"
                )
        trainer = cls(model, cfg, callbacks)
        names = {n: p for p, n in trainer._param_names().items()}
        saved_groups = state["param_groups"]
        if [g["params"] for g in saved_groups] != [
            [trainer._param_names()[p] for p in g["params"]] for g in trainer.optimizer.param_groups
        ]:
            raise ValueError(
                f"checkpoint {str(path)!r}: optimizer parameter groups do not match the model"
            )
        for i, (g, saved) in enumerate(zip(trainer.optimizer.param_groups, saved_groups)):
            extra = sorted(set(saved) - set(g))
            if extra:
                raise ValueError(
                    f"checkpoint file {str(sp)!r}: param_groups[{i}] has unknown option(s) "
                    f"{extra}; {type(trainer.optimizer).__name__} has {sorted(set(g) - {'params'})}"
                )
        stray = sorted(
            {k.split("::")[0] for k in [*opt_tensors, *state["optimizer_scalars"]]} - set(names)
        )
        if stray:
            raise ValueError(
                f"checkpoint {str(path)!r}: optimizer state for unknown parameters {stray[:5]}"
            )
        for key, v in opt_tensors.items():  # per-parameter state: a scalar or the parameter's shape
            p = names[key.split("::")[0]]
            if v.dim() and (v.shape != p.shape or v.dtype != p.dtype):
                raise ValueError(
                    f"checkpoint file {str(path / _OPTIMIZER_FILE)!r}: optimizer state {key!r} is "
                    f"{tuple(v.shape)} {v.dtype}, its parameter is {tuple(p.shape)} {p.dtype}"
                )
        # Everything is checked: only now touch the model (and the new optimizer).
        model.load_state_dict(tensors, strict=True)
        for g, saved in zip(trainer.optimizer.param_groups, saved_groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for key, v in opt_tensors.items():
            pname, skey = key.split("::")
            trainer.optimizer.state[names[pname]][skey] = v.to(names[pname].device)
        for key, v in state["optimizer_scalars"].items():
            pname, skey = key.split("::")
            trainer.optimizer.state[names[pname]][skey] = v
        gen_state = bytes.fromhex(state["rng"]["trainer_generator"])
        trainer.generator.set_state(torch.frombuffer(bytearray(gen_state), dtype=torch.uint8))
        trainer.step = state["step"]
        trainer.batch_size = state.get("batch_size")  # absent: written before it was recorded
        trainer._batch_size_provisional = trainer.batch_size is None
        trainer.data_stream = state.get("data_stream")
        trainer.history = list(state["history"])
        return trainer
