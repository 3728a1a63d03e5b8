"""Unlabelled English sentences made on the spot: no dataset download exists here, so the
transformer recipe calibrates, distils and evaluates on sentences generated deterministically
from templates × vocabularies (a seed picks every slot). Different seeds give disjoint-looking
sets; :func:`splits` makes calibration, distillation and held-out sets that share no sentence.
"""

from __future__ import annotations

import random

__all__ = ["make_sentences", "splits"]

_NOUNS = (
    "cat", "dog", "market", "river", "city", "doctor", "teacher", "computer", "garden",
    "song", "storm", "child", "bank", "train", "coffee", "book", "engine", "island",
    "painter", "bridge", "forest", "company", "student", "phone", "kitchen", "museum",
    "farmer", "planet", "recipe", "election", "hospital", "violin",
)  # fmt: skip
_VERBS = (
    "sees", "likes", "builds", "finds", "watches", "buys", "paints", "moves", "repairs",
    "describes", "follows", "ignores", "visits", "questions", "remembers", "sells",
)  # fmt: skip
_ADJS = (
    "red", "quiet", "old", "bright", "tiny", "famous", "broken", "happy", "strange",
    "expensive", "modern", "rural", "noisy", "careful", "frozen", "golden",
)  # fmt: skip
_PLACES = (
    "near the station", "in the old town", "after the rain", "before dawn", "at the market",
    "on the hill", "during the meeting", "across the border", "under the bridge", "at home",
)  # fmt: skip
_TEMPLATES = (
    "The {a} {n} {v} a {b} {m} {p}.",
    "Why does the {n} always look so {a} {p}?",
    "A {a} {n} and a {b} {m} were seen {p}.",
    "{P} the {n} {v} every {a} {m} it meets.",
    "Nobody expected the {m} to be this {b}.",
    "How can a {a} {n} help a {b} {m}?",
    "The report says the {n} {v} the {m} {p}.",
    "My {a} {n} never {v} anything {b}.",
    "She told me the {m} was {a} and {b}.",
    "Yesterday a {n} {v} our {b} {m} {p}.",
)


def make_sentences(count: int, seed: int) -> list[str]:
    """``count`` sentences, the same for the same ``(count, seed)``."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    r = random.Random(seed)
    out = []
    for _ in range(count):
        p = r.choice(_PLACES)
        out.append(
            r.choice(_TEMPLATES).format(
                a=r.choice(_ADJS),
                b=r.choice(_ADJS),
                n=r.choice(_NOUNS),
                m=r.choice(_NOUNS),
                v=r.choice(_VERBS),
                p=p,
                P=p[0].upper() + p[1:] + ",",
            )
        )
    return out


def splits(
    calibration: int, distill: int, held_out: int, seed: int = 0
) -> tuple[list[str], list[str], list[str]]:
    """Calibration, distillation and held-out sentences, no sentence in two of them."""
    pool: list[str] = []
    seen: set[str] = set()
    need = calibration + distill + held_out
    s = seed
    while len(pool) < need:
        for sent in make_sentences(need, s):
            if sent not in seen:
                seen.add(sent)
                pool.append(sent)
        s += 1_000_003
    a, b = calibration, calibration + distill
    return pool[:a], pool[a:b], pool[b:need]
