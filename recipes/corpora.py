"""Real English text that ships with Python, its packages or the system's documentation (no
dataset download exists here), for calibrating on one real source and evaluating on another:

- :func:`python_reference_sentences`: the Python Language Reference, as the standard library
  ships it for ``help()`` (module ``pydoc_data.topics``, file ``pydoc_data/topics.py``):
  technical prose, always installed.
- :func:`sklearn_description_pairs`: scikit-learn's dataset descriptions (package
  ``scikit-learn``, files ``sklearn/datasets/descr/*.rst``; scikit-learn is installed with
  ``sentence-transformers``): prose about datasets, their origin and use.
- :func:`lee_news_pairs`: the Lee background corpus (package ``gensim``, file
  ``gensim/test/test_data/lee_background.cor``): 300 Australian Broadcasting Corporation news
  stories, one per line (Lee, Pincombe & Welsh, 2005). Read from an installed ``gensim`` or
  from its wheel (``pip download --no-deps gensim==4.4.0``), never imported.

- :func:`movie_review_pairs`: Pang & Lee's one-sentence movie reviews (package ``gensim``,
  file :data:`REVIEWS_FILE`), everyday evaluative language, as shipped (lower-cased, tokenized).
- :func:`wikipedia_sentences`: English Wikipedia articles (package ``gensim``, file
  :data:`WIKI_FILE`, a shortened dump of 206 pages, 106 of them articles: anarchism,
  Afghanistan, Aristotle, Albert Einstein, ...), wiki markup, formulas and code removed
  (sentences a removed template left a hole in are left out): encyclopedic prose on
  history, science, places and people — general-domain text, unlike the technical sources
  below, and another source than the Lee news stories. Read from an installed ``gensim`` or
  its wheel, as :func:`lee_news_pairs`.

- :func:`broad_sentences`: a calibration corpus broader than the Language Reference alone,
  the five technical-prose sources below interleaved: the Language Reference, the standard
  library's docstrings (:func:`stdlib_docstring_sentences`), installed packages' docstrings
  (:func:`package_docstring_sentences`), the system's package documentation
  (:func:`system_doc_sentences`, ``/usr/share/doc``) and GNU info manuals
  (:func:`info_manual_sentences`, ``/usr/share/info``). It never reads scikit-learn's
  ``datasets`` subpackage (where the dataset descriptions come from) nor gensim.

A *pair* is two consecutive sentences of one paragraph or story; retrieval accuracy
(:func:`retrieval_accuracy`) asks whether a sentence's embedding is nearest to its own pair's
among all pairs.
"""

from __future__ import annotations

import ast
import bz2
import gzip
import html
import importlib.util
import logging
import re
import sysconfig
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from enum import StrEnum
from pathlib import Path

import torch

__all__ = [
    "BROAD_LEAST",
    "BROAD_PACKAGES",
    "BROAD_SOURCES",
    "DEFAULT_CALIBRATION_SENTENCES",
    "INFO_DIR",
    "LEE_FILE",
    "READ_CAP",
    "SYSTEM_DOC_DIR",
    "REVIEWS_FILE",
    "WIKI_FILE",
    "CalibrationText",
    "broad_sentences",
    "calibration_sentences",
    "default_calibration_text",
    "evenly",
    "info_manual_sentences",
    "interleave",
    "lee_news_pairs",
    "movie_review_pairs",
    "package_docstring_sentences",
    "python_reference_sentences",
    "retrieval_accuracy",
    "sklearn_description_pairs",
    "stdlib_docstring_sentences",
    "system_doc_sentences",
    "wikipedia_sentences",
]

LEE_FILE = "gensim/test/test_data/lee_background.cor"
REVIEWS_FILE = "gensim/test/test_data/pang_lee_polarity.cor"
WIKI_FILE = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)

log = logging.getLogger("recipes.corpora")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def _sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph of prose: whitespace folded, split after ``.!?``; kept when
    5 to 60 words long and mostly letters (no code, tables or citations)."""
    text = " ".join(paragraph.split())
    out = []
    for s in _SENTENCE_END.split(text):
        words = s.split()
        letters = sum(c.isalpha() for c in s)
        if 5 <= len(words) <= 60 and letters >= 0.7 * len(s) and s[-1] in ".!?":
            out.append(s)
    return out


def _prose_paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks that read as prose: not indented (code, grammar, tables),
    not markup lines."""
    paras = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines or any(ln.startswith((" ", "\t")) for ln in lines):
            continue
        if any(ln.lstrip().startswith(("..", ":", "*", "=", "-", "|", "+", ">>>")) for ln in lines):
            continue
        paras.append(" ".join(lines))
    return paras


def python_reference_sentences(count: int | None = None) -> list[str]:
    """Prose sentences of the Python Language Reference (``pydoc_data/topics.py``), in the
    order of its topics; the first ``count`` (all when ``None``)."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for name in sorted(topics):
        for para in _prose_paragraphs(topics[name]):
            out.extend(_sentences(para))
    return out if count is None else out[:count]


def _pairs(paragraphs: list[list[str]]) -> list[tuple[str, str]]:
    """Disjoint consecutive sentence pairs of each paragraph."""
    return [(p[i], p[i + 1]) for p in paragraphs for i in range(0, len(p) - 1, 2)]


def sklearn_description_pairs() -> list[tuple[str, str]]:
    """Consecutive sentence pairs from scikit-learn's dataset descriptions
    (``sklearn/datasets/descr/*.rst``), files in name order.

    Raises:
        RuntimeError: when scikit-learn is not installed.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sklearn_description_pairs needs scikit-learn installed")
    descr = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "descr"
    paragraphs = [
        _sentences(para)
        for f in sorted(descr.glob("*.rst"))
        for para in _prose_paragraphs(f.read_text(encoding="utf-8"))
    ]
    return _pairs(paragraphs)


def _gensim_root() -> Path | None:
    """The folder holding an installed gensim package (``None``: not installed)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _gensim_file(name: str, wheel: str | Path | None, user: str) -> bytes:
    """The bytes of gensim's file ``name`` from the wheel at ``wheel`` or an installed gensim.

    Raises:
        RuntimeError: when neither is available (naming ``user``, the function asking).
    """
    if wheel is not None:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(name)
    root = _gensim_root()
    if root is None:
        raise RuntimeError(
            f"{user} needs gensim installed, or the path of its wheel "
            "(pip download --no-deps gensim==4.4.0)"
        )
    return (root / name).read_bytes()


def _lee_text(wheel: str | Path | None) -> str:
    return _gensim_file(LEE_FILE, wheel, "lee_news_pairs").decode("utf-8")


def lee_news_pairs(wheel: str | Path | None = None) -> list[tuple[str, str]]:
    """The first two sentences of each Lee background news story (:data:`LEE_FILE`), from an
    installed ``gensim`` or from the gensim wheel at ``wheel``; stories with fewer than two
    usable sentences are skipped.

    Raises:
        RuntimeError: when neither is available.
    """
    out = []
    for story in _lee_text(wheel).splitlines():
        s = _sentences(story)
        if len(s) >= 2:
            out.append((s[0], s[1]))
    return out


def movie_review_pairs(wheel: str | Path | None = None) -> list[tuple[str, str]]:
    """The 200 one-sentence movie reviews of :data:`REVIEWS_FILE` (Pang & Lee's sentence
    polarity data, lower-cased and tokenized as shipped; the label dropped), paired in file
    order (review 0 with 1, 2 with 3, ...): everyday evaluative language, neither technical
    prose nor news. Two reviews of a pair are unrelated, so only cosine means something on
    them, not retrieval.

    Raises:
        RuntimeError: when neither gensim nor its wheel is available.
    """
    # shipped in Windows-1252 (its dashes are byte 0x97)
    text = _gensim_file(REVIEWS_FILE, wheel, "movie_review_pairs").decode("cp1252")
    lines = [x.split(" ", 1)[1].strip() for x in text.splitlines() if " " in x]
    return list(zip(lines[0::2], lines[1::2], strict=False))


def _outside(text: str, opening: str, closing: str) -> str:
    """``text`` without what lies between ``opening`` and its ``closing`` (nested). An
    ``opening`` never closed stays as text (with what follows it), so a stray brace cannot
    swallow the rest of an article."""
    out: list[str] = []
    depth, i, start = 0, 0, 0  # start: where the outermost open span began
    while i < len(text):
        if text.startswith(opening, i):
            if not depth:
                start = i
            depth, i = depth + 1, i + len(opening)
        elif depth and text.startswith(closing, i):
            depth, i = depth - 1, i + len(closing)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    if depth:  # unclosed: keep it as it was (the sentence filter drops its markup)
        out.append(text[start:])
    return "".join(out)


_WIKI_DROP = (
    re.compile(r"<!--.*?-->", re.S),  # comments
    # formulas, code and other verbatim blocks, whose braces are not templates
    re.compile(
        r"<(math|code|pre|nowiki|syntaxhighlight|source|chem|score|gallery|timeline|hiero)\b"
        r"[^>]*>.*?</\1\s*>",
        re.S | re.I,
    ),
    re.compile(r"<ref[^>/]*/>"),  # citations
    re.compile(r"<ref[^>]*>.*?</ref>", re.S),
    # files, images, categories and interlanguage links (their captions may hold links)
    re.compile(r"\[\[(?:File|Image|Category|[a-z-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]"),
    re.compile(r"\[https?://\S+\]"),  # bare external links
)
_WIKI_LINK = re.compile(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]")  # [[target|shown]] → shown
_WIKI_EXTERNAL = re.compile(r"\[https?://\S+ ([^\]]*)\]")  # [url shown] → shown
_WIKI_TAG = re.compile(r"<[^>]+>")
_WIKI_NOT_PROSE = ("=", "*", "#", ":", ";", "|", "!")  # headings, lists, indents, tables
_WIKI_HOLLOW = re.compile(r" ?\(\s*[;,]?\s*\)")  # brackets a removed template emptied
# a removed template's hole in a sentence: punctuation after a space ("between ." for
# "between {{convert|40|and|65|kg}}.")
_WIKI_HOLE = re.compile(r"\s[.,;:]")


def _wiki_paragraphs(wikitext: str) -> list[str]:
    """The prose paragraphs of one article's wikitext: templates, tables, references, files,
    categories and markup removed, links replaced by their text; headings, lists and
    indented lines left out."""
    t = wikitext
    for drop in _WIKI_DROP[:4]:
        t = drop.sub("", t)
    t = _outside(_outside(t, "{{", "}}"), "{|", "|}")
    for drop in _WIKI_DROP[4:]:
        t = drop.sub("", t)
    t = _WIKI_EXTERNAL.sub(r"\1", _WIKI_LINK.sub(r"\1", t))
    t = _WIKI_TAG.sub("", t).replace("'''", "").replace("''", "")
    t = _WIKI_HOLLOW.sub("", t)
    out = []
    for para in re.split(r"\n\s*\n", t):
        lines = [x.strip() for x in para.splitlines()]
        lines = [x for x in lines if x and not x.startswith(_WIKI_NOT_PROSE)]
        if lines:
            out.append(" ".join(lines))
    return out


def wikipedia_sentences(wheel: str | Path | None = None, count: int | None = None) -> list[str]:
    """Prose sentences of the English Wikipedia articles of :data:`WIKI_FILE` (redirects
    left out), each once, in article order (15,754 sentences); ``count``: that many evenly
    spaced over them (:func:`evenly`).

    Raises:
        RuntimeError: when neither gensim nor its wheel is available.
    """
    raw = bz2.decompress(_gensim_file(WIKI_FILE, wheel, "wikipedia_sentences")).decode("utf-8")
    sentences = []
    for body in re.findall(r"<text[^>]*>(.*?)</text>", raw, re.S):
        wikitext = html.unescape(html.unescape(body))  # the dump escapes entities twice
        if wikitext.lstrip().upper().startswith("#REDIRECT"):
            continue
        sentences += [s for para in _wiki_paragraphs(wikitext) for s in _sentences(para)]
    out = _prose(s for s in sentences if not _WIKI_HOLE.search(s))
    return out if count is None else evenly(out, count)


def retrieval_accuracy(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows ``i`` whose ``a[i]`` is nearest (cosine) to ``b[i]`` among all of
    ``b``; ``a, b: (P, D)``, pair ``i`` being ``(a[i], b[i])``."""
    an = torch.nn.functional.normalize(a.float(), dim=-1)
    bn = torch.nn.functional.normalize(b.float(), dim=-1)
    hit = (an @ bn.T).argmax(dim=1) == torch.arange(a.shape[0])
    return float(hit.float().mean())


# -- broad calibration text: docstrings and system documentation --------------------------------
SYSTEM_DOC_DIR = Path("/usr/share/doc")
INFO_DIR = Path("/usr/share/info")
#: packages whose docstrings :func:`broad_sentences` reads (scikit-learn without ``datasets``)
BROAD_PACKAGES = (
    "numpy", "scipy", "torch", "pandas", "sympy", "networkx", "matplotlib", "transformers", "sklearn",
)  # fmt: skip
#: the sources :func:`broad_sentences` interleaves, in turn
BROAD_SOURCES = ("reference", "stdlib", "packages", "system_doc", "info")

# characters that mark code, markup or paths rather than prose
_CODE = re.compile(r"[`_=<>{}\[\]\\|#$~@*^]|::|\(\)|\w\.\w|\.\.\.|https?:|/\w")
# directories never read for docstrings: tests, and scikit-learn's dataset descriptions (B)
_SKIP_DIRS = {"test", "tests", "idle_test", "lib2to3", "site-packages", "datasets"}
_DOC_FILE = re.compile(r"^(readme|news|faq|todo|authors|thanks|.*\.(md|txt|rst|markdown))")
_LICENCE_FILE = re.compile(r"copying|licen[cs]e|copyright|changelog")
# names the prefix match of _DOC_FILE takes that are never prose (symbol lists, checksums)
_NOT_PROSE_FILE = re.compile(r"_symbols\.|md5sums")
# paths under the system documentation that may hold the evaluation text (B, C)
_EVAL_DOC = re.compile(r"sklearn|scikit|gensim", re.IGNORECASE)
#: most bytes read of one documentation file (decompressed)
READ_CAP = 4 * 2**20
#: the smallest ``count`` :func:`broad_sentences` takes: one sentence of each source
BROAD_LEAST = len(BROAD_SOURCES)


def _prose(sentences: Iterable[str]) -> list[str]:
    """Sentences with no code, markup or path characters, each kept once, in order."""
    seen: set[str] = set()
    out = []
    for s in sentences:
        if not _CODE.search(s) and s not in seen:
            seen.add(s)
            out.append(s)
    return out


def _docstring_sentences(files: Iterable[Path]) -> Iterator[str]:
    """Prose sentences of the module, class and function docstrings of ``files`` (parsed, never
    imported), in file order and ``ast.walk`` order within a file."""
    for f in files:
        try:
            with warnings.catch_warnings():  # invalid escapes in old sources: not our code
                warnings.simplefilter("ignore")
                tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file of another Python version or encoding: not prose we need
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=True)
                for para in _prose_paragraphs(doc or ""):
                    yield from _sentences(para)


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts))


def stdlib_docstring_sentences() -> list[str]:
    """Prose sentences of the running Python's standard library docstrings (its ``*.py`` files
    in path order, tests left out), each once."""
    return _prose(_docstring_sentences(_python_files(Path(sysconfig.get_paths()["stdlib"]))))


def package_docstring_sentences(packages: Sequence[str] = BROAD_PACKAGES) -> list[str]:
    """Prose sentences of the docstrings of installed ``packages`` (in the order given, files in
    path order; tests and any ``datasets`` subpackage left out), each once.

    Raises:
        RuntimeError: naming a package that is not installed.
    """
    files: list[Path] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package_docstring_sentences: package {name!r} is not installed")
        files += _python_files(Path(next(iter(spec.submodule_search_locations))))
    return _prose(_docstring_sentences(files))


def _read_text(p: Path, cap: int = READ_CAP) -> str:
    """The first ``cap`` bytes of ``p`` (decompressed when ``*.gz``), as text."""
    with gzip.open(p, "rb") if p.suffix == ".gz" else p.open("rb") as f:
        data = f.read(cap)
    return data.decode("utf-8", errors="replace")


def _need_dir(root: Path, what: str) -> None:
    if not root.is_dir():
        raise RuntimeError(f"{what} needs the directory {root}, which does not exist")


def system_doc_sentences(root: Path = SYSTEM_DOC_DIR) -> list[str]:
    """Prose sentences of the system packages' READMEs, NEWS, FAQs and text documents under
    ``root`` (Debian's ``/usr/share/doc``; gzipped or not; copyright, licence and changelog
    files, symbol lists and any path naming scikit-learn or gensim, whose text evaluates the
    recipe, left out; at most :data:`READ_CAP` bytes of each), files in path order, each
    sentence once.

    Raises:
        RuntimeError: when ``root`` does not exist.
    """
    _need_dir(root, "system_doc_sentences")
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and _DOC_FILE.match(p.name.lower().removesuffix(".gz"))
        and not _LICENCE_FILE.search(p.name.lower())
        and not _NOT_PROSE_FILE.search(p.name.lower())
        and not _EVAL_DOC.search(str(p.relative_to(root)))
    )
    return _prose(
        s for f in files for para in _prose_paragraphs(_read_text(f)) for s in _sentences(para)
    )


def info_manual_sentences(root: Path = INFO_DIR) -> list[str]:
    """Prose sentences of the GNU info manuals under ``root`` (``*.info*.gz``: coreutils,
    find, diff, ...), files in name order, each sentence once.

    Raises:
        RuntimeError: when ``root`` does not exist.
    """
    _need_dir(root, "info_manual_sentences")
    texts = (_read_text(f).replace("\x1f", "\n\n") for f in sorted(root.glob("*.info*.gz")))
    return _prose(s for t in texts for para in _prose_paragraphs(t) for s in _sentences(para))


def evenly(sentences: Sequence[str], count: int) -> list[str]:
    """``count`` items evenly spaced over ``sentences`` (all of them when there are fewer)."""
    if count >= len(sentences):
        return list(sentences)
    return [sentences[i * len(sentences) // count] for i in range(count)]


def interleave(*lists: Sequence[str]) -> list[str]:
    """One item of each list in turn, until every list is used up."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def broad_sentences(
    count: int = 1270, doc_root: Path = SYSTEM_DOC_DIR, info_root: Path = INFO_DIR
) -> list[str]:
    """``count // 5 * 5`` calibration sentences from five technical-prose sources
    (:data:`BROAD_SOURCES`): ``count // 5`` sentences evenly spaced over each of the Python
    Language Reference (:func:`python_reference_sentences`), the standard library's
    docstrings, :data:`BROAD_PACKAGES`' docstrings, ``doc_root`` (``/usr/share/doc``) and
    ``info_root`` (``/usr/share/info``), interleaved one of each in turn. Deterministic for a
    given set of installed packages and system documents (so it differs between machines).

    Raises:
        ValueError: when ``count`` is below :data:`BROAD_LEAST` (one sentence per source).
        RuntimeError: when a source is missing (a package, or a system directory) or gives
            fewer than ``count // 5`` sentences.
    """
    if count < BROAD_LEAST:
        raise ValueError(
            f"broad_sentences: count {count} is below {BROAD_LEAST}, one sentence of each of "
            f"{', '.join(BROAD_SOURCES)}"
        )
    each = count // len(BROAD_SOURCES)
    log.info("harvesting %d calibration sentences of %s", count, ", ".join(BROAD_SOURCES))
    sources = (
        python_reference_sentences(),
        stdlib_docstring_sentences(),
        package_docstring_sentences(),
        system_doc_sentences(doc_root),
        info_manual_sentences(info_root),
    )
    for name, got in zip(BROAD_SOURCES, sources, strict=True):
        if len(got) < each:
            raise RuntimeError(f"broad_sentences: {name} gave {len(got)} sentences, {each} needed")
    return interleave(*(evenly(s, each) for s in sources))


class CalibrationText(StrEnum):
    """Which real text calibrates a transformer prune."""

    #: :func:`broad_sentences`: five technical-prose sources interleaved
    BROAD = "broad"
    #: :func:`python_reference_sentences`: the Python Language Reference alone
    REFERENCE = "reference"
    #: :func:`wikipedia_sentences`: English Wikipedia articles (gensim's wheel, or gensim)
    WIKIPEDIA = "wikipedia"


#: :func:`calibration_sentences`' count when none is given, per text (measured: docs/benchmarks.md)
DEFAULT_CALIBRATION_SENTENCES = {
    CalibrationText.BROAD: 1270,
    CalibrationText.REFERENCE: 256,
    CalibrationText.WIKIPEDIA: 1270,
}


def default_calibration_text(wheel: str | Path | None = None) -> CalibrationText:
    """The calibration text a transformer prune takes when none is named: Wikipedia's
    general-domain prose where gensim's text is at hand (``wheel`` given, or an installed
    gensim that holds :data:`WIKI_FILE`), else the broad technical text, always installed.
    Chosen on validation text of neither kind (movie reviews, :func:`movie_review_pairs`),
    docs/benchmarks.md."""
    root = _gensim_root()
    if wheel is not None or (root is not None and (root / WIKI_FILE).is_file()):
        return CalibrationText.WIKIPEDIA
    return CalibrationText.BROAD


def calibration_sentences(
    text: CalibrationText, count: int | None = None, wheel: str | Path | None = None
) -> list[str]:
    """``count`` calibration sentences of ``text`` (``None``:
    :data:`DEFAULT_CALIBRATION_SENTENCES`, 1,270 broad or Wikipedia, 256 reference; the
    reference gives at most as many as it has, Wikipedia's evenly spaced over its 15,754;
    :attr:`CalibrationText.BROAD` rounds ``count`` down to a multiple of five). ``wheel``:
    gensim's wheel, where :attr:`CalibrationText.WIKIPEDIA` reads from when gensim is not
    installed.

    Raises:
        ValueError: when ``count`` is too small for ``text`` (:func:`broad_sentences`).
        RuntimeError: when a source of ``text`` is missing or too short.
    """
    n = DEFAULT_CALIBRATION_SENTENCES[text] if count is None else count
    if text is CalibrationText.BROAD:
        return broad_sentences(n)
    if text is CalibrationText.WIKIPEDIA:
        return wikipedia_sentences(wheel, n)
    return python_reference_sentences(n)
