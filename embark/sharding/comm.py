"""Collectives of the sharding runtime: a differentiable all-to-all and a byte counter.

All traffic goes through :func:`exchange_ints` (headers as int64; keys as the bytes of int32
bag lengths and int64 ids, :func:`int_bytes`) and :func:`exchange_vectors` (pooled partials or
per-key vectors, differentiable), each one ``dist.all_to_all_single`` on a flat 1-d buffer
with uneven splits, and :func:`all_reduce_sum` (data-parallel gradients).
Gloo (CPU) in torch 2.13 supports these for int64, uint8, float32, float16 and bfloat16, with
uneven splits and ``async_op``. ``torch.distributed.nn.functional.all_to_all_single`` works on
gloo too but is deprecated, and one autograd node per wire dtype would let ranks enter the
backward collectives in different orders; :class:`_VectorAllToAll` packs every wire dtype's
bytes into one exchange instead.

Layout of one all-to-all on 3 ranks, seen from rank 1 (``send_splits`` / ``recv_splits`` are
element counts per peer; the buffers are the peers' segments concatenated in rank order)::

    rank 1 sends    [ a a | b b b | c ]        send_splits = [2, 3, 1]
                      to 0  to 1    to 2
    rank 1 receives [ x | b b b | y y ]        recv_splits = [1, 3, 2]
                    from 0 from 1 from 2

Backward is the same exchange with the splits swapped: the gradient of what rank 1 received
from rank 0 goes back to rank 0. Vectors travel in the wire dtype (``CommDtype``); the cast
back to float32 happens on arrival. Gradients travel in :func:`grad_wire` of it: the wire dtype,
except bf16 for fp16 (same bytes; fp16 cannot hold gradients scaled by 1 / global batch). DP
gradients are summed by the all-reduce in that dtype too (bf16's 8-bit mantissa for an fp16
table's hot rows, in exchange for its range).

Without an initialised process group (``group`` is ``None`` and ``dist`` is not initialised)
the world has one rank and every collective is the identity, which keeps single-process use
and unit tests free of ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from embark.types import CommDtype

WIRE_DTYPES: dict[CommDtype, torch.dtype] = {
    CommDtype.FP32: torch.float32,
    CommDtype.FP16: torch.float16,
    CommDtype.BF16: torch.bfloat16,
}


def grad_wire(wire: CommDtype) -> CommDtype:
    """The wire dtype of the gradients of what travels in ``wire``: bf16 for fp16 (the same 2
    bytes, fp32's exponent range), else ``wire`` itself. A loss divided by the global batch
    makes embedding gradients ~1e-2 / B (1.5e-7 at B = 65,536), below fp16's smallest normal
    (6.1e-5): sent as fp16 without a scale they lost 5.6 % of their L2 norm (4 % of entries
    flushed to 0), as bf16 0.2 %."""
    return CommDtype.BF16 if wire is CommDtype.FP16 else wire


def _grad_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dt == torch.float16 else dt


# Integer dtypes of the keys exchange, as the planner's cost model counts them
# (CostConstants.key_bytes / length_bytes). A bag length travels as int32: a shard's part of a
# bag is at most the whole bag, whose length JaggedBatch already holds as int32.
KEY_DTYPE = torch.int64
LENGTH_DTYPE = torch.int32


def int_bytes(x: torch.Tensor) -> torch.Tensor:
    """``(n * itemsize,) uint8`` the bytes of ``x: (n,)`` (a view when ``x`` is contiguous)."""
    return x.contiguous().view(torch.uint8)


def from_int_bytes(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`int_bytes`: ``buf: (n * itemsize,) uint8`` → ``(n,) dtype`` (a copy:
    a segment of a packed buffer may start at an offset not aligned for ``dtype``).

    Raises:
        ValueError: when ``buf``'s length is not a multiple of ``dtype``'s size.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if buf.dim() != 1 or buf.dtype != torch.uint8 or buf.numel() % size:
        raise ValueError(
            f"from_int_bytes: need 1-d uint8 bytes, a multiple of {size} for {dtype}, got "
            f"{buf.dtype} of shape {tuple(buf.shape)}"
        )
    return buf.clone().view(dtype)


def distributed_world(group: Any | None) -> tuple[int, int] | None:
    """``(rank, world_size)`` of ``group`` (the default group when ``None``), or ``None`` when
    ``torch.distributed`` is not initialised and no group was given (a one-rank world)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass
class CommStats:
    """Bytes this rank sent to other ranks, by phase and by level (self-sends not counted).

    Phases: ``"header"`` (per-batch counts), ``"keys"`` (input distribution), ``"vectors"``
    (output distribution), ``"vector_grads"`` (its backward), ``"dp_grads"`` (all-reduce of
    data-parallel replicas, counted as the buffer size once per call, level ``"all"``).
    Levels: ``"intra"`` / ``"inter"``, whether the peer sits on this rank's node
    (``rank // gpus_per_node``).
    """

    rank: int = 0
    gpus_per_node: int = 1
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def record(
        self, phase: str, splits: Sequence[int], itemsize: int, peers: Sequence[int] | None = None
    ) -> None:
        """Count one all-to-all: ``splits[i]`` elements of ``itemsize`` bytes sent to rank
        ``peers[i]`` (default ``i``: the world group)."""
        node = self.rank // self.gpus_per_node
        for i, n in enumerate(splits):
            peer = i if peers is None else peers[i]
            if peer == self.rank or not n:
                continue
            level = "intra" if peer // self.gpus_per_node == node else "inter"
            key = (phase, level)
            self.bytes[key] = self.bytes.get(key, 0) + int(n) * itemsize

    def record_bytes(self, phase: str, nbytes: int) -> None:
        """Count ``nbytes`` for ``phase`` at level ``"all"`` (all-reduce)."""
        key = (phase, "all")
        self.bytes[key] = self.bytes.get(key, 0) + int(nbytes)

    @property
    def phases(self) -> dict[str, int]:
        """Bytes per phase, all levels."""
        out: dict[str, int] = {}
        for (phase, _), n in self.bytes.items():
            out[phase] = out.get(phase, 0) + n
        return out

    def level(self, level: str, phase: str | None = None) -> int:
        """Bytes sent at ``level`` (``"intra"`` / ``"inter"``), in one phase or all."""
        return sum(n for (p, lv), n in self.bytes.items() if lv == level and phase in (None, p))

    def reset(self) -> None:
        self.bytes.clear()


def _exchange(
    x: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Any | None,
    async_op: bool = False,
) -> tuple[torch.Tensor, Any]:
    """One ``all_to_all_single`` of a flat buffer; identity in a one-rank world."""
    if distributed_world(group) is None:
        return x, None
    out = x.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(
        out, x.contiguous(), recv_splits, send_splits, group=group, async_op=async_op
    )
    return out, work


def exchange_ints(
    x: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: Any | None = None,
    *,
    stats: CommStats | None = None,
    phase: str = "keys",
) -> torch.Tensor:
    """All-to-all of ``x: (sum(send_splits),)`` integers (int64 counts, or uint8 bytes of
    packed keys; not differentiable); splits count elements of ``x``'s dtype.

    Returns:
        ``(sum(recv_splits),)`` of ``x``'s dtype, the peers' segments in rank order.
    """
    out, work = exchange_ints_async(x, send_splits, recv_splits, group, stats=stats, phase=phase)
    if work is not None:
        work.wait()
    return out


def exchange_ints_async(
    x: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: Any | None = None,
    *,
    stats: CommStats | None = None,
    phase: str = "keys",
) -> tuple[torch.Tensor, Any]:
    """:func:`exchange_ints` started asynchronously: ``(output buffer, work)``; read the
    buffer only after ``work.wait()`` (``work`` is ``None`` in a one-rank world)."""
    send, recv = [int(n) for n in send_splits], [int(n) for n in recv_splits]
    if x.dim() != 1 or x.numel() != sum(send):
        raise ValueError(
            f"exchange_ints: x must be 1-d with sum(send_splits)={sum(send)} elements, got "
            f"shape {tuple(x.shape)}"
        )
    if stats is not None:
        stats.record(phase, send, x.element_size())
    return _exchange(x, send, recv, group, async_op=True)


def _pack(
    xs: Sequence[torch.Tensor], splits: Sequence[Sequence[int]], wires: Sequence[torch.dtype]
) -> tuple[torch.Tensor, list[int]]:
    """Bytes of every group's segment for peer 0, then peer 1, ... (each group cast to its
    wire dtype); returns ``(uint8 buffer, bytes per peer)``."""
    world = len(splits[0]) if splits else 0
    offs = [0] * len(xs)
    chunks: list[torch.Tensor] = []
    per_peer: list[int] = []
    for p in range(world):
        n_bytes = 0
        for g, (x, wdt) in enumerate(zip(xs, wires)):
            n = splits[g][p]
            if n:
                seg = x[offs[g] : offs[g] + n].detach().to(wdt).contiguous().view(torch.uint8)
                chunks.append(seg)
                n_bytes += seg.numel()
            offs[g] += n
        per_peer.append(n_bytes)
    buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return buf, per_peer


def _unpack(
    buf: torch.Tensor, splits: Sequence[Sequence[int]], wires: Sequence[torch.dtype]
) -> list[torch.Tensor]:
    """Inverse of :func:`_pack` on the receiving side: float32 tensor per group."""
    world = len(splits[0]) if splits else 0
    parts: list[list[torch.Tensor]] = [[] for _ in wires]
    pos = 0
    for p in range(world):
        for g, wdt in enumerate(wires):
            n = splits[g][p]
            if n:
                nbytes = n * torch.empty((), dtype=wdt).element_size()
                # clone: a segment may start at an offset not aligned for wdt
                seg = buf[pos : pos + nbytes].clone().view(wdt)
                parts[g].append(seg.to(torch.float32))
                pos += nbytes
    return [torch.cat(ps) if ps else torch.empty(0) for ps in parts]


def _peer_bytes(splits: Sequence[Sequence[int]], wires: Sequence[torch.dtype]) -> list[int]:
    world = len(splits[0]) if splits else 0
    sizes = [torch.empty((), dtype=w).element_size() for w in wires]
    return [sum(splits[g][p] * sizes[g] for g in range(len(wires))) for p in range(world)]


def _vector_exchange(
    xs: Sequence[torch.Tensor],
    send: Sequence[Sequence[int]],
    recv: Sequence[Sequence[int]],
    wires: Sequence[torch.dtype],
    group: Any | None,
    stats: CommStats | None,
    phase: str,
    peers: Sequence[int] | None,
) -> list[torch.Tensor]:
    buf, send_bytes = _pack(xs, send, wires)
    if stats is not None:
        stats.record(phase, send_bytes, 1, peers)
    out, _ = _exchange(buf, send_bytes, _peer_bytes(recv, wires), group)
    return _unpack(out, recv, wires)


class _VectorAllToAll(torch.autograd.Function):
    """Differentiable all-to-all of several float32 buffers, each with its own wire dtype, in
    one exchange: one collective forward and one backward, so ranks never disagree on the
    order of collectives during backward."""

    @staticmethod
    def forward(ctx: Any, meta: dict[str, Any], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.meta = meta
        return tuple(
            _vector_exchange(
                xs,
                meta["send"],
                meta["recv"],
                meta["wires"],
                meta["group"],
                meta["stats"],
                "vectors",
                meta["peers"],
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        m = ctx.meta
        g = _vector_exchange(  # fp16 payloads send their gradients as bf16: grad_wire()
            [x.contiguous() for x in grads],
            m["recv"],
            m["send"],
            [_grad_dtype(w) for w in m["wires"]],
            m["group"],
            m["stats"],
            "vector_grads",
            m["peers"],
        )
        return (None, *g)


def exchange_vectors(
    xs: Sequence[torch.Tensor],
    wires: Sequence[CommDtype],
    send_splits: Sequence[Sequence[int]],
    recv_splits: Sequence[Sequence[int]],
    group: Any | None = None,
    *,
    stats: CommStats | None = None,
    peers: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Differentiable all-to-all of ``G`` float32 buffers in one collective, buffer ``g``
    travelling in ``wires[g]`` (gradients in ``grad_wire(wires[g])``).

    Args:
        xs: ``G`` tensors, ``xs[g]: (sum(send_splits[g]),) float32``; its segment ``p`` goes to
            rank ``p``.
        wires: ``(G,)`` wire dtype of each buffer.
        send_splits: ``(G, world)`` element counts sent to each rank.
        recv_splits: ``(G, world)`` element counts received from each rank.
        group: process group (``None``: the default group, or a one-rank world).
        stats: byte counter to update (``"vectors"``, and ``"vector_grads"`` in backward).
        peers: world rank of each group rank, for ``stats`` (default: the group is the world).

    Returns:
        ``G`` tensors, ``(sum(recv_splits[g]),) float32``, segments in rank order, rounded
        through the wire dtype (also in a one-rank world, so numerics do not depend on it).
    """
    if not (len(xs) == len(wires) == len(send_splits) == len(recv_splits)):
        raise ValueError("exchange_vectors: xs, wires and splits must have one entry per buffer")
    for g, x in enumerate(xs):
        if x.dim() != 1 or x.dtype != torch.float32 or x.numel() != sum(send_splits[g]):
            raise ValueError(
                f"exchange_vectors: buffer {g} must be 1-d float32 with "
                f"{sum(send_splits[g])} elements, got {x.dtype} of shape {tuple(x.shape)}"
            )
    meta = {
        "send": [[int(n) for n in s] for s in send_splits],
        "recv": [[int(n) for n in r] for r in recv_splits],
        "wires": [WIRE_DTYPES[w] for w in wires],
        "group": group,
        "stats": stats,
        "peers": None if peers is None else list(peers),
    }
    return list(_VectorAllToAll.apply(meta, *xs))


class _Tie(torch.autograd.Function):
    """Identity on ``outs`` whose backward also hands zero gradients to ``anchors``."""

    @staticmethod
    def forward(ctx: Any, n: int, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.anchor_shapes = [a.shape for a in args[n:]]
        return tuple(o.view_as(o) for o in args[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *grads, *[torch.zeros(s) for s in ctx.anchor_shapes])


def tie(outs: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Make ``anchors`` part of the backward of every tensor in ``outs``.

    Backward of an exchange is itself a collective that every rank must enter. A rank's
    outputs may not depend on what it received (it received nothing, or its loss uses only
    some tables), and autograd would then skip the exchange's backward on that rank while
    the others wait in it. Tying the received buffers to every output makes the backward run
    whenever any output is used; the zero gradients added change nothing.
    """
    if not outs or not anchors:
        return list(outs)
    return list(_Tie.apply(len(outs), *outs, *anchors))


def all_reduce_sum(
    x: torch.Tensor,
    group: Any | None = None,
    *,
    wire: CommDtype = CommDtype.FP32,
    stats: CommStats | None = None,
    phase: str = "dp_grads",
) -> torch.Tensor:
    """Sum ``x`` over the ranks (not differentiable), travelling in ``wire``; returns a new
    tensor of ``x.dtype`` and ``x.shape``."""
    wdt = WIRE_DTYPES[wire]
    buf = x.detach().to(wdt, copy=True)
    if distributed_world(group) is not None:
        if stats is not None:
            stats.record_bytes(phase, buf.numel() * buf.element_size())
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.to(x.dtype)
