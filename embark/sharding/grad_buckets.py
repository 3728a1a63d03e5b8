"""Gradient buckets: the SUM all-reduce of replicated parameters' gradients, started while
``backward`` still runs (as DDP's reducer does), so the exchange of the last layers'
gradients overlaps the backward of the first layers.

Parameters are cut into buckets of about :func:`~embark.types.grad_bucket_bytes` of their
bytes, in reverse registration order (backward produces the last layers' gradients first;
:func:`bucket_indices`). A hook on each parameter (``register_post_accumulate_grad_hook``)
counts the gradients that arrived; when a bucket is complete its gradients are copied into
the bucket's buffer (allocated once and reused every step: a fresh bucket-sized tensor would
be page-faulted in each time; a parameter larger than a bucket is summed in its own gradient,
no copy) and its all-reduce starts asynchronously; after it, each ``p.grad`` is a view of the
buffer. Buckets start strictly in order (bucket ``i`` after ``0 .. i-1``), so every
rank issues the same sequence of collectives whatever order autograd finishes them in::

    backward:   top MLP grads ─▶ bucket 0 ─all_reduce(async)─┐
                cross net     ─▶ bucket 1 ─all_reduce(async)─┤   (backward goes on)
                bottom MLP    ─▶ bucket 2 ─all_reduce(async)─┤
    finish():   buckets never completed (unused parameters: zeros) start now; wait for all;
                p.grad = its slice of the summed buffer

The sum of one element is the same whichever bucket carries it, and every rank gets the same
sum (an all-reduce), so replicas stay bit-identical; against one flat all-reduce only the
order of float additions inside the collective can differ.

With a :class:`~embark.sharding.node_allreduce.HierarchicalAllReduce` each bucket is summed
node by node (reduce-scatter inside the node, all-reduce across, all-gather inside): three
dependent collectives, so they run one bucket after the other on a worker thread of this
object (started by the first bucket, kept for later steps, ended by :meth:`close`), in bucket
order on every rank, while backward goes on in the main thread. When one of them raises (a
peer died) the buckets queued behind it issue no collective (each would wait for the process
group's timeout) and :meth:`finish` re-raises at once; when ``backward`` itself raises, the
caller drops the step with :meth:`cancel`.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embark.types import grad_bucket_bytes


def bucket_indices(numels: Sequence[int], bucket_bytes: int, itemsize: int = 4) -> list[list[int]]:
    """Buckets of the parameters of sizes ``numels``, walking them in reverse order (the order
    backward completes them): a parameter of at least half a bucket is a bucket alone (summed
    in its own gradient); the smaller ones (biases, narrow layers) fill shared buckets of at
    most ``bucket_bytes``, each placed where it fills up, the last one at the end (a bias
    between two large layers would otherwise cost a collective of its own).

    >>> bucket_indices([2, 2, 30, 2], 80)  # 8, 8, 120, 8 bytes
    [[2], [3, 1, 0]]
    """
    out: list[list[int]] = []
    small: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        n = numels[i] * itemsize
        if 2 * n >= bucket_bytes:
            out.append([i])
            continue
        if small and size + n > bucket_bytes:
            out.append(small)
            small, size = [], 0
        small.append(i)
        size += n
    if small:
        out.append(small)
    return out


class GradBuckets:
    """SUM all-reduce of ``params``' gradients in buckets, started from inside ``backward``
    once :meth:`arm` was called; :meth:`finish` completes it (a collective: every rank of
    ``group`` arms and finishes in step, with the same parameters).

    Args:
        params: the replicated parameters (same shapes, same order on every rank); those
            that do not require a gradient are left out.
        group: the process group of the all-reduces (``None``: the default group). A group
            that carries no other collective makes the overlap safe whatever order autograd
            runs the other ranks' collective nodes in.
        overlap: start buckets from inside ``backward`` (else every bucket starts in
            :meth:`finish`).
        bucket_bytes: bucket size (``None``: :func:`~embark.types.grad_bucket_bytes` of
            the parameters' bytes).
        hierarchical: sum each bucket in place with this blocking reduction, e.g. a
            :class:`~embark.sharding.node_allreduce.HierarchicalAllReduce` (on the worker
            thread; its groups then carry nothing else), else one all-reduce on ``group``.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Any | None,
        overlap: bool = True,
        bucket_bytes: int | None = None,
        hierarchical: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group, self.overlap = group, overlap
        self.hierarchical = hierarchical
        self._worker: _Worker | None = None
        self._abort = threading.Event()
        numels = [p.numel() for p in self.params]
        if bucket_bytes is None:
            bucket_bytes = grad_bucket_bytes(
                sum(n * p.element_size() for n, p in zip(numels, self.params))
            )
        self.bucket_bytes = bucket_bytes
        self.buckets = bucket_indices(numels, bucket_bytes)
        self._bucket_of = {id(self.params[i]): b for b, idx in enumerate(self.buckets) for i in idx}
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._missing: list[int] = []
        self._started: list[tuple[torch.Tensor, Any | Future[None]]] = []
        self._hooks: list[Any] = []

    def arm(self) -> None:
        """Start counting gradients: the next ``backward`` starts each bucket's all-reduce
        once its gradients are complete (a previous unfinished step is dropped: :meth:`cancel`)."""
        if self._started or self._hooks:
            self.cancel()
        self._missing = [len(idx) for idx in self.buckets]
        self._started = []
        if self.overlap:
            self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in self.params]

    def _arrived(self, p: torch.Tensor) -> None:
        b = self._bucket_of[id(p)]
        self._missing[b] -= 1
        while len(self._started) < len(self.buckets) and self._missing[len(self._started)] == 0:
            self._start(len(self._started))

    @torch.no_grad()
    def _start(self, b: int) -> None:
        idx = self.buckets[b]
        lone = self.params[idx[0]].grad if len(idx) == 1 else None
        if lone is not None and lone.is_contiguous():
            # a parameter that fills a bucket alone is summed in its own gradient: no copy
            self._all_reduce(lone.view(-1))
            return
        flat = self._buffers[b]
        if flat is None:
            first = self.params[idx[0]]
            flat = first.new_empty(sum(self.params[i].numel() for i in idx))
            self._buffers[b] = flat
        pos = 0
        for i in idx:
            p = self.params[i]
            piece = flat[pos : pos + p.numel()]
            pos += p.numel()
            if p.grad is None:
                piece.zero_()
            elif p.grad.data_ptr() != piece.data_ptr():  # else: last step's view, kept
                piece.copy_(p.grad.reshape(-1))
        self._all_reduce(flat)

    def _all_reduce(self, flat: torch.Tensor) -> None:
        work: Any | Future[None] = None
        if self.hierarchical is not None:
            if self._worker is None:
                self._worker = _Worker(self.hierarchical)
                # an idle worker ends with its GradBuckets where close() was never called
                weakref.finalize(self, self._worker.close, False)
            work = self._worker.submit(flat, self._abort)
        elif dist.is_available() and dist.is_initialized():
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._started.append((flat, work))

    @property
    def started(self) -> int:
        """How many buckets of the current step have started their all-reduce."""
        return len(self._started)

    @torch.no_grad()
    def finish(self) -> None:
        """Start the buckets not started yet (a parameter without a gradient counts as
        zeros), wait for every all-reduce and set each ``p.grad`` to its summed gradient.

        Raises:
            Exception: what a bucket's all-reduce raised (e.g. a peer died), as soon as it
                did: the buckets behind it are skipped and the step is dropped (:meth:`cancel`).
        """
        self._drop_hooks()
        if not self._missing:
            self._missing = [len(idx) for idx in self.buckets]
        try:
            while len(self._started) < len(self.buckets):
                self._start(len(self._started))
            for _, work in self._started:
                if isinstance(work, Future):
                    work.result()  # re-raises what the worker thread raised
                elif work is not None:
                    work.wait()
        except BaseException:
            self.cancel()
            raise
        for (flat, _), idx in zip(self._started, self.buckets):
            pieces = flat.split([self.params[i].numel() for i in idx])
            for i, piece in zip(idx, pieces):
                self.params[i].grad = piece.view_as(self.params[i])
        self._missing, self._started = [], []

    def cancel(self) -> None:
        """Drop the current step (after ``backward`` or an all-reduce raised): remove the
        hooks, skip every bucket not yet running and let the worker thread end once the one
        it runs returns, without waiting for it (a collective whose peer died returns only
        at the process group's timeout). The buffers are dropped too (that bucket may still
        write into its own); the next :meth:`arm` starts afresh with a new worker."""
        self._drop_hooks()
        self._abort.set()  # the step's queued buckets fail at once
        self._abort = threading.Event()
        for _, work in self._started:
            if isinstance(work, Future):
                work.cancel()
        self.close(wait=False)
        self._buffers = [None] * len(self.buckets)
        self._missing, self._started = [], []

    def close(self, wait: bool = True) -> None:
        """End the worker thread (hierarchical buckets) after the buckets queued before;
        ``wait``: join it. A later step starts a new one."""
        if self._worker is not None:
            self._worker.close(wait)
            self._worker = None

    def _drop_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Worker:
    """One daemon thread (named ``grad-buckets``) that runs the buckets' reductions one after
    the other, in submission order. A daemon: a reduction stuck on a dead peer never keeps the
    process from exiting. Each bucket carries its step's abort event: once a reduction of the
    step raised (or the step was cancelled) the step's later buckets fail at once without
    issuing a collective."""

    def __init__(self, reduce: Callable[[torch.Tensor], None]) -> None:
        self._reduce = reduce
        self._queue: queue.SimpleQueue[tuple[Future[None], torch.Tensor, threading.Event] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="grad-buckets", daemon=True)
        self._thread.start()

    def submit(self, flat: torch.Tensor, abort: threading.Event) -> Future[None]:
        """Queue the reduction of ``flat``; its future completes when it ran."""
        fut: Future[None] = Future()
        self._queue.put((fut, flat, abort))
        return fut

    def close(self, wait: bool) -> None:
        """Let the thread end after what was queued before (``wait``: join it)."""
        self._queue.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, flat, abort = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued
            if abort.is_set():
                fut.set_exception(RuntimeError("gradient bucket skipped: its step was dropped"))
                continue
            try:
                self._reduce(flat)
            except BaseException as exc:  # handed to the caller through the future
                abort.set()
                fut.set_exception(exc)
            else:
                fut.set_result(None)
