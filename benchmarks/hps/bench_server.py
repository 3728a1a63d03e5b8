"""The v2 inference server, side by side in one run, JSON out.

    python -m benchmarks.hps.bench_server                    # everything (~3 min on 2 cores)
    python -m benchmarks.hps.bench_server --only overhead --requests 50

Sections (``--only``):
- ``overhead``: the tiny DLRM-DCNv2 served; per batch size, the median latency of the same
  request three ways: in-process (``DLRMServable.infer``: lookups + onnxruntime, no HTTP),
  through the server with tritonclient's binary tensors, and with JSON tensors. Ratio =
  served / in-process.
- ``grpc``: the same batch-``--grpc-batch`` request through ``tritonclient.grpc`` (raw tensors)
  and ``tritonclient.http`` (binary tensors), ``--grpc-requests`` of each, interleaved: p50 /
  p99 per protocol and the p50 ratio gRPC / HTTP; the scores must be identical.
- ``throughput``: ``--clients`` tritonclient threads sending batch-256 requests for
  ``--seconds``: requests/s, samples/s, p50/p99, errors.
- ``pruned``: the DLRM-DCNv2 dense part at full MLPerf widths (tables shrunk), dense vs TW 75 %
  condensed (G=128): the exported dense graph alone in onnxruntime, the whole model through the
  server, and torch's eager forward (the TW kernel) for reference; batch ``--pruned-batch``.
- ``concurrency``: ``--conc-clients`` × ``--conc-batches`` × HTTP/gRPC against the dynamically
  batched server (``--queue-delay-us``), for the tiny model and ``dlrm_dcnv2`` ÷ 1000, beside
  the in-process limit (one fused ``embedding_bag`` + onnxruntime): samples/s, p50/p99, the
  mean merged batch, every answer checked bit-equal (:mod:`benchmarks.hps.server_concurrency`;
  clients in their own processes; ``--conc-protocols`` picks tritonclient over ``http`` or
  ``grpc``, or ``http-raw`` / ``grpc-raw``: pre-serialized requests (one ``sendall`` on a
  kept-alive socket; a bytes-only grpcio method), their answers compared byte for byte with
  answers checked in full before the cell (:mod:`benchmarks.hps.raw_clients`); ``--servers``
  items may set each server's queue delay and preferred batch size, ``@DELAY_US:PREFERRED``,
  and its gRPC front processes, ``#N`` (0: grpcio in the server's process; the rows' CPU per
  request then has a ``fronts`` part); ``--conc-ort-threads`` sets the servers' onnxruntime
  intra-op threads (default: the server's, every core the process may use).

``--threads`` threads for onnxruntime and torch; the server runs in a background thread of this
process (the clients of all sections but ``concurrency`` too), so on 2 cores the figures include
their contention.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tritonclient.grpc as tg
import tritonclient.http as th

from benchmarks.hps.server_concurrency import (
    BATCHES,
    CLIENT_KINDS,
    CLIENTS,
    PROTOCOLS,
    bench_concurrency,
)
from benchmarks.hps.server_variants import SERVER_FORM, parse_servers
from benchmarks.meta import RESULTS_DIR, write_json
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import get_workload
from export.artifacts import write_serving_artifacts
from hps.parameter_server import HierarchicalParameterServer
from hps.serving import EventLoop, HttpParser, InferenceServer, ServerConfig
from tilesparse import TileSparseConfig, prune_

log = logging.getLogger("bench_server")
SECTIONS = ("overhead", "grpc", "throughput", "pruned", "concurrency")


def request(model: DLRM, batch: int, seed: int) -> dict[str, np.ndarray]:
    """Random valid inputs: ``dense (B, D) float32``, ``ids_<t> (B, hotness) int64``."""
    g = np.random.default_rng(seed)
    out = {"dense": g.random((batch, model.workload.dense_features), dtype=np.float32)}
    for t in model.workload.tables:
        out[f"ids_{t.name}"] = g.integers(0, t.num_rows, (batch, t.hotness))
    return out


def infer_inputs(req: dict[str, np.ndarray], binary: bool) -> list[th.InferInput]:
    out = []
    for name, arr in req.items():
        x = th.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT64")
        x.set_data_from_numpy(arr, binary_data=binary)
        out.append(x)
    return out


def median_ms(fn: Callable[[], object], n: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


class Served:
    """A model's artifacts, its parameter server and a running v2 server."""

    def __init__(
        self,
        model: DLRM,
        folder: Path,
        threads: int,
        max_batch: int,
        workers: int = 2,
        merged_batch: int = 0,
        queue_delay_us: int = ServerConfig.max_queue_delay_us,
        preferred_batch: int = ServerConfig.preferred_batch_size,
        http: HttpParser = HttpParser.AUTO,
        loop: EventLoop = EventLoop.AUTO,
        grpc_processes: int = ServerConfig.grpc_processes,
        gc_freeze: bool = ServerConfig.gc_freeze,
        parallel_min_macs: int = ServerConfig.ort_parallel_min_macs,
        measure_threads: bool = ServerConfig.ort_measure_threads,
    ) -> None:
        write_serving_artifacts(
            model, folder, max_batch_size=max_batch, cache_fraction=1.0, overwrite=True
        )
        self.ps = HierarchicalParameterServer.from_config(folder / "ps.json")
        cfg = ServerConfig(
            port=0,
            grpc_port=0,
            workers=workers,
            ort_threads=threads,
            ort_parallel_min_macs=parallel_min_macs,
            ort_measure_threads=measure_threads,
            max_batch_size=merged_batch,
            max_queue_delay_us=queue_delay_us,
            preferred_batch_size=preferred_batch,
            http=http,
            loop=loop,
            grpc_processes=grpc_processes,
            gc_freeze=gc_freeze,
        )
        self.srv = InferenceServer(self.ps, cfg).start()
        self.servable = self.srv.servables["dlrm"]
        self.folder = folder

    def batching(self) -> dict[str, int]:
        """The batching in effect on the server (recorded in each JSON row): its queue delay,
        merged max batch, preferred batch size as set and as used (0 → the merged max)."""
        cfg = self.srv.batchers["dlrm"].cfg
        return {
            "max_queue_delay_us": cfg.max_queue_delay_us,
            "merged_max_batch": cfg.max_batch_size,
            "preferred_batch_size": cfg.preferred_batch_size,
            "preferred_batch_effective": cfg.preferred,
            "gc_freeze": int(self.srv.cfg.gc_freeze),
            "ort_parallel_min_macs": self.srv.cfg.ort_parallel_min_macs,
            "ort_measure_threads": int(self.srv.cfg.ort_measure_threads),
            "ort_serial_below": self.servable.serial_below,
        }

    def stats(self) -> dict[str, Any]:
        """The model's Triton statistics document (as ``GET /v2/models/dlrm/stats``)."""
        return self.srv.counts["dlrm"].to_dict("dlrm")

    def close(self) -> None:
        self.srv.stop()
        self.ps.close()


def bench_overhead(served: Served, model: DLRM, batches: list[int], n: int) -> list[dict[str, Any]]:
    rows = []
    client = th.InferenceServerClient(served.srv.address)
    for b in batches:
        req = request(model, b, seed=b)
        bin_in, json_in = infer_inputs(req, True), infer_inputs(req, False)
        json_out = [th.InferRequestedOutput("logits", binary_data=False)]
        t_in = median_ms(lambda: served.servable.infer(req), n)  # noqa: B023 - called right here
        t_bin = median_ms(lambda: client.infer("dlrm", bin_in), n)  # noqa: B023
        t_json = median_ms(lambda: client.infer("dlrm", json_in, outputs=json_out), n)  # noqa: B023
        got = client.infer("dlrm", bin_in).as_numpy("logits")
        err = float(np.abs(got - served.servable.infer(req)["logits"]).max())
        rows.append(
            {
                "bench": "overhead",
                "batch": b,
                "inprocess_ms": t_in,
                "binary_ms": t_bin,
                "json_ms": t_json,
                "binary_ratio": t_bin / t_in,
                "json_ratio": t_json / t_in,
                "max_abs_diff": err,
            }
        )
        log.info(
            "overhead B=%d: in-process %.2f ms, binary %.2f ms (%.2fx), json %.2f ms (%.2fx)",
            b,
            t_in,
            t_bin,
            t_bin / t_in,
            t_json,
            t_json / t_in,
        )
    return rows


def grpc_inputs(req: dict[str, np.ndarray]) -> list[tg.InferInput]:
    out = []
    for name, arr in req.items():
        x = tg.InferInput(name, list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT64")
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def _percentile(ms: list[float], q: float) -> float:
    s = sorted(ms)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_grpc(served: Served, model: DLRM, batch: int, n: int) -> dict[str, Any]:
    """p50 / p99 of one request through each protocol, timed alternately (each pair in a
    different order every time, so load drifts hit both alike)."""
    req = request(model, batch, seed=batch)
    http = th.InferenceServerClient(served.srv.address)
    grpc = tg.InferenceServerClient(str(served.srv.grpc_address))
    h_in, g_in = infer_inputs(req, True), grpc_inputs(req)
    same = bool(
        np.array_equal(
            http.infer("dlrm", h_in).as_numpy("logits"), grpc.infer("dlrm", g_in).as_numpy("logits")
        )
    )
    calls = {
        "http": lambda: http.infer("dlrm", h_in),
        "grpc": lambda: grpc.infer("dlrm", g_in),
    }
    lat: dict[str, list[float]] = {"http": [], "grpc": []}
    for i in range(n):
        for name in ("http", "grpc") if i % 2 else ("grpc", "http"):
            t0 = time.perf_counter()
            calls[name]()
            lat[name].append(1e3 * (time.perf_counter() - t0))
    grpc.close()
    row: dict[str, Any] = {"bench": "grpc", "batch": batch, "requests": n, "identical": same}
    for name, ms in lat.items():
        row[f"{name}_p50_ms"] = statistics.median(ms)
        row[f"{name}_p99_ms"] = _percentile(ms, 0.99)
    row["grpc_over_http_p50"] = row["grpc_p50_ms"] / row["http_p50_ms"]
    log.info(
        "grpc B=%d, %d each: gRPC p50 %.2f ms, HTTP p50 %.2f ms (gRPC/HTTP %.2f), identical %s",
        batch,
        n,
        row["grpc_p50_ms"],
        row["http_p50_ms"],
        row["grpc_over_http_p50"],
        same,
    )
    return row


def bench_throughput(served: Served, model: DLRM, clients: int, seconds: float) -> dict[str, Any]:
    reqs = [infer_inputs(request(model, 256, seed=1000 + i), True) for i in range(8)]
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(k: int) -> None:
        c = th.InferenceServerClient(served.srv.address)
        i = k
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                c.infer("dlrm", reqs[i % len(reqs)])
            except Exception as e:  # counted and reported: the figure is "no errors"
                with lock:
                    errors.append(str(e))
            else:
                with lock:
                    lat.append(time.perf_counter() - t0)
            i += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ms = sorted(x * 1e3 for x in lat)
    row = {
        "bench": "throughput",
        "clients": clients,
        "batch": 256,
        "seconds": wall,
        "requests": len(lat),
        "errors": len(errors),
        "requests_per_s": len(lat) / wall,
        "samples_per_s": 256 * len(lat) / wall,
        "p50_ms": statistics.median(ms) if ms else None,
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None,
        "first_error": errors[0] if errors else None,
    }
    log.info(
        "throughput %d clients: %.0f req/s (%.0f samples/s), p50 %.1f ms, p99 %.1f ms, %d errors",
        clients,
        row["requests_per_s"],
        row["samples_per_s"],
        row["p50_ms"] or 0,
        row["p99_ms"] or 0,
        len(errors),
    )
    return row


def bench_pruned(tmp: Path, batch: int, threads: int, n: int) -> list[dict[str, Any]]:
    import onnxruntime as ort

    workload = get_workload("dlrm_dcnv2").scaled(1e6)  # tables shrunk; dense widths untouched
    dense = build_model(workload, seed=0).eval()
    pruned = copy.deepcopy(dense)
    prune_(
        pruned, TileSparseConfig(pattern="tw", sparsity=0.75, tile=128, global_threshold=False)
    ).compress()
    req = request(dense, batch, seed=7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, workload.dense_features, generator=g)
    pooled = torch.randn(batch, len(workload.tables), workload.tables[0].dim, generator=g)
    rows, times = [], {}
    torch.set_num_threads(threads)
    for name, model in (("dense", dense), ("tw75", pruned)):
        served = Served(model, tmp / name, threads, max_batch=batch, workers=1)
        try:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            sess = ort.InferenceSession(str(tmp / name / "dense.onnx"), opts)
            feed = {"dense": x.numpy(), "pooled": pooled.numpy()}
            with torch.no_grad():
                ref = model.dense_forward(x, pooled).numpy()
                t_torch = median_ms(lambda: model.dense_forward(x, pooled), n)  # noqa: B023
            err = float(np.abs(sess.run(None, feed)[0] - ref).max())
            t_ort = median_ms(lambda: sess.run(None, feed), n)  # noqa: B023
            client = th.InferenceServerClient(served.srv.address)
            inputs = infer_inputs(req, True)
            t_srv = median_ms(lambda: client.infer("dlrm", inputs), n)  # noqa: B023
        finally:
            served.close()
        times[name] = (t_ort, t_srv, t_torch)
        rows.append(
            {
                "bench": "pruned",
                "model": name,
                "batch": batch,
                "threads": threads,
                "onnx_dense_part_ms": t_ort,
                "served_ms": t_srv,
                "torch_dense_part_ms": t_torch,
                "onnx_vs_torch_max_abs_diff": err,
            }
        )
        log.info(
            "pruned %s B=%d: onnxruntime dense part %.1f ms, served %.1f ms, torch %.1f ms",
            name,
            batch,
            t_ort,
            t_srv,
            t_torch,
        )
    for r in rows:
        if r["model"] == "tw75":
            d = times["dense"]
            r.update(
                onnx_speedup=d[0] / r["onnx_dense_part_ms"],
                served_speedup=d[1] / r["served_ms"],
                torch_speedup=d[2] / r["torch_dense_part_ms"],
            )
            log.info(
                "TW 75%% vs dense: onnxruntime %.2fx, served %.2fx, torch %.2fx",
                r["onnx_speedup"],
                r["served_speedup"],
                r["torch_speedup"],
            )
    return rows


def run_concurrency(
    name: str, folder: Path, args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """The ``concurrency`` section for workload ``name`` (``dlrm_dcnv2`` scaled ÷ 1000): one
    server per ``--servers`` variant, the variants of each cell run one after the other."""
    w = get_workload(name)
    model = build_model(w.scaled(1000) if name == "dlrm_dcnv2" else w, seed=0).eval()
    servers: dict[str, Served] = {}
    try:
        for k, v in enumerate(parse_servers(args.servers)):
            delay = args.queue_delay_us if v.delay_us is None else v.delay_us
            preferred = args.preferred_batch if v.preferred is None else v.preferred
            macs = (
                args.ort_parallel_min_macs if v.parallel_min_macs is None else v.parallel_min_macs
            )
            counted = macs is not None  # a bound given: multiply-adds counted, not timed
            s = Served(
                model,
                folder / f"server{k}",
                threads=args.conc_ort_threads,
                max_batch=max(args.merged_batch, 256),
                merged_batch=args.merged_batch,
                queue_delay_us=delay,
                preferred_batch=preferred,
                http=v.parser,
                loop=v.loop,
                grpc_processes=v.grpc_processes,
                gc_freeze=args.gc_freeze,
                parallel_min_macs=ServerConfig.ort_parallel_min_macs if macs is None else macs,
                measure_threads=not counted,
            )
            key = f"{s.srv.http_parser.value}/{s.srv.event_loop.value}@{delay}:{preferred}"
            key += f"#{s.srv.cfg.grpc_fronts}"  # gRPC front processes (0: in-process)
            if counted:
                key += f"^{macs}"
            if key in servers:
                raise ValueError(f"--servers names {key} twice")
            servers[key] = s
        return bench_concurrency(
            name if name != "dlrm_dcnv2" else "dlrm_dcnv2/1000",
            model,
            servers,
            str(folder / "server0" / "dense.onnx"),
            request,
            tuple(int(c) for c in args.conc_clients.split(",")),
            tuple(int(b) for b in args.conc_batches.split(",")),
            args.conc_seconds,
            threads=len(os.sched_getaffinity(0)),
            limit_runs=10,
            on_row=on_row,
            distinct=args.conc_requests,
            protocols=tuple(x.strip() for x in args.conc_protocols.split(",")),
        )
    finally:
        for s in servers.values():
            s.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hps.bench_server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    p.add_argument("--batches", default="1,64,256,1024")
    p.add_argument("--requests", type=int, default=30, help="timed requests per figure (median)")
    p.add_argument("--grpc-batch", type=int, default=256)
    p.add_argument("--grpc-requests", type=int, default=300, help="requests per protocol")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--pruned-batch", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--conc-clients", default=",".join(map(str, CLIENTS)))
    p.add_argument("--conc-batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--conc-seconds", type=float, default=3.0, help="timed seconds per cell")
    p.add_argument("--conc-models", default="tiny,dlrm_dcnv2")
    p.add_argument(
        "--conc-protocols",
        default=",".join(PROTOCOLS),
        help=f"concurrency: the clients of each cell, in turn, some of {list(CLIENT_KINDS)} "
        "(http-raw, grpc-raw: pre-serialized requests, answers compared byte for byte with "
        "answers checked in full before the cell)",
    )
    p.add_argument(
        "--queue-delay-us",
        type=int,
        default=ServerConfig.max_queue_delay_us,
        help="the server's batching delay, every section (default: the server's)",
    )
    p.add_argument(
        "--preferred-batch",
        type=int,
        default=ServerConfig.preferred_batch_size,
        help="the server's preferred_batch_size (0: the merged max; default: the server's)",
    )
    p.add_argument(
        "--merged-batch", type=int, default=2048, help="the server's max_batch_size per execution"
    )
    p.add_argument(
        "--conc-ort-threads",
        type=int,
        default=ServerConfig.ort_threads,
        help="concurrency: the servers' onnxruntime intra-op threads (default: the server's, "
        "every core the process may use)",
    )
    p.add_argument(
        "--ort-parallel-min-macs",
        type=int,
        default=None,
        help="concurrency: the servers' bound under which an execution's dense graph runs on "
        "one onnxruntime thread, multiply-adds counted rather than both sessions timed at load "
        "(0: every execution on --conc-ort-threads; default: the server's, timed)",
    )
    p.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="every server leaves the interpreter's objects unfrozen (ServerConfig.gc_freeze; "
        "process-wide, so not a --servers variant)",
    )
    p.add_argument(
        "--conc-requests",
        type=int,
        default=8,
        help="distinct requests each concurrency cell cycles through (1: every key stays cached)",
    )
    p.add_argument(
        "--servers",
        default="auto/auto",
        help="concurrency: the servers compared cell by cell, "
        f"{SERVER_FORM} each (e.g. "
        "h11/asyncio,httptools/uvloop@5000:256,auto/auto#0; auto: the fastest installed; "
        "DELAY_US, PREFERRED: that server's queue delay and preferred batch size; "
        "GRPC_PROCESSES: its gRPC front processes, 0 for grpcio in its process; MACS: its "
        "--ort-parallel-min-macs)",
    )
    p.add_argument("--out", default=str(RESULTS_DIR / "hps_server.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = sorted(set(only) - set(SECTIONS))
    if bad:
        p.error(f"--only: unknown sections {bad}; expected a subset of {list(SECTIONS)}")
    for name in (
        "requests",
        "clients",
        "pruned_batch",
        "threads",
        "grpc_batch",
        "grpc_requests",
        "conc_requests",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = sorted({x.strip() for x in args.conc_protocols.split(",")} - set(CLIENT_KINDS))
    if bad:
        p.error(f"--conc-protocols: unknown {bad}; expected some of {list(CLIENT_KINDS)}")
    try:
        parse_servers(args.servers)
    except ValueError as e:
        p.error(str(e))
    meta_args = {k: str(v) for k, v in vars(args).items()}
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_server_") as tmp:
        if {"overhead", "grpc", "throughput"} & set(only):
            model = build_model(get_workload("tiny"), seed=0).eval()
            biggest = max([*batches, 256, args.grpc_batch])
            served = Served(
                model,
                Path(tmp) / "tiny",
                threads=1,
                max_batch=biggest,
                queue_delay_us=args.queue_delay_us,
                preferred_batch=args.preferred_batch,
                gc_freeze=args.gc_freeze,
            )
            try:
                section: list[dict[str, Any]] = []
                if "overhead" in only:
                    section += bench_overhead(served, model, batches, args.requests)
                if "grpc" in only:
                    section.append(bench_grpc(served, model, args.grpc_batch, args.grpc_requests))
                if "throughput" in only:
                    section.append(bench_throughput(served, model, args.clients, args.seconds))
                rows += [{**r, **served.batching()} for r in section]
            finally:
                served.close()
        if "pruned" in only:
            rows += bench_pruned(
                Path(tmp), args.pruned_batch, args.threads, max(5, args.requests // 3)
            )
        if "concurrency" in only:
            done = list(rows)

            def on_row(row: dict[str, Any]) -> None:  # a run stopped early keeps its cells
                done.append(row)
                write_json(args.out, done, args=meta_args, partial=True)

            for name in args.conc_models.split(","):
                rows += run_concurrency(name, Path(tmp) / f"conc_{name}", args, on_row)
    path = write_json(args.out, rows, args=meta_args)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
