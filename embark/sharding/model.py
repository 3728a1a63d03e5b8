"""The sharded DLRM: embedding tables held by a
:class:`~embark.sharding.collection.ShardedEmbeddingCollection` per a
:class:`~embark.types.ShardingPlan`, the dense part replicated on every rank, and the
:class:`ShardedSync` that lets the one :class:`~embark.training.trainer.Trainer` train it.

N ranks, each training on its slice of a global batch of ``B`` samples
(:func:`embark.data.batch.local_batch`), take the same steps as one process on the whole
global batch (up to the order of float sums)::

    rank r:  local batch (B_r samples, Σ_r B_r = B)
       sparse ──ShardedEmbeddingCollection──▶ {table: (B_r, dim)}  (keys to owners, vectors back)
       dense  ──dense part (replica)─────────▶ logits (B_r,)
       loss_r = Σ_{local samples} BCE-with-logits / B             (B = GLOBAL batch size)
       backward: shard gradients arrive through the (differentiable) exchanges; the SUM
                 all-reduce of the dense part's and the fp32 DP replicas' gradients starts
                 bucket by bucket as they complete (embark.sharding.grad_buckets)
       reduce_dp_gradients()          16-bit-wire DP replicas: SUM over ranks
       replicated gradients           wait for the buckets' all-reduces
       optimizer step                 same optimizer, same options as one process

Gradient convention. Each rank's loss is its *share of the global loss*: ``Σ_r loss_r`` is
the single-process mean loss over the global batch (``B`` is learnt in the collection's
header exchange, no extra collective). Every parameter must then hold the gradient of
``Σ_r loss_r``: shard gradients already do (each rank's loss sends its part back through the
exchanges), DP replicas and the dense part get it by a SUM all-reduce. An AVERAGE all-reduce
(DDP's default, which pairs with a per-rank *mean* loss) would make the dense and DP
gradients ``world`` times smaller than the sharded tables'. Uneven local batches are exact
under this convention; a per-rank mean would weigh their samples unequally.

Optimizers. SGD (with momentum) and Adagrad are elementwise, so a shard stepped by itself
equals the same slice of the full table stepped whole; the optimizer state of a shard (e.g.
Adagrad's ``sum``) is the matching slice of the full table's state. The dense replicas get
bit-identical gradients (the all-reduce gives every rank the same sum) and therefore stay
bit-identical. Every embedding parameter gets a gradient on every step (zeros when its rank
looked nothing up), as a single-process ``nn.EmbeddingBag`` always does, so optimizer state
stays in lockstep over parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from embark.data.batch import Batch
from embark.data.hotness import enforce_hotness
from embark.data.jagged import JaggedBatch
from embark.models.dlrm import DLRM, build_dense_part, uniform_block_
from embark.models.tables import EmbeddingTables, TableModel
from embark.models.workloads import Workload
from embark.sharding.collection import ShardedEmbeddingCollection
from embark.sharding.comm import distributed_world, grad_wire
from embark.sharding.grad_buckets import GradBuckets
from embark.sharding.node_allreduce import HierarchicalAllReduce, NodeRailGroups
from embark.sharding.phases import Phase, PhaseClock
from embark.sharding.prefetch import InputPrefetcher
from embark.types import CommDtype, GradReduce, ShardingPlan


def group_src(group: Any | None) -> int:
    """Global rank of the group's rank 0 (``broadcast`` takes global ranks)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def is_distributed(group: Any | None) -> bool:
    """Whether ``group`` (``None``: the default group) is a real process group."""
    return distributed_world(group) is not None


def gather_1d(x: torch.Tensor, group: Any | None) -> torch.Tensor:
    """Concatenate every rank's ``(n_r,)`` tensor in rank order, on every rank (gloo's
    all_gather needs equal sizes: pad to the largest, then cut)."""
    if not is_distributed(group):
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


# The replicated parameters are broadcast in pieces of at most this many bytes (16 MiB): few
# collectives for the many small dense weights, little memory beyond the model for large ones.
BROADCAST_BUCKET_BYTES = 16 << 20


def _buckets(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into runs of at most ``limit`` bytes (a larger one alone)."""
    out: list[list[nn.Parameter]] = []
    size = limit
    for p in params:
        if size + p.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


class ShardedDLRM(TableModel):
    """A :class:`~embark.models.dlrm.DLRM` whose tables are sharded per ``plan`` and whose
    dense part (projections, bottom MLP, interaction, top MLP) is a replica on every rank.

    Two ways to make one:

    * :meth:`build` (``ShardedDLRM.build(workload, plan, rank, seed=s)``): each rank allocates
      only its shards, its DP replicas and the dense part, with exactly the values
      ``build_model(workload, s)`` gives them; ``seed=None`` leaves them to a checkpoint.
      Memory is flat in the size of the tables a rank does not hold.
    * ``ShardedDLRM(model, plan, rank)``: from a whole single-process model (e.g. a trained
      one); every rank holds ``model`` whole while it copies its shards out.

    Args:
        model: the single-process model to start from (every rank passes an equal one); it is
            not modified: its dense part is copied and each rank copies its shards of the
            tables (``load_full_weights``). The dense part and the DP replicas are then
            broadcast from rank 0, so they start bit-identical even if the ranks' models were
            not.
        plan: the sharding plan of ``model.workload``'s tables for this group's world size.
        rank: this process's rank in ``process_group``.
        process_group: ``None``: the default group (a one-rank world without
            ``torch.distributed``).
        comm_dtype: wire dtype of every table, overriding the plan's.

    Attributes:
        embeddings: the :class:`ShardedEmbeddingCollection` (parameters
            ``embeddings.weights.<table>``).
        dense: the DLRM without its tables (``dense.embeddings`` is empty); only its
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
        embeddings = ShardedEmbeddingCollection(
            model.workload.tables, plan, rank, process_group, comm_dtype=comm_dtype, seed=None
        )
        embeddings.load_full_weights(
            {n: model.embeddings[n].get_parameter("weight") for n in model.table_names}
        )
        tables = model.embeddings
        model.embeddings = EmbeddingTables(())  # deep-copy the dense part only
        try:
            dense = copy.deepcopy(model)
        finally:
            model.embeddings = tables
        self._attach(model.workload, embeddings, dense)

    @classmethod
    def build(
        cls,
        workload: Workload,
        plan: ShardingPlan,
        rank: int,
        process_group: Any | None = None,
        comm_dtype: CommDtype | str | None = None,
        seed: int | None = 0,
    ) -> ShardedDLRM:
        """The sharded model of ``workload`` built on this rank alone, without any table
        this rank does not hold (a collective: the replicas are broadcast from rank 0).

        Args:
            workload, plan, rank, process_group, comm_dtype: as for the constructor.
            seed: the values are ``build_model(workload, seed)``'s, bit for bit: each table's
                draw is replayed block by block (:func:`~embark.models.dlrm.uniform_block_`),
                keeping this rank's shard, so a rank spends the time of drawing every table
                but holds only its shards plus 4 MiB of scratch. ``None``: no draw; tables
                are zeros and the dense part holds placeholder values, for a checkpoint to
                overwrite (:func:`~embark.sharding.load_sharded_checkpoint`).

        Raises:
            ValueError: from :class:`ShardedEmbeddingCollection` (world size, rank, tables).
        """
        embeddings = ShardedEmbeddingCollection(
            workload.tables, plan, rank, process_group, comm_dtype=comm_dtype, seed=None
        )
        fill = None if seed is None else _ShardFill(embeddings)
        dense = build_dense_part(workload, 0 if seed is None else seed, fill)
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._attach(workload, embeddings, dense)
        return model

    def _attach(
        self, workload: Workload, embeddings: ShardedEmbeddingCollection, dense: DLRM
    ) -> None:
        """Set the parts and start the replicas equal (broadcast from rank 0)."""
        self.workload = workload
        self.table_names = [t.name for t in workload.tables]
        self.process_group = embeddings.process_group
        self.embeddings = embeddings
        self.dense = dense
        self.rank, self.world_size = embeddings.rank, embeddings.world_size
        self._dense_group: Any | None = None
        self._rail_groups: NodeRailGroups | None = None
        self._bucketed = False  # set by gradient_buckets: grad_reduce and its size are fixed
        self._grad_reduce = GradReduce.HIERARCHICAL
        self._grad_bucket_bytes: int | None = None
        # set by embark.sharding.pipeline.SparseDistPipeline while it trains
        self.prefetcher: InputPrefetcher | None = None
        self.phase_clock: PhaseClock | None = None  # set_phase_clock (benchmarks)
        self._broadcast_replicas()

    @property
    def grad_reduce(self) -> GradReduce:
        """How the buckets are summed where the world spans several nodes of several ranks
        (one node, or one rank per node: flat); set before the first step."""
        return self._grad_reduce

    @grad_reduce.setter
    def grad_reduce(self, how: GradReduce) -> None:
        self._check_unbucketed("grad_reduce", how)
        self._grad_reduce = GradReduce(how)

    @property
    def grad_bucket_bytes(self) -> int | None:
        """The gradient buckets' size (``None``: :func:`~embark.types.grad_bucket_bytes` of
        the bucketed bytes); set before the first step."""
        return self._grad_bucket_bytes

    @grad_bucket_bytes.setter
    def grad_bucket_bytes(self, nbytes: int | None) -> None:
        self._check_unbucketed("grad_bucket_bytes", nbytes)
        if nbytes is not None and nbytes < 1:
            raise ValueError(f"ShardedDLRM: grad_bucket_bytes must be >= 1 or None, got {nbytes}")
        self._grad_bucket_bytes = nbytes

    def _check_unbucketed(self, name: str, value: object) -> None:
        if self._bucketed:
            raise RuntimeError(
                f"ShardedDLRM: cannot set {name} to {value!r}: the gradient buckets were made "
                f"by the first step with {getattr(self, name)!r}; set it before training"
            )

    def set_phase_clock(self, clock: PhaseClock | None) -> None:
        """Time each step's phases on ``clock`` (``None``: stop) (:mod:`embark.sharding.phases`)."""
        self.phase_clock = clock
        self.embeddings.phase_clock = clock

    def embedding_store(self) -> ShardedEmbeddingCollection:
        """This rank's tables (:class:`ShardedEmbeddingCollection`)."""
        return self.embeddings

    def embedding_tables(self) -> dict[str, nn.Parameter]:
        """This rank's table pieces (:meth:`ShardedEmbeddingCollection.trainable_weights`)."""
        return self.embeddings.trainable_weights()

    def replicated_tables(self) -> frozenset[str]:
        """The data-parallel tables."""
        return self.embeddings.replicated()

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds whole: the dense part's, then the DP replicas."""
        dp = [self.embeddings.weights[n] for n in self.embeddings.layout.dp_tables]
        return [*self.dense.parameters(), *dp]

    @torch.no_grad()
    def _broadcast_replicas(self) -> None:
        """Rank 0's dense part and DP replicas to every rank, in buckets of at most
        BROADCAST_BUCKET_BYTES (a parameter larger than that alone, in place): one flat copy
        of them all would double their memory while the model is built."""
        if not is_distributed(self.process_group):
            return
        src, group = group_src(self.process_group), self.process_group
        for bucket in _buckets(self.replicated_parameters(), BROADCAST_BUCKET_BYTES):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.broadcast(bucket[0].detach(), src=src, group=group)
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            dist.broadcast(flat, src=src, group=group)
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.copy_(piece.view_as(p))

    def forward_with_batch_sizes(
        self, dense: torch.Tensor, sparse: JaggedBatch
    ) -> tuple[torch.Tensor, list[int]]:
        """Like :meth:`forward`, also returning every rank's local batch size (learnt in the
        collection's header exchange: no extra collective)."""
        sparse = enforce_hotness(sparse, self.workload.tables)
        self.dense.check_inputs(dense, sparse)
        clock = self.phase_clock
        if clock is not None:
            clock.mark(Phase.OTHER)
        pf = self.prefetcher
        inp = pf.take(sparse) if pf is not None else None
        if inp is None:
            inp = self.embeddings.distribute_input(sparse)
        if clock is not None:
            clock.mark(Phase.INPUT_DIST)
        pooled = self.embeddings.compute(inp)
        if pf is not None:
            pf.after_forward()  # the next batch's keys travel during this dense step
        if clock is not None:
            clock.mark(Phase.INPUT_DIST)
            for v in pooled.values():
                if v.requires_grad:
                    v.register_hook(_MarkOnGrad(clock, Phase.DENSE_BWD))
        logits = self.dense.dense_forward(dense, [pooled[n] for n in self.table_names])
        if clock is not None:
            clock.mark(Phase.DENSE_FWD)
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
        if is_distributed(self.process_group):
            dist.all_reduce(flat, group=self.process_group)
        sizes = [p.numel() for p in params] + ([extra.numel()] if extra is not None else [])
        parts = flat.split(sizes)
        for p, piece in zip(params, parts):
            p.grad = piece.view_as(p).clone()
        return parts[-1].view_as(extra) if extra is not None else None

    def bucketed_dp_tables(self) -> frozenset[str]:
        """The DP tables whose gradients travel in :meth:`gradient_buckets`: those summed in
        fp32 (a 16-bit gradient wire keeps :meth:`ShardedEmbeddingCollection.reduce_dp_gradients`)."""
        layout = self.embeddings.layout
        return frozenset(n for n in layout.dp_tables if grad_wire(layout.wire(n)) is CommDtype.FP32)

    def gradient_buckets(self) -> GradBuckets:
        """The dense part's gradients and the :meth:`bucketed_dp_tables` replicas' in
        :class:`~embark.sharding.grad_buckets.GradBuckets` (the replicas first, so their
        gradients, complete early in backward, share the last bucket with the biases).

        With the default process group the buckets travel on process groups of their own
        (created on the first call: a collective of every rank), which carry nothing else,
        so their all-reduces may start from inside ``backward`` while the embedding exchanges'
        backward runs on the default group. There, when the plan spans several nodes of
        several ranks and :attr:`grad_reduce` is ``HIERARCHICAL``, each bucket is summed node
        by node (:mod:`embark.sharding.node_allreduce`: the node uplinks carry ``2 (N-1)/N``
        of the bytes instead of the flat ring's ``2 (W-1)/W``). With another group they start
        after ``backward`` (``overlap=False``), flat: a second group would need every rank of
        the world to create it.
        """
        self._bucketed = True
        overlap = self.process_group is None and is_distributed(None)
        dp = [self.embeddings.weights[n] for n in sorted(self.bucketed_dp_tables())]
        params = [*dp, *self.dense.parameters()]
        if overlap and self.hierarchical_grad_reduce():
            if self._rail_groups is None:
                gpn = self.embeddings.layout.plan.gpus_per_node
                self._rail_groups = NodeRailGroups.create(self.world_size, gpn, self.rank)
            reducer = HierarchicalAllReduce(self._rail_groups)
            return GradBuckets(params, None, True, self.grad_bucket_bytes, hierarchical=reducer)
        if overlap and self._dense_group is None:
            self._dense_group = dist.new_group(list(range(self.world_size)))
        group = self._dense_group if overlap else self.process_group
        return GradBuckets(params, group, overlap, self.grad_bucket_bytes)

    def hierarchical_grad_reduce(self) -> bool:
        """Whether :meth:`gradient_buckets` sums node by node: :attr:`grad_reduce` is
        ``HIERARCHICAL``, the default process group (gloo: see
        :meth:`~embark.sharding.node_allreduce.NodeRailGroups.create`), and a plan of 2+
        nodes of 2+ ranks."""
        gpn = self.embeddings.layout.plan.gpus_per_node
        return (
            self.grad_reduce is GradReduce.HIERARCHICAL
            and self.process_group is None
            and 1 < gpn < self.world_size
            and dist.get_backend() == dist.Backend.GLOO
        )

    def full_state_dict(self, dst: int | None = 0) -> dict[str, torch.Tensor]:
        """The single-process :class:`~embark.models.dlrm.DLRM` ``state_dict`` (names as
        there: ``embeddings.<table>.weight`` gathered whole, then the dense part), on ``dst``
        (``None``: every rank); ``{}`` elsewhere. A collective."""
        tables = self.embeddings.full_weights(dst=dst)
        if not tables:
            return {}
        out = {f"embeddings.{n}.weight": w for n, w in tables.items()}
        dense = {k: v.detach().clone() for k, v in self.dense.state_dict().items()}
        return {**out, **dense}

    def gradient_sync(self) -> ShardedSync:
        """The :class:`~embark.training.sync.GradientSync` a Trainer of this model uses."""
        return ShardedSync(self)


class _ShardFill:
    """A :data:`~embark.models.dlrm.TableFill` drawing each table whole, block by block, into
    this rank's shard or replica of it (nothing kept of a table the rank does not hold)."""

    def __init__(self, embeddings: ShardedEmbeddingCollection) -> None:
        self.embeddings = embeddings
        self.shapes = {t.name: (t.num_rows, t.dim) for t in embeddings.layout.tables}

    @torch.no_grad()
    def __call__(self, table: str, bound: float, generator: torch.Generator) -> None:
        shard = self.embeddings.local_shards.get(table)
        if shard is None:
            uniform_block_(self.shapes[table], bound, generator)
            return
        uniform_block_(
            self.shapes[table],
            bound,
            generator,
            out=self.embeddings.weights[table],
            row_start=shard.row_start,
            col_start=shard.col_start,
        )


class _MarkOnGrad:
    """A gradient hook that marks ``phase`` on ``clock`` (the gradient passes unchanged)."""

    def __init__(self, clock: PhaseClock, phase: Phase) -> None:
        self.clock, self.phase = clock, phase

    def __call__(self, grad: torch.Tensor) -> None:
        self.clock.mark(self.phase)


class ShardedSync:
    """The collective parts of a training step of a :class:`ShardedDLRM` (see the module
    docstring for the gradient convention); a :class:`~embark.training.sync.GradientSync`."""

    batch_scope = "a global batch"

    def __init__(self, model: ShardedDLRM) -> None:
        self.model = model
        self._buckets: GradBuckets | None = None
        self._global_loss: float | None = None

    def loss(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """This rank's share of the global loss, and the global batch size (equal on every
        rank).

        Raises:
            ValueError: when the global batch is empty, or from the forward (on every rank).
        """
        logits, sizes = self.model.forward_with_batch_sizes(batch.dense, batch.sparse)
        total = sum(sizes)
        if total == 0:
            raise ValueError("train_step: the global batch is empty on every rank")
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / total
        return loss, total

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global mean loss (one float summed over the ranks; before ``backward``)."""
        total = loss.detach().reshape(1).float().clone()
        if is_distributed(self.model.process_group):
            dist.all_reduce(total, group=self.model.process_group)
        self._global_loss = float(total)
        return self._global_loss

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the dense gradients' all-reduce starting bucket by bucket
        inside it (:meth:`ShardedDLRM.gradient_buckets`)."""
        if self._buckets is None:
            self._buckets = self.model.gradient_buckets()
        self._buckets.arm()
        clock = self.model.phase_clock
        if clock is not None:
            clock.mark(Phase.OTHER)
        try:
            loss.backward()
        except BaseException:
            self._buckets.cancel()  # no hook left armed, no bucket left queued
            raise
        if clock is not None:
            clock.mark(Phase.EMB_BWD)

    def reduce(self, loss: torch.Tensor) -> float:
        """Give every table parameter a gradient, sum the DP replicas' and the dense part's
        over the ranks; the global mean loss (:meth:`global_loss`'s, else summed here)."""
        for p in self.model.embeddings.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._buckets is None:
            self.model.embeddings.reduce_dp_gradients()
            global_loss = self.model.reduce_dense_gradients(extra=loss.detach().reshape(1))
            assert global_loss is not None  # extra was given
            return float(global_loss)
        bucketed = self.model.bucketed_dp_tables()
        self.model.embeddings.reduce_dp_gradients(skip=bucketed)
        self._buckets.finish()
        if self.model.phase_clock is not None:
            self.model.phase_clock.mark(Phase.ALLREDUCE)
        emb = self.model.embeddings
        if bucketed and is_distributed(self.model.process_group):
            emb.stats.record_bytes("dp_grads", sum(emb.weights[n].numel() * 4 for n in bucketed))
        value = self._global_loss
        self._global_loss = None
        return value if value is not None else self.global_loss(loss)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_1d(x, self.model.process_group)
