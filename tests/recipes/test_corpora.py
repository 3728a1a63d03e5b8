"""The broad calibration corpus's sources (recipes.corpora): each yields enough well-formed
prose sentences, leaves tests and dataset descriptions out, and a missing source is an
error, never an empty corpus. The whole-package harvest (minutes) is left to the benchmark;
these read the system sources whole and packages built here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from recipes.corpora import (
    CalibrationText,
    calibration_sentences,
    evenly,
    info_manual_sentences,
    interleave,
    package_docstring_sentences,
    python_reference_sentences,
    system_doc_sentences,
)

_CODE = re.compile(r"[`_=<>{}\[\]\\|#$~@*^]|::|\(\)")


def _well_formed(sentences: list[str], least: int) -> None:
    assert len(sentences) >= least
    assert len(set(sentences)) == len(sentences)
    for s in sentences:
        assert 5 <= len(s.split()) <= 60 and s[-1] in ".!?" and not _CODE.search(s), s


def test_system_doc_and_info_manuals_yield_prose() -> None:
    docs = system_doc_sentences()
    _well_formed(docs, 5000)
    assert not any("Permission is hereby granted" in s for s in docs)  # no licence files
    _well_formed(info_manual_sentences(), 1000)


def test_missing_sources_are_errors(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not exist"):
        system_doc_sentences(tmp_path / "absent")
    with pytest.raises(RuntimeError, match="does not exist"):
        info_manual_sentences(tmp_path / "absent")
    with pytest.raises(RuntimeError, match="'no_such_package_xyz' is not installed"):
        package_docstring_sentences(("no_such_package_xyz",))


def _write(path: Path, doc: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'"""{doc}"""\n\n\ndef f():\n    """Nested docs are read as well here."""\n')


def test_package_docstrings_skip_tests_and_datasets(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "corpus_pkg_demo"
    _write(root / "__init__.py", "The package reads its input files in order.\n\nx = `code` here.")
    _write(root / "tests" / "test_a.py", "This sentence is inside a test module.")
    _write(root / "datasets" / "load.py", "This sentence describes a bundled dataset.")
    _write(root / "sub" / "b.py", "The submodule writes results to disk.")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("corpus_pkg_demo", None)
    got = package_docstring_sentences(("corpus_pkg_demo",))
    assert got == [
        "The package reads its input files in order.",
        "Nested docs are read as well here.",  # once, though two of the files read hold it
        "The submodule writes results to disk.",
    ]


def test_evenly_and_interleave_are_exact() -> None:
    assert evenly(list("abcdefghij"), 3) == ["a", "d", "g"]
    assert evenly(list("ab"), 5) == ["a", "b"]
    assert interleave(["a1", "a2", "a3"], ["b1"], ["c1", "c2"]) == [
        "a1", "b1", "c1", "a2", "c2", "a3",
    ]  # fmt: skip


def test_reference_calibration_text() -> None:
    got = calibration_sentences(CalibrationText.REFERENCE, 40)
    assert got == python_reference_sentences(40)
