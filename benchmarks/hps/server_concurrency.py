"""The ``concurrency`` section of ``bench_server``: concurrent small-batch clients against the
dynamically batched server, beside the in-process limit, HTTP and gRPC.

The **in-process limit** of a batch size is what the same process computes with nothing in the
way: one ``torch.nn.functional.embedding_bag`` over all tables' rows fused into one resident
tensor (each table's bags as wide as its hotness, as the server's requests carry them), and
the exported dense graph in onnxruntime (all cores) — samples/s at that batch, the better of
torch on one thread or on all. It is measured right before and right after each server's
window of a cell, and the window is set against the mean of the two: a shared host's speed
drifts within seconds (the tiny model's limit at batch 256 read 380,000-810,000 samples/s
minutes apart), and one measurement before a window of several seconds catches a fast or a
slow stretch that the window does not.

Clients run in separate processes (``clients_per_process`` threads each, tritonclient), so
their Python work does not share the server's interpreter lock; each cell runs for
``seconds`` after a warm-up, and every answer is checked against the servable's own scores
for that request (bit-equal, batched or not).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.hps.raw_clients import grpc_raw_client, http_raw_client
from embark.models.dlrm import DLRM
from hps.serving.grpc_front.relay import GrpcFronts

log = logging.getLogger("bench_server")

CLIENTS = (1, 4, 16, 64)
BATCHES = (1, 16, 256)
PROTOCOLS = ("http", "grpc")
#: Every client a cell can run: tritonclient over HTTP or gRPC, or ``http-raw`` / ``grpc-raw``:
#: pre-serialized requests, each answer compared byte for byte with the answer checked in full
#: before the cell (:mod:`benchmarks.hps.raw_clients`).
CLIENT_KINDS = ("http", "grpc", "http-raw", "grpc-raw")
_MAX_PROCESSES = 4  # client processes per cell (threads share them)


#: Seconds of timed runs (at least) behind each in-process limit figure, per torch setting.
LIMIT_MIN_S = 0.25


def fused_limit(model: DLRM, onnx_path: str, batch: int, threads: int, n: int) -> float:
    """Samples/s of the in-process limit at ``batch``: the median of at least ``n`` timed
    runs and :data:`LIMIT_MIN_S` of them."""
    import onnxruntime as ort

    tables = model.workload.tables
    weights = [model.embeddings[t.name].weight.detach() for t in tables]
    fused = torch.cat(weights)  # every row resident, one tensor
    base = np.cumsum([0] + [w.shape[0] for w in weights[:-1]])
    hots = [t.hotness for t in tables]
    g = np.random.default_rng(batch)
    # (B, Σ hotness): sample after sample, each table's own bag width (what the server's
    # requests carry), so bag (b, j) of the flat ids is table j of sample b
    ids = np.concatenate(
        [base[j] + g.integers(0, t.num_rows, (batch, t.hotness)) for j, t in enumerate(tables)],
        axis=1,
    )
    flat = torch.from_numpy(ids.reshape(-1))
    starts = np.cumsum([0] + hots[:-1])
    offsets = torch.from_numpy(
        (np.arange(batch)[:, None] * sum(hots) + starts[None, :]).reshape(-1)
    )
    dense = g.random((batch, model.workload.dense_features), dtype=np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
    dim = fused.shape[1]

    def run() -> None:
        pooled = F.embedding_bag(flat, fused, offsets, mode="sum")  # (B · T, dim)
        sess.run(None, {"dense": dense, "pooled": pooled.view(batch, len(tables), dim).numpy()})

    best = 0.0
    saved = torch.get_num_threads()
    try:
        for torch_threads in sorted({1, threads}):  # the better of the two is the limit
            torch.set_num_threads(torch_threads)
            run()
            ts: list[float] = []
            # at least n runs and LIMIT_MIN_S of them: a run of the tiny model is ~0.5 ms, and
            # the median of ten such runs moved 2× from cell to cell on a shared host
            while len(ts) < n or sum(ts) < LIMIT_MIN_S:
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            best = max(best, batch / statistics.median(ts))
    finally:
        torch.set_num_threads(saved)
    return best


def _client_process(
    address: str,
    protocol: str,
    reqs: list[dict[str, np.ndarray]],
    wants: list[np.ndarray],
    threads: int,
    seconds: float,
    start: Any,
    out: Any,
) -> None:
    """One client process: ``threads`` clients, warmed up, wait on the ``start`` barrier (every
    process and the parent), then send ``reqs`` in turn for ``seconds``; puts ``(latencies s,
    requests completed within the window, errors, wrong answers)`` on ``out``."""
    if protocol.endswith("-raw"):
        raw = http_raw_client if protocol == "http-raw" else grpc_raw_client
        raw_sender, right = raw(address, reqs, wants, start)
        out.put(_closed_loop(threads, len(reqs), seconds, start, raw_sender, right))
        return
    import tritonclient.grpc as tg
    import tritonclient.http as th

    def inputs(req: dict[str, np.ndarray]) -> list[Any]:
        res = []
        for name, arr in req.items():
            dt = "FP32" if arr.dtype == np.float32 else "INT64"
            if protocol == "http":
                x = th.InferInput(name, list(arr.shape), dt)
                x.set_data_from_numpy(arr, binary_data=True)
            else:
                x = tg.InferInput(name, list(arr.shape), dt)
                x.set_data_from_numpy(arr)
            res.append(x)
        return res

    def sender(k: int) -> Callable[[int], Any]:
        c: Any = (
            th.InferenceServerClient(address)
            if protocol == "http"
            else tg.InferenceServerClient(address)
        )
        prepared = [inputs(r) for r in reqs]
        return lambda j: c.infer("dlrm", prepared[j]).as_numpy("logits")

    out.put(
        _closed_loop(
            threads, len(reqs), seconds, start, sender, lambda j, got: np.array_equal(got, wants[j])
        )
    )


def _closed_loop(
    threads: int,
    n: int,
    seconds: float,
    start: Any,
    sender: Callable[[int], Callable[[int], Any]],
    right: Callable[[int, Any], bool],
) -> tuple[list[float], int, list[str], int, float]:
    """``threads`` closed-loop clients of one process: client ``k`` gets its ``send`` from
    ``sender(k)`` in its own thread, sends two untimed requests, waits for every client and the
    ``start`` barrier (every process and the parent), then sends requests ``k, k + 1, …``
    (modulo ``n``) for ``seconds``, each answer judged by ``right(j, answer)`` after its time
    is taken. Returns ``(latencies s, requests completed within the window, errors, wrong
    answers, this process's CPU seconds over the window)``."""
    lat: list[float] = []
    in_window = [0]
    errors: list[str] = []
    wrong = [0]
    lock = threading.Lock()
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    window: list[float] = []

    def worker(k: int) -> None:
        send = sender(k)
        for i in range(2):  # warm-up, not timed
            send((k + i) % n)
        ready.wait()
        go.wait()
        stop = window[1]
        i = k
        while time.perf_counter() < stop:
            j = i % n
            t0 = time.perf_counter()
            try:
                got = send(j)
            except Exception as e:  # counted: the figure is "no errors"
                with lock:
                    errors.append(str(e)[:200])
            else:
                t1 = time.perf_counter()
                with lock:
                    lat.append(t1 - t0)
                    in_window[0] += t1 <= stop
                    wrong[0] += not right(j, got)
            i += 1

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    ready.wait()
    start.wait()
    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = cpu_start.ru_utime + cpu_start.ru_stime
    now = time.perf_counter()
    window.extend([now, now + seconds])
    go.set()
    for t in ts:
        t.join()
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    return lat, in_window[0], errors, wrong[0], cpu.ru_utime + cpu.ru_stime - cpu0


def thread_cpu_s(fronts: Sequence[int] = ()) -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by role: the model's
    inference thread (``batcher``), the HTTP event loop (``http``), grpcio's threads or the
    threads reading and answering the gRPC front processes (``grpc``), everything else (``other``: the
    cache worker, onnxruntime's pool, the main thread), and the gRPC front processes
    ``fronts`` (pids; ``fronts``); read from ``/proc`` (``{}`` where there is none)."""
    roles = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {"batcher": 0.0, "http": 0.0, "grpc": 0.0, "other": 0.0, "fronts": 0.0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        cpu = _stat_cpu_s(f"/proc/self/task/{tid}/stat", tick)
        if cpu is None:  # the thread ended meanwhile
            continue
        name = roles.get(int(tid), "")
        role = (
            "batcher"
            if name.startswith("hps-batcher")
            else "http"
            if name == "hps-v2-server"
            else "grpc"
            if name.startswith(("hps-v2-grpc", "hps-grpc-"))
            else "other"
        )
        out[role] += cpu
    for pid in fronts:
        out["fronts"] += _stat_cpu_s(f"/proc/{pid}/stat", tick) or 0.0
    return out


def _stat_cpu_s(path: str, tick: int) -> float | None:
    """utime + stime of a ``/proc/.../stat`` file in seconds (``None``: it is gone)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / tick


def run_cell(
    address: str,
    protocol: str,
    clients: int,
    reqs: list[dict[str, np.ndarray]],
    wants: list[np.ndarray],
    seconds: float,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``clients`` clients for ``seconds``: samples/s (requests completed within the window),
    p50/p99 ms, errors, wrong answers. ``on_start`` runs as the timed window opens (every
    client warmed up and past the start barrier): where the caller reads the server's
    counters, so that its figures leave out the clients' untimed first requests."""
    ctx = mp.get_context("spawn")
    procs_n = min(clients, _MAX_PROCESSES)
    per = [clients // procs_n + (k < clients % procs_n) for k in range(procs_n)]
    q = ctx.Queue()
    start = ctx.Barrier(procs_n + 1)
    procs = [
        ctx.Process(
            target=_client_process, args=(address, protocol, reqs, wants, n, seconds, start, q)
        )
        for n in per
    ]
    for p in procs:
        p.start()
    start.wait(timeout=600)
    if on_start is not None:
        on_start()
    results = [q.get(timeout=seconds + 600) for _ in procs]
    for p in procs:
        p.join(60)
    client_cpu = sum(r[4] for r in results)
    lat = sorted(x for r in results for x in r[0])
    errors = [e for r in results for e in r[2]]
    batch = reqs[0]["dense"].shape[0]
    ms = [1e3 * x for x in lat]
    return {
        "requests": len(lat),
        "samples_per_s": batch * sum(r[1] for r in results) / seconds,
        "p50_ms": statistics.median(ms) if ms else None,
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None,
        # the tail past p99: a pause of the whole server (e.g. a full collection) shows here
        "p999_ms": ms[min(len(ms) - 1, int(0.999 * len(ms)))] if ms else None,
        "max_ms": ms[-1] if ms else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wrong_answers": sum(r[3] for r in results),
        "client_cpu_s": client_cpu,
    }


class GcClock:
    """The cyclic collector's time and runs in this process (where the benchmark's servers
    run) while it is entered: ``seconds``, the longest single run ``longest_s`` and
    ``runs[g]`` per generation (from ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.longest_s = 0.0
        self.runs = [0, 0, 0]
        self._t0 = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self.longest_s = max(self.longest_s, dt)
        self.runs[info["generation"]] += 1

    def reset(self) -> None:
        """Count from now on (the collections so far are forgotten)."""
        self.seconds = 0.0
        self.longest_s = 0.0
        self.runs = [0, 0, 0]

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)


def _pct(sorted_ms: list[float], q: float) -> float | None:
    """The ``q`` quantile of ascending ``sorted_ms`` (nearest rank; ``None`` when empty)."""
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))] if sorted_ms else None


def _cache_hits(served: Any) -> tuple[int, int]:
    """Every table's looked-up keys (with repeats) so far: (answered by the cache, all)."""
    st = served.servable.session.stats()
    cache = sum(v["hits_all"]["cache"] for v in st.values())
    total = sum(sum(v["hits_all"].values()) for v in st.values())
    return cache, total


def bench_concurrency(
    name: str,
    model: DLRM,
    servers: dict[str, Any],
    onnx_path: str,
    request_fn: Any,
    clients: tuple[int, ...],
    batches: tuple[int, ...],
    seconds: float,
    threads: int,
    limit_runs: int = 10,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    distinct: int = 8,
    protocols: tuple[str, ...] = PROTOCOLS,
) -> list[dict[str, Any]]:
    """Every ``clients × batches × protocol`` cell of model ``name`` on each of ``servers``
    (variant name → a running ``bench_server.Served``; the variants of a cell run one after
    the other, in turn first), with the in-process limit at each batch and at 256 measured
    right before and right after each variant's window (the one after a window is the
    next's before; rows carry both and their mean, the ratios' yardstick); ``on_row`` sees
    each row as it is measured. The clients cycle through ``distinct`` requests of random
    keys (1: the same keys every time, which the cache holds after the first: the server
    without the cache's misses; each row's ``cache_hit_rate`` says). ``protocols``: the
    clients of each cell, of :data:`CLIENT_KINDS` (row field ``client``; ``protocol`` is
    ``http`` or ``grpc``)."""
    unknown = sorted(set(protocols) - set(CLIENT_KINDS))
    if unknown:
        raise ValueError(f"unknown clients {unknown}; expected some of {list(CLIENT_KINDS)}")
    reps = limit_runs
    rows = []
    names = list(servers)
    for b in batches:
        reqs = [request_fn(model, b, seed=10_000 + b * 10 + i) for i in range(distinct)]
        wants = [servers[names[0]].servable.infer(r)["logits"] for r in reqs]
        for variant in names[1:]:  # each server's cache sees the keys once, as the first's did
            for r, want in zip(reqs, wants, strict=True):
                got = servers[variant].servable.infer(r)["logits"]
                if not np.array_equal(got, want):
                    raise AssertionError(f"server {variant} scores a request differently")
        for cell_no, (c, kind) in enumerate((c, p) for c in clients for p in protocols):
            # the limit measured right before each window and right after it: the host's
            # speed drifts, and the window is set against the mean of the two
            limits = {x: fused_limit(model, onnx_path, x, threads, reps) for x in {b, 256}}
            shift = cell_no % len(names)
            for variant in names[shift:] + names[:shift]:
                served = servers[variant]
                proto = "http" if kind.startswith("http") else "grpc"
                addr = served.srv.address if proto == "http" else str(served.srv.grpc_address)
                fronts = served.srv.grpc.pids if isinstance(served.srv.grpc, GrpcFronts) else []
                snap: dict[str, Any] = {}
                gcs = GcClock()

                def window_opens(
                    served: Any = served,
                    fronts: list[int] = fronts,
                    snap: dict[str, Any] = snap,
                    gcs: GcClock = gcs,
                ) -> None:
                    # the server's counters (and its collector's time) from the timed window
                    # on: the clients' untimed first requests, single executions while the
                    # clients start, left out
                    gcs.reset()
                    snap.update(
                        stats=served.stats(), hits=_cache_hits(served), cpu=thread_cpu_s(fronts)
                    )

                with gcs:
                    cell = run_cell(addr, kind, c, reqs, wants, seconds, window_opens)
                before, hits0, cpu0 = snap["stats"], snap["hits"], snap["cpu"]
                cpu1 = thread_cpu_s(fronts)
                after = served.stats()
                execs = after["execution_count"] - before["execution_count"]
                done = after["inference_count"] - before["inference_count"]
                n_req = (
                    after["inference_stats"]["success"]["count"]
                    - before["inference_stats"]["success"]["count"]
                )
                infer_ns = sum(x["compute_infer"]["ns"] for x in after["batch_stats"]) - sum(
                    x["compute_infer"]["ns"] for x in before["batch_stats"]
                )
                cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
                # where a request's server time went (means over the cell, from /stats)
                phase_ms = {
                    k: (after["inference_stats"][k]["ns"] - before["inference_stats"][k]["ns"])
                    / n_req
                    / 1e6
                    if n_req
                    else None
                    for k in (
                        "queue",
                        "compute_input",
                        "compute_infer",
                        "compute_output",
                        "success",
                    )
                }
                delay_ms = served.srv.batchers["dlrm"].cfg.max_queue_delay_us / 1e3
                exec_ms = infer_ns / execs / 1e6 if execs else 0.0
                # the bound: p99 ≤ 2 × max_queue_delay + one merged batch's compute
                # (the mean execution of the window)
                bound_ms = 2 * delay_ms + exec_ms
                # the server's side of each request of the cell: its whole handling and its
                # part in the batcher (queue + execution), which the bound is about
                recent = served.srv.counts["dlrm"].recent_ns(n_req)
                whole_ms = sorted(r[0] / 1e6 for r in recent)
                batched_ms = sorted(r[1] / 1e6 for r in recent)
                # the bound's two parts apart: each request's own execution, and the rest of
                # its time in the server (queue, parsing, answer), which the bound allows 2 ×
                # max_queue_delay
                own_exec_ms = sorted(r[2] / 1e6 for r in recent)
                outside_ms = sorted((r[0] - r[2]) / 1e6 for r in recent)
                # the bound with the p99 of the requests' own executions for "one merged
                # batch's compute": on a host where the same execution's time varies between
                # runs, the mean execution alone is exceeded by the execution's own tail,
                # whatever the batcher does
                bound99_ms = 2 * delay_ms + (_pct(own_exec_ms, 0.99) or 0.0)
                hits1 = _cache_hits(served)
                looked_up = hits1[1] - hits0[1]
                later = {x: fused_limit(model, onnx_path, x, threads, reps) for x in limits}
                around = {x: (limits[x] + later[x]) / 2 for x in limits}
                row = {
                    "bench": "concurrency",
                    "model": name,
                    "protocol": proto,
                    "client": "raw" if kind.endswith("-raw") else "tritonclient",
                    "server": variant,
                    "clients": c,
                    "batch": b,
                    **cell,
                    # the mean of the limits right before and right after the window
                    "limit_same_batch_samples_per_s": around[b],
                    "limit_b256_samples_per_s": around[256],
                    "limit_b256_before_samples_per_s": limits[256],
                    "limit_b256_after_samples_per_s": later[256],
                    "ratio_vs_limit_b256": cell["samples_per_s"] / around[256],
                    "ratio_vs_limit_same_batch": cell["samples_per_s"] / around[b],
                    "mean_execution_batch": done / execs if execs else None,
                    "mean_execution_ms": infer_ns / execs / 1e6 if execs else None,
                    "p99_bound_ms": bound_ms,
                    "p99_within_bound": bool(
                        cell["p99_ms"] is not None and cell["p99_ms"] <= bound_ms
                    ),
                    "p99_over_bound": cell["p99_ms"] / bound_ms
                    if cell["p99_ms"] and bound_ms
                    else None,
                    "server_p50_request_ms": _pct(whole_ms, 0.5),
                    "server_p99_request_ms": _pct(whole_ms, 0.99),
                    "server_p50_batched_ms": _pct(batched_ms, 0.5),
                    "server_p99_batched_ms": _pct(batched_ms, 0.99),
                    "server_p99_batched_within_bound": bool(
                        batched_ms and _pct(batched_ms, 0.99) <= bound_ms
                    ),
                    "server_p99_request_within_bound": bool(
                        whole_ms and _pct(whole_ms, 0.99) <= bound_ms
                    ),
                    "server_p50_own_execution_ms": _pct(own_exec_ms, 0.5),
                    "server_p99_own_execution_ms": _pct(own_exec_ms, 0.99),
                    "p99_bound_p99_execution_ms": bound99_ms,
                    "p99_within_bound_p99_execution": bool(
                        cell["p99_ms"] is not None and own_exec_ms and cell["p99_ms"] <= bound99_ms
                    ),
                    "server_p99_outside_execution_ms": _pct(outside_ms, 0.99),
                    "server_p99_outside_execution_within_2x_delay": bool(
                        outside_ms and _pct(outside_ms, 0.99) <= 2 * delay_ms
                    ),
                    # share of the cell's looked-up keys the cache answered (the rest: the
                    # volatile db; a 64-way set of a full-size cache can overflow)
                    "cache_hit_rate": (hits1[0] - hits0[0]) / looked_up if looked_up else None,
                    # server CPU per request, by thread role, and the clients' (µs)
                    **{
                        f"server_cpu_us_per_request_{k}": 1e6 * v / n_req if n_req else None
                        for k, v in cpu.items()
                    },
                    "client_cpu_us_per_request": (
                        1e6 * cell["client_cpu_s"] / cell["requests"] if cell["requests"] else None
                    ),
                    **{f"server_mean_{k}_ms": v for k, v in phase_ms.items()},
                    # the cyclic collector in the servers' process over the cell (it holds
                    # the interpreter lock while it runs)
                    "server_gc_s": gcs.seconds,
                    "server_gc_longest_ms": 1e3 * gcs.longest_s,
                    "server_gc_runs": list(gcs.runs),
                    "load_avg_1m": os.getloadavg()[0],
                    **served.batching(),
                    "distinct_requests": distinct,
                }
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                log.info(
                    "%s %s %s %2d clients × B=%-3d: %8.0f samples/s (limit@256 %.0f, %.0f before, "
                    "%.0f after: %.3fx), p50 %.1f "
                    "ms, p99 %.1f ms (bound %.1f; server p99 %.1f, batcher p99 %.1f, own execution p50/p99 %.1f/%.1f, outside it p99 %.1f), mean batch %.1f (%.2f ms), server CPU/request %s µs, "
                    "client %.0f µs, %d errors, %d wrong, collector %.3f s (longest %.1f ms), "
                    "load %.1f",
                    name,
                    variant,
                    kind,
                    c,
                    b,
                    cell["samples_per_s"],
                    around[256],
                    limits[256],
                    later[256],
                    row["ratio_vs_limit_b256"],
                    cell["p50_ms"] or 0,
                    cell["p99_ms"] or 0,
                    bound_ms,
                    row["server_p99_request_ms"] or 0,
                    row["server_p99_batched_ms"] or 0,
                    row["server_p50_own_execution_ms"] or 0,
                    row["server_p99_own_execution_ms"] or 0,
                    row["server_p99_outside_execution_ms"] or 0,
                    row["mean_execution_batch"] or 0,
                    row["mean_execution_ms"] or 0,
                    {k: round(1e6 * v / max(n_req, 1)) for k, v in cpu.items()},
                    row["client_cpu_us_per_request"] or 0,
                    cell["errors"],
                    cell["wrong_answers"],
                    gcs.seconds,
                    1e3 * gcs.longest_s,
                    row["load_avg_1m"],
                )
                limits = later  # the next window's limit before it
    return rows
