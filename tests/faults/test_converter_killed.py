"""The Criteo converter under faults: killed at random points it never leaves a folder that
opens (and a resumed run finishes it byte for byte), and bad inputs end with exit status 0 or
1, never an abort (134).

``TILEREC_FAULT_RUNS`` sets the runs per case (default: 5 kills, 2 runs per bad input and mode,
to keep the suite short; ``TILEREC_FAULT_RUNS=20`` runs the acceptance counts).
"""

from __future__ import annotations

import gzip
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from embark.data.binary import CriteoBinary
from embark.data.convert import convert_criteo
from embark.data.criteo_sample import write_criteo_like
from embark.data.staging import staging_path
from embark.models.workloads import get_workload

W = get_workload("dlrm_dcnv2").scaled(100_000)
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _runs(default: int) -> int:
    return int(os.environ.get("TILEREC_FAULT_RUNS", default))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "embark.data.convert", "--workload", "dlrm_dcnv2",
            "--no-progress", "--chunk-mb", "1", *args]  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _holds(out: Path, ref: Path) -> bool:
    """Whether ``out`` opens and holds exactly the conversion ``ref``."""
    reader = CriteoBinary(out, W, 4096)  # manifest, sizes and checksums checked
    got, want = _files(out), _files(ref)
    return (
        reader.num_samples == CriteoBinary(ref, W, 4096).num_samples
        and all(got.get(name) == data for name, data in want.items() if name.endswith(".npy"))
        and sorted(got) == sorted(want)
    )


@pytest.mark.slow
def test_a_killed_conversion_never_leaves_a_folder_that_opens(tmp_path):
    """Each run converts three inputs into ``out`` — empty, or (every other run) holding an
    older conversion it replaces — and is killed (SIGKILL; SIGINT every fourth run) at a
    random point of its run. ``out`` then holds the old conversion or the new one, whole, or
    nothing; a run with ``--resume`` finishes the new one byte for byte. The points spread
    over the length of a timed run; a run that finishes before its signal (the timed one ran
    on a busier host) halves what is left of that length for the later runs."""
    srcs = [write_criteo_like(tmp_path / f"day_{i}.tsv", 6_000, seed=i) for i in range(3)]
    ref, old = tmp_path / "ref", tmp_path / "old"
    convert_criteo(srcs, ref, chunk_bytes=1 << 20)
    convert_criteo(srcs[:1], old, chunk_bytes=1 << 20)
    out = tmp_path / "out"
    args = _cli("--in", *map(str, srcs), "--out", str(out), "--overwrite")
    t0 = time.monotonic()
    subprocess.run(_cli("--in", "missing", "--out", str(out)), env=ENV, capture_output=True)
    startup = time.monotonic() - t0  # the interpreter and imports, before the converter runs
    subprocess.run(args, env=ENV, check=True, capture_output=True)
    whole = time.monotonic() - t0 - startup
    rng = random.Random(0)
    seen = {"nothing": 0, "partial": 0, "old": 0, "new": 0}
    runs = _runs(5)
    for run in range(runs):
        for p in (out, staging_path(out)):
            shutil.rmtree(p, ignore_errors=True)
        if run % 2:
            shutil.copytree(old, out)
        proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        sig = signal.SIGINT if run % 4 == 3 else signal.SIGKILL
        # delays spread over the conversion (stratified), after most of the start-up; SIGINT
        # while Python itself starts is Python's own traceback, so it comes after the start-up
        lo = startup if sig == signal.SIGINT else 0.8 * startup
        time.sleep(lo + (run + rng.random()) / runs * (whole - lo))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        # -SIGINT: the signal came as the interpreter exited, after the converter finished
        assert proc.returncode in (0, 130, -signal.SIGKILL, -signal.SIGINT), (proc.returncode, err)
        if proc.returncode == 0:  # it finished before the signal: the timed run was slower
            whole = startup + (whole - startup) / 2  # (a busy host), so later delays shrink
        assert b"Traceback" not in err, err
        if out.exists():
            is_new = _holds(out, ref)
            assert is_new or (run % 2 and _holds(out, old)), run
            seen["new" if is_new else "old"] += 1
        else:
            with pytest.raises(FileNotFoundError):
                CriteoBinary(out, W, 4096)
            seen["partial" if staging_path(out).exists() else "nothing"] += 1
        if not (out.exists() and _holds(out, ref)):
            done = subprocess.run([*args, "--resume"], env=ENV, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            assert _holds(out, ref)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    print(seen)  # the figures for the report, with -s
    assert seen["partial"] > 0, seen  # kills landed inside conversions


def _bad_inputs(folder: Path) -> dict[str, Path]:
    """Inputs that end in an error (or, with --skip-bad-lines, a skipped line)."""
    folder.mkdir()
    good = "\t".join(["0", *["3"] * 13, *["0b"] * 26]) + "\n"
    overflow = "\t".join(["1", "9223372036854775808", *["1"] * 12, *["0a"] * 26]) + "\n"
    short = "\t".join(["1", *["1"] * 13, *["0a"] * 25]) + "\n"
    files = {
        "dense_overflow": (folder / "overflow.tsv", good * 10 + overflow + good * 10),
        "field_count": (folder / "short.tsv", good * 10 + short + good * 10),
        "one_line": (folder / "one.tsv", overflow),
    }
    for path, text in files.values():
        path.write_text(text)
    gz = folder / "one.tsv.gz"
    gz.write_bytes(gzip.compress(overflow.encode()))
    return {**{k: p for k, (p, _) in files.items()}, "gzip": gz}


@pytest.mark.slow
def test_bad_inputs_end_with_status_0_or_1_never_an_abort(tmp_path):
    inputs = _bad_inputs(tmp_path / "in")
    cases = [
        (name + "".join(skip), path, skip, run)
        for name, path in inputs.items()
        for skip in ((), ("--skip-bad-lines",))
        for run in range(_runs(2))
    ]

    def convert(case: str, path: Path, skip: tuple[str, ...], run: int):
        out = tmp_path / f"o-{case}-{run}"
        return subprocess.run(
            _cli("--in", str(path), "--out", str(out), *skip), env=ENV,
            capture_output=True, text=True,
        )  # fmt: skip

    # independent runs (each its own input and output folder): the interpreters start side by
    # side, not one after another
    with ThreadPoolExecutor(max_workers=4) as pool:
        procs = list(pool.map(lambda c: convert(*c), cases))
    counts: dict[str, dict[int, int]] = {}
    for (case, _, skip, _), proc in zip(cases, procs, strict=True):
        counts.setdefault(case, {})
        counts[case][proc.returncode] = counts[case].get(proc.returncode, 0) + 1
        assert "terminate called" not in proc.stderr, (case, proc.stderr)
        assert proc.returncode == (0 if skip else 1), (case, proc.stderr)
    print(counts)  # the figures for the report, with -s
