"""Spawning a gloo world for a test: ``world`` processes that each run ``script --worker RANK
WORLD INIT_FILE OUT_DIR`` (the test file itself, run as a script), rendezvous through a file
and write their results under ``OUT_DIR``. One spawn per world: a process that imports torch
costs seconds on 2 cores, so each worker runs every case of its file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
            [sys.executable, str(script), "--worker", str(r), str(world), str(out_dir / "init"), str(out_dir)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def worker_main(worker, usage: str) -> None:  # noqa: ANN001 - worker(rank, world, init_file, out_dir)
    """The ``__main__`` of a test file run as a worker."""
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
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
            o = F.embedding_bag(
                batch.values_for(t.name), ref_w[t.name], batch.bag_offsets(t.name),
                mode=t.combiner.value,
            ) if batch.batch_size else ref_w[t.name][:0]
            loss = loss + (o * ups[r][t.name]).sum()
            if r == rank:
                pooled[t.name] = o.detach()
    loss.backward()
    return ref_w, pooled
