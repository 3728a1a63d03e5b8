"""Dynamic batching after Triton's dynamic batcher (differences below): the requests of one
model that are waiting at the same time are merged into one execution (one lookup per table,
one dense onnxruntime run), and each request gets exactly its own rows back.

One inference thread per model owns the executions; the protocol servers announce each
request when they start reading it (:meth:`DynamicBatcher.arrival`), parse it on their own
threads (HTTP: the event loop), check it (:meth:`DLRMServable.check`), hand it over
(:meth:`Arrival.submit`) and encode the answer when its future resolves. The inference thread
takes the oldest waiting request and every waiting request after it, in order, while the
batch stays within ``max_batch_size`` samples (the first that would take it past opens the
next batch). Only once nothing more is waiting does ``preferred_batch_size`` count (0, the
default: ``max_batch_size``): a batch of at least that many samples runs at once; a smaller
one waits for more until ``max_queue_delay_us`` has passed since its oldest request arrived
or, by this server's own rule, until waiting could not grow it: no announced request is
still being read, and it holds as many requests as its known clients
(:mod:`hps.serving.known_clients`: connections that came back, i.e. sent a second request)
can have in flight at once. A lone client therefore never waits (its request is all it can
send), nor does one that opens a connection per request (it never comes back); closed-loop
clients share one execution per round. A batch of requests that queued while an execution
ran also waits, once it ends, for the requests that execution has just answered to known
clients to be sent again (at most ``max_queue_delay_us`` from its end, and only while fewer
have come back from a client than it was answered; a closed connection sends none), so
closed-loop clients that fell into two groups, each queued behind the other's execution, are
merged back into one execution per round. Two differences from Triton's dynamic batcher:
Triton sends the largest preferred size it can form and leaves the rest queued, where this
batcher takes every waiting request up to ``max_batch_size`` (the preferred size only decides
how long a smaller batch waits); and Triton waits the full delay unless its largest preferred
size is reached, with no early close when its queue cannot grow, and runs the requests that
queued during an execution at once when their delay has passed::

    arrivals     r1 (B=16)  r2 (B=16)      r3 (B=250)
    queue        [r1, r2] ─────────────── r3 waits: 16 + 16 + 250 > max_batch_size 256
    execution    rows 0..15 → r1, rows 16..31 → r2     then r3 alone (or with later ones)

    lone request r4, nothing announced      → runs at once (no queue delay)
    r5 submitted while r6 is being parsed   → waits for r6 (at most max_queue_delay_us)
    known clients a, b; a's request queued  → waits for b's (at most max_queue_delay_us)
    a queued during an execution that       → waits for b's next request (at most
      answered known client b                  max_queue_delay_us after that execution;
                                               b, a connection of 4 callers, 2 of them
                                               answered: for 2 of b's requests)

Merging is exact: the merged run's rows are bit-equal to running each request alone
(onnxruntime's CPU kernels compute each output row with the same reduction order whatever
the batch; pooling sums each sample's rows in the order its request gave them). Requests with
narrower id lists than their batch mates are padded with -1, which pools nothing. If a merged
execution fails, each of its requests is run again alone, so a request is only ever failed by
its own keys or inputs (a tier that failed for one request's keys does not fail its batch
mates). A non-finite output of a request is an error of that request alone
(:class:`~hps.serving.servable.NonFiniteOutputError`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hps.serving.known_clients import SWEEP_NS, KnownClients
from hps.serving.servable import CheckedInputs, DLRMServable, Tensors, check_outputs_finite
from hps.serving.statistics import ModelCounts

log = logging.getLogger(__name__)

__all__ = [
    "MAX_QUEUE_DELAY_US",
    "Arrival",
    "BatchedResult",
    "BatchingConfig",
    "DynamicBatcher",
    "merge_requests",
]

#: The longest queue delay a server accepts: 1 s (Triton's defaults are 0 to a few ms).
MAX_QUEUE_DELAY_US = 1_000_000


@dataclass(frozen=True)
class BatchingConfig:
    """How one model's requests are merged.

    Args:
        max_batch_size: most samples of one execution (≥ 1, at most the model's
            ``max_batch_size`` of ``ps.json``, which bounds a lookup's keys); a request of more
            samples than this (but within the model's limit) runs alone.
        max_queue_delay_us: the longest the oldest waiting request waits for more requests
            to join its batch, or, for requests queued behind an execution, the longest they
            wait after it ends (0: merge only what is waiting already, never wait).
        preferred_batch_size: once nothing more is waiting, a batch of fewer samples waits
            for more (at most ``max_queue_delay_us`` since its oldest request, or since the
            end of the execution it queued behind); one of at least this many runs at once.
            Every waiting request joins a batch up to ``max_batch_size`` whatever this is
            (Triton's batcher sends its largest preferred size instead). 0 (the default):
            ``max_batch_size``. A smaller batch also closes as soon as no more requests can
            come (this server's rule; Triton waits the delay): nothing else is waiting or
            being read
            (:meth:`DynamicBatcher.arrival`) and it holds as many requests as the known
            clients can send at once. A client (connection) is known once it has sent a
            second request, while it has a request in flight and for
            :data:`~hps.serving.known_clients.KNOWN_CLIENT_NS` after its last request or
            answer, unless its connection closed (HTTP); it counts as the most requests it had
            in flight at once over the last one to two seconds
            (:mod:`hps.serving.known_clients`). So a lone client does not wait, nor does one
            that opens a connection (HTTP) or channel (gRPC) per request, and closed-loop
            clients that all come back within the delay share one execution. Requests that
            queued while an execution ran also wait for as many requests as it has just
            answered to each known client (at most ``max_queue_delay_us`` from its end). A
            request with no client (``None``) counts as a client that never comes back.

    Raises:
        ValueError: naming the knob, for a value outside its range.
    """

    max_batch_size: int
    max_queue_delay_us: int = 0
    preferred_batch_size: int = 0

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("max_batch_size", 1, 2**31 - 1),
            ("max_queue_delay_us", 0, MAX_QUEUE_DELAY_US),
            ("preferred_batch_size", 0, self.max_batch_size),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer from {lo} to {hi}, got {v!r}")

    @property
    def preferred(self) -> int:
        """The effective preferred batch size: ``preferred_batch_size``, or
        ``max_batch_size`` when it is 0."""
        return self.preferred_batch_size or self.max_batch_size


@dataclass(frozen=True)
class BatchedResult:
    """One request's share of an execution: its output rows and where its time went.

    ``outputs`` are ``(B,)`` float32 arrays (views into the execution's outputs);
    ``queue_ns`` from :meth:`DynamicBatcher.submit` to the start of its execution;
    ``infer_ns`` the execution (merge, lookups, dense run, split); ``batch_size`` the samples
    of the execution.
    """

    outputs: Tensors
    queue_ns: int
    infer_ns: int
    batch_size: int


@dataclass
class _Pending:
    inputs: CheckedInputs
    samples: int
    submitted_ns: int
    future: Future[BatchedResult]
    client: Hashable | None


class Arrival:
    """A request announced to its model's batcher (:meth:`DynamicBatcher.arrival`) while the
    server reads and parses it: the batch it may join waits for it (at most
    ``max_queue_delay_us``). Use it as a context manager: leaving it unsubmitted (a request
    that failed to parse) withdraws the announcement.

    >>> with batcher.arrival() as a:                               # doctest: +SKIP
    ...     fut = a.submit(servable.check(parse(body)))
    """

    def __init__(self, batcher: DynamicBatcher, client: Hashable | None) -> None:
        self._batcher = batcher
        self._client = client
        self._open = True

    def submit(self, inputs: CheckedInputs) -> Future[BatchedResult]:
        """Queue the request (see :meth:`DynamicBatcher.submit`); the announcement ends.

        Raises:
            RuntimeError: submitted twice, or the batcher is closed.
        """
        if not self._open:
            raise RuntimeError("this arrival was already submitted or withdrawn")
        self._open = False
        return self._batcher._enqueue(inputs, arrived=True, client=self._client)

    def withdraw(self) -> None:
        """End the announcement without a request (nothing happens if it already ended)."""
        if self._open:
            self._open = False
            self._batcher._withdraw()

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc: object) -> None:
        self.withdraw()


def merge_requests(servable: DLRMServable, requests: Sequence[CheckedInputs]) -> CheckedInputs:
    """The inputs of one execution: each input of ``requests`` (checked by
    :meth:`DLRMServable.check`) concatenated along the batch, id lists padded with -1 to the
    widest request's.

    Returns:
        ``dense (ΣB, D) float32`` and ``ids_<t> (ΣB, max w_t) int64``.
    """
    if len(requests) == 1:
        return requests[0]
    merged = CheckedInputs(dense=np.concatenate([r["dense"] for r in requests]))
    for name in servable.id_inputs:
        parts = [r[name] for r in requests]
        widths = {p.shape[1] for p in parts}
        if len(widths) == 1:
            merged[name] = np.concatenate(parts)
            continue
        width = max(widths)
        out = np.full((sum(p.shape[0] for p in parts), width), -1, dtype=np.int64)
        row = 0
        for p in parts:
            out[row : row + p.shape[0], : p.shape[1]] = p
            row += p.shape[0]
        merged[name] = out
    return merged


class DynamicBatcher:
    """The inference thread of one model: merges waiting requests and runs them.

    Args:
        servable: the model (its :meth:`~DLRMServable.infer` runs each execution).
        cfg: how requests are merged.
        counts: the model's statistics (executions and their batch sizes are counted here).
        torch_threads: torch intra-op threads of the inference thread (OpenMP's setting is
            per thread: other threads keep theirs). The lookups and pooling are many small
            ops; on a busy host each parallel one waits for descheduled helper threads (tiny
            model, batch 16, 2 cores under load: 1.3 s per execution with 2 threads, 60 ms
            with 1), so 1 is the default.
        clock: the nanosecond clock of queue times and known clients (tests inject one).

    Raises:
        ValueError: ``cfg.max_batch_size`` above the model's ``max_batch_size``.
    """

    def __init__(
        self,
        servable: DLRMServable,
        cfg: BatchingConfig,
        counts: ModelCounts,
        torch_threads: int = 1,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if cfg.max_batch_size > servable.max_batch_size:
            raise ValueError(
                f"model {servable.name!r}: batching max_batch_size {cfg.max_batch_size} "
                f"exceeds the model's max_batch_size {servable.max_batch_size} (ps.json), "
                "which bounds one lookup"
            )
        self.servable, self.cfg, self.counts = servable, cfg, counts
        self._queue: deque[_Pending] = deque()
        self._arriving = 0  # announced requests not yet submitted (Arrival)
        self._clients = KnownClients()  # who can still send: a batch waits only for them
        self._clock = clock
        self._cond = threading.Condition()
        self._closed = False
        self._waiting = False  # a batch waits for more requests (the inference thread)
        # the latest execution's answered requests of known clients, by client, less the
        # requests each client has sent since: a batch of requests queued during that
        # execution waits for them (closed-loop callers send again once answered; a
        # connection may carry several, as grpcio's channels of one process share one);
        # a client none of whose answered requests is still awaited has no entry
        self._due: dict[Hashable, int] = {}
        self._due_deadline = 0  # the clock's ns: the latest execution's end + the delay
        self._torch_threads = torch_threads
        self._thread = threading.Thread(
            target=self._loop, name=f"hps-batcher-{servable.name[:32]}", daemon=True
        )
        self._thread.start()

    def arrival(self, client: Hashable | None = None) -> Arrival:
        """Announce a request the caller is reading: until it is submitted or withdrawn, a
        batch it could join waits for it (at most ``max_queue_delay_us``). ``client``: who
        sends it (a connection's peer address; ``None``: a client that never comes back),
        for the known clients (:mod:`hps.serving.known_clients`).

        Raises:
            RuntimeError: the batcher is closed.
        """
        with self._cond:
            self._check_open()
            self._arriving += 1
        return Arrival(self, client)

    def submit(
        self, inputs: CheckedInputs, client: Hashable | None = None
    ) -> Future[BatchedResult]:
        """Queue one request (inputs checked by :meth:`DLRMServable.check`); its future
        resolves to its :class:`BatchedResult`, or to the exception that failed it. With
        nothing else queued or announced it runs at once. ``client``: as for
        :meth:`arrival`.

        Raises:
            RuntimeError: the batcher is closed.
        """
        return self._enqueue(inputs, arrived=False, client=client)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"model {self.servable.name!r}: the server is shutting down")

    def _enqueue(
        self, inputs: CheckedInputs, arrived: bool, client: Hashable | None
    ) -> Future[BatchedResult]:
        fut: Future[BatchedResult] = Future()
        with self._cond:
            now = self._clock()
            if arrived:
                self._arriving -= 1
            self._check_open()
            self._clients.sweep(now)  # also when no batch asks (a full one)
            if client is not None:
                self._clients.sent(client, now)
                n = self._due.get(client)
                if n is not None:  # one of the answered ones comes back
                    if n > 1:
                        self._due[client] = n - 1
                    else:
                        del self._due[client]
            item = _Pending(inputs, int(inputs["dense"].shape[0]), now, fut, client)
            self._queue.append(item)
            self._cond.notify()
        return fut

    def _withdraw(self) -> None:
        with self._cond:
            self._arriving -= 1
            self._cond.notify()  # the batch waiting for it may close now

    @property
    def known_clients(self) -> int:
        """How many clients (connections) are known: came back, so a batch may wait for
        them."""
        with self._cond:
            return len(self._clients)

    @property
    def remembered_clients(self) -> int:
        """How many clients (connections) are remembered, known or seen once (bounded)."""
        with self._cond:
            return self._clients.remembered

    @property
    def batch_waiting(self) -> bool:
        """Whether the inference thread holds a batch, smaller than its preferred size, that
        waits for more requests: until the delay has passed since its oldest request (for
        requests queued behind an execution, while that execution's answered requests have
        not come back: since its end), or no more can come (no announced request is being
        read and it holds as many requests as the known clients can have in flight at
        once)."""
        with self._cond:
            return self._waiting

    def forget(self, client: Hashable) -> None:
        """``client``'s connection closed: it sends no more requests, so no batch waits for
        it (the HTTP server calls this when a connection is lost)."""
        with self._cond:
            self._clients.forget(client, self._clock())
            self._due.pop(client, None)
            self._cond.notify()  # the batch waiting for it may close now

    def close(self, timeout_s: float = 10.0) -> None:
        """Run what is queued, then stop the inference thread (at most ``timeout_s``)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the inference thread
    def _loop(self) -> None:
        torch.set_num_threads(self._torch_threads)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            # a request whose future was cancelled (its caller went away) is not run
            live = [p for p in batch if p.future.set_running_or_notify_cancel()]
            if len(live) < len(batch):  # not answered: nothing of theirs is waited for
                self._release([p for p in batch if p.future.cancelled()], due=False)
            if live:
                with self._cond:
                    self._due.clear()  # only this execution's answers are waited for
                self._execute(live)

    def _next_batch(self) -> list[_Pending] | None:
        """The requests of the next execution (``None``: closed and drained)."""
        limit, delay_ns = self.cfg.max_batch_size, self.cfg.max_queue_delay_us * 1000
        preferred = self.cfg.preferred
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            batch = [self._queue.popleft()]
            samples = batch[0].samples
            deadline = batch[0].submitted_ns + delay_ns
            while samples < limit:
                if self._queue:
                    nxt = self._queue[0]
                    if samples + nxt.samples > limit:
                        break  # it opens the next batch
                    batch.append(self._queue.popleft())
                    samples += nxt.samples
                    continue
                if samples >= preferred or self._closed:
                    break
                if not self._arriving and self._all_clients_in(batch):
                    break  # nothing is on its way and no one else is known to send
                now = self._clock()
                wait_ns = deadline - now
                if wait_ns <= 0:
                    if not self._due:
                        break
                    # a just-answered caller is on its way (``_release`` set the deadline)
                    wait_ns = self._due_deadline - now
                    if wait_ns <= 0:
                        break
                wait_ns = min(wait_ns, SWEEP_NS)  # wake for the next sweep: silent clients
                self._waiting = True
                self._cond.wait(wait_ns / 1e9)
                self._waiting = False
            return batch

    def _all_clients_in(self, batch: list[_Pending]) -> bool:
        """Whether ``batch`` holds as many requests as the known clients can send at once
        (:meth:`KnownClients.capacity`; one connection may carry several callers). Its
        requests of clients that are not known count too: the batch closes no later for
        them. Called with the lock held."""
        return len(batch) >= self._clients.capacity(self._clock())

    def _release(self, batch: list[_Pending], due: bool = True) -> None:
        """The requests of ``batch`` are answered (before their futures resolve): their
        clients have fewer in flight, and, with ``due``, each one of a known client is
        waited for until ``max_queue_delay_us`` from now by the requests that queued behind
        this execution."""
        with self._cond:
            now = self._clock()
            if due:
                self._due_deadline = now + self.cfg.max_queue_delay_us * 1000
            for p in batch:
                if p.client is not None:
                    self._clients.answered(p.client, now)
                    if due and self._clients.open(p.client):
                        self._due[p.client] = self._due.get(p.client, 0) + 1

    def _execute(self, batch: list[_Pending]) -> None:
        """Run ``batch`` as one execution and resolve each request's future; a failed merged
        execution is retried request by request."""
        start = self._clock()
        try:
            merged = merge_requests(self.servable, [p.inputs for p in batch])
            outputs = self.servable.infer(merged)
        except Exception as e:
            if len(batch) == 1:
                self._release(batch)
                self._resolve_error(batch[0], e)
                return
            log.debug(
                "model %r: a merged execution of %d requests failed (%s); running each alone",
                self.servable.name,
                len(batch),
                e,
            )
            for p in batch:
                self._execute([p])
            return
        infer_ns = self._clock() - start
        size = sum(p.samples for p in batch)
        self.counts.executed(size, infer_ns)
        self._release(batch)
        # one check of the whole execution; a request's own rows are checked only when some
        # row is not finite (the error names its request's sample)
        finite = all(np.isfinite(v).all() for v in outputs.values())
        row = 0
        for p in batch:
            part = {k: v[row : row + p.samples] for k, v in outputs.items()}
            row += p.samples
            if not finite:
                try:
                    check_outputs_finite(self.servable.name, part)
                except Exception as e:
                    self._resolve_error(p, e)
                    continue
            p.future.set_result(BatchedResult(part, start - p.submitted_ns, infer_ns, size))

    @staticmethod
    def _resolve_error(p: _Pending, e: Exception) -> None:
        p.future.set_exception(e)


def start_batchers(
    servables: dict[str, DLRMServable],
    configs: dict[str, BatchingConfig],
    counts: dict[str, ModelCounts],
    torch_threads: int = 1,
) -> dict[str, DynamicBatcher]:
    """One running :class:`DynamicBatcher` per model (model name → batcher); those started
    are closed again if a later one cannot start."""
    out: dict[str, DynamicBatcher] = {}
    try:
        for name, s in servables.items():
            out[name] = DynamicBatcher(s, configs[name], counts[name], torch_threads)
    except BaseException:
        for b in out.values():
            b.close()
        raise
    return out


def model_config(s: DLRMServable, batching: BatchingConfig) -> dict[str, Any]:
    """Triton's configuration of ``s`` served with ``batching``: the servable's
    (:meth:`DLRMServable.config`) with Triton's ``dynamic_batching`` section."""
    return {
        **s.config(),
        "dynamic_batching": {
            "preferred_batch_size": [batching.preferred],
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
        },
    }
