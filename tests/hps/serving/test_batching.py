"""Dynamic batching: concurrent requests merged into one execution, each client getting exactly
the rows it would get alone (bit-equal), over the batcher itself and through HTTP and gRPC at
once; the batch bound, the queue delay, the statistics Triton reports, the model configuration;
a failed merged execution fails only the request that caused it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.batcher import (
    BatchedResult,
    BatchingConfig,
    DynamicBatcher,
    merge_requests,
    model_config,
)
from hps.serving.http_server import InferenceServer, ModelBatching, ServerConfig, build_servables
from hps.serving.servable import DLRMServable, Tensors
from hps.serving.statistics import RECENT_REQUESTS, ModelCounts, PhaseNs
from hps.types import Pooling
from tests.hps.serving.tiny_dlrm import make_request, triton_inputs

# (batch, narrow id lists, seed) of the concurrent requests: sizes 1 to 17, some narrow
REQUESTS = [
    (1, False, 0),
    (5, True, 1),
    (16, False, 2),
    (3, True, 3),
    (17, False, 4),
    (2, False, 5),
]


@pytest.fixture(scope="module")
def servable(ps: HierarchicalParameterServer) -> DLRMServable:
    return build_servables(ps)["tiny"]


def grpc_inputs(req: Tensors) -> list[tg.InferInput]:
    """``req`` as tritonclient.grpc inputs (raw contents)."""
    out = []
    for name, arr in req.items():
        x = tg.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT64")
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def _requests(model: DLRM) -> list[Tensors]:
    return [make_request(model, b, seed=100 + s, narrow=n) for b, n, s in REQUESTS]


def test_merged_execution_is_bit_equal_to_each_request_alone(servable, tiny) -> None:
    """All requests announced before the first is submitted (a 1 s delay, the bound their
    sum): one execution of every sample, and each request's rows are bit-equal to running it
    alone."""
    reqs = _requests(tiny)
    alone = [servable.infer(r) for r in reqs]
    counts = ModelCounts()
    total = sum(b for b, _, _ in REQUESTS)
    batcher = DynamicBatcher(servable, BatchingConfig(total, max_queue_delay_us=10**6), counts)
    try:
        arrivals = [batcher.arrival() for _ in reqs]
        futures = [a.submit(servable.check(r)) for a, r in zip(arrivals, reqs, strict=True)]
        done = [f.result(timeout=60) for f in futures]
    finally:
        batcher.close()
    assert counts.executions == 1 and counts.batch_ns.keys() == {total}
    for got, want, (b, _, _) in zip(done, alone, REQUESTS, strict=True):
        assert got.batch_size == total
        for name in ("logits", "probability"):
            assert got.outputs[name].shape == (b,)
            assert np.array_equal(got.outputs[name], want[name]), name


def test_merge_pads_narrow_id_lists_with_minus_one(servable, tiny) -> None:
    a = servable.check(make_request(tiny, 2, seed=1, narrow=True))
    b = servable.check(make_request(tiny, 1, seed=2))
    narrow = next(n for n in servable.id_inputs if a[n].shape[1] < b[n].shape[1])
    m = merge_requests(servable, [a, b])
    w = a[narrow].shape[1]
    assert m[narrow].shape == (3, b[narrow].shape[1])
    assert np.array_equal(m[narrow][:2, :w], a[narrow]) and (m[narrow][:2, w:] == -1).all()
    assert np.array_equal(m[narrow][2:], b[narrow])
    assert np.array_equal(m["dense"], np.concatenate([a["dense"], b["dense"]]))


def test_an_execution_never_exceeds_max_batch_size(servable, tiny) -> None:
    """Requests of 16 samples under a bound of 40: executions of at most 32; a request larger
    than the bound (but within the model's 64) runs alone."""
    counts = ModelCounts()
    batcher = DynamicBatcher(servable, BatchingConfig(40, max_queue_delay_us=200_000), counts)
    try:
        reqs = [servable.check(make_request(tiny, b, seed=i)) for i, b in enumerate([16] * 5)]
        reqs.append(servable.check(make_request(tiny, 50, seed=9)))
        arrivals = [batcher.arrival() for _ in reqs]
        for f in [a.submit(r) for a, r in zip(arrivals, reqs, strict=True)]:
            f.result(timeout=60)
    finally:
        batcher.close()
    assert max(counts.batch_ns) == 50 and counts.batch_ns[50][0] == 1
    assert set(counts.batch_ns) - {50} <= {16, 32}
    assert sum(size * c for size, (c, _) in counts.batch_ns.items()) == 5 * 16 + 50


def test_a_failed_merged_execution_fails_only_its_culprit(servable, tiny, monkeypatch) -> None:
    """An execution holding the marked sample raises; merged, everything fails, so each
    request runs again alone: only the marked one fails."""
    real = servable.infer

    def picky(inputs: Tensors) -> Tensors:
        if (inputs["dense"][:, 0] == 7.0).any():
            raise RuntimeError("sample marked 7")
        return real(inputs)

    monkeypatch.setattr(servable, "infer", picky)
    reqs = _requests(tiny)
    reqs[2]["dense"][3, 0] = 7.0
    total = sum(b for b, _, _ in REQUESTS)
    batcher = DynamicBatcher(servable, BatchingConfig(total, 500_000), ModelCounts())
    try:
        arrivals = [batcher.arrival() for _ in reqs]
        futures = [a.submit(servable.check(r)) for a, r in zip(arrivals, reqs, strict=True)]
        with pytest.raises(RuntimeError, match="sample marked 7"):
            futures[2].result(timeout=60)
        ok = [f.result(timeout=60) for i, f in enumerate(futures) if i != 2]
    finally:
        batcher.close()
    monkeypatch.undo()
    want = [real(r) for i, r in enumerate(reqs) if i != 2]
    for got, w in zip(ok, want, strict=True):
        assert np.array_equal(got.outputs["logits"], w["logits"])


def test_a_lone_request_does_not_wait_for_the_queue_delay(servable, tiny) -> None:
    """Nothing queued, nothing announced: waiting could not grow the batch, so the request
    runs at once, not after the delay (1 s: a request that waited it shows queue_ns ≥ 1 s);
    each of several lone requests is its own execution, bit-equal to running it alone."""
    delay_us = 10**6
    counts = ModelCounts()
    batcher = DynamicBatcher(servable, BatchingConfig(64, max_queue_delay_us=delay_us), counts)
    reqs = [make_request(tiny, b, seed=40 + b) for b in (1, 7, 16)]
    try:
        done = [batcher.submit(servable.check(r)).result(timeout=60) for r in reqs]
    finally:
        batcher.close()
    assert counts.executions == 3
    for got, r in zip(done, reqs, strict=True):
        assert got.queue_ns < delay_us * 1000 and got.batch_size == r["dense"].shape[0]
        assert np.array_equal(got.outputs["logits"], servable.infer(r)["logits"])


def test_a_batch_waits_for_an_announced_request_until_it_comes_or_withdraws(servable, tiny) -> None:
    """A request submitted while another is announced waits for it (the delay is 1 s) and
    both run as one execution, bit-equal to each alone; an announcement withdrawn (a request
    that failed to parse) releases the batch waiting for it."""
    counts = ModelCounts()
    batcher = DynamicBatcher(servable, BatchingConfig(64, max_queue_delay_us=10**6), counts)
    a, b, c = (make_request(tiny, n, seed=50 + n) for n in (3, 5, 2))
    try:
        late = batcher.arrival()
        first = batcher.submit(servable.check(a))
        with late:
            second = late.submit(servable.check(b))
        merged = [first.result(timeout=60), second.result(timeout=60)]
        failing = batcher.arrival()
        third = batcher.submit(servable.check(c))
        with failing:  # parsing failed: leaving the block withdraws it
            pass
        alone = third.result(timeout=60)
        with pytest.raises(RuntimeError, match="already submitted or withdrawn"):
            late.submit(servable.check(a))
    finally:
        batcher.close()
    assert [r.batch_size for r in merged] == [8, 8] and alone.batch_size == 2
    assert counts.executions == 2
    for got, r in [*zip(merged, (a, b), strict=True), (alone, c)]:
        assert np.array_equal(got.outputs["logits"], servable.infer(r)["logits"])


def test_batching_config_is_refused_out_of_range(servable) -> None:
    with pytest.raises(ValueError, match="max_queue_delay_us must be an integer from 0 to"):
        BatchingConfig(8, -1)
    with pytest.raises(
        ValueError, match="batching max_batch_size 65 exceeds the model's max_batch_size 64"
    ):
        ServerConfig(max_batch_size=65).batching(servable)
    with pytest.raises(ValueError, match="NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US"):
        ModelBatching.parse("tiny:8")
    with pytest.raises(ValueError, match="names a model twice"):
        ServerConfig(model_batching=(ModelBatching("a", 1, 0), ModelBatching("a", 2, 0)))


def test_concurrent_http_and_grpc_clients_get_their_own_rows(ps, servable, tiny) -> None:
    """12 clients (HTTP and gRPC alternating) at once through one server with a 50 ms queue
    delay: every answer bit-equal to its request alone, fewer executions than requests, the
    statistics and both protocols' model configuration say so."""
    cfg = ServerConfig(
        port=0, grpc_port=0, model_batching=(ModelBatching("tiny", 64, 50_000),), workers=2
    )
    reqs = [make_request(tiny, 1 + i % 4, seed=200 + i, narrow=i % 3 == 0) for i in range(12)]
    alone = [servable.infer(r)["logits"] for r in reqs]
    with InferenceServer(ps, cfg) as srv:
        start = threading.Barrier(len(reqs))

        def call(i: int) -> np.ndarray:
            start.wait(30)
            if i % 2:
                c = tg.InferenceServerClient(str(srv.grpc_address))
                return c.infer("tiny", grpc_inputs(reqs[i])).as_numpy("logits")
            h = th.InferenceServerClient(srv.address)
            return h.infer("tiny", triton_inputs(reqs[i])).as_numpy("logits")

        with ThreadPoolExecutor(len(reqs)) as ex:
            got = list(ex.map(call, range(len(reqs))))
        http = th.InferenceServerClient(srv.address)
        st = http.get_inference_statistics("tiny")["model_stats"][0]
        hcfg = http.get_model_config("tiny")
        gcfg = tg.InferenceServerClient(str(srv.grpc_address)).get_model_config(
            "tiny", as_json=True
        )["config"]
    for g, want in zip(got, alone, strict=True):
        assert np.array_equal(g, want)
    assert st["inference_stats"]["success"]["count"] == len(reqs)
    assert st["inference_count"] == sum(r["dense"].shape[0] for r in reqs)
    assert st["execution_count"] < len(reqs)
    assert sum(b["compute_infer"]["count"] for b in st["batch_stats"]) == st["execution_count"]
    assert st["inference_stats"]["queue"]["ns"] > 0
    want_batching = {"preferred_batch_size": [64], "max_queue_delay_microseconds": 50_000}
    assert hcfg["dynamic_batching"] == want_batching
    assert gcfg["dynamic_batching"] == {
        "preferred_batch_size": [64],
        "max_queue_delay_microseconds": "50000",  # protobuf's JSON writes uint64 as text
    }


def test_non_finite_scores_are_refused_and_counted(ps, servable, tiny) -> None:
    """A finite dense input of 3e38 overflows the model: HTTP 422 and gRPC INVALID_ARGUMENT
    naming the model and the sample, counted in the stats; its batch mates are answered."""
    bad = make_request(tiny, 3, seed=300)
    bad["dense"][1, :] = 3e38
    good = make_request(tiny, 2, seed=301)
    cfg = ServerConfig(port=0, grpc_port=0, model_batching=(ModelBatching("tiny", 64, 20_000),))
    with InferenceServer(ps, cfg) as srv:
        http = th.InferenceServerClient(srv.address, concurrency=2)
        g = tg.InferenceServerClient(str(srv.grpc_address))
        pending = http.async_infer("tiny", triton_inputs(good))
        with pytest.raises(InferenceServerException) as h:
            http.infer("tiny", triton_inputs(bad))
        assert np.array_equal(
            pending.get_result().as_numpy("logits"), servable.infer(good)["logits"]
        )
        with pytest.raises(InferenceServerException) as r:
            g.infer("tiny", grpc_inputs(bad))
        st = http.get_inference_statistics("tiny")["model_stats"][0]
    assert h.value.status() == "422", h.value
    assert "model 'tiny' computed a non-finite logits" in h.value.message()
    assert "for sample 1" in h.value.message()
    assert r.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert r.value.message() == h.value.message()
    assert st["non_finite_output"] == 2 and st["inference_stats"]["fail"]["count"] == 2


def _pooled_in_order(servable: DLRMServable, inputs: Tensors) -> np.ndarray:
    """The reference pooled block ``(B, T, dim) float32``: each table's rows looked up one
    table at a time (``lookup``), summed key by key in bag order from 0.0 in float32, padding
    skipped, MEAN bags divided by their keys."""
    b = inputs["dense"].shape[0]
    tables = servable.tables
    out = np.zeros((b, len(tables), tables[0].dim), np.float32)
    for j, t in enumerate(tables):
        ids = inputs[f"ids_{t.name}"]
        rows = servable.session.lookup(t.name, torch.from_numpy(np.maximum(ids, 0))).numpy()
        for i in range(b):
            acc, n = np.zeros(t.dim, np.float32), 0
            for k in range(ids.shape[1]):
                if ids[i, k] >= 0:
                    acc, n = acc + rows[i, k], n + 1
            out[i, j] = acc / np.float32(n) if Pooling(t.combiner) is Pooling.MEAN and n else acc
    return out


def test_pooled_block_is_each_bag_summed_in_request_order(servable, tiny) -> None:
    """The pooled block a (merged) execution feeds the dense graph is, bit for bit, each bag's
    rows summed in request order from 0 (padding skipped, MEAN tables divided), for requests
    with and without padding, merged and alone."""
    assert {Pooling(t.combiner) for t in servable.tables} == set(Pooling)
    reqs = [servable.check(make_request(tiny, b, seed=40 + b, narrow=b == 3)) for b in (1, 3, 5)]
    full = {n: np.where(a < 0, 7, a) if n.startswith("ids_") else a for n, a in reqs[0].items()}
    for inputs in (*reqs, merge_requests(servable, reqs), full):
        b = inputs["dense"].shape[0]
        got = servable._pool(inputs, b)
        assert got.shape == (b, len(servable.tables), servable.tables[0].dim)
        assert np.array_equal(got, _pooled_in_order(servable, inputs))


class StillClock:
    """A nanosecond clock that moves only when the test moves it (no client is forgotten
    however slow the host; a batch that waits for the delay runs only once it is moved)."""

    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def _until_waiting(batcher: DynamicBatcher) -> None:
    """Wait (at most 60 s) until ``batcher`` holds a batch that waits for more requests."""
    for _ in range(60_000):
        if batcher.batch_waiting:
            return
        threading.Event().wait(0.001)
    raise AssertionError("no batch waited")


def _at_once(
    batcher: DynamicBatcher, servable: DLRMServable, tiny: DLRM, clients: str
) -> list[Future[BatchedResult]]:
    """One single-sample request of each of ``clients`` (a name may repeat), all in flight at
    once: an announced request holds their batch until they are all queued."""
    with batcher.arrival():
        return [
            batcher.submit(servable.check(make_request(tiny, 1, seed=i)), client=c)
            for i, c in enumerate(clients)
        ]


def test_a_preferred_batch_size_closes_a_batch_before_every_known_client_is_in(
    servable, tiny
) -> None:
    """Preferred size 8, a 1 s delay on a clock that stands still, known clients a, b, c (4
    requests in flight at once, at most): a's 3 samples wait, b's 5 close the batch at 8
    without c's; a batch that cannot reach it runs once the delay has passed. Every answer is
    bit-equal to its request alone."""
    clock = StillClock()
    counts = ModelCounts()
    cfg = BatchingConfig(64, max_queue_delay_us=10**6, preferred_batch_size=8)
    batcher = DynamicBatcher(servable, cfg, counts, clock=clock)
    a, b, a_late = (make_request(tiny, n, seed=60 + n) for n in (3, 5, 2))
    try:
        for f in _at_once(batcher, servable, tiny, "aabbcc"):  # each came back
            f.result(timeout=60)
        executions = counts.executions
        first = batcher.submit(servable.check(a), client="a")
        second = batcher.submit(servable.check(b), client="b")
        merged = [first.result(timeout=60), second.result(timeout=60)]
        assert counts.executions == executions + 1
        late = batcher.submit(servable.check(a_late), client="a")
        _until_waiting(batcher)
        assert not late.done()  # 2 < 8 samples and c may still send: it waits
        clock.ns += 10**9  # the delay has passed
        alone = late.result(timeout=60)
    finally:
        batcher.close()
    assert [r.batch_size for r in merged] == [8, 8]
    assert alone.batch_size == 2
    for got, r in [*zip(merged, (a, b), strict=True), (alone, a_late)]:
        assert np.array_equal(got.outputs["logits"], servable.infer(r)["logits"])


def test_preferred_batch_size_is_checked_capped_and_reported(servable) -> None:
    with pytest.raises(ValueError, match="preferred_batch_size must be an integer from 0 to 8"):
        BatchingConfig(8, 0, preferred_batch_size=9)
    with pytest.raises(ValueError, match=r"preferred_batch_size must be an integer from 0 to"):
        ServerConfig(preferred_batch_size=-1)
    cfg = ServerConfig(preferred_batch_size=1000).batching(servable)
    assert (cfg.max_batch_size, cfg.preferred_batch_size) == (64, 64)  # the model's 64 caps it
    m = ModelBatching.parse("tiny:32:100:16")
    assert m == ModelBatching("tiny", 32, 100, 16)
    per_model = ServerConfig(preferred_batch_size=8, model_batching=(m,)).batching(servable)
    assert (per_model.max_batch_size, per_model.preferred_batch_size) == (32, 16)
    three = ServerConfig(preferred_batch_size=8, model_batching=(ModelBatching.parse("tiny:32:0"),))
    assert three.batching(servable).preferred_batch_size == 8  # the server's
    with pytest.raises(ValueError, match=r"\[:PREFERRED_BATCH_SIZE\] \(two or three integers\)"):
        ModelBatching.parse("tiny:8:1:2:3")
    with pytest.raises(ValueError, match="'tiny': preferred_batch_size must be .* got -5"):
        ModelBatching.parse("tiny:32:100:-5")
    with pytest.raises(ValueError, match="'tiny': max_queue_delay_us must be .* got 1000001"):
        ModelBatching.parse("tiny:32:1000001")
    with pytest.raises(ValueError, match="'tiny': max_batch_size must be .* got -1"):
        ModelBatching.parse("tiny:-1:0")
    doc = model_config(servable, BatchingConfig(64, 100, preferred_batch_size=16))
    assert doc["dynamic_batching"]["preferred_batch_size"] == [16]


def test_the_default_batching_values_are_reported_in_the_model_config(servable) -> None:
    """The server's default knobs: each model's own batch size, a 10 ms delay, and a preferred
    size of 0, which is the batch size (Triton's batcher without preferred sizes): the model
    configuration shows the values in effect."""
    cfg = ServerConfig().batching(servable)
    assert (cfg.max_batch_size, cfg.max_queue_delay_us, cfg.preferred_batch_size) == (64, 10_000, 0)
    assert cfg.preferred == 64
    assert model_config(servable, cfg)["dynamic_batching"] == {
        "preferred_batch_size": [64],
        "max_queue_delay_microseconds": 10_000,
    }
    assert BatchingConfig(32, 0, preferred_batch_size=4).preferred == 4


def test_model_counts_keep_the_latest_requests_latencies_in_order() -> None:
    counts = ModelCounts()
    for k in range(RECENT_REQUESTS + 3):
        counts.succeeded(10 * k, 1, PhaseNs(queue=k, compute_infer=2 * k))
    latest = counts.recent_ns(2)
    k = RECENT_REQUESTS + 2
    assert latest == [(10 * (k - 1), 3 * (k - 1), 2 * (k - 1)), (10 * k, 3 * k, 2 * k)]
    assert len(counts.recent_ns(10**9)) == RECENT_REQUESTS and counts.recent_ns(0) == []


def test_phase_add_sums_every_phase() -> None:
    """PhaseNs.add names its fields one by one: a phase added later must be summed too."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(PhaseNs)]
    total = PhaseNs(**{n: 1 + i for i, n in enumerate(names)})
    total.add(PhaseNs(**{n: 10 * (1 + i) for i, n in enumerate(names)}))
    assert dataclasses.asdict(total) == {n: 11 * (1 + i) for i, n in enumerate(names)}


def test_a_batch_closes_once_every_known_client_has_a_request_in_it(servable, tiny) -> None:
    """The default preferred size (the batch size, 64), a 1 s delay on a clock that stands
    still (a batch that waits for the delay never runs): a client's first requests never wait
    (``a`` has not come back: not known), nor does a lone known client (``a``'s second
    request, its own batch); once ``b`` has come back too, ``b``'s request waits for ``a``'s
    next one and both run as one execution, bit-equal to each alone."""
    counts = ModelCounts()
    cfg = BatchingConfig(64, max_queue_delay_us=10**6)
    batcher = DynamicBatcher(servable, cfg, counts, clock=StillClock())
    r = [make_request(tiny, n, seed=70 + n) for n in (2, 3, 4)]
    try:
        first = [f.result(timeout=60) for f in _at_once(batcher, servable, tiny, "ab")]
        alone = batcher.submit(servable.check(r[0]), client="a").result(timeout=60)
        fb = batcher.submit(servable.check(r[1]), client="b")
        _until_waiting(batcher)
        assert not fb.done()  # a, known, may still send
        fa = batcher.submit(servable.check(r[2]), client="a")
        merged = [fb.result(timeout=60), fa.result(timeout=60)]
    finally:
        batcher.close()
    assert [x.batch_size for x in first] == [2, 2]  # no one known yet: nothing to wait for
    assert alone.batch_size == 2  # a came back; b has not
    assert [m.batch_size for m in merged] == [7, 7]
    assert counts.executions == 3
    for got, x in zip([alone, *merged], r, strict=True):
        assert np.array_equal(got.outputs["logits"], servable.infer(x)["logits"])


class HeldInfer:
    """A servable's ``infer`` that holds each execution until the test lets it go (``gate``)
    and tells when one has started (``entered``)."""

    def __init__(self, real: Callable[[Tensors], Tensors]) -> None:
        self.real = real
        self.gate, self.entered = threading.Event(), threading.Event()

    def __call__(self, inputs: Tensors) -> Tensors:
        self.entered.set()
        assert self.gate.wait(60)
        return self.real(inputs)


#: ns the tests' clock moves at a time: past their 0.3 s delay, within the second that keeps
#: a silent client known
STEP_NS = 350_000_000


def _queued_behind(
    batcher: DynamicBatcher,
    servable: DLRMServable,
    clock: StillClock,
    held: HeldInfer,
    first: tuple[Tensors, str],
    queued: tuple[Tensors, str],
) -> Future[BatchedResult]:
    """``first`` (a request and its client) runs, held, once its own delay has passed; the
    ``queued`` one is submitted behind it and its delay passes too; then the held execution
    ends, and the queued request's batch is left waiting (asserted). Returns its future."""
    held.gate.clear()
    held.entered.clear()
    running = batcher.submit(servable.check(first[0]), client=first[1])
    clock.ns += STEP_NS  # it no longer waits for the other known clients
    assert held.entered.wait(60)
    behind = batcher.submit(servable.check(queued[0]), client=queued[1])
    clock.ns += STEP_NS  # the queued request's own delay has passed
    held.gate.set()
    assert running.result(timeout=60).batch_size == first[0]["dense"].shape[0]
    _until_waiting(batcher)
    assert not behind.done()  # the execution just answered a caller that may send again
    return behind


def test_a_request_queued_behind_an_execution_waits_for_the_clients_it_answered(
    servable, tiny, monkeypatch
) -> None:
    """Known clients a and b, one request in flight each, a 0.3 s delay on a clock that moves
    only when the test moves it. b's request runs (held until the test lets it go) while a's
    queues and a's delay passes. Once b's execution ends, a's request waits for b, whom it has
    just answered: b's next request joins it and the two run as one execution (Triton would
    run a's alone). If b sends nothing, the wait ends once the delay has passed since that
    execution ended. Each answer is bit-equal to its request alone."""
    real = servable.infer
    held = HeldInfer(real)
    clock = StillClock()
    cfg = BatchingConfig(64, max_queue_delay_us=300_000)
    batcher = DynamicBatcher(servable, cfg, ModelCounts(), clock=clock)
    r = [make_request(tiny, n, seed=80 + n) for n in range(1, 6)]
    try:
        for _ in range(2):  # a and b come back: known, one request in flight each
            [f.result(timeout=60) for f in _at_once(batcher, servable, tiny, "ab")]
        monkeypatch.setattr(servable, "infer", held)
        # b's next request comes: one execution of a's and b's
        fa = _queued_behind(batcher, servable, clock, held, (r[0], "b"), (r[1], "a"))
        fb = batcher.submit(servable.check(r[2]), client="b")
        merged = [fa.result(timeout=60), fb.result(timeout=60)]
        # b sends nothing: a runs alone once the delay has passed since b's execution ended
        fa = _queued_behind(batcher, servable, clock, held, (r[3], "b"), (r[4], "a"))
        clock.ns += STEP_NS
        late = fa.result(timeout=60)
    finally:
        held.gate.set()
        batcher.close()
    monkeypatch.undo()
    assert [m.batch_size for m in merged] == [2 + 3, 2 + 3]
    assert late.batch_size == 5
    for got, x in zip([*merged, late], [r[1], r[2], r[4]], strict=True):
        assert np.array_equal(got.outputs["logits"], real(x)["logits"])


def test_a_closed_connection_is_not_waited_for_behind_an_execution(
    servable, tiny, monkeypatch
) -> None:
    """Known clients a, b and c (c idle, so the batch cannot close for want of clients), a
    0.3 s delay on a clock that moves only when the test moves it. b's request runs, held;
    a's queues behind it and its delay passes; the execution ends and a's request waits for
    b's next one. b's connection closes: a's request runs at once, alone."""
    real = servable.infer
    held = HeldInfer(real)
    clock = StillClock()
    cfg = BatchingConfig(64, max_queue_delay_us=300_000)
    batcher = DynamicBatcher(servable, cfg, ModelCounts(), clock=clock)
    rb, ra = (make_request(tiny, n, seed=100 + n) for n in (1, 2))
    try:
        for _ in range(2):  # a, b, c come back: known, one request in flight each
            [f.result(timeout=60) for f in _at_once(batcher, servable, tiny, "abc")]
        monkeypatch.setattr(servable, "infer", held)
        fa = _queued_behind(batcher, servable, clock, held, (rb, "b"), (ra, "a"))
        batcher.forget("b")  # c, silent for 0.7 s, is still known
        alone = fa.result(timeout=60)
    finally:
        held.gate.set()
        batcher.close()
    monkeypatch.undo()
    assert alone.batch_size == 2
    assert np.array_equal(alone.outputs["logits"], real(ra)["logits"])


def test_a_connection_of_several_callers_is_waited_for_once_per_answered_request(
    servable, tiny, monkeypatch
) -> None:
    """Known client m, one connection carrying two callers (grpcio's channels of one process
    share one). m's first request runs (held) while its second queues and its delay passes;
    that execution answers one of m's requests, so the queued one waits for one more of m's
    (m still has a request in flight: it is waited for per answered request, not only when
    idle), and the two run as one execution."""
    real = servable.infer
    held = HeldInfer(real)
    clock = StillClock()
    cfg = BatchingConfig(64, max_queue_delay_us=300_000)
    batcher = DynamicBatcher(servable, cfg, ModelCounts(), clock=clock)
    r = [make_request(tiny, n, seed=90 + n) for n in (1, 2, 3)]
    try:
        for _ in range(2):  # m: two requests in flight at once, known
            [f.result(timeout=60) for f in _at_once(batcher, servable, tiny, "mm")]
        monkeypatch.setattr(servable, "infer", held)
        second = _queued_behind(batcher, servable, clock, held, (r[0], "m"), (r[1], "m"))
        third = batcher.submit(servable.check(r[2]), client="m")
        merged = [second.result(timeout=60), third.result(timeout=60)]
    finally:
        held.gate.set()
        batcher.close()
    monkeypatch.undo()
    assert [m.batch_size for m in merged] == [2 + 3, 2 + 3]
    for got, x in zip(merged, r[1:], strict=True):
        assert np.array_equal(got.outputs["logits"], real(x)["logits"])
