"""Criteo data path: the converter vs the TSV reader vs TorchRec's ``tsv_to_npys`` on the same
generated file, ``CriteoBinary`` samples/s at batch 8192 on 1 and 2 ranks, and the per-rank
synthetic generator's data time on worlds 1, 2, 4 — side by side in one run.

    python -m benchmarks.embark.bench_data [--lines 400000] [--peer-lines 100000]
        [--rounds 2] [--out F]

The input is :func:`embark.data.write_criteo_like` (Criteo-like values, empty fields in
every column). Every figure is a fresh process, as a user runs it, so the converter's figure
includes Python's start-up and its imports; each round runs every contender once, in turn, so
the load of a shared host falls on all alike; the table shows the median over rounds. The two
slow peers (``CriteoTSV``, TorchRec) read the first ``--peer-lines`` lines only (their rate
does not depend on the file's length). Per process: wall seconds, CPU seconds (user + system,
every thread) and peak RSS (``VmHWM``); rates are per wall second, and per CPU second in the
JSON (``*_per_cpu_s``), which a busy host disturbs less. TorchRec opens files through ``iopath`` (its optional
``datasets`` extra); where that is missing a local-files stand-in is used.

``CriteoBinary`` on 2 ranks: two processes at once, each reading its half of every global
batch; the aggregate rate is global samples over the slower rank's time. Synthetic data:
``SyntheticCTR(dlrm_dcnv2 / 1000, batch 8192)``, CPU seconds for rank 0's slice of a global
batch at world 1, 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.meta import REPO_ROOT, RESULTS_DIR, write_json

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
{body}
ru = resource.getrusage(resource.RUSAGE_SELF)
hwm = next(int(s.split()[1]) for s in open("/proc/self/status") if s.startswith("VmHWM:"))
print("RESULT " + json.dumps({{"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": hwm / 1024,
                             "inner_s": time.perf_counter() - t0, **extra}}))
"""

_CONVERT = """
from embark.data.convert import main
rc = main(["--workload", "dlrm_dcnv2", "--in", sys.argv[1], "--out", sys.argv[2], "--overwrite", "--no-progress"])
assert rc == 0
extra = {}
"""

_TSV = """
from embark.data.criteo import CriteoTSV
from embark.models.workloads import get_workload
n = sum(b.batch_size for b in CriteoTSV(sys.argv[1], get_workload("dlrm_dcnv2").scaled(1000), 8192))
extra = {"lines": n}
"""

_TORCHREC = """
import types
try:
    import iopath.common.file_io
    stand_in = False
except ImportError:
    class _Files:
        def open(self, path, mode="r", **kw):
            return open(path, mode)
        def set_strict_kwargs_checking(self, flag):
            pass
    class _Factory:
        def get(self, key):
            return _Files()
    for name in ("iopath", "iopath.common", "iopath.common.file_io"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["iopath.common.file_io"].PathManagerFactory = _Factory
    stand_in = True
from torchrec.datasets.criteo import BinaryCriteoUtils
out = sys.argv[2]
BinaryCriteoUtils.tsv_to_npys(sys.argv[1], out + "/d.npy", out + "/s.npy", out + "/l.npy")
extra = {"iopath_stand_in": stand_in}
"""

_BINARY = """
from embark.data.binary import CriteoBinary
from embark.models.workloads import get_workload
rank, world = int(sys.argv[2]), int(sys.argv[3])
reader = CriteoBinary(sys.argv[1], get_workload("dlrm_dcnv2").scaled(1000), 8192, rank=rank, world_size=world)
start = time.perf_counter()
n = sum(b.batch_size for b in reader)
extra = {"samples": n, "read_s": time.perf_counter() - start}
"""

_SYNTHETIC = """
from embark.data.synthetic import SyntheticCTR
from embark.models.workloads import get_workload
data = SyntheticCTR(get_workload("dlrm_dcnv2").scaled(1000), 8192)
extra = {}
for world in (1, 2, 4):
    data.batch(0, rank=0, world_size=world)
    t = time.process_time()
    for i in range(1, 4):
        data.batch(i, rank=0, world_size=world)
    extra[f"world{world}_cpu_s_per_batch"] = (time.process_time() - t) / 3
"""


def _start(body: str, *args: str) -> tuple[subprocess.Popen[str], float]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    code = _CHILD.format(body=body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, time.perf_counter()


def _finish(proc: subprocess.Popen[str], t0: float) -> dict[str, Any]:
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{err[-3000:]}")
    line = next(s for s in out.splitlines() if s.startswith("RESULT "))
    return {"wall_s": wall, **json.loads(line[len("RESULT ") :])}


def _run(body: str, *args: str) -> dict[str, Any]:
    return _finish(*_start(body, *args))


def _round(src: Path, peer: Path, tmp: Path, lines: int, peer_lines: int) -> list[dict[str, Any]]:
    rows = []
    r = _run(_CONVERT, str(src), str(tmp / "bin"))
    rows.append(
        {"what": "convert (ours, CLI)", "lines": lines, "lines_per_s": lines / r["wall_s"], **r}
    )
    r = _run(_TSV, str(peer))
    rows.append(
        {"what": "CriteoTSV (current reader)", "lines_per_s": peer_lines / r["wall_s"], **r}
    )
    (tmp / "tr").mkdir(exist_ok=True)
    r = _run(_TORCHREC, str(peer), str(tmp / "tr"))
    rows.append(
        {
            "what": "TorchRec tsv_to_npys",
            "lines": peer_lines,
            "lines_per_s": peer_lines / r["wall_s"],
            **r,
        }
    )
    r = _run(_BINARY, str(tmp / "bin"), "0", "1")
    rows.append({"what": "CriteoBinary, 1 rank", "samples_per_s": r["samples"] / r["read_s"], **r})
    procs = [_start(_BINARY, str(tmp / "bin"), str(k), "2") for k in range(2)]
    ranks = [_finish(*p) for p in procs]
    slow = max(x["read_s"] for x in ranks)
    rows.append({
        "what": "CriteoBinary, 2 ranks", "samples": sum(x["samples"] for x in ranks), "read_s": slow,
        "samples_per_s": sum(x["samples"] for x in ranks) / slow,
        "cpu_s": sum(x["cpu_s"] for x in ranks), "peak_rss_mb": max(x["peak_rss_mb"] for x in ranks),
        "wall_s": max(x["wall_s"] for x in ranks),
    })  # fmt: skip
    return rows


def _per_cpu(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        n = r.get("lines", r.get("samples"))
        r["per_cpu_s"] = n / r["cpu_s"] if n and r["cpu_s"] else None


def _median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for k, first in enumerate(rounds[0]):
        row = dict(first)
        for key, value in first.items():
            if isinstance(value, float):
                row[key] = statistics.median(r[k][key] for r in rounds)
        out.append(row)
    return out


def _table(rows: list[dict[str, Any]], synthetic: dict[str, Any]) -> str:
    lines = [
        "| what | lines or samples | per wall s | per CPU s | wall s | CPU s | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r.get("lines_per_s") or r.get("samples_per_s")
        n = r.get("lines", r.get("samples"))
        lines.append(
            f"| {r['what']} | {n:,} | {rate:,.0f} | {r['per_cpu_s']:,.0f} | {r['wall_s']:.2f} | "
            f"{r['cpu_s']:.2f} | {r['peak_rss_mb']:.0f} |"
        )
    one = synthetic["world1_cpu_s_per_batch"]
    lines.append("")
    lines.append("| SyntheticCTR rank 0, batch 8192 | world 1 | world 2 | world 4 |")
    lines.append("|---|---:|---:|---:|")
    lines.append(
        "| CPU s per global batch (ratio to world 1) | "
        + " | ".join(
            f"{synthetic[f'world{w}_cpu_s_per_batch']:.3f} ({synthetic[f'world{w}_cpu_s_per_batch'] / one:.2f})"
            for w in (1, 2, 4)
        )
        + " |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=400_000)
    p.add_argument("--peer-lines", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_data.json"))
    args = p.parse_args(argv)
    from embark.data.criteo_sample import write_criteo_like

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = write_criteo_like(tmp / "day_0", args.lines, seed=0)
        peer = tmp / "peer"
        with open(src, "rb") as fh, open(peer, "wb") as out:
            for _ in range(args.peer_lines):
                out.write(fh.readline())
        load_before = os.getloadavg()
        rounds = [_round(src, peer, tmp, args.lines, args.peer_lines) for _ in range(args.rounds)]
        synthetic = _run(_SYNTHETIC)
        load_after = os.getloadavg()
    for one in rounds:
        _per_cpu(one)
    rows = _median_rows(rounds)
    table = _table(rows, synthetic)
    print(table)
    print(f"load average before {load_before}, after {load_after}")
    write_json(
        args.out, rows, lines=args.lines, peer_lines=args.peer_lines, rounds=args.rounds,
        synthetic=synthetic, loadavg_before=load_before, loadavg_after=load_after, table=table,
        all_rounds=rounds,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
