"""``ShardedEmbeddingCollection``: the embedding tables of a sharding plan, run on
``torch.distributed`` (gloo on CPU).

Each rank holds only its shards (one ``nn.Parameter`` per table it has a piece of) and pools
its own local batch; the result equals ``nn.EmbeddingBag(mode=combiner)`` on the full table.
One forward is three exchanges (all-to-alls) plus local work::

    1 header   every rank -> every rank: [status, table, bad id, B, count per owned shard]
               (errors are raised here, on every rank, before any data moves)
    2 keys     source -> owner: int64 ids re-based to the shard (REDUCTION: after the
               int32 per-sample lengths; UNIQUE: de-duplicated per (source, shard)), one
               byte buffer
    3 vectors  owner -> source, in the table's wire dtype:
               REDUCTION: (B_source, cols) partial sums per shard
               UNIQUE:    (distinct ids, cols) one row per distinct id
       then at the source: sum partials over row shards, concatenate column blocks,
       divide by the full bag length for ``mean``.
    DP tables: local lookup in the replica; :meth:`reduce_dp_gradients` after backward.
    ``hierarchical=True``: step 3 for a REDUCTION column block row-split over several ranks
    of a node goes owner -> node relay (sum) -> source, see
    :mod:`embark.sharding.hierarchical` (a block with one owner per node stays flat);
    :attr:`stats` counts bytes per phase and level.
    Pipelining: :meth:`pipeline` / :meth:`forward_async` start batch i+1's keys exchange
    (async) before batch i's lookup; keys read no weights, so an optimizer step between the
    two changes nothing: results equal the plain :meth:`forward`, step by step.

Worked example, 2 ranks, local batch B = 2 on each, table ``t`` (8 rows × 4 cols) sharded
3D: cols 0:2 row-split (rows 0:4 on rank 0, 4:8 on rank 1), cols 2:4 whole on rank 1,
cluster REDUCTION; rank 0's bags are sample 0 = [1, 5], sample 1 = [5, 5, 7]::

    keys from rank 0:   to rank 0  [lengths 1, 0 | rows 1]            (shard rows 0:4)
                        to rank 1  [lengths 1, 3 | rows 1, 1, 1, 3]   (shard rows 4:8, -4)
                                   [lengths 2, 3 | rows 1, 5, 5, 5, 7] (shard cols 2:4)
    vectors to rank 0:  from 0  (2, 2) = [W[1, 0:2],  0                      ]
                        from 1  (2, 2) = [W[5, 0:2],  2 W[5, 0:2] + W[7, 0:2]]
                        from 1  (2, 2) = [W[1]+W[5],  2 W[5] + W[7]          ][:, 2:4]
    output on rank 0:   (2, 4) = [ from0 + from1 (cols 0:2) | from1' (cols 2:4) ]

Gradients: the exchanges are differentiable (backward is the reverse exchange, in the wire
dtype, except that fp16 payloads send their gradients as bf16: ``comm.grad_wire``; a loss
divided by the global batch puts them below fp16's normal range), so a shard's gradient is the sum of what every rank's loss sends it. DP
replicas get the same by a SUM all-reduce: every embedding parameter then holds the gradient
of ``Σ_ranks loss_rank``, which is single-process training on the global batch when each
rank's loss is its share of the global loss (e.g. per-sample losses summed and divided by
the *global* batch size). Averaging (DDP's default) would make DP tables ``world`` times
smaller than sharded ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from embark.data.jagged import JaggedBatch
from embark.models.tables import TableStore
from embark.sharding.comm import (
    LENGTH_DTYPE,
    CommStats,
    all_reduce_sum,
    distributed_world,
    exchange_ints,
    exchange_ints_async,
    exchange_vectors,
    grad_wire,
    int_bytes,
    tie,
)
from embark.sharding.full_tables import FullTables
from embark.sharding.hierarchical import NodeGroups, reduce_hierarchically, relayed_blocks
from embark.sharding.input import (
    BAD_ID,
    HEADER,
    MISSING_KEY,
    OK,
    DistributedInput,
    PendingInput,
    Routed,
    Sent,
    decode_keys,
    segment_bytes,
)
from embark.sharding.phases import Phase, PhaseClock
from embark.sharding.routing import (
    Layout,
    ShardRef,
    bag_lengths,
    check_ids,
    route_keys,
    sample_ids,
)
from embark.types import Cluster, Combiner, CommDtype, Shard, ShardingPlan, TableConfig


class ShardedEmbeddingCollection(FullTables, TableStore):
    """This rank's part of the embedding tables of ``plan`` (see the module docstring).

    Args:
        tables: every table of the collection (all ranks pass the same list).
        plan: sharding plan for exactly ``tables`` and this process group's world size.
        rank: this process's rank (must match the process group's).
        process_group: collectives' group (``None``: the default group; a one-rank world
            when ``torch.distributed`` is not initialised).
        comm_dtype: when set, the wire dtype of every table (overrides the plan's).
        hierarchical: REDUCTION partial sums are reduced inside a node before the inter-node
            exchange (:mod:`embark.sharding.hierarchical`); needs the default process group.
            Creating the subgroups is a collective. No effect on one node or one GPU per node.
            ``None`` (default): on with the default process group — the exchange the
            planner's cost model rates — off with any other group.
        seed: initialisation seed (uniform ``±sqrt(1/num_rows)``, as ``embark.models.dlrm``); a
            shard's values depend on the seed, the table and the shard's corner, so DP
            replicas start equal. ``None``: zeros, for values loaded next
            (:meth:`load_full_weights`, a checkpoint, ``ShardedDLRM.build``). Either way a rank
            allocates only its own shards.

    Raises:
        ValueError: (on every rank, before any collective) when the plan's world size is not
            the group's, ``rank`` is outside the plan or is not this process's rank, a table
            is missing from the plan or mis-shaped (:class:`~embark.types.PlanError`), or a
            table name is duplicated (a ``"."`` in one is refused by ``TableConfig``), or
            ``hierarchical`` is asked of a non-default process group.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        rank: int,
        process_group: Any | None = None,
        comm_dtype: CommDtype | str | None = None,
        hierarchical: bool | None = None,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        tables = tuple(tables)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"ShardedEmbeddingCollection: duplicate table names in {names}")
        world = distributed_world(process_group)
        group_size = 1 if world is None else world[1]
        if plan.world_size != group_size:
            raise ValueError(
                f"the plan is for world size {plan.world_size} but the process group has "
                f"{group_size} rank(s)"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank!r} is outside the plan's ranks 0..{plan.world_size - 1}")
        if world is not None and world[0] != rank:
            raise ValueError(
                f"rank {rank} was given but this process is rank {world[0]} of its group"
            )
        plan.check_tables(tables)
        if hierarchical and process_group is not None:
            raise ValueError(
                "hierarchical=True needs the default process group (process_group=None)"
            )
        if hierarchical is None:
            hierarchical = process_group is None
        wire = None if comm_dtype is None else CommDtype(comm_dtype)
        self.layout = Layout(tables, plan, wire)
        self.rank, self.world_size = rank, plan.world_size
        self.process_group = process_group
        self.stats = CommStats(rank=rank, gpus_per_node=plan.gpus_per_node)
        self.local_shards: dict[str, Shard] = {}
        self.weights = nn.ParameterDict()
        for i, t in enumerate(tables):
            s = self.layout.local_shard(t.name, rank)
            if s is None:
                continue
            w = torch.zeros(s.num_rows, s.num_cols)
            if seed is not None:
                gen = torch.Generator().manual_seed(
                    hash((seed, i, s.row_start, s.col_start)) & (2**62 - 1)
                )
                bound = (1.0 / t.num_rows) ** 0.5
                w.uniform_(-bound, bound, generator=gen)
            self.local_shards[t.name] = s
            self.weights[t.name] = nn.Parameter(w)
        self.phase_clock: PhaseClock | None = None  # embark.sharding.phases (benchmarks)
        # positions: table -> [(owner rank, index in owned[owner])], in shards_of order
        self._positions: dict[str, list[tuple[int, int]]] = {}
        for o, refs in enumerate(self.layout.owned):
            for i, ref in enumerate(refs):
                self._positions.setdefault(ref.table, []).append((o, i))
        for pos in self._positions.values():
            pos.sort(key=lambda oi: self._shard_key(self.layout.owned[oi[0]][oi[1]]))
        gpn = plan.gpus_per_node
        self._groups: NodeGroups | None = None
        self._relayed: frozenset[tuple[str, int, int]] = frozenset()
        if hierarchical and world is not None and 1 < gpn < plan.world_size:
            self._blocks, self._relayed = relayed_blocks(self.layout, gpn)
            if self._relayed:  # else every block goes flat: no node groups, no extra stages
                self._groups = NodeGroups.create(plan.world_size, gpn, rank)

    @staticmethod
    def _shard_key(ref: ShardRef) -> tuple[int, int]:
        return ref.shard.col_start, ref.shard.row_start

    def _check_batch(self, sparse: JaggedBatch) -> tuple[int, int, int, list[torch.Tensor]]:
        tables = self.layout.tables
        for i, t in enumerate(tables):
            if t.name not in sparse.keys:
                return MISSING_KEY, i, 0, []
        values = [sparse.values_for(t.name) for t in tables]
        bad = check_ids(tables, values)
        if bad is not None:
            return BAD_ID, bad[0], bad[1], []
        return OK, 0, 0, values

    def _raise_if_bad(self, headers: list[torch.Tensor]) -> None:
        for r, h in enumerate(headers):
            code, ti, bad = (int(v) for v in h[:3])
            if code == OK:
                continue
            t = self.layout.tables[ti]
            if code == MISSING_KEY:
                raise ValueError(
                    f"rank {r}: the batch has no key {t.name!r} (every table of the collection "
                    "needs its key, possibly with empty bags)"
                )
            raise ValueError(
                f"rank {r}: table {t.name!r} has {t.num_rows} rows but id {bad} was looked up "
                f"(expected ids 0..{t.num_rows - 1})"
            )

    def _route(self, sparse: JaggedBatch) -> Routed:
        """Cut every table's ids into per-shard segments (nothing sent yet)."""
        layout, owned = self.layout, self.layout.owned
        code, ti, bad, values = self._check_batch(sparse)
        batch = sparse.batch_size if code == OK else 0
        sent = [[Sent(ref, 0) for ref in refs] for refs in owned]
        out = Routed(code, ti, bad, batch, sent, [[] for _ in range(self.world_size)])
        if code != OK:
            return out
        for i, t in enumerate(layout.tables):
            out.lengths[t.name] = sparse.lengths_for(t.name)
            if layout.is_dp(t.name):
                out.dp_input[t.name] = (values[i], sparse.bag_offsets(t.name))
                continue
            samples = sample_ids(out.lengths[t.name])
            pos = self._positions[t.name]
            shards = [owned[o][k].shard for o, k in pos]
            for (o, k), (rows, smp) in zip(pos, route_keys(values[i], samples, shards)):
                ref = owned[o][k]
                if ref.cluster is Cluster.REDUCTION:
                    out.segments[o].append(int_bytes(bag_lengths(smp, batch).to(LENGTH_DTYPE)))
                    out.segments[o].append(int_bytes(rows))
                    sent[o][k] = Sent(ref, rows.numel())
                else:
                    uniq, inv = torch.unique(rows, return_inverse=True)
                    out.segments[o].append(int_bytes(uniq))
                    sent[o][k] = Sent(ref, uniq.numel(), inv, smp)
        return out

    def start_input(self, sparse: JaggedBatch) -> PendingInput:
        """Steps 1-2: exchange the header (synchronously: it is small and carries the
        errors) and start sending every id to its owners (asynchronously).

        Args:
            sparse: this rank's local batch, a key per table (extra keys are ignored).

        Raises:
            ValueError: on every rank, when any rank's batch lacks a table's key or looks up
                an id outside its table (naming the rank, the table and the id).
        """
        owned, me, world = self.layout.owned, self.rank, self.world_size
        routed = self._route(sparse)
        send_h = [HEADER + len(owned[o]) for o in range(world)]
        recv_h = [HEADER + len(owned[me])] * world
        got = exchange_ints(
            routed.header(), send_h, recv_h, self.process_group, stats=self.stats, phase="header"
        )
        headers = list(got.split(recv_h))
        self._raise_if_bad(headers)
        batch_sizes = [int(h[3]) for h in headers]
        seg_size = segment_bytes(owned[me], batch_sizes, [h[HEADER:].tolist() for h in headers])
        flat = [x for o in range(world) for x in routed.segments[o]]
        keys = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
        send_k = [sum(int(x.numel()) for x in routed.segments[o]) for o in range(world)]
        recv_k = [sum(s) for s in seg_size]
        got, work = exchange_ints_async(
            keys, send_k, recv_k, self.process_group, stats=self.stats, phase="keys"
        )

        def finish() -> DistributedInput:
            if work is not None:
                work.wait()
            received = decode_keys(got, owned[me], batch_sizes, recv_k, seg_size)
            return DistributedInput(
                routed.batch_size,
                routed.lengths,
                routed.dp_input,
                routed.sent,
                batch_sizes,
                received,
            )

        return PendingInput(finish)

    def forward_async(self, sparse: JaggedBatch) -> PendingInput:
        """Start the input distribution of ``sparse``; pool it later with
        ``compute(pending.wait())``, after other work (e.g. the previous batch's compute)."""
        return self.start_input(sparse)

    def distribute_input(self, sparse: JaggedBatch) -> DistributedInput:
        """Steps 1-2 for one batch, waiting for the keys (:meth:`start_input` then ``wait``)."""
        return self.start_input(sparse).wait()

    def pipeline(self, batches: Iterable[JaggedBatch]) -> Iterator[dict[str, torch.Tensor]]:
        """Pool a stream of local batches, batch ``i+1``'s keys exchange in flight while
        batch ``i`` is looked up and its vectors exchanged (every rank iterates in step).

        Yields:
            per batch, what :meth:`forward` returns for it (equal values and gradients).
        """
        it = iter(batches)
        first = next(it, None)
        if first is None:
            return
        pending = self.start_input(first)
        for nxt in it:
            ahead = self.start_input(nxt)
            yield self.compute(pending.wait())
            pending = ahead
        yield self.compute(pending.wait())

    # ------------------------------------------------------ lookup and output
    def _lookup(self, inp: DistributedInput) -> list[list[torch.Tensor]]:
        """Owner side: ``out[k][r]``, shard ``owned[rank][k]``'s answer to source ``r``:
        ``(B_r, cols)`` partial sums (REDUCTION) or ``(distinct ids, cols)`` rows (UNIQUE)."""
        out: list[list[torch.Tensor]] = []
        for k, ref in enumerate(self.layout.owned[self.rank]):
            w = self.weights[ref.table]
            rows = torch.cat([inp.received[r][k][1] for r in range(self.world_size)])
            if ref.cluster is Cluster.REDUCTION:
                lens = torch.cat([_lengths(inp.received[r][k][0]) for r in range(self.world_size)])
                if lens.numel():
                    offsets = torch.zeros_like(lens)
                    torch.cumsum(lens[:-1], 0, out=offsets[1:])
                    pooled = self._bag(ref.table, rows, offsets, "sum")
                else:
                    pooled = w[:0]
                out.append(list(pooled.split(inp.batch_sizes)))
            else:
                counts = [inp.received[r][k][1].numel() for r in range(self.world_size)]
                if self.update_of(ref.table) is not None and rows.numel():
                    # one row per distinct id: bags of one
                    looked_up = self._bag(ref.table, rows, torch.arange(rows.numel()), "sum")
                else:
                    looked_up = F.embedding(rows, w).float()
                out.append(list(looked_up.split(counts)))
        return out

    def _bag(self, table: str, ids: torch.Tensor, offsets: torch.Tensor, mode: str) -> torch.Tensor:
        """Pool ``ids`` (re-based to this rank's shard) from the shard of ``table``: through
        its fused update when the trainer installed one, else ``F.embedding_bag``
        (:meth:`~embark.models.tables.TableStore.lookup`; float32 whatever the storage)."""
        return self.lookup(table, ids, offsets, mode)

    def trainable_weights(self) -> dict[str, nn.Parameter]:
        """``{table: this rank's shard or replica (rows, cols)}`` for the tables this rank
        holds a piece of (float32, or the dtype the trainer stores them in)."""
        return {n: self.weights[n] for n in self.local_shards}

    def replicated(self) -> frozenset[str]:
        """The data-parallel tables (replicas whose gradients are summed over the ranks)."""
        return frozenset(self.layout.dp_tables)

    def _set_weight(self, table: str, weight: nn.Parameter) -> None:
        self.weights[table] = weight

    def compute(self, inp: DistributedInput) -> dict[str, torch.Tensor]:
        """Step 3 and pooling: look up, send vectors back, assemble this rank's outputs.

        Returns:
            ``{table: (B, dim) float32}`` in table order.
        """
        layout, me = self.layout, self.rank
        wires = list(layout.wires_in_use)
        answers = self._lookup(inp)
        if self.phase_clock is not None:
            self.phase_clock.mark(Phase.LOOKUP)
        vectors, got = self._exchange_flat(inp, answers, wires)
        block_parts: dict[tuple[str, int], list[torch.Tensor]] = {}
        anchors = list(got)
        if self._groups is not None and wires:
            block_parts, more = reduce_hierarchically(
                answers,
                layout.owned,
                me,
                inp.batch_sizes,
                self._groups,
                self._blocks,
                wires,
                self.stats,
                after=got,
            )
            anchors += more
        outs: dict[str, torch.Tensor] = {}
        for t in layout.tables:
            if layout.is_dp(t.name):
                continue
            outs[t.name] = self._assemble(t, inp, vectors, block_parts)
        if outs:
            names = list(outs)
            outs = dict(zip(names, tie([outs[n] for n in names], anchors)))
        for t in layout.tables:
            if layout.is_dp(t.name):
                values, offsets = inp.dp_input[t.name]
                mode = "mean" if t.combiner is Combiner.MEAN else "sum"
                w = self.weights[t.name]
                # float32 bags whatever the replica's storage (its gradient is in that dtype)
                outs[t.name] = (
                    F.embedding_bag(values, w, offsets, mode=mode) if inp.batch_size else w[:0]
                ).float()
        if self.phase_clock is not None:
            self.phase_clock.mark(Phase.OUTPUT_A2A)
        return {t.name: outs[t.name] for t in layout.tables}

    def _exchange_flat(
        self, inp: DistributedInput, answers: list[list[torch.Tensor]], wires: list[CommDtype]
    ) -> tuple[dict[tuple[int, int], torch.Tensor], list[torch.Tensor]]:
        """The flat vectors exchange (every shard but those of relayed REDUCTION blocks): one
        buffer per wire dtype in one all-to-all. Returns ``({(owner, k): (rows, cols)},
        received buffers)``."""
        owned, me, world = self.layout.owned, self.rank, self.world_size
        gpn = self.layout.plan.gpus_per_node

        def flat(ref: ShardRef, wire: CommDtype) -> bool:
            node = ref.shard.rank // gpn
            return ref.wire is wire and (ref.table, ref.shard.col_start, node) not in self._relayed

        xs, send, recv = [], [], []
        for wire in wires:
            pieces: list[torch.Tensor] = []
            send_g, recv_g = [], []
            for r in range(world):
                mine = [a[r].reshape(-1) for k, a in enumerate(answers) if flat(owned[me][k], wire)]
                pieces += mine
                send_g.append(sum(p.numel() for p in mine))
            for o in range(world):
                recv_g.append(
                    sum(
                        self._answer_rows(inp, o, k) * ref.num_cols
                        for k, ref in enumerate(owned[o])
                        if flat(ref, wire)
                    )
                )
            x = torch.cat(pieces) if pieces else torch.zeros(0)
            if torch.is_grad_enabled() and not x.requires_grad:
                # every rank must record the exchange, or backward would wait for this one
                x = x.detach().requires_grad_(True)
            xs.append(x)
            send.append(send_g)
            recv.append(recv_g)
        got = (
            exchange_vectors(xs, wires, send, recv, self.process_group, stats=self.stats)
            if wires
            else []
        )
        vectors: dict[tuple[int, int], torch.Tensor] = {}
        for g, wire in enumerate(wires):
            parts = got[g].split(recv[g])
            for o in range(world):
                refs = [(k, ref) for k, ref in enumerate(owned[o]) if flat(ref, wire)]
                sizes = [self._answer_rows(inp, o, k) * ref.num_cols for k, ref in refs]
                for (k, ref), v in zip(refs, parts[o].split(sizes)):
                    vectors[(o, k)] = v.view(-1, ref.num_cols)
        return vectors, list(got)

    def _answer_rows(self, inp: DistributedInput, o: int, k: int) -> int:
        s = inp.sent[o][k]
        return inp.batch_size if s.ref.cluster is Cluster.REDUCTION else s.count

    def _assemble(
        self,
        t: TableConfig,
        inp: DistributedInput,
        vectors: dict[tuple[int, int], torch.Tensor],
        block_parts: dict[tuple[str, int], list[torch.Tensor]],
    ) -> torch.Tensor:
        """``(B, dim)``: partials summed over row shards (or over nodes, for hierarchical
        REDUCTION), column blocks concatenated."""
        blocks: dict[int, torch.Tensor] = {}
        for (name, c0), parts in block_parts.items():
            if name == t.name:
                for v in parts:
                    blocks[c0] = blocks[c0] + v if c0 in blocks else v
        for o, k in self._positions[t.name]:
            if (o, k) not in vectors:
                continue
            s = inp.sent[o][k]
            v = vectors[(o, k)]
            if s.ref.cluster is Cluster.UNIQUE:
                assert s.inverse is not None and s.samples is not None
                v = v.new_zeros(inp.batch_size, s.ref.num_cols).index_add(
                    0, s.samples, v[s.inverse]
                )
            c0 = s.ref.shard.col_start
            blocks[c0] = blocks[c0] + v if c0 in blocks else v
        out = torch.cat([blocks[c] for c in sorted(blocks)], dim=1)
        if t.combiner is Combiner.MEAN and inp.batch_size:
            out = out / inp.lengths[t.name].clamp(min=1).unsqueeze(1).to(out.dtype)
        return out

    def forward(self, sparse: JaggedBatch) -> dict[str, torch.Tensor]:
        """Pool this rank's local batch (a collective: every rank calls it, in step).

        Args:
            sparse: ``B`` samples, a key per table (ids ``0 .. num_rows-1``).

        Returns:
            ``{table: (B, dim) float32}`` in table order, equal to
            ``nn.EmbeddingBag(mode=combiner)`` on the full table.

        Raises:
            ValueError: on every rank, naming the rank, table and id, when any rank's batch
                is missing a key or looks up an id out of range.
        """
        return self.compute(self.distribute_input(sparse))

    # ------------------------------------------------------------ DP gradients
    @torch.no_grad()
    def reduce_dp_gradients(self, skip: frozenset[str] = frozenset()) -> None:
        """Sum the gradients of the DP replicas over the ranks, in their wire dtype's gradient
        wire (``comm.grad_wire``: bf16 for fp16; a collective; call after ``backward`` and
        before the optimizer step). A replica with no gradient counts as zero and gets one.

        Args:
            skip: replicas summed elsewhere (e.g. in the dense gradients' buckets).
        """
        dp = [n for n in self.layout.dp_tables if n not in skip]
        for wire in CommDtype:
            names = [n for n in dp if self.layout.wire(n) is wire]
            if not names:
                continue
            params = [self.weights[n] for n in names]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = all_reduce_sum(
                torch.cat([g.reshape(-1) for g in grads]),
                self.process_group,
                wire=grad_wire(wire),
                stats=self.stats,
            )
            for p, piece in zip(params, flat.split([p.numel() for p in params])):
                p.grad = piece.view_as(p).clone()


def _lengths(lengths: torch.Tensor | None) -> torch.Tensor:
    """The bag lengths a REDUCTION shard receives (sent for every REDUCTION shard)."""
    if lengths is None:
        raise RuntimeError("a REDUCTION shard received keys without bag lengths")
    return lengths
