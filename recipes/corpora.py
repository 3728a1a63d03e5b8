"""Real English text that ships inside Python packages (no dataset download exists here), for
calibrating on one real source and evaluating on another:

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

A *pair* is two consecutive sentences of one paragraph or story; retrieval accuracy
(:func:`retrieval_accuracy`) asks whether a sentence's embedding is nearest to its own pair's
among all pairs.
"""

from __future__ import annotations

import importlib.util
import re
import zipfile
from pathlib import Path

import torch

__all__ = [
    "LEE_FILE",
    "lee_news_pairs",
    "python_reference_sentences",
    "retrieval_accuracy",
    "sklearn_description_pairs",
]

LEE_FILE = "gensim/test/test_data/lee_background.cor"

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


def _lee_text(wheel: str | Path | None) -> str:
    if wheel is not None:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(LEE_FILE).decode("utf-8")
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "lee_news_pairs needs gensim installed, or the path of its wheel "
            "(pip download --no-deps gensim==4.4.0)"
        )
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return (root / LEE_FILE).read_text(encoding="utf-8")


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


def retrieval_accuracy(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows ``i`` whose ``a[i]`` is nearest (cosine) to ``b[i]`` among all of
    ``b``; ``a, b: (P, D)``, pair ``i`` being ``(a[i], b[i])``."""
    an = torch.nn.functional.normalize(a.float(), dim=-1)
    bn = torch.nn.functional.normalize(b.float(), dim=-1)
    hit = (an @ bn.T).argmax(dim=1) == torch.arange(a.shape[0])
    return float(hit.float().mean())
