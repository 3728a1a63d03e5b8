"""A tiny served DLRM for the server's tests and the fault suite: the model (half its tables
mean-pooled), its serving artifacts, requests for it, the eager reference scores, and the CLI
server (``python -m hps.server``) in a subprocess, stopped by pid."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
import tritonclient.http as th

from embark.data.jagged import JaggedBatch
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import get_workload
from embark.types import Combiner
from export.artifacts import write_serving_artifacts

ROOT = Path(__file__).resolve().parents[3]


def tiny_model() -> DLRM:
    """The ``tiny`` workload, odd tables mean-pooled, seed 5, in eval mode."""
    w = get_workload("tiny")
    tables = tuple(
        dataclasses.replace(t, combiner=Combiner.MEAN) if i % 2 else t
        for i, t in enumerate(w.tables)
    )
    return build_model(dataclasses.replace(w, tables=tables), seed=5).eval()


def write_artifacts(model: DLRM, out: Path) -> Path:
    """Serving artifacts of ``model`` in ``out`` (model ``tiny``, max batch 64); ``out``."""
    write_serving_artifacts(model, out, model_name="tiny", max_batch_size=64, cache_fraction=0.3)
    return out


def make_request(model: DLRM, batch: int, seed: int, narrow: bool = False) -> dict[str, np.ndarray]:
    """``dense (B, D) float32`` and ``ids_<t> (B, H_t) int64``, ~1/4 of multi-hot slots -1; with
    ``narrow`` one table sends fewer ids per sample than its hotness."""
    g = np.random.default_rng(seed)
    out = {"dense": g.random((batch, model.workload.dense_features), dtype=np.float32)}
    for i, t in enumerate(model.workload.tables):
        width = max(1, t.hotness - 1) if narrow and i == 3 else t.hotness
        ids = g.integers(0, t.num_rows, (batch, width))
        if width > 1:
            ids[g.random(ids.shape) < 0.25] = -1
        out[f"ids_{t.name}"] = ids
    return out


@torch.no_grad()
def eager_logits(model: DLRM, req: dict[str, np.ndarray]) -> np.ndarray:
    """The reference: the eager model on the same bags (padding dropped) → ``(B,)`` logits."""
    values, lengths = [], []
    for t in model.workload.tables:
        ids = torch.from_numpy(req[f"ids_{t.name}"])
        values.append(ids[ids >= 0])
        lengths.append((ids >= 0).sum(dim=1))
    sparse = JaggedBatch(model.table_names, torch.cat(values), torch.cat(lengths).to(torch.int32))
    return model(torch.from_numpy(req["dense"]), sparse).numpy()


def triton_inputs(
    req: dict[str, np.ndarray], binary: bool = True, int32: bool = False
) -> list[th.InferInput]:
    """``req`` as tritonclient inputs (binary tensors unless ``binary`` is false)."""
    out = []
    for name, arr in req.items():
        if arr.dtype == np.int64 and int32:
            arr = arr.astype(np.int32)
        x = th.InferInput(
            name,
            list(arr.shape),
            {np.float32: "FP32", np.float64: "FP64", np.int64: "INT64", np.int32: "INT32"}[
                arr.dtype.type
            ],
        )
        x.set_data_from_numpy(arr, binary_data=binary)
        out.append(x)
    return out


def bindable(port: int) -> bool:
    """Whether a new server could listen on ``port`` (SO_REUSEADDR as servers set it: a
    connection of the stopped server in TIME_WAIT does not count, a listening socket does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def wait_until(cond: Callable[[], object], timeout_s: float = 20.0) -> bool:
    """Poll ``cond`` every 50 ms until it is true (``True``) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def refused(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 any more."""
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CliServer:
    """``python -m hps.server --config <ps.json> --port <free> <flags>`` in a subprocess (this
    checkout first on ``PYTHONPATH``), ready once ``/v2/health/ready`` answers; stopped by
    SIGTERM to its pid (SIGKILL after 30 s). ``output`` holds its stdout and stderr once
    stopped, ``returncode`` its exit status.

    >>> with CliServer(art / "ps.json", "--workers", "2") as srv:     # doctest: +SKIP
    ...     th.InferenceServerClient(srv.address).infer("tiny", ...)
    """

    def __init__(self, config: Path, *flags: str, ready_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.output = ""
        self.returncode: int | None = None
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "hps.server", "--config", str(config)]
        self._proc = subprocess.Popen(
            [*argv, "--port", str(self.port), *flags],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        client = th.InferenceServerClient(self.address)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.is_server_ready():
                    return
            except Exception:  # not listening yet
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.address} did not start: {self.stop()}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def children(self) -> list[int]:
        """The server's child processes now (its gRPC fronts), from ``/proc``."""
        out: list[int] = []
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            with open(f"/proc/{self.pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        return sorted(out)

    def stop(self) -> str:
        """SIGTERM (then SIGKILL after 30 s); the process's output."""
        if self.returncode is None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
            try:
                out, _ = self._proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                out, _ = self._proc.communicate()
            self.output, self.returncode = out or "", self._proc.returncode
        return self.output

    def __enter__(self) -> CliServer:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
