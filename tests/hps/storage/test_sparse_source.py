"""Which sparse files a database was loaded from: a stat for the same files, a hash otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hps.storage.sparse_files import SparseFormat, write_table
from hps.storage.sparse_source import SparseFileStamp, SparseSource
from tests.hps.hps_helpers import make_table


def _table(folder: Path, seed: int, fmt: SparseFormat = SparseFormat.HUGECTR) -> Path:
    keys, rows = make_table(50, 4, seed=seed)
    return write_table(folder, keys, rows, fmt=fmt, overwrite=True)


@pytest.mark.parametrize("fmt", list(SparseFormat))
def test_the_same_files_match_without_hashing(
    tmp_path: Path, fmt: SparseFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = SparseSource.of(_table(tmp_path / "t", 0, fmt))
    assert [f.name for f in src.files] == (
        ["key", "emb_vector"] if fmt is SparseFormat.HUGECTR else ["embedding.safetensors"]
    )
    assert SparseSource.from_json(src.to_json()) == src

    def no_hashing(path: Path) -> SparseFileStamp:
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(SparseFileStamp, "of", no_hashing)
    assert src.matches(tmp_path / "t")


def test_a_copy_of_the_same_bytes_matches_and_other_bytes_do_not(tmp_path: Path) -> None:
    src = SparseSource.of(_table(tmp_path / "t", 0))
    shutil.copytree(tmp_path / "t", tmp_path / "copy")  # new inodes and times: hashed
    assert src.matches(tmp_path / "copy")
    _table(tmp_path / "t", 1)  # another export: same sizes, other bytes
    assert not src.matches(tmp_path / "t")
    emb = tmp_path / "copy" / "emb_vector"
    data = bytearray(emb.read_bytes())
    data[-1] ^= 1  # one bit, written in place (same size, same inode)
    emb.write_bytes(bytes(data))
    assert not src.matches(tmp_path / "copy")


def test_another_layout_or_a_missing_folder_does_not_match(tmp_path: Path) -> None:
    src = SparseSource.of(_table(tmp_path / "t", 0))
    assert not src.matches(tmp_path / "absent")
    _table(tmp_path / "t", 0, SparseFormat.SAFETENSORS)
    assert not src.matches(tmp_path / "t")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="found neither"):
        SparseSource.of(tmp_path / "empty")


@pytest.mark.parametrize("doc", [None, {}, {"files": [{"name": "key"}]}, {"files": 5}, "x"])
def test_a_record_of_unknown_form_is_no_source(doc: object) -> None:
    assert SparseSource.from_json(doc) is None


def test_describe_names_each_file(tmp_path: Path) -> None:
    keys = np.arange(3, dtype=np.int64)
    write_table(tmp_path / "t", keys, np.zeros((3, 2), np.float32))
    text = SparseSource.of(tmp_path / "t").describe()
    assert text.startswith("key 24 bytes sha256 ") and ", emb_vector 24 bytes sha256 " in text
