"""Spawning a gloo world for a test: ``world`` processes that each run ``script --worker RANK
WORLD INIT_FILE OUT_DIR`` (the test file itself, run as a script), rendezvous through a file
and write their results under ``OUT_DIR``. One spawn per world: a process that imports torch
costs seconds on 2 cores, so each worker runs every case of its file.

:func:`launch_ranks` starts a command line (``-m embark.sharded_train ...``) as torchrun's
workers, without torchrun's agent, and returns every rank's exit status and output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def spawn_world(script: str | Path, world: int, out_dir: Path, timeout_s: float = 240.0) -> None:
    """Run ``world`` worker processes of ``script`` to the end.

    Raises:
        AssertionError: a rank exits non-zero (its last output is in the message) or runs past
            ``timeout_s`` (every rank is then killed).
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                "--worker",
                str(r),
                str(world),
                str(out_dir / "init"),
                str(out_dir),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a rank of the {world}-rank world ran past {timeout_s} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{log[-4000:]}"


def spawn_reports(
    script: str | Path, world: int, out_dir: Path, timeout_s: float = 240.0
) -> list[dict[str, Any]]:
    """:func:`spawn_world`, then every rank's ``rank<r>.json`` report, in rank order."""
    spawn_world(script, world, out_dir, timeout_s=timeout_s)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(
    world: int, args: Sequence[str], timeout_s: float = 180.0, attempts: int = 3
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python *args`` as ranks ``0..world-1`` of one env:// rendezvous, with the variables
    torchrun gives its workers (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; one node), and wait for every rank to end by itself.

    Not torchrun itself: its agent SIGTERMs the other ranks as soon as one exits non-zero, so
    under it "every rank exits 2" (or "rank 0 logged the error") holds only when no rank is
    faster than another. Output goes to files, not pipes, so a rank blocked on a full pipe
    cannot stall the others. A launch whose rank 0 lost its free port to another process
    (``EADDRINUSE``) is retried on a new port, up to ``attempts`` launches.

    Returns:
        one ``CompletedProcess`` per rank, in rank order (``returncode``, ``stdout``, ``stderr``).

    Raises:
        AssertionError: a rank runs past ``timeout_s`` (every rank is then killed).
    """
    for _ in range(attempts):
        done = _launch_once(world, args, timeout_s, free_port())
        if not any("EADDRINUSE" in p.stderr for p in done):
            return done
    return done


def _launch_once(
    world: int, args: Sequence[str], timeout_s: float, port: int
) -> list[subprocess.CompletedProcess[str]]:
    base = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    cmd = [sys.executable, *args]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(world)]
        procs = []
        try:
            for r, (out, err) in enumerate(outs):
                with open(out, "w") as fo, open(err, "w") as fe:
                    env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
                    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe))
            deadline = time.monotonic() + timeout_s
            for r, p in enumerate(procs):
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"rank {r} of {world} ran past {timeout_s} s: {' '.join(cmd)}"
                    ) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [
            subprocess.CompletedProcess(cmd, p.returncode, out.read_text(), err.read_text())
            for p, (out, err) in zip(procs, outs)
        ]


def worker_main(worker, usage: str) -> None:  # noqa: ANN001 - worker(rank, world, init_file, out_dir)
    """The ``__main__`` of a test file run as a worker."""
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        # finished, its report written: skip interpreter teardown, where a gloo thread still
        # joinable at static destruction can abort a completed rank (as embark.sharded_train)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        sys.exit(f"usage: {usage} --worker RANK WORLD INIT_FILE OUT_DIR")


def reference_step(full, tables, batches, ups, rank: int):  # noqa: ANN001, ANN201 - test helper
    """The single-process reference of one sharded step: ``F.embedding_bag`` on the full tables
    for every rank's local batch, loss ``Σ_ranks Σ_tables (pooled · upstream)``, backward.

    Args:
        full: ``{table: (rows, dim)}`` full weights; tables: the TableConfigs; batches: one
            JaggedBatch per rank; ups: per rank ``{table: (B_r, dim)}`` upstream gradients.

    Returns:
        ``(weights, pooled)``: ``{table: leaf tensor with .grad}`` and this rank's pooled outputs.
    """
    import torch
    import torch.nn.functional as F

    ref_w = {n: w.clone().requires_grad_(True) for n, w in full.items()}
    loss = torch.zeros(())
    pooled = {}
    for r, batch in enumerate(batches):
        for t in tables:
            o = (
                F.embedding_bag(
                    batch.values_for(t.name),
                    ref_w[t.name],
                    batch.bag_offsets(t.name),
                    mode=t.combiner.value,
                )
                if batch.batch_size
                else ref_w[t.name][:0]
            )
            loss = loss + (o * ups[r][t.name]).sum()
            if r == rank:
                pooled[t.name] = o.detach()
    loss.backward()
    return ref_w, pooled
