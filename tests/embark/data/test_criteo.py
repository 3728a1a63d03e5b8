from __future__ import annotations

import gzip
import logging
import math
import re

import pytest
import torch

from embark.data import CriteoFormatError, CriteoTSV
from embark.models.workloads import get_workload

W = get_workload("dlrm_dcnv2").scaled(100_000)  # 26 tables, 13 dense: the real layout


def _line(label="1", dense=None, cats=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
    return "\t".join([label, *dense, *cats]) + "\n"


def _write(path, lines):
    path.write_text("".join(lines))
    return path


def test_parses_values_hashes_and_layout(tmp_path):
    dense = ["5", "", "-3", "0", "12", *[""] * 8]
    cats = ["68fd1e64", "", "FFFFFFFF", *[f"{i:x}" for i in range(23)]]
    f = _write(tmp_path / "day_0", [_line("1", dense, cats), _line("0")])
    b = next(iter(CriteoTSV(f, W, batch_size=8)))
    assert torch.equal(b.labels, torch.tensor([1.0, 0.0]))
    want = [math.log1p(v) for v in (5, 0, 0, 0, 12)]  # empty -> 0, negative -> clipped at 0
    torch.testing.assert_close(b.dense[0, :5], torch.tensor(want), rtol=1e-6, atol=0)
    assert b.dense.dtype == torch.float32 and b.dense.shape == (2, 13)
    rows = [t.num_rows for t in W.tables]
    assert int(b.sparse.values_for("t0")[0]) == 0x68FD1E64 % rows[0]
    assert int(b.sparse.values_for("t1")[0]) == 0  # empty category -> row 0
    assert int(b.sparse.values_for("t2")[0]) == 0xFFFFFFFF % rows[2]
    assert b.sparse.keys == [t.name for t in W.tables]
    assert torch.equal(b.sparse.lengths, torch.ones(2 * 26, dtype=torch.int32))
    # key-major: the first two values are t0 of sample 0 and sample 1
    assert b.sparse.values[:2].tolist() == [0x68FD1E64 % rows[0], 0]


def test_batching_multiple_files_and_gzip(tmp_path):
    a = _write(tmp_path / "a.tsv", [_line(str(i % 2)) for i in range(3)])
    gz = tmp_path / "b.tsv.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write("".join(_line("1") for _ in range(2)) + "\n")  # trailing blank line is fine
    sizes = [b.batch_size for b in CriteoTSV([a, gz], W, batch_size=2)]
    assert sizes == [2, 2, 1]
    assert [b.batch_size for b in CriteoTSV([a, gz], W, batch_size=2, drop_last=True)] == [2, 2]


@pytest.mark.parametrize(
    ("bad", "kind", "match"),
    [
        (_line()[:-1] + "\textra\n", "field_count", "expected 40 tab-separated fields, got 41"),
        ("1\t2\t3\n", "field_count", "got 3"),
        (_line(cats=["zz12", *["0"] * 25]), "categorical", "C1 must be hexadecimal, got 'zz12'"),
        (_line(cats=["0"] * 25 + ["-1f"]), "categorical", "C26 must be hexadecimal"),
        (_line(dense=["1", "3.5", *["0"] * 11]), "dense", "I2 must be an integer, got '3.5'"),
        (_line(label="2"), "label", "label must be 0 or 1, got '2'"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, kind, match):
    f = _write(tmp_path / "day_3", [_line(), _line(), bad, _line()])
    with pytest.raises(CriteoFormatError, match=match) as info:
        list(CriteoTSV(f, W, batch_size=2))
    assert str(info.value).startswith(f"{f}:3: ")
    assert info.value.line == 3 and info.value.kind == kind and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "bad", [" 5", "5 ", "1_000", "+7", "\u0663", "\uff15", "--1", "-", "0x5", "5\x00"]
)
def test_dense_accepts_only_ascii_decimal(tmp_path, bad):
    reader = CriteoTSV(_write(tmp_path / "x", [_line()]), W, batch_size=1)
    dense = ["0"] * 13
    dense[4] = bad
    with pytest.raises(
        CriteoFormatError, match=re.escape(f"I5 must be an integer, got {bad!r}")
    ) as info:
        reader.parse_line(_line(dense=dense), "f.tsv", 7)
    assert info.value.kind == "dense" and str(info.value).startswith("f.tsv:7: ")


@pytest.mark.parametrize(
    "bad", [" 68fd", "68fd ", "ab cd", "+1f", "0x1f", "1_f", "\u0663", "g1", "-0"]
)
def test_categorical_accepts_only_ascii_hex(tmp_path, bad):
    reader = CriteoTSV(_write(tmp_path / "x", [_line()]), W, batch_size=1)
    cats = ["0"] * 26
    cats[2] = bad
    with pytest.raises(
        CriteoFormatError, match=re.escape(f"C3 must be hexadecimal, got {bad!r}")
    ) as info:
        reader.parse_line(_line(cats=cats), "f.tsv", 7)
    assert info.value.kind == "categorical"


def test_strict_syntax_still_takes_valid_fields(tmp_path):
    f = _write(tmp_path / "x", [_line()])
    reader = CriteoTSV(f, W, batch_size=1)
    dense = ["-0", "007", "-12", "", *["1"] * 9]
    cats = ["00000000", "AbCdEf01", "", *["f"] * 23]
    label, got_dense, got_ids = reader.parse_line(_line("0", dense, cats))
    assert label == 0 and got_dense[:4] == [0, 7, -12, 0]
    rows = [t.num_rows for t in W.tables]
    assert got_ids[:4] == [0, 0xABCDEF01 % rows[1], 0, 0xF % rows[3]]


def test_skip_bad_lines_counts_and_reports(tmp_path, caplog):
    lines = [
        _line(),
        "1\t2\n",
        _line(cats=["xyz", *["0"] * 25]),
        _line("0"),
        _line(dense=["a", *["0"] * 12]),
    ]
    f = _write(tmp_path / "day_1", lines)
    reader = CriteoTSV(f, W, batch_size=10, skip_bad_lines=True)
    with caplog.at_level(logging.WARNING, logger="embark.data.criteo"):
        batches = list(reader)
    assert [b.batch_size for b in batches] == [2]
    assert torch.equal(batches[0].labels, torch.tensor([1.0, 0.0]))
    stats = reader.stats.to_dict()
    assert stats["lines"] == 5 and stats["good_lines"] == 2 and stats["bad_lines"] == 3
    assert stats["reasons"] == {"field_count": 1, "categorical": 1, "dense": 1}
    assert stats["examples"][0].startswith(f"{f}:2: ")
    assert "skipped 3 of 5 lines" in caplog.text


def test_constructor_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        CriteoTSV(tmp_path / "missing.tsv", W, batch_size=4)
    f = _write(tmp_path / "x", [_line()])
    with pytest.raises(ValueError, match="batch_size"):
        CriteoTSV(f, W, batch_size=0)


# -- issue #22, item 7: one bad line never aborts the reader -----------------------------------
_HUGE_LINES = {
    "overflow": (_line(dense=["1" + "0" * 400, *["0"] * 12]), "dense",
                 "I1 must be a 64-bit integer, got '100000000000000000000000'... (401 characters)"),
    "int64": (_line(dense=["0", str(2**63), *["0"] * 11]), "dense",
              f"I2 must be a 64-bit integer, got {str(2**63)!r}"),
    "digits": (_line(dense=["7" * 5000, *["0"] * 12]), "dense",
               "I1 must be a 64-bit integer, got '777777777777777777777777'... (5000 characters)"),
    "hex": (_line(cats=["a" * 5000, *["0"] * 25]), "categorical",
            "C1 must be at most 16 hex digits (64 bits), got 'aaaaaaaaaaaaaaaaaaaaaaaa'... (5000 characters)"),
    "label": (_line(label="1" * 5000), "label",
              "label must be 0 or 1, got '111111111111111111111111'... (5000 characters)"),
}  # fmt: skip


def _write_bytes(path, lines: list[bytes]):
    path.write_bytes(b"".join(lines))
    return path


@pytest.mark.parametrize("case", list(_HUGE_LINES))
def test_huge_values_are_format_errors_or_skipped(tmp_path, case):
    bad, kind, msg = _HUGE_LINES[case]
    f = _write(tmp_path / "day_5", [_line(), bad, _line("0")])
    with pytest.raises(CriteoFormatError) as info:
        list(CriteoTSV(f, W, batch_size=4))
    assert str(info.value) == f"{f}:2: " + (
        "dense feature " if kind == "dense" else "categorical feature " if kind == "categorical" else ""
    ) + msg  # fmt: skip
    assert info.value.kind == kind and info.value.line == 2
    reader = CriteoTSV(f, W, batch_size=4, skip_bad_lines=True)
    assert [b.batch_size for b in reader] == [2]
    assert reader.stats.reasons == {kind: 1} and reader.stats.bad_lines == 1


@pytest.mark.parametrize("raw", [b"1\t\xff\xfe", b"\x80", b"0\t5\t\xc3\x28"])
def test_bytes_that_are_not_utf8_are_a_format_error_or_skipped(tmp_path, raw):
    good = _line().encode()
    bad = raw + good[len(raw.split(b"\t")[0]) :] if b"\t" in raw else raw + b"\n"
    f = _write_bytes(tmp_path / "day_6", [good, good, bad, good])
    with pytest.raises(
        CriteoFormatError, match=r"not UTF-8 text: byte 0x[0-9a-f]{2} at column"
    ) as info:
        list(CriteoTSV(f, W, batch_size=8))
    assert str(info.value).startswith(f"{f}:3: ") and info.value.kind == "encoding"
    reader = CriteoTSV(f, W, batch_size=8, skip_bad_lines=True)
    assert [b.batch_size for b in reader] == [3]
    assert reader.stats.reasons == {"encoding": 1}


@pytest.mark.parametrize("skip", [False, True])
def test_a_truncated_gzip_names_the_file_and_the_lines_read(tmp_path, skip):
    whole = gzip.compress("".join(_line(str(i % 2)) for i in range(2000)).encode())
    f = tmp_path / "day_7.gz"
    f.write_bytes(whole[: len(whole) // 2])
    reader = CriteoTSV(f, W, batch_size=64, skip_bad_lines=skip)
    seen = 0
    with pytest.raises(CriteoFormatError) as info:
        for b in reader:
            seen += b.batch_size
    err = info.value
    read = err.line - 1
    assert err.kind == "truncated" and 0 < read < 2000 and seen <= read
    assert str(err).startswith(
        f"{f}:{read + 1}: the file cannot be read past line {read} ({read} lines were read): "
        "Compressed file ended before the end-of-stream marker was reached"
    )


def test_a_gz_that_is_not_gzip_is_named(tmp_path):
    f = _write(tmp_path / "day_8.gz", [_line()])
    with pytest.raises(
        CriteoFormatError,
        match=r"day_8.gz:1: the file cannot be read past line 0 \(0 lines were read\): Not a gzipped file",
    ):
        list(CriteoTSV(f, W, batch_size=4, skip_bad_lines=True))
