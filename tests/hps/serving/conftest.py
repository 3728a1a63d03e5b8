"""Fixtures shared by the serving tests: the tiny DLRM, its artifacts, a parameter server over
them, and a server speaking HTTP and gRPC over them, gRPC in this process or from a front
process (the model and its artifacts session-scoped: exporting the model is the slow part)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import InferenceServer, ServerConfig
from tests.hps.serving.tiny_dlrm import tiny_model, write_artifacts


@pytest.fixture(scope="session")
def tiny() -> DLRM:
    return tiny_model()


@pytest.fixture(scope="session")
def tiny_artifacts(tiny: DLRM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifacts(tiny, tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def ps(tiny_artifacts: Path) -> Iterator[HierarchicalParameterServer]:
    """The parameter server over the tiny model's artifacts (one per test module)."""
    p = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session", params=[0, 1], ids=["grpc-in-process", "grpc-front"])
def both_served(tiny_artifacts: Path, request: pytest.FixtureRequest) -> Iterator[InferenceServer]:
    """HTTP and gRPC on free ports, 4 workers, requests up to 1 MiB; gRPC served by grpcio's
    threads in this process, then by one front process (every test that uses it runs
    against both)."""
    ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    cfg = ServerConfig(
        port=0, grpc_port=0, workers=4, max_request_mb=1.0, grpc_processes=request.param
    )
    srv = InferenceServer(ps, cfg).start()
    try:
        yield srv
    finally:
        srv.stop()
        ps.close()
