"""A conversion is published whole: interrupted, failed or concurrent conversions never leave
a folder that reads, and :class:`CriteoBinary` reads a folder only through its manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embark.data.convert as convert
from embark.data.binary import CriteoBinary
from embark.data.convert import convert_criteo, main
from embark.data.criteo_lines import CriteoFormatError
from embark.data.criteo_sample import write_criteo_like
from embark.data.manifest import MANIFEST, ManifestError
from embark.data.npy import HEADER_BYTES, NpyWriter
from embark.data.staging import FolderBusyError, FolderLock, old_path, staging_path
from embark.models.workloads import get_workload

W = get_workload("dlrm_dcnv2").scaled(100_000)
ROOT = Path(__file__).resolve().parents[3]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _inputs(tmp_path: Path, sizes: dict[str, int], seed: int = 0) -> list[Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return [
        write_criteo_like(tmp_path / f"{stem}.tsv", n, seed=seed + i)
        for i, (stem, n) in enumerate(sizes.items())
    ]


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, index: int, error: BaseException) -> None:
    """Make the conversion of input ``index`` (0-based) raise ``error``."""
    real = convert._convert_one
    calls = iter(range(1000))

    def convert_one(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if next(calls) == index:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "_convert_one", convert_one)


# ------------------------------------------------------------------ item 1: interrupted
def test_an_interrupted_conversion_publishes_nothing_and_resumes(tmp_path, monkeypatch):
    srcs = _inputs(tmp_path / "in", {"a": 600, "b": 400})
    ref = tmp_path / "ref"
    convert_criteo(srcs, ref, chunk_bytes=30_000)
    out = tmp_path / "o"
    _interrupt_at(monkeypatch, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        convert_criteo(srcs, out, chunk_bytes=30_000)
    assert not out.exists()  # a_*.npy is finished, but only in the staging folder
    partial = staging_path(out)
    assert sorted(p.name for p in partial.iterdir()) == [
        "a_dense.npy", "a_labels.npy", "a_sparse.npy", "progress.json",
    ]  # fmt: skip
    with pytest.raises(FileNotFoundError, match=f"'{out}' does not exist"):
        CriteoBinary(out, W, 100)
    with pytest.raises(FileNotFoundError, match=f"'{partial}' holds no {MANIFEST}"):
        CriteoBinary(partial, W, 100)
    monkeypatch.undo()
    with pytest.raises(
        ValueError, match=r"left .*\.o\.partial' \(1 of 2 input\(s\) finished\): pass --resume"
    ):
        convert_criteo(srcs, out, chunk_bytes=30_000)
    res = convert_criteo(srcs, out, chunk_bytes=30_000, resume=True)
    assert res.resumed == 1 and res.files == [("a", 600), ("b", 400)] and res.stats.lines == 1000
    assert _files(out) == _files(ref)  # byte for byte what an uninterrupted run writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "o", "ref"]


def test_resume_refuses_changed_inputs_and_a_bad_line_removes_the_partial(tmp_path, monkeypatch):
    srcs = _inputs(tmp_path / "in", {"a": 300, "b": 300})
    out = tmp_path / "o"
    _interrupt_at(monkeypatch, 1, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        convert_criteo(srcs, out)
    monkeypatch.undo()
    with open(srcs[0], "a") as fh:  # the finished input changed since
        fh.write(open(srcs[1]).readline())
    with pytest.raises(ValueError, match="cannot resume .*other inputs or options"):
        convert_criteo(srcs, out, resume=True)
    with open(srcs[1], "a") as fh:
        fh.write("2" + "\t" * 39 + "\n")
    shutil.rmtree(staging_path(out))
    with pytest.raises(CriteoFormatError, match="b.tsv:301: label must be 0 or 1"):
        convert_criteo(srcs, out)
    assert not out.exists() and not staging_path(out).exists()  # nothing to resume from


def test_a_folder_without_a_manifest_is_refused_naming_it(tmp_path):
    srcs = _inputs(tmp_path / "in", {"a": 200})
    convert_criteo(srcs, tmp_path / "o")
    (tmp_path / "o" / MANIFEST).unlink()  # what the unpublished converter's kill left
    with pytest.raises(FileNotFoundError, match=f"'{tmp_path / 'o'}' holds no {MANIFEST}"):
        CriteoBinary(tmp_path / "o", W, 10)


# ------------------------------------------------------------------ item 2: failed overwrite
def test_a_failed_overwrite_leaves_the_previous_conversion_whole(tmp_path):
    v1 = _inputs(tmp_path / "v1", {"a": 1000, "c": 300})
    mix = tmp_path / "mix"
    convert_criteo(v1, mix)
    before = _files(mix)
    v2 = _inputs(tmp_path / "v2", {"a": 500, "c": 100}, seed=9)
    with open(v2[1], "a") as fh:
        fh.write("x" + "\t" * 39 + "\n")
    with pytest.raises(CriteoFormatError, match="c.tsv:101"):
        convert_criteo(v2, mix, overwrite=True)
    assert _files(mix) == before
    assert CriteoBinary(mix, W, 100).num_samples == 1300
    res = convert_criteo(v2[:1], mix, overwrite=True)  # a good overwrite replaces it whole
    assert res.files == [("a", 500)] and sorted(_files(mix)) == [
        "a_dense.npy", "a_labels.npy", "a_sparse.npy", MANIFEST,
    ]  # fmt: skip
    assert CriteoBinary(mix, W, 100).num_samples == 500
    assert not old_path(mix).exists() and not staging_path(mix).exists()


def test_files_that_differ_from_the_manifest_are_refused(tmp_path):
    v1 = _inputs(tmp_path / "v1", {"a": 1000, "c": 300})
    v2 = _inputs(tmp_path / "v2", {"a": 500}, seed=9)
    convert_criteo(v1, tmp_path / "mix")
    convert_criteo(v2, tmp_path / "other")
    for kind in ("dense", "sparse", "labels"):  # the new a beside the old c and manifest
        name = f"a_{kind}.npy"
        (tmp_path / "mix" / name).write_bytes((tmp_path / "other" / name).read_bytes())
    with pytest.raises(ValueError, match=r"a_dense.npy: 500 rows in .* says 1000 rows"):
        CriteoBinary(tmp_path / "mix", W, 100)


def test_checksums_and_labels_catch_a_corrupted_byte(tmp_path):
    convert_criteo(_inputs(tmp_path / "in", {"a": 300}), tmp_path / "o")
    labels = tmp_path / "o" / "a_labels.npy"
    raw = bytearray(labels.read_bytes())
    raw[HEADER_BYTES + 4 * 17] = 127  # row 17's label
    labels.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"a_labels.npy: the sha256 of its rows differs"):
        CriteoBinary(tmp_path / "o", W, 100)
    reader = CriteoBinary(tmp_path / "o", W, 100, verify=False)  # rows and sizes still agree
    with pytest.raises(
        ValueError, match=r"a_labels.npy: row 17 has label 127; labels must be 0 or 1"
    ):
        reader.batch(0)
    with pytest.raises(ValueError, match=r"row 17 has label 127"):
        next(iter(CriteoBinary(tmp_path / "o", W, 100, verify=False, shuffle=True)))


# ------------------------------------------------------------------ item 3: concurrent
def test_a_second_conversion_into_a_locked_folder_is_refused(tmp_path):
    srcs = _inputs(tmp_path / "in", {"a": 100})
    out = tmp_path / "o"
    with FolderLock(out):
        with pytest.raises(FolderBusyError, match=f"pid {os.getpid()}\\) is writing '{out}'"):
            convert_criteo(srcs, out)
    assert not out.exists()
    convert_criteo(srcs, out)  # the lock is gone with its holder
    assert not out.with_name(".o.lock").exists()


def test_two_conversions_at_once_leave_one_whole_folder(tmp_path):
    srcs = _inputs(tmp_path / "in", {"a": 20_000})
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "embark.data.convert", "--workload", "dlrm_dcnv2",
           "--in", str(srcs[0]), "--out", str(out), "--no-progress", "--chunk-mb", "1"]  # fmt: skip
    procs = [subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs if p.stderr]
    assert sorted(rc for rc, _ in results) == [0, 1], results
    err = next(e for rc, e in results if rc == 1)
    assert "is writing" in err or "is not empty" in err, err
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"][0]["rows"] == 20_000
    assert CriteoBinary(out, W, 1000).num_samples == 20_000  # sizes and checksums agree


# ------------------------------------------------------------------ item 10: minor
def test_manifest_errors_name_the_file(tmp_path):
    convert_criteo(_inputs(tmp_path / "in", {"a": 50}), tmp_path / "o")
    m = tmp_path / "o" / MANIFEST
    good = json.loads(m.read_text())
    m.write_text("{not json")
    with pytest.raises(ManifestError, match=f"{m}: not a JSON manifest"):
        CriteoBinary(tmp_path / "o", W, 10)
    for stem in ("../../x", "/etc/x", ".hidden", "a/b", ""):
        doc = json.loads(json.dumps(good))
        doc["files"][0]["stem"] = stem
        m.write_text(json.dumps(doc))
        with pytest.raises(
            ManifestError, match=f"{m} files\\[0\\]: stem .* is not a plain file name"
        ):
            CriteoBinary(tmp_path / "o", W, 10)
    doc = json.loads(json.dumps(good))
    del doc["files"][0]["rows"]
    m.write_text(json.dumps(doc))
    with pytest.raises(
        ManifestError, match=f"{m} files\\[0\\]: 'rows' must be an integer >= 0, got None"
    ):
        CriteoBinary(tmp_path / "o", W, 10)
    doc["version"] = 1
    m.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="version 1, expected 'tilerec-criteo-npy' version 2"):
        CriteoBinary(tmp_path / "o", W, 10)


def _run(*args: str) -> int:
    return main(["--workload", "dlrm_dcnv2", "--no-progress", *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scale", "nan"], "--scale must be a finite number >= 1, got nan"),
        (["--scale", "inf"], "--scale must be a finite number >= 1, got inf"),
        (["--scale", "-5"], "--scale must be a finite number >= 1, got -5.0"),
        (["--chunk-mb", "100000000"], "--chunk-mb must be between 1 and 1024 (MiB"),
        (["--chunk-mb", "0"], "--chunk-mb must be between 1 and 1024"),
    ],
)
def test_cli_bounds(tmp_path, capsys, args, message):
    src = _inputs(tmp_path / "in", {"a": 10})[0]
    assert _run("--in", str(src), "--out", str(tmp_path / "o"), *args) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_input_errors(tmp_path, capsys):
    (tmp_path / "empty.gz").write_bytes(b"")
    assert _run("--in", str(tmp_path / "empty.gz"), "--out", str(tmp_path / "o")) == 1
    assert (
        f"'{tmp_path / 'empty.gz'}' is empty (0 bytes): not a gzip file" in capsys.readouterr().err
    )
    (tmp_path / "d").mkdir()
    assert _run("--in", str(tmp_path / "d"), "--out", str(tmp_path / "o")) == 1
    assert f"'{tmp_path / 'd'}' is a folder; expected a TSV file" in capsys.readouterr().err
    assert _run("--in", str(tmp_path / "nope"), "--out", str(tmp_path / "o")) == 1
    assert "does not exist" in capsys.readouterr().err
    src = _inputs(tmp_path / "in", {"a": 10})[0]
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    assert _run("--in", str(src), "--out", str(tmp_path / "user"), "--overwrite") == 1
    assert "holds 1 entr(y/ies) a conversion does not write (notes.txt)" in capsys.readouterr().err
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


def test_a_full_disk_names_the_file(tmp_path):
    dev_full = Path("/dev/full")
    if not dev_full.exists():
        pytest.skip("no /dev/full on this system")
    (tmp_path / "a.npy.tmp").symlink_to(dev_full)  # every write there fails with ENOSPC
    w = NpyWriter(tmp_path / "a.npy", np.float32, (13,))
    with pytest.raises(
        OSError, match=f"cannot write {tmp_path / 'a.npy.tmp'}: No space left on device"
    ):
        w.append(np.zeros((100_000, 13), np.float32))
        w.close()
    w.discard()
    assert not (tmp_path / "a.npy.tmp").exists()


def test_a_full_disk_stops_the_cli_naming_the_file(tmp_path, capsys):
    src = _inputs(tmp_path / "in", {"a": 3000})[0]  # ~0.5 MB of npy files
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        assert _run("--in", str(src), "--out", str(mnt / "o")) == 1
        err = capsys.readouterr().err
        assert (
            f"error: cannot write {mnt}/.o.partial/a_" in err and "No space left on device" in err
        )
        assert not (mnt / "o").exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_rows_sha256_is_of_the_rows(tmp_path):
    with NpyWriter(tmp_path / "a.npy", np.int32, (1,)) as w:
        w.append(np.array([[0], [1], [1]], np.int32))
    raw = (tmp_path / "a.npy").read_bytes()
    assert w.sha256 == hashlib.sha256(raw[HEADER_BYTES:]).hexdigest()


def test_a_file_of_bad_lines_only_converts_to_no_rows_when_skipped(tmp_path):
    f = tmp_path / "bad.tsv"
    f.write_text("2" + "\t" * 39 + "\n")
    res = convert_criteo([f], tmp_path / "o", skip_bad_lines=True)
    assert res.files == [("bad", 0)] and res.stats.bad_lines == 1
    assert CriteoBinary(tmp_path / "o", W, 10).num_samples == 0


def test_sigint_ends_the_cli_with_130_and_how_to_continue(tmp_path, monkeypatch, capsys):
    srcs = _inputs(tmp_path / "in", {"a": 100, "b": 100})
    _interrupt_at(monkeypatch, 1, KeyboardInterrupt())
    out = tmp_path / "o"
    assert _run("--in", *map(str, srcs), "--out", str(out)) == 130
    err = capsys.readouterr().err
    assert f"interrupted: {out} was not changed; the inputs finished so far are kept in" in err
    assert "run the same command with --resume to continue" in err and "Traceback" not in err
    monkeypatch.undo()
    assert _run("--in", *map(str, srcs), "--out", str(out), "--resume") == 0
    assert "(1 file(s) kept from the interrupted conversion)" in capsys.readouterr().err


def test_a_replacement_killed_between_its_renames_is_undone_or_finished(tmp_path):
    srcs = _inputs(tmp_path / "in", {"a": 100})
    out = tmp_path / "o"
    convert_criteo(srcs, out)
    before = _files(out)
    os.rename(out, old_path(out))  # killed after the first rename of a replacement
    with pytest.raises(ValueError, match="is not empty: pass --overwrite"):
        convert_criteo(srcs, out)  # the next writer restored the previous folder first
    assert _files(out) == before and not old_path(out).exists()
    shutil.copytree(out, old_path(out))  # killed after the second rename, before the removal
    convert_criteo(srcs, out, overwrite=True)
    assert not old_path(out).exists() and _files(out) == before


def test_the_library_bounds_the_chunk_size(tmp_path):
    src = _inputs(tmp_path / "in", {"a": 10})
    for bad in (0, 1 << 40, 2.5, True):
        with pytest.raises(
            ValueError, match=r"chunk_bytes must be an integer in \[1, 1073741824\]"
        ):
            convert_criteo(src, tmp_path / "o", chunk_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "o").exists()
