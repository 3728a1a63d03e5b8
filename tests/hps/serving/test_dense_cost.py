"""The dense graph's cost per sample, and small executions run on one onnxruntime thread with
the same scores as on the pool."""

from __future__ import annotations

import dataclasses
import logging
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
    WEIGHT_READ_SAMPLES,
    serial_batch_limit,
    weight_macs_per_sample,
)
from hps.serving.http_server import InferenceServer, build_servables
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
    s = build_servables(ps, ort_threads=2, ort_parallel_min_macs=bound)["tiny"]
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
    s = build_servables(ps, ort_threads=2, ort_parallel_min_macs=10**12)["tiny"]
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
    "argv,want",
    [([], DEFAULT_PARALLEL_MIN_MACS), (["--ort-parallel-min-macs", "0"], 0)],
    ids=["default", "off"],
)
def test_the_cli_flag_reaches_the_server_s_models(
    ps: HierarchicalParameterServer, argv: list[str], want: int
) -> None:
    knobs = from_namespace(ServerKnobs, build_parser().parse_args(["--config", "x", *argv]))
    cfg = dataclasses.replace(knobs.server_config(), port=0, ort_threads=2)
    assert cfg.ort_parallel_min_macs == want
    with InferenceServer(ps, cfg) as srv:
        s = srv.servables["tiny"]
        # the tiny model's bound at the default is 155 samples, capped at its batch of 64
        assert s.serial_below == (s.max_batch_size + 1 if want else 0)
        assert (s._ort_serial is None) == (want == 0)


def test_a_bad_cli_value_is_named() -> None:
    knobs = from_namespace(
        ServerKnobs, build_parser().parse_args(["--config", "x", "--ort-parallel-min-macs", "-1"])
    )
    with pytest.raises(ValueError, match=r"ServerConfig\.ort_parallel_min_macs must be an integer"):
        knobs.server_config()
