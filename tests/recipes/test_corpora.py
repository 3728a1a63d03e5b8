"""The broad calibration corpus's sources (recipes.corpora): each yields enough well-formed
prose sentences, leaves tests and dataset descriptions out, and a missing source is an
error, never an empty corpus. The whole-package harvest (minutes) is left to the benchmark;
these read the system sources whole and packages built here."""

from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

import pytest

import recipes.corpora as corpora
from recipes.corpora import (
    CalibrationText,
    broad_sentences,
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
    # at least what broad_sentences(1270) takes of each (254): a slimmer image still serves
    _well_formed(system_doc_sentences(), 1270 // 5)
    _well_formed(info_manual_sentences(), 1270 // 5)


def test_system_doc_reads_prose_files_only(tmp_path: Path) -> None:
    docs = tmp_path / "doc"
    for rel, text in {
        "pkg/README": "The tool copies files between two hosts.",
        "pkg/copyright": "Permission is hereby granted to use this work freely.",
        "pkg/changelog.Debian": "The release fixes a crash on empty input.",
        "pkg/libfoo_symbols.txt.amd64": "The symbol list names every exported function.",
        "python3-sklearn/README": "The estimator fits a model to the data given.",
        "Gensim-data/notes.txt": "The corpus holds many short news stories.",
        "pkg/data.bin": "The binary file holds nothing a reader wants.",
    }.items():
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        (docs / rel).write_text(text + "\n")
    (docs / "pkg" / "NEWS.gz").write_bytes(gzip.compress(b"The new version reads gzip files.\n"))
    assert system_doc_sentences(docs) == [
        "The new version reads gzip files.",
        "The tool copies files between two hosts.",
    ]
    info = tmp_path / "info"
    info.mkdir()
    (info / "tool.info.gz").write_bytes(gzip.compress(b"\x1fThe manual explains each option.\n"))
    assert info_manual_sentences(info) == ["The manual explains each option."]


def _fake_sources(monkeypatch, sizes: dict[str, int]) -> None:
    """Each broad source monkeypatched to ``sizes[name]`` sentences named after it."""

    def fake(name: str):
        return lambda *a, **k: [f"{name} {i}" for i in range(sizes[name])]

    for name, fn in {
        "reference": "python_reference_sentences",
        "stdlib": "stdlib_docstring_sentences",
        "packages": "package_docstring_sentences",
        "system_doc": "system_doc_sentences",
        "info": "info_manual_sentences",
    }.items():
        monkeypatch.setattr(corpora, fn, fake(name))


def test_broad_sentences_interleave_evenly(monkeypatch) -> None:
    _fake_sources(monkeypatch, dict.fromkeys(corpora.BROAD_SOURCES, 4))
    names = corpora.BROAD_SOURCES
    assert broad_sentences(12) == [f"{n} {i}" for i in (0, 2) for n in names]  # 12 // 5 = 2
    assert calibration_sentences(CalibrationText.BROAD, 5) == [f"{n} 0" for n in names]


def test_broad_sentences_refuse_too_few(monkeypatch) -> None:
    _fake_sources(monkeypatch, dict.fromkeys(corpora.BROAD_SOURCES, 4) | {"info": 1})
    with pytest.raises(ValueError, match="count 4 is below 5"):
        broad_sentences(4)
    assert len(broad_sentences(5)) == 5
    with pytest.raises(RuntimeError, match="info gave 1 sentences, 2 needed"):
        broad_sentences(10)


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
    assert calibration_sentences(CalibrationText.REFERENCE) == python_reference_sentences(256)


_WIKI_PAGES = """<mediawiki><page><title>Old</title><text xml:space="preserve">#REDIRECT [[New]]</text></page>
<page><title>New</title><text xml:space="preserve">{{Infobox place|name=New {{nested|x}}}}
The river town of [[Newtown|New]] lies on the [[Avon River]] near the coast.&lt;ref&gt;A book of the town's history was printed.&lt;/ref&gt; It was founded by farmers in 1850 and grew quickly afterwards.

== History ==
* A listed item that is not prose at all here.
The square has held a weekly market since 1870 in the town.
: The founders wrote that the square would always hold a market.
; A definition term written as a sentence.
[[File:Town.jpg|The town was photographed from the hill in spring.]]
{| class="wikitable"
| a table cell with words in it || another cell
|}
Its first school opened in 1861 with &amp;quot;forty pupils&amp;quot; and one teacher. The [http://example.org railway station] arrived twenty years later, in 1881. The harbour opened in 1890 for the fishing boats.[http://example.org/harbour]
&lt;!-- This editor comment is a full sentence of prose. --&gt;
The ratio of farms to houses &lt;math&gt;\frac{a}{b}&lt;/math&gt; stayed small for decades.
Aruba ({{IPA|x}}; {{lang|y}}) is an island that traded with the town.
A ship weighed between {{convert|40|and|65|t}}.
&lt;math&gt;{{x^2&lt;/math&gt;
The mill burned down in 1902 and was never rebuilt.
[[Category:Towns founded in the nineteenth century by farmers.]]
[[fr:La ville est au bord de la rivière et de la mer.]]</text></page></mediawiki>"""


def test_wikipedia_sentences_strip_markup(tmp_path: Path, monkeypatch) -> None:
    """Redirects, templates (nested), tables, references, files, categories, interlanguage
    links, formulas (one holding an unclosed brace pair), headings, lists and indented lines
    are left out, each removed piece holding text that would pass as prose;
    links keep their shown text; brackets a removed template emptied go, and a sentence a
    removed template left a hole in is left out; the dump's twice-escaped entities are read
    as text."""
    import bz2
    import zipfile

    wheel = tmp_path / "gensim-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(corpora.WIKI_FILE, bz2.compress(_WIKI_PAGES.encode()))
        reviews = (
            "__label__neg dull \x97 and long .\n__label__pos a joy .\n__label__pos odd one .\n"
        )
        zf.writestr(corpora.REVIEWS_FILE, reviews.encode("latin-1"))
    assert corpora.wikipedia_sentences(wheel) == [
        "The river town of New lies on the Avon River near the coast.",
        "It was founded by farmers in 1850 and grew quickly afterwards.",
        "The square has held a weekly market since 1870 in the town.",
        'Its first school opened in 1861 with "forty pupils" and one teacher.',
        "The railway station arrived twenty years later, in 1881.",
        "The harbour opened in 1890 for the fishing boats.",
        "The ratio of farms to houses stayed small for decades.",
        "Aruba is an island that traded with the town.",
        "The mill burned down in 1902 and was never rebuilt.",
    ]
    assert corpora._outside("a {{b}} c {{d e", "{{", "}}") == "a  c {{d e"  # unclosed: kept
    assert corpora.wikipedia_sentences(wheel, 3) == [
        "The river town of New lies on the Avon River near the coast.",
        'Its first school opened in 1861 with "forty pupils" and one teacher.',
        "The ratio of farms to houses stayed small for decades.",
    ]
    assert calibration_sentences(
        CalibrationText.WIKIPEDIA, 3, wheel
    ) == corpora.wikipedia_sentences(wheel, 3)
    # Windows-1252 as shipped (0x97: a dash); an odd review out has no pair
    assert corpora.movie_review_pairs(wheel) == [("dull \u2014 and long .", "a joy .")]
    monkeypatch.setattr(corpora.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="wikipedia_sentences needs gensim installed"):
        corpora.wikipedia_sentences()
    with pytest.raises(RuntimeError, match="wikipedia_sentences needs gensim installed"):
        calibration_sentences(CalibrationText.WIKIPEDIA)
