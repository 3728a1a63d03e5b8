"""The dense graph's cost per sample, and small executions run on one onnxruntime thread with
the same scores as on the pool."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.server import ServerKnobs, build_parser
from hps.serving.dense_cost import (
    DEFAULT_PARALLEL_MIN_MACS,
    MEASURE_MAX_BYTES,
    PARALLEL_MIN_GAIN,
    WEIGHT_READ_SAMPLES,
    SizeTiming,
    crossover_sizes,
    measure_crossover,
    serial_batch_limit,
    time_sessions,
    timed_batch_limit,
    weight_macs_per_sample,
)
from hps.serving.http_server import InferenceServer, ServerConfig, build_servables
from hps.serving.servable import DLRMServable, _counted_macs
from knobs import from_namespace
from tests.hps.serving.tiny_dlrm import make_request


def test_the_exported_graph_costs_its_weight_matrices_per_sample(
    tiny: DLRM, tiny_artifacts
) -> None:
    # every 2-D weight of the model's dense part is one (K, N) matrix applied to each sample
    want = sum(
        p.numel()
        for name, p in tiny.named_parameters()
        if p.ndim == 2 and not name.startswith("embeddings")
    )
    assert want == 48_512  # 13·64 + 64·32 + 32·16 + 2·(144·32 + 32·144) + 144·128 + 128·64 + 64
    assert weight_macs_per_sample(tiny_artifacts / "dense.onnx") == want


def test_only_weight_matrices_of_matmul_and_gemm_count(tmp_path: Path) -> None:
    f32 = TensorProto.FLOAT
    inits = [
        numpy_helper.from_array(np.ones((3, 5), np.float32), "w"),  # MatMul weight: 15
        numpy_helper.from_array(np.ones((7, 5), np.float32), "g"),  # Gemm transB: 35
        numpy_helper.from_array(np.ones(7, np.float32), "bias"),  # 1-D: not a matrix
        numpy_helper.from_array(np.ones((7, 2), np.float32), "a"),  # an Add's operand
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Gemm", ["h", "g", "bias"], ["y"], transB=1),
        helper.make_node("MatMul", ["y", "yt"], ["dot"]),  # two activations
        helper.make_node("Add", ["dot", "a"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", f32, ["B", 3]),
            helper.make_tensor_value_info("yt", f32, [7, 2]),
        ],
        [helper.make_tensor_value_info("out", f32, ["B", 2])],
        initializer=inits,
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert weight_macs_per_sample(path) == 15 + 35


def test_an_unreadable_graph_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "dense.onnx"
    bad.write_bytes(b"\x08not a model")
    with pytest.raises(ValueError, match="cannot read ONNX graph .*dense.onnx"):
        weight_macs_per_sample(bad)


@pytest.mark.parametrize(
    "macs,bound,max_batch,want",
    [
        # the tiny model at the default: 154 samples and the read are 164 × 48,512 = 7.96 M
        (48_512, DEFAULT_PARALLEL_MIN_MACS, 2048, 155),
        (16_030_464, DEFAULT_PARALLEL_MIN_MACS, 2048, 0),  # dlrm_dcnv2 at the default
        # 319 samples and the weights' read are 329 × 48,512 = 15.96 M
        (48_512, 16_000_000, 2048, 320),
        (48_512, 16_000_000, 64, 65),  # every batch the model takes runs on one thread
        (16_030_464, 16_000_000, 256, 0),  # dlrm_dcnv2: one sample reaches the bound
        (1_500_000, 16_000_000, 256, 0),  # 1 sample + the read: 16.5 M
        (1_400_000, 16_000_000, 256, 2),  # 1 sample + the read: 15.4 M, 2 samples 16.8 M
        (48_512, 0, 2048, 0),  # the bound off
        (0, 16_000_000, 100, 0),  # nothing counted: no estimate, every batch on the pool
        (48_512, 16_000_000, 0, 0),  # no batch reaches the pool, but none runs either
        (48_512, 16_000_000, 1, 2),
        (100, 1300, 10, 3),  # 1,300 multiply-adds from 3 samples (and the read)
        (100, 1301, 10, 4),
    ],
)
def test_the_serial_batch_limit(macs: int, bound: int, max_batch: int, want: int) -> None:
    assert serial_batch_limit(macs, bound, max_batch) == want


def test_a_negative_count_is_named() -> None:
    with pytest.raises(ValueError, match="parallel_min_macs must be >= 0, got -1"):
        serial_batch_limit(10, -1, 10)
    with pytest.raises(ValueError, match="macs_per_sample must be >= 0, got -5"):
        serial_batch_limit(-5, 10, 10)


class _Runs:
    """An onnxruntime session that counts the batch sizes it ran."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.batches: list[int] = []

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> Any:
        self.batches.append(feed["dense"].shape[0])
        return self.session.run(names, feed)


def test_small_executions_run_on_one_thread_with_the_pool_s_scores(
    ps: HierarchicalParameterServer, tiny: DLRM, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_sample = weight_macs_per_sample(Path(ps.cfg.model("tiny").network_file))
    bound = (3 + WEIGHT_READ_SAMPLES) * per_sample + 1  # 4 samples and the weights' read
    s = build_servables(ps, ort_threads=2, ort_parallel_min_macs=bound, ort_measure=False)["tiny"]
    assert (s.macs_per_sample, s.serial_below) == (per_sample, 4)
    pool, serial = _Runs(s._ort), _Runs(s._ort_serial)
    monkeypatch.setattr(s, "_ort", pool)
    monkeypatch.setattr(s, "_ort_serial", serial)
    req = make_request(tiny, 12, seed=3)
    whole = s.infer(req)
    parts = [s.infer({k: v[i : i + 3] for k, v in req.items()}) for i in range(0, 12, 3)]
    assert (pool.batches, serial.batches) == ([12], [3, 3, 3, 3])
    for name in ("logits", "probability"):
        assert np.array_equal(whole[name], np.concatenate([p[name] for p in parts]))
    s.infer({k: v[:4] for k, v in req.items()})
    assert pool.batches == [12, 4]


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_one_thread_and_the_pool_score_a_batch_bit_equally(
    ps: HierarchicalParameterServer, tiny: DLRM, batch: int
) -> None:
    built = build_servables(ps, ort_threads=2, ort_parallel_min_macs=10**12, ort_measure=False)
    s = built["tiny"]
    assert s._ort_serial is not None
    checked = s.check(make_request(tiny, batch, seed=batch))
    feed = {"dense": checked["dense"], "pooled": s._pool(checked, batch).copy()}
    one = s._ort_serial.run(None, feed)[0]
    assert np.array_equal(one, s._ort.run(None, feed)[0])


def test_a_graph_that_cannot_be_counted_runs_on_the_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "dense.onnx"
    bad.write_bytes(b"\x08not a model")
    with caplog.at_level(logging.WARNING, logger="hps.serving.servable"):
        assert _counted_macs("m", bad) == 0
    assert "model 'm': its dense graph's cost is not counted (cannot read ONNX graph" in caplog.text
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(  # a weight that is a Constant node's value: not counted
        [
            helper.make_node(
                "Constant", [], ["w"], value=numpy_helper.from_array(np.ones((3, 5), np.float32))
            ),
            helper.make_node("MatMul", ["x", "w"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", f32, ["B", 3])],
        [helper.make_tensor_value_info("y", f32, ["B", 5])],
    )
    path = tmp_path / "const.onnx"
    onnx.save(helper.make_model(graph), str(path))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hps.serving.servable"):
        assert _counted_macs("m", path) == 0
    assert "model 'm': no weight matrix of its dense graph was counted" in caplog.text


@pytest.mark.parametrize(
    "threads,bound",
    [(1, 16_000_000), (2, 0)],
    ids=["one-thread-pool", "bound-off"],
)
def test_no_serial_session_when_every_execution_runs_on_the_pool(
    ps: HierarchicalParameterServer, threads: int, bound: int
) -> None:
    s: DLRMServable = build_servables(ps, ort_threads=threads, ort_parallel_min_macs=bound)["tiny"]
    assert s.serial_below == 0
    assert s._ort_serial is None


def test_a_negative_bound_is_refused(ps: HierarchicalParameterServer) -> None:
    with pytest.raises(ValueError, match="ort_parallel_min_macs must be >= 0, got -1"):
        DLRMServable(ps.cfg.model("tiny"), ps.session("tiny"), 2, -1)


@pytest.mark.parametrize(
    "argv,want,measured",
    [
        ([], DEFAULT_PARALLEL_MIN_MACS, True),
        (["--no-ort-measure-threads"], DEFAULT_PARALLEL_MIN_MACS, False),
        (["--ort-parallel-min-macs", "0"], 0, True),
    ],
    ids=["default", "counted", "off"],
)
def test_the_cli_flags_reach_the_server_s_models(
    ps: HierarchicalParameterServer, argv: list[str], want: int, measured: bool
) -> None:
    knobs = from_namespace(ServerKnobs, build_parser().parse_args(["--config", "x", *argv]))
    cfg = dataclasses.replace(knobs.server_config(), port=0, ort_threads=2)
    assert (cfg.ort_parallel_min_macs, cfg.ort_measure_threads) == (want, measured)
    with InferenceServer(ps, cfg) as srv:
        s = srv.servables["tiny"]
        if not want:
            assert (s.serial_below, s._ort_serial, s.crossover) == (0, None, None)
        elif measured:  # what the host measured decides; the choice follows from its timings
            assert s.crossover is not None
            assert s.serial_below == _replayed(s.crossover.timings, s.max_batch_size)
            assert (s._ort_serial is None) == (s.serial_below == 0)
        else:  # the tiny model's bound at the default is 155 samples, capped at its batch of 64
            assert (s.serial_below, s.crossover) == (s.max_batch_size + 1, None)
            assert s._ort_serial is not None


def test_a_bad_cli_value_is_named() -> None:
    knobs = from_namespace(
        ServerKnobs, build_parser().parse_args(["--config", "x", "--ort-parallel-min-macs", "-1"])
    )
    with pytest.raises(ValueError, match=r"ServerConfig\.ort_parallel_min_macs must be an integer"):
        knobs.server_config()


# ---------------------------------------------------------------- the crossover measured at load
def _replayed(timings: tuple[SizeTiming, ...], max_batch: int) -> int:
    """The crossover :func:`measure_crossover` finds from ``timings`` timed again."""
    by = {t.batch: t for t in timings}
    return measure_crossover(by.__getitem__, max_batch).serial_below


class _Timed:
    """A ``time_both`` whose pool takes ``pool_us(b)`` and one thread ``one_us(b)``; it
    records the sizes it was asked for."""

    def __init__(self, pool_us: Callable[[int], float], one_us: Callable[[int], float]) -> None:
        self.pool_us, self.one_us = pool_us, one_us
        self.asked: list[int] = []

    def __call__(self, b: int) -> SizeTiming:
        self.asked.append(b)
        return SizeTiming(b, self.pool_us(b) * 1e-6, self.one_us(b) * 1e-6)


def test_the_measured_sizes() -> None:
    assert [crossover_sizes(n) for n in (0, 1, 2, 3, 64, 100)] == [
        [],
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 4, 8, 16, 32, 64],
        [1, 2, 4, 8, 16, 32, 64, 100],
    ]


@pytest.mark.parametrize(
    "pool_us,max_batch,want,asked",
    [
        # never faster on the pool: every batch the model takes on one thread
        (lambda b: 2.0 * b, 100, 101, [1, 2, 4, 8, 16, 32, 64, 100]),
        # faster from 64 on: found at 64, confirmed at 128, 256 not timed
        (lambda b: 0.5 * b if b >= 64 else 2.0 * b, 256, 64, [1, 2, 4, 8, 16, 32, 64, 128]),
        # faster from one sample on: no batch runs on one thread
        (lambda b: 0.5 * b, 256, 0, [1, 2]),
        # a lone win at 8 is noise; the run of wins from 32 decides
        (lambda b: 0.5 * b if b == 8 or b >= 32 else 2.0 * b, 256, 32, [1, 2, 4, 8, 16, 32, 64]),
        # a win at the last size needs no confirmation
        (lambda b: 0.5 * b if b == 100 else 2.0 * b, 100, 100, [1, 2, 4, 8, 16, 32, 64, 100]),
        # a tie, and a gain just short of the margin, go to one thread
        (lambda b: 1.0 * b, 8, 9, [1, 2, 4, 8]),
        (lambda b: (1.0 - PARALLEL_MIN_GAIN) * b, 8, 9, [1, 2, 4, 8]),
        # nothing to time
        (lambda b: 1.0, 0, 0, []),
    ],
    ids=["never", "from-64", "from-1", "lone-win", "last", "tie", "margin", "no-batch"],
)
def test_the_crossover_is_the_first_confirmed_win_of_the_pool(
    pool_us: Callable[[int], float], max_batch: int, want: int, asked: list[int]
) -> None:
    timed = _Timed(pool_us, lambda b: 1.0 * b)
    found = measure_crossover(timed, max_batch)
    assert (found.serial_below, timed.asked) == (want, asked)
    assert [t.batch for t in found.timings] == asked


def test_past_the_budget_the_sizes_not_timed_run_on_the_pool() -> None:
    ticks = iter(range(100))
    clock = lambda: float(next(ticks))  # noqa: E731 - one second per reading
    timed = _Timed(lambda b: 2.0 * b, lambda b: 1.0 * b)
    found = measure_crossover(timed, 256, budget_s=2.5, clock=clock)
    # readings 0 (start), then 1, 2 and 3 before the second, third and fourth sizes: the
    # fourth (8) is past the budget and not timed, so one thread takes only what it won
    assert (found.serial_below, timed.asked) == (8, [1, 2, 4])
    ticks = iter(range(100))
    timed = _Timed(lambda b: 0.5 * b if b >= 4 else 2.0 * b, lambda b: 1.0 * b)
    found = measure_crossover(timed, 256, budget_s=2.5, clock=clock)
    assert (found.serial_below, timed.asked) == (4, [1, 2, 4])  # the pending win counts


def test_bad_measure_arguments_are_named() -> None:
    timed = _Timed(lambda b: 1.0, lambda b: 1.0)
    with pytest.raises(ValueError, match="max_batch_size must be >= 0, got -1"):
        measure_crossover(timed, -1)
    with pytest.raises(ValueError, match="budget_s must be > 0, got 0"):
        measure_crossover(timed, 8, budget_s=0)
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        time_sessions(lambda n, f: None, lambda n, f: None, {"x": (3,)}, ["y"], runs=0)


def test_both_sessions_run_alternately_on_the_same_inputs() -> None:
    calls: list[tuple[str, list[str], dict[str, np.ndarray]]] = []

    def runner(who: str) -> Callable[[list[str], dict[str, np.ndarray]], None]:
        return lambda names, feed: calls.append((who, names, feed))

    time_both = time_sessions(runner("pool"), runner("one"), {"d": (3,), "p": (2, 4)}, ["y"], 3)
    t = time_both(5)
    assert t.batch == 5 and t.pool_s > 0 and t.one_s > 0
    # one warm-up run each, then three pairs whose first member takes turns
    order = ["pool", "one", "pool", "one", "one", "pool", "pool", "one"]
    assert [c[0] for c in calls] == order
    assert all(c[1] == ["y"] for c in calls)
    feed = calls[0][2]
    assert all(c[2] is feed for c in calls)
    assert {k: (v.shape, v.dtype) for k, v in feed.items()} == {
        "d": ((5, 3), np.float32),
        "p": ((5, 2, 4), np.float32),
    }
    assert all(np.isfinite(v).all() and v.std() > 0 for v in feed.values())
    calls.clear()
    time_both(2)
    assert calls[0][2]["p"].shape == (2, 2, 4)


def test_the_server_runs_on_one_thread_what_it_measured_one_thread_wins(
    ps: HierarchicalParameterServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="hps.serving.http_server.server"):
        s = build_servables(ps, ort_threads=2)["tiny"]
    assert s.crossover is not None
    assert [t.batch for t in s.crossover.timings][:2] == [1, 2]
    assert s.serial_below == _replayed(s.crossover.timings, s.max_batch_size)
    assert (s._ort_serial is None) == (s.serial_below == 0)
    assert f"timed at load, median on 2 threads/one: {s.crossover.describe()}" in caplog.text


def test_a_graph_that_fails_while_timed_is_named_at_load(
    ps: HierarchicalParameterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*args: object) -> Callable[[int], SizeTiming]:
        def time_both(b: int) -> SizeTiming:
            raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dims")

        return time_both

    monkeypatch.setattr("hps.serving.servable.time_sessions", failing)
    with pytest.raises(
        ValueError,
        match=r"model 'tiny': its dense graph failed on random inputs \{'dense': \(13,\), "
        r"'pooled': \(\d+, \d+\)\} \(after the batch\) while its threads were timed: "
        r"\[ONNXRuntimeError\] : 2 : INVALID_ARGUMENT",
    ):
        build_servables(ps, ort_threads=2)


def test_the_timed_sizes_stay_within_their_bytes() -> None:
    per = 26 * 128 * 4 + 13 * 4  # dlrm_dcnv2's pooled block and dense features, float32
    assert timed_batch_limit(65_536, per) == MEASURE_MAX_BYTES // per == 5_021
    assert timed_batch_limit(64, per) == 64  # the model's own bound is smaller
    assert timed_batch_limit(0, per) == 0
    assert timed_batch_limit(10, MEASURE_MAX_BYTES + 1) == 1  # one sample is always timed
    with pytest.raises(ValueError, match="bytes_per_sample >= 1, got 8 and 0"):
        timed_batch_limit(8, 0)


def test_the_timing_switch_must_be_a_bool() -> None:
    with pytest.raises(
        ValueError, match=r"ServerConfig\.ort_measure_threads must be True or False, got 'no'"
    ):
        ServerConfig(ort_measure_threads="no")  # type: ignore[arg-type]


def test_multiply_adds_are_counted_only_where_they_decide(
    ps: HierarchicalParameterServer,
) -> None:
    timed = build_servables(ps, ort_threads=2)["tiny"]
    counted = build_servables(ps, ort_threads=2, ort_measure=False)["tiny"]
    assert (timed.macs_per_sample, counted.macs_per_sample) == (0, 48_512)
