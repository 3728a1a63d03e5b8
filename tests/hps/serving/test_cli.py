"""``python -m hps.server`` refuses bad flags and environments with exit status 2 and an error
that names the bad value and what was expected, never a traceback."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from embark.models.dlrm import DLRM
from hps.server import build_parser, main
from hps.serving.http_server import InferenceServer
from tests.hps.serving.tiny_dlrm import ROOT, tiny_model, write_artifacts


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model: DLRM = tiny_model()
    return write_artifacts(model, tmp_path_factory.mktemp("serving")) / "ps.json"


def _never_serve(self: InferenceServer) -> None:
    pytest.fail("the server accepted the arguments and started serving")


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """``cli(argv)``: run the CLI in-process; it must exit 2 (not serve). Its stderr."""
    monkeypatch.setattr(InferenceServer, "serve_until_signalled", _never_serve)
    return functools.partial(_exit_2, capsys=capsys)


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


def test_an_unknown_log_level_is_a_usage_error_listing_the_levels(config, cli) -> None:
    err = cli(["--config", str(config), "--log-level", "bogus"])
    assert "argument --log-level: invalid choice: 'bogus'" in err
    assert "'debug', 'info', 'warning', 'error', 'critical'" in err
    assert build_parser().parse_args(["--config", "x", "--log-level", "DEBUG"]).log_level == "debug"


def test_an_address_in_use_is_named(config, cli) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = cli(["--config", str(config), "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err


def test_a_binary_config_file_is_named(tmp_path, cli) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    err = cli(["--config", str(binary)])
    assert f"{binary}: not UTF-8 text (byte 0x80 at offset 128)" in err


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--workers", "1000000"], "workers must be an integer from 1 to 256, got 1000000"),
        (["--max-connections", "0"], "max_connections must be an integer from 1 to 65536, got 0"),
        (["--header-timeout-s", "inf"], "header_timeout_s must be a finite number of seconds > 0"),
        (["--body-timeout-s", "-1"], "body_timeout_s must be a finite number of seconds > 0"),
    ],
)
def test_knobs_out_of_range_exit_2_naming_the_limit(config, cli, flags, match) -> None:
    assert match in cli(["--config", str(config), *flags])


def test_a_bad_log_level_ends_the_process_without_a_traceback(config) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hps.server", "--config", str(config), "--log-level", "bogus"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith("python -m hps.server: error: "), r.stderr


def test_a_grpc_port_out_of_range_is_named(config, cli) -> None:
    err = cli(["--config", str(config), "--port", "0", "--grpc-port", "70000"])
    assert "ServerConfig.grpc_port must be an integer from 0 to 65535, got 70000" in err


def test_the_grpc_port_must_differ_from_the_http_port(config, cli) -> None:
    err = cli(["--config", str(config), "--port", "8123", "--grpc-port", "8123"])
    assert "grpc_port 8123 is also the HTTP port" in err


def test_a_grpc_address_in_use_is_named(config, cli) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = cli(["--config", str(config), "--port", "0", "--grpc-port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port} (gRPC): Address already in use" in err
