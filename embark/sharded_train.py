"""Sharded data-parallel training of a DLRM: embedding tables held by a
:class:`~embark.sharding.ShardedEmbeddingCollection` per a :class:`~embark.types.ShardingPlan`,
the dense part replicated on every rank.

N ranks, each training on its slice of a global batch of ``B`` samples, take the same steps as
the single-process :class:`~embark.training.trainer.Trainer` on the whole global batch (up to the order
of float sums)::

    rank r:  local batch (B_r samples, Σ_r B_r = B)
       sparse ──ShardedEmbeddingCollection──▶ {table: (B_r, dim)}  (keys to owners, vectors back)
       dense  ──dense part (replica)─────────▶ logits (B_r,)
       loss_r = Σ_{local samples} BCE-with-logits / B             (B = GLOBAL batch size)
       backward: shard gradients arrive through the (differentiable) exchanges
       reduce_dp_gradients()          DP table replicas: SUM over ranks
       dense gradients + loss_r       one SUM all-reduce
       optimizer step                 same optimizer, same options as the Trainer

Gradient convention. Each rank's loss is its *share of the global loss*: ``Σ_r loss_r`` is
the single-process mean loss over the global batch. Every parameter must then hold the
gradient of ``Σ_r loss_r``: shard gradients already do (each rank's loss sends its part back
through the exchanges), DP replicas and the dense part get it by a SUM all-reduce. An AVERAGE
all-reduce (DDP's default, which pairs with a per-rank *mean* loss) would make the dense and
DP gradients ``world`` times smaller than the sharded tables'. Uneven local batches are
exact under this convention; a per-rank mean would weigh their samples unequally.

Optimizers. SGD (with momentum) and Adagrad are elementwise, so a shard stepped by itself
equals the same slice of the full table stepped whole; the optimizer state of a shard (e.g.
Adagrad's ``sum``) is the matching slice of the full table's state. The dense replicas get
bit-identical gradients (the all-reduce gives every rank the same sum) and therefore stay
bit-identical.

Command line (gloo on CPU; rank 0 prints the loss, the eval AUC and writes ``--out``)::

    torchrun --nproc-per-node 2 -m embark.sharded_train --workload tiny --steps 50 \\
        [--plan plan.json]        # a plan, or `python -m embark.plan --out` output; none = plan
                                  # here with the greedy planner for one cpu-local node
        [--checkpoint-dir ckpt [--checkpoint-every N]]   # rank 0 writes it at the end (and
                                  # every N steps), atomically, in the Trainer's format
        [--resume ckpt]           # continue a checkpoint of any world size, or of the
                                  # single-process Trainer (`python -m recipes.train_dlrm`)
    python -m embark.sharded_train --help   # every knob with its default

Every rank generates the same global batches (:class:`~embark.data.SyntheticCTR`) and trains
on its :func:`local_batch`. (Generating only the slice would not be the same data: a label is
drawn against the teacher's logit from a forward over the whole batch, and a forward over a
slice can differ in the last bit.) A plan for another world size exits with status 2 on every rank.

Resuming. ``--steps`` is the TOTAL number of steps (as the recipe's and the Trainer's
``total - t.step`` example): a checkpoint at step ``k`` trains ``--steps - k`` more steps on
global batches ``k, k+1, ...`` (batch ``i`` at step ``i + 1``, as an uninterrupted run), so
the weights end as an uninterrupted ``--steps``-step run's, up to float sums (on another world
size). The seed, optimizer, learning rates and global batch size are the checkpoint's (giving
a different one is an error: another ``--batch-size`` would be another data stream, batch
``k`` of it not the samples an uninterrupted run trains on next). A checkpoint written before
checkpoints recorded the batch size resumes with ``--batch-size`` (default 512), with a
warning. A missing or corrupt checkpoint, one of another workload (or ``--scale``) or one past
``--steps`` exits with status 2 on every rank, naming the path.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from embark.data.batch import Batch
from embark.data.jagged import JaggedBatch
from embark.data.synthetic import SyntheticCTR
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import PRESETS as WORKLOADS
from embark.models.workloads import Workload, get_workload
from embark.plan import float_at_least, int_at_least
from embark.planner import PlannerError, plan_sharding
from embark.planner.planner import STRATEGIES
from embark.sharding import ShardedEmbeddingCollection
from embark.sharding.comm import distributed_world
from embark.topology import get_topology
from embark.training.metrics import auc, log_loss
from embark.training.trainer import (
    Callback,
    OptimizerKind,
    TrainConfig,
    admit_batch,
    build_optimizer,
)
from embark.types import CommDtype, PlanError, ShardingPlan

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ data
def local_range(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s contiguous slice of a global batch: sizes differ
    by at most one (``batch_size = 10, world 4`` → ``[0:2], [2:5], [5:7], [7:10]``)."""
    return batch_size * rank // world_size, batch_size * (rank + 1) // world_size


def slice_batch(batch: Batch, start: int, end: int) -> Batch:
    """Samples ``start:end`` of ``batch`` (dense rows, labels and every key's bags).

    Raises:
        ValueError: when ``0 <= start <= end <= batch.batch_size`` does not hold.
    """
    b = batch.batch_size
    if not 0 <= start <= end <= b:
        raise ValueError(f"slice {start}:{end} is outside a batch of {b} samples")
    sp = batch.sparse
    per_key = {}
    for k in sp.keys:
        values, lengths = sp.values_for(k), sp.lengths_for(k)
        off = sp.bag_offsets(k)
        lo = int(off[start]) if start < b else values.numel()
        hi = int(off[end]) if end < b else values.numel()
        per_key[k] = (values[lo:hi], lengths[start:end])
    return Batch(batch.dense[start:end], JaggedBatch.from_per_key(per_key), batch.labels[start:end])


def local_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's slice of a global batch (:func:`local_range`)."""
    return slice_batch(batch, *local_range(batch.batch_size, rank, world_size))


# ----------------------------------------------------------------------- collectives
def _group_src(group: Any | None) -> int:
    """Global rank of the group's rank 0 (``broadcast`` takes global ranks)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _is_distributed(group: Any | None) -> bool:
    return distributed_world(group) is not None


def _gather_1d(x: torch.Tensor, group: Any | None) -> torch.Tensor:
    """Concatenate every rank's ``(n_r,)`` tensor in rank order, on every rank (gloo's
    all_gather needs equal sizes: pad to the largest, then cut)."""
    if not _is_distributed(group):
        return x
    world = dist.get_world_size(group)
    n = torch.tensor([x.numel()])
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    most = int(max(int(s) for s in sizes))
    padded = torch.cat([x, x.new_zeros(most - x.numel())])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])


# ----------------------------------------------------------------------------- model
class ShardedDLRM(nn.Module):
    """A :class:`~embark.models.dlrm.DLRM` whose tables are sharded per ``plan`` and whose dense part
    (projections, bottom MLP, interaction, top MLP) is a replica on every rank.

    Args:
        model: the single-process model to start from (every rank passes an equal one, e.g.
            ``build_model(workload, seed)``); it is not modified: its dense part is copied and
            each rank copies its shards of the tables (``load_full_weights``). The dense part
            and the DP replicas are then broadcast from rank 0, so they start bit-identical
            even if the ranks' models were not.
        plan: the sharding plan of ``model.workload``'s tables for this group's world size.
        rank: this process's rank in ``process_group``.
        process_group: ``None``: the default group (a one-rank world without
            ``torch.distributed``).
        comm_dtype: wire dtype of every table, overriding the plan's.

    Attributes:
        embeddings: the :class:`ShardedEmbeddingCollection` (parameters ``embeddings.weights.<table>``).
        dense: the copied DLRM without its tables (``dense.embeddings`` is empty); only its
            :meth:`~embark.models.dlrm.DLRM.dense_forward` is used.

    Raises:
        ValueError: from :class:`ShardedEmbeddingCollection` (world size, rank, tables).
    """

    def __init__(
        self,
        model: DLRM,
        plan: ShardingPlan,
        rank: int,
        process_group: Any | None = None,
        comm_dtype: CommDtype | str | None = None,
    ) -> None:
        super().__init__()
        self.workload = model.workload
        self.table_names = list(model.table_names)
        self.process_group = process_group
        self.embeddings = ShardedEmbeddingCollection(
            model.workload.tables, plan, rank, process_group, comm_dtype=comm_dtype
        )
        self.embeddings.load_full_weights({n: bag.weight for n, bag in model.embeddings.items()})
        tables = model.embeddings
        model.embeddings = nn.ModuleDict()  # deep-copy the dense part only
        try:
            self.dense = copy.deepcopy(model)
        finally:
            model.embeddings = tables
        self.rank, self.world_size = rank, plan.world_size
        self._broadcast_replicas()

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole: the dense part's, then the DP replicas."""
        dp = [self.embeddings.weights[n] for n in self.embeddings.layout.dp_tables]
        return [*self.dense.parameters(), *dp]

    @torch.no_grad()
    def _broadcast_replicas(self) -> None:
        if not _is_distributed(self.process_group):
            return
        params = self.replicated_parameters()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.broadcast(flat, src=_group_src(self.process_group), group=self.process_group)
        for p, piece in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(piece.view_as(p))

    def forward_with_batch_sizes(
        self, dense: torch.Tensor, sparse: JaggedBatch
    ) -> tuple[torch.Tensor, list[int]]:
        """Like :meth:`forward`, also returning every rank's local batch size (learnt in the
        collection's header exchange: no extra collective)."""
        if dense.dim() != 2 or dense.shape[1] != self.workload.dense_features:
            raise ValueError(
                f"dense must be (B, {self.workload.dense_features}), got {tuple(dense.shape)}"
            )
        if sparse.batch_size != dense.shape[0]:
            raise ValueError(
                f"dense has batch {dense.shape[0]} but sparse has batch {sparse.batch_size}"
            )
        inp = self.embeddings.distribute_input(sparse)
        pooled = self.embeddings.compute(inp)
        logits = self.dense.dense_forward(dense, [pooled[n] for n in self.table_names])
        return logits, list(inp.batch_sizes)

    def forward(self, dense: torch.Tensor, sparse: JaggedBatch) -> torch.Tensor:
        """``dense: (B_r, D) float32`` and ``sparse`` (``B_r`` samples) of this rank's local
        batch → ``(B_r,) float32`` logits (a collective: every rank calls it, in step)."""
        return self.forward_with_batch_sizes(dense, sparse)[0]

    @torch.no_grad()
    def reduce_dense_gradients(self, extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """SUM all-reduce of the dense part's gradients (a collective; after ``backward``).

        Args:
            extra: a small float32 tensor summed in the same all-reduce (e.g. the local loss).

        Returns:
            ``extra`` summed over the ranks (``None`` when not given).
        """
        params = list(self.dense.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        pieces = [g.reshape(-1) for g in grads]
        if extra is not None:
            pieces.append(extra.detach().reshape(-1).float())
        flat = torch.cat(pieces)
        if _is_distributed(self.process_group):
            dist.all_reduce(flat, group=self.process_group)
        sizes = [p.numel() for p in params] + ([extra.numel()] if extra is not None else [])
        parts = flat.split(sizes)
        for p, piece in zip(params, parts):
            p.grad = piece.view_as(p).clone()
        return parts[-1].view_as(extra) if extra is not None else None

    def full_state_dict(self, dst: int | None = 0) -> dict[str, torch.Tensor]:
        """The single-process :class:`~embark.models.dlrm.DLRM` ``state_dict`` (names as there:
        ``embeddings.<table>.weight`` gathered whole, then the dense part), on ``dst`` (``None``:
        every rank); ``{}`` elsewhere. A collective."""
        tables = self.embeddings.full_weights(dst=dst)
        if not tables:
            return {}
        out = {f"embeddings.{n}.weight": w for n, w in tables.items()}
        dense = {k: v.detach().clone() for k, v in self.dense.state_dict().items()}
        return {**out, **dense}


# --------------------------------------------------------------------------- trainer
class ShardedTrainer:
    """Train a :class:`ShardedDLRM` with the single-process :class:`~embark.training.trainer.Trainer`'s
    optimizer semantics (see the module docstring for the gradient convention).

    Every rank calls every method in step, each with its own local batch.

    Args:
        model: the sharded model.
        cfg: hyper-parameters (``eval_every`` / ``checkpoint_*`` are used by the CLI).
        callbacks: :class:`~embark.training.trainer.Callback` hooks, called on every rank with this
            trainer (gradients are already reduced in ``on_after_backward``).

    Attributes:
        step: optimizer steps taken.
        batch_size: the GLOBAL batch of the first step (as the Trainer's ``batch_size``;
            saved in checkpoints); ``None`` before it. A larger global batch is an error.
        data_stream: what else fixes the data stream (as the Trainer's; saved in checkpoints).
        generator: seeded by ``cfg.seed`` (as the Trainer's; saved in checkpoints).
        history: evaluation records.
    """

    def __init__(
        self, model: ShardedDLRM, cfg: TrainConfig, callbacks: Iterable[Callback] = ()
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.callbacks: list[Callback] = list(callbacks)
        self.step = 0
        self.batch_size: int | None = None
        self._batch_size_provisional = (
            False  # as the Trainer's: see embark.training.trainer.admit_batch
        )
        self.data_stream: dict[str, Any] | None = None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict[str, float]] = []
        emb = [p for p in model.embeddings.parameters() if p.requires_grad]
        dense = [p for p in model.dense.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, emb, dense)

    def train_step(self, batch: Batch) -> float:
        """One optimizer step on this rank's local ``batch`` (a collective).

        Returns:
            the global batch's mean loss (equal on every rank).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        logits, sizes = self.model.forward_with_batch_sizes(batch.dense, batch.sparse)
        total = sum(sizes)
        if total == 0:
            raise ValueError("train_step: the global batch is empty on every rank")
        admit_batch(self, total, "a global batch")  # equal on every rank
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / total
        loss.backward()
        for p in self.model.embeddings.parameters():
            if p.grad is None:  # keep every parameter's optimizer state in lockstep (as the
                p.grad = torch.zeros_like(p)  # Trainer's EmbeddingBags, which always get one)
        self.model.embeddings.reduce_dp_gradients()
        global_loss = self.model.reduce_dense_gradients(extra=loss.detach().reshape(1))
        assert global_loss is not None
        step = self.step + 1
        for cb in self.callbacks:
            cb.on_after_backward(self, step)  # type: ignore[arg-type]
        self.optimizer.step()
        self.step = step
        if self.batch_size is None:
            self.batch_size = total
        value = float(global_loss)
        for cb in self.callbacks:
            cb.on_step_end(self, step, value)  # type: ignore[arg-type]
        return value

    @torch.no_grad()
    def predict(self, batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (N,), labels (N,))`` of every rank's local ``batches`` concatenated in
        rank order, on every rank (each rank must pass the same number of batches)."""
        was_training = self.model.training
        self.model.eval()
        try:
            logits, labels = [], []
            for b in batches:
                logits.append(self.model(b.dense, b.sparse).float())
                labels.append(b.labels.float())
        finally:
            self.model.train(was_training)
        if not logits:
            raise ValueError("evaluate: no batches")
        group = self.model.process_group
        return _gather_1d(torch.cat(logits), group), _gather_1d(torch.cat(labels), group)

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        """``{"step", "auc", "logloss", "num_samples", "positive_rate"}`` over every rank's
        local ``batches`` (a collective; the same on every rank)."""
        logits, labels = self.predict(batches)
        return {
            "step": self.step,
            "auc": auc(logits, labels),
            "logloss": log_loss(logits, labels, from_logits=True),
            "num_samples": int(labels.numel()),
            "positive_rate": float(labels.mean()),
        }


# ------------------------------------------------------------------------------- CLI
DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "embedding_lr": 0.1,
    "seed": 0,
    "batch_size": 512,
}  # without --resume


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m embark.sharded_train",
        description="Sharded data-parallel DLRM training on synthetic teacher data (gloo, CPU).",
    )
    p.add_argument("--workload", default="tiny", choices=WORKLOADS)
    p.add_argument(
        "--scale",
        type=float_at_least(1.0),
        default=1.0,
        help="divide every table's rows by this (>= 1)",
    )
    p.add_argument("--steps", type=int_at_least(0), default=50)
    p.add_argument(
        "--batch-size",
        type=int_at_least(1),
        default=None,
        help=f"GLOBAL batch, all ranks (default {DEFAULTS['batch_size']}; --resume: the checkpoint's)",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="plan JSON (a plan, or `python -m embark.plan --out` output); none = plan here",
    )
    p.add_argument(
        "--strategy", default="auto", choices=STRATEGIES, help="planner strategy without --plan"
    )
    p.add_argument(
        "--optimizer",
        default=None,
        choices=[o.value for o in OptimizerKind],
        help="none = the workload's choice",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate of the dense part (default {DEFAULTS['lr']}; --resume: the checkpoint's)",
    )
    p.add_argument(
        "--embedding-lr",
        type=float,
        default=None,
        help=f"learning rate of the tables (default {DEFAULTS['embedding_lr']}; --resume: the checkpoint's)",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0),
        default=None,
        help="model, data and teacher seed (default 0; --resume: the checkpoint's)",
    )
    p.add_argument(
        "--ragged",
        action="store_true",
        default=None,
        help="variable bag sizes 0..2*hotness (default: fixed hotness; --resume: the checkpoint's)",
    )
    p.add_argument(
        "--label-sharpness",
        type=float,
        default=None,
        help="teacher logit scale, > 0 (default 2.0; --resume: the checkpoint's)",
    )
    p.add_argument(
        "--eval-batches", type=int_at_least(1), default=8, help="held-out global batches"
    )
    p.add_argument(
        "--log-every", type=int_at_least(1), default=10, help="print the loss every N steps"
    )
    p.add_argument("--out", default=None, help="rank 0 writes the results JSON here")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="rank 0 writes the final checkpoint here (replaced atomically)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int_at_least(0),
        default=0,
        help="also checkpoint every N steps (0 = only at the end); needs --checkpoint-dir",
    )
    p.add_argument(
        "--resume",
        default=None,
        help="continue this checkpoint (any world size, or the single-process Trainer's) "
        "to --steps TOTAL steps",
    )
    return p.parse_args(argv)


def resolve_plan(
    args: argparse.Namespace, workload: Workload, world_size: int, batch_size: int
) -> ShardingPlan:
    """The plan of ``--plan`` (checked against the world and the workload), or one made by the
    planner for ``world_size`` ranks on one ``cpu-local`` node at global ``batch_size``.

    Raises:
        ValueError: naming the file, for a plan whose world size is not ``world_size``, or
            one that does not place exactly the workload's tables.
    """
    if args.plan is None:
        topology = replace(get_topology("cpu-local"), gpus_per_node=world_size)
        return plan_sharding(workload, topology, batch_size, args.strategy)
    try:
        doc = json.loads(Path(args.plan).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--plan {args.plan!r} cannot be read as JSON: {e}") from None
    if isinstance(doc, dict) and isinstance(doc.get("plan"), dict):
        doc = doc["plan"]  # the document `python -m embark.plan --out` writes
    plan = ShardingPlan.from_dict(doc)
    if plan.world_size != world_size:
        raise ValueError(
            f"--plan {args.plan!r} is for world size {plan.world_size} but this run has "
            f"{world_size} rank(s): start it with `torchrun --nproc-per-node {plan.world_size}` "
            f"or plan for {world_size} rank(s)"
        )
    plan.check_tables(workload.tables)
    return plan


def run(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    """Train and evaluate (every rank); returns the results (equal on every rank)."""
    from embark.sharded_checkpoint import (
        check_checkpoint_dir,
        from_single_process,
        load_resume,
        save_sharded_checkpoint,
    )

    workload = get_workload(args.workload)
    if args.scale > 1:
        workload = workload.scaled(args.scale)
    single = load_resume(args, workload) if args.resume is not None else None
    batch_size = (
        args.batch_size or (single.batch_size if single else None) or DEFAULTS["batch_size"]
    )
    if single is not None and single.batch_size is None and rank == 0:
        log.warning(
            "--resume %r records no batch size (written before checkpoints did): "
            "resuming with --batch-size %d; it must be the one it was trained with",
            args.resume,
            batch_size,
        )
    if batch_size < world_size:
        what = (
            "--batch-size"
            if args.batch_size
            else "the checkpoint's batch size"
            if single is not None and single.batch_size
            else "the default batch size"
        )
        raise ValueError(f"{what} {batch_size} is smaller than the world size {world_size}")
    plan = resolve_plan(args, workload, world_size, batch_size)
    check_checkpoint_dir(args)

    if single is not None:
        trainer = from_single_process(single, plan, rank)
        if trainer.batch_size is None:  # an older checkpoint: the given one
            trainer.batch_size, trainer._batch_size_provisional = batch_size, False
    else:
        seed = DEFAULTS["seed"] if args.seed is None else args.seed
        cfg = TrainConfig(
            lr=DEFAULTS["lr"] if args.lr is None else args.lr,
            embedding_lr=DEFAULTS["embedding_lr"]
            if args.embedding_lr is None
            else args.embedding_lr,
            seed=seed,
            optimizer=args.optimizer or workload.optimizer,
        )
        trainer = ShardedTrainer(ShardedDLRM(build_model(workload, seed=seed), plan, rank), cfg)
    cfg = trainer.cfg
    if single is not None and single.data_stream is not None:
        data = SyntheticCTR.from_stream_config(workload, batch_size, cfg.seed, single.data_stream)
    else:
        if single is not None and rank == 0:
            log.warning(
                "--resume %r records no data stream (written before checkpoints did): "
                "resuming on --ragged %s --label-sharpness %g; they must be the ones it "
                "was trained with",
                args.resume,
                bool(args.ragged),
                args.label_sharpness or 2.0,
            )
        data = SyntheticCTR(
            workload,
            batch_size,
            seed=cfg.seed,
            ragged=bool(args.ragged),
            label_sharpness=2.0 if args.label_sharpness is None else args.label_sharpness,
        )
    trainer.data_stream = data.stream_config()
    start, saved_at, save_seconds = trainer.step, None, 0.0

    def save() -> None:
        nonlocal saved_at, save_seconds
        t = time.perf_counter()
        save_sharded_checkpoint(trainer, args.checkpoint_dir)  # a collective; rank 0 writes
        saved_at, save_seconds = trainer.step, save_seconds + time.perf_counter() - t

    t0 = time.perf_counter()
    losses = []
    for batch in data.batches(args.steps - start, start=start):  # batch i → step i + 1
        losses.append(trainer.train_step(local_batch(batch, rank, world_size)))
        if rank == 0 and (trainer.step % args.log_every == 0 or trainer.step == args.steps):
            print(f"step {trainer.step:>6}  loss {losses[-1]:.4f}", flush=True)
        if args.checkpoint_every and trainer.step % args.checkpoint_every == 0:
            save()
    if args.checkpoint_dir is not None and saved_at != trainer.step:
        save()
    seconds = time.perf_counter() - t0 - save_seconds
    evals = [
        local_batch(b, rank, world_size) for b in data.batches(args.eval_batches, split="eval")
    ]
    metrics = trainer.evaluate(evals)
    samples = len(losses) * batch_size
    return {
        "workload": workload.name,
        "world_size": world_size,
        "steps": trainer.step,
        "start_step": start,
        "resumed_from": args.resume,
        "checkpoint": args.checkpoint_dir,
        "batch_size": batch_size,
        "optimizer": cfg.optimizer.value,
        "final_loss": losses[-1] if losses else None,
        "mean_loss": sum(losses) / len(losses) if losses else None,
        "eval_auc": metrics["auc"],
        "eval_logloss": metrics["logloss"],
        "teacher_auc": data.teacher_auc(args.eval_batches, split="eval"),
        "train_seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "plan": plan.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``torchrun --nproc-per-node N -m embark.sharded_train ...`` (gloo), or plain
    ``python -m embark.sharded_train`` for one rank. Exit status 2 on a bad plan, setting or
    checkpoint, on every rank (each checks the same inputs, so none waits in a collective)."""
    quiet = os.environ.get("RANK", "0") != "0"  # progress and planner logs from rank 0 only
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    args = parse_args(argv)
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        results = run(args, rank, world_size)
    except (PlanError, PlannerError, ValueError) as e:
        if rank == 0:
            log.error("error: %s", e)
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    if rank == 0:
        print(
            f"sharded_train [{results['workload']}, world {world_size}, {results['steps']} steps × "
            f"{results['batch_size']}]  loss {results['final_loss'] or float('nan'):.4f}  eval AUC "
            f"{results['eval_auc']:.4f} (teacher {results['teacher_auc']:.4f})  eval logloss "
            f"{results['eval_logloss']:.4f}  {results['samples_per_s']:,.0f} samples/s"
            + (f"  (resumed at step {results['start_step']})" if args.resume else "")
            + (f"  checkpoint {args.checkpoint_dir}" if args.checkpoint_dir else ""),
            flush=True,
        )
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    if "WORLD_SIZE" in os.environ:
        # A launched rank has finished (process group destroyed, results and checkpoint
        # written, output flushed below): skip the interpreter's teardown, where a gloo thread
        # still joinable at static destruction once aborted a completed run ("terminate called
        # without an active exception", SIGABRT, in CI) and made a finished run look failed.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
