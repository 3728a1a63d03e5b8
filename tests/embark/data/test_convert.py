from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embark.data.convert import convert_criteo, dense_transform, stem_of
from embark.data.criteo import CriteoTSV
from embark.data.criteo_lines import CriteoFormatError, parse_fields
from embark.data.criteo_sample import write_criteo_like
from embark.data.fastparse import parse_chunk
from embark.data.npy import HEADER_BYTES, NpyArray, NpyWriter
from embark.models.workloads import get_workload

W = get_workload("dlrm_dcnv2").scaled(100_000)
ROOT = Path(__file__).resolve().parents[3]
SMALL_CHUNK = 20_000  # bytes: ~150 lines, so files span many chunks and lines cross them


def _line(label="1", dense=None, cats=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
    return "\t".join([label, *dense, *cats]) + "\n"


def _edge_lines() -> list[str]:
    """Valid lines the fast path must read exactly as the line parser does."""
    return [
        _line("0", ["-0", "007", "-12", "", str(2**63 - 1), str(-(2**63)), *[""] * 7]),
        _line("1", cats=["ffffffffffffffff", "8000000000000000", "a", "AbC", "", *["1"] * 21]),
        _line("1", cats=["0" * 16, *[f"{i:x}" for i in range(25)]]),
    ]


def _want(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """labels, dense (int64), raw ids (uint64) of every line, by the line parser."""
    rows = [parse_fields(s, 13, 26) for s in path.read_text().splitlines() if s]
    labels = np.array([r[0] for r in rows], dtype=np.int32)
    dense = np.array([r[1] for r in rows], dtype=np.int64)
    ids = np.array([r[2] for r in rows], dtype=np.uint64)
    return labels, dense, ids


def _load(out: Path, stem: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.load(out / f"{stem}_{k}.npy") for k in ("labels", "dense", "sparse"))  # type: ignore[return-value]


def test_converted_files_equal_the_line_parser(tmp_path):
    src = write_criteo_like(tmp_path / "day_0.tsv", 3000, seed=3)
    with open(src, "a") as fh:
        fh.writelines(_edge_lines())
    res = convert_criteo([src], tmp_path / "out", chunk_bytes=SMALL_CHUNK)
    labels, dense, ids = _load(tmp_path / "out", "day_0")
    want_labels, want_dense, want_ids = _want(src)
    assert labels.dtype == np.int32 and labels.shape == (3003, 1)
    assert dense.dtype == np.float32 and dense.shape == (3003, 13)
    assert ids.dtype == np.int64 and ids.shape == (3003, 26)
    assert np.array_equal(labels[:, 0], want_labels)
    assert np.array_equal(dense, dense_transform(want_dense))
    assert np.array_equal(ids.view(np.uint64), want_ids)  # ids >= 2**63 as their bits
    assert ids[-2, 0] == -1 and ids.view(np.uint64)[-2, 1] == 2**63
    assert res.files == [("day_0", 3003)] and res.stats.lines == 3003
    manifest = json.loads((tmp_path / "out" / "criteo_binary.json").read_text())
    (rec,) = manifest["files"]
    assert rec["stem"] == "day_0" and rec["rows"] == 3003
    for kind in ("dense", "sparse", "labels"):
        raw = (tmp_path / "out" / f"day_0_{kind}.npy").read_bytes()
        want = {"bytes": len(raw), "sha256": hashlib.sha256(raw[HEADER_BYTES:]).hexdigest()}
        assert rec["arrays"][kind] == want
    assert manifest["dense_transform"] == "log1p_clip0" and manifest["version"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_0.tsv", "out"]  # no lock, no partial


def test_the_fast_path_takes_the_edge_lines():
    data = "".join(_edge_lines() * 2).encode()
    chunk = parse_chunk(data, 1, "x", 13, 26)
    exact = parse_chunk(data + b"\t\n", 1, "x", 13, 26, skip_bad_lines=True)
    assert not chunk.exact and exact.exact and chunk.rows == exact.rows == 6
    for a, b in ((chunk.labels, exact.labels), (chunk.dense, exact.dense), (chunk.ids, exact.ids)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_gzip_and_plain_convert_alike_and_stems(tmp_path):
    plain = write_criteo_like(tmp_path / "day_1", 500, seed=4)
    gz = tmp_path / "day_2.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    convert_criteo([plain, gz], tmp_path / "out", chunk_bytes=SMALL_CHUNK)
    for a, b in zip(_load(tmp_path / "out", "day_1"), _load(tmp_path / "out", "day_2")):
        assert np.array_equal(a, b)
    assert [stem_of(p) for p in ("day_0.gz", "train.txt", "x.tsv.gz", "day_3")] == [
        "day_0", "train", "x", "day_3",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"share the output stem\(s\) \['day_1'\]"):
        convert_criteo([plain, tmp_path / "day_1"], tmp_path / "out2")


# every kind of malformed line, each placed after the first chunk (line 200)
_BAD = {
    "encoding": (b"1\t\xff" + _line()[3:].encode(), "encoding", "not UTF-8 text: byte 0xff"),
    "field_count": (_line()[:-1].encode() + b"\textra\n", "field_count", "expected 40"),
    "blank_tabs": (b"\t" * 39 + b"\n", "label", "label must be 0 or 1, got ''"),
    "spaces": (b"   \n", "field_count", "got 1"),
    "cr_inside": (_line().replace("\t", "\r", 1).encode(), "field_count", "got 39"),
    "label": (_line(label="2").encode(), "label", "got '2'"),
    "label_01": (_line(label="01").encode(), "label", "got '01'"),
    "dense_float": (_line(dense=["3.5", *["0"] * 12]).encode(), "dense", "I1 must be an integer"),
    "dense_space": (_line(dense=[" 5", *["0"] * 12]).encode(), "dense", "I1 must be an integer"),
    "dense_hex": (_line(dense=["0x5", *["0"] * 12]).encode(), "dense", "I1 must be an integer"),
    "dense_overflow": (_line(dense=[str(2**63), *["0"] * 12]).encode(), "dense", "64-bit"),
    "dense_zeros": (_line(dense=["0" * 25 + "1", *["0"] * 12]).encode(), "dense", "64-bit"),
    "dense_huge": (_line(dense=["7" * 5000, *["0"] * 12]).encode(), "dense", "(5000 characters)"),
    "cat_long": (_line(cats=["a" * 17, *["0"] * 25]).encode(), "categorical", "at most 16 hex"),
    "cat_bad": (_line(cats=["0x1f", *["0"] * 25]).encode(), "categorical", "hexadecimal"),
    "cat_quote": (_line(cats=['"ab"', *["0"] * 25]).encode(), "categorical", "hexadecimal"),
}


def _file_with(tmp_path: Path, bad: bytes) -> Path:
    good = write_criteo_like(tmp_path / "good", 400, seed=5).read_bytes().splitlines(keepends=True)
    f = tmp_path / "day_9"
    f.write_bytes(b"".join(good[:199]) + bad + b"".join(good[199:]))
    return f


@pytest.mark.parametrize("case", list(_BAD))
def test_every_bad_line_kind_stops_or_is_skipped_as_criteo_tsv_does(tmp_path, case):
    bad, kind, match = _BAD[case]
    f = _file_with(tmp_path, bad)
    with pytest.raises(CriteoFormatError, match=match) as info:
        convert_criteo([f], tmp_path / "out", chunk_bytes=SMALL_CHUNK)
    assert (info.value.kind, info.value.line) == (kind, 200)
    assert str(info.value).startswith(f"{f}:200: ")
    assert not list((tmp_path / "out").glob("*.npy*"))  # nothing half-written is left
    with pytest.raises(CriteoFormatError) as tsv:
        list(CriteoTSV(f, W, batch_size=64))
    assert str(tsv.value) == str(info.value)
    res = convert_criteo([f], tmp_path / "out", chunk_bytes=SMALL_CHUNK, skip_bad_lines=True)
    assert res.stats.bad_lines == 1 and res.stats.reasons == {kind: 1}
    assert res.stats.lines == 401 and res.files == [("day_9", 400)]
    reader = CriteoTSV(f, W, batch_size=1000, skip_bad_lines=True)
    (batch,) = list(reader)
    assert reader.stats.to_dict() == res.stats.to_dict()
    labels, dense, _ = _load(tmp_path / "out", "day_9")
    assert np.array_equal(labels[:, 0], batch.labels.numpy().astype(np.int32))
    assert np.array_equal(dense, batch.dense.numpy())


def test_a_truncated_gzip_is_an_error_naming_the_file_and_lines(tmp_path):
    whole = gzip.compress(write_criteo_like(tmp_path / "x", 2000, seed=6).read_bytes())
    f = tmp_path / "day_7.gz"
    f.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CriteoFormatError) as info:
        convert_criteo([f], tmp_path / "out", chunk_bytes=SMALL_CHUNK, skip_bad_lines=True)
    read = info.value.line - 1
    assert info.value.kind == "truncated" and 0 < read < 2000
    assert str(info.value).startswith(
        f"{f}:{read + 1}: the file cannot be read past line {read} ({read} lines were read)"
    )
    assert not list((tmp_path / "out").glob("*.npy*"))


def test_npy_writer_header_and_reader(tmp_path):
    with NpyWriter(tmp_path / "a.npy", np.float32, (3,)) as w:
        w.append(np.arange(6, dtype=np.float32).reshape(2, 3))
        w.append(np.ones((1, 3), dtype=np.float32))
        with pytest.raises(ValueError, match=r"rows of float32 \(3,\) expected, got int64 \(3,\)"):
            w.append(np.ones((1, 3), dtype=np.int64))
    got = np.load(tmp_path / "a.npy")
    assert got.shape == (3, 3) and got[2].tolist() == [1, 1, 1]
    arr = NpyArray.open(tmp_path / "a.npy")
    assert arr.offset == HEADER_BYTES and arr.shape == (3, 3)
    assert np.array_equal(arr.rows(1, 3), got[1:3])
    (tmp_path / "b.npy").write_bytes(b"not npy")
    with pytest.raises(ValueError, match=r"b.npy: not a .npy file"):
        NpyArray.open(tmp_path / "b.npy")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = (
        "import sys; from embark.data.convert import main; rc = main(sys.argv[1:]); "
        "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd
    )


def test_cli_converts_without_torch_and_reports(tmp_path):
    src = write_criteo_like(tmp_path / "day_0.gz", 300, seed=7)
    out = tmp_path / "out"
    run = _cli(
        "--workload",
        "dlrm_dcnv2",
        "--in",
        str(src),
        "--out",
        str(out),
        "--no-progress",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "no torch"  # start-up stays short
    assert "converted 300 of 300 lines from 1 file(s)" in run.stderr
    assert np.load(out / "day_0_labels.npy").shape == (300, 1)
    again = _cli("--workload", "dlrm_dcnv2", "--in", str(src), "--out", str(out), cwd=tmp_path)
    assert again.returncode == 1 and "is not empty: pass --overwrite" in again.stderr
    bad = _file_with(tmp_path, _BAD["dense_float"][0])
    run = _cli(
        "--workload", "dlrm_dcnv2", "--in", str(bad), "--out", str(tmp_path / "o2"), cwd=tmp_path
    )
    assert run.returncode == 1 and f"error: {bad}:200: dense feature I1" in run.stderr
    run = _cli(
        "--workload", "dlrm_dcnv2", "--in", str(bad), "--out", str(tmp_path / "o3"),
        "--skip-bad-lines", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0 and "skipped 1 bad line(s) {'dense': 1}" in run.stderr
    assert f"{bad}:200: dense feature I1 must be an integer" in run.stderr
