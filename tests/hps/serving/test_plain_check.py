"""A servable checks a request with every check passing and every table taking its ids as they
are in one pass (``_check_plain``); it gives exactly what the full check gives, and any other
request (a bad one, or one a vocabulary entry must map) takes the full check and its error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import build_servables
from hps.serving.servable import DLRMServable, InputError, Tensors
from hps.vocabulary import ServingVocabulary, TableVocabulary
from tests.hps.serving.tiny_dlrm import make_request


@pytest.fixture(scope="module")
def servable(tiny_artifacts: Path) -> Iterator[DLRMServable]:
    ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    try:
        yield build_servables(ps)["tiny"]
    finally:
        ps.close()


def _unpadded(model: DLRM, b: int, seed: int) -> Tensors:
    req = make_request(model, b, seed)
    for name, ids in req.items():
        if name != "dense":
            ids[ids < 0] = 7  # every slot a key
    return req


def _same(servable: DLRMServable, req: Tensors) -> None:
    got, want = servable.check(req), servable._check_full(req)
    assert list(got) == list(want)
    for name, a in want.items():
        g = got[name]
        assert (g.dtype, g.shape, g.flags.writeable) == (a.dtype, a.shape, a.flags.writeable)
        assert g.flags.c_contiguous == a.flags.c_contiguous
        np.testing.assert_array_equal(g, a)
        if name != "dense":
            assert not np.shares_memory(g, req[name])  # a copy: request buffers are read-only


def _variants(model: DLRM) -> list[Tensors]:
    plain = _unpadded(model, 5, seed=1)
    int32 = {k: v.astype(np.int32) if k != "dense" else v for k, v in plain.items()}
    fortran = {**plain, "dense": np.asfortranarray(plain["dense"])}
    return [
        plain,
        int32,
        fortran,
        make_request(model, 4, seed=2),  # -1 pads short bags
        make_request(model, 3, seed=3, narrow=True),
        _unpadded(model, 0, seed=4),
    ]


def test_the_one_pass_check_gives_what_the_full_check_gives(servable, tiny) -> None:
    voc = servable.vocabulary  # the tiny artifacts' identity entries, as export writes them
    assert voc is not None and all(e.keys is None for e in voc.tables.values())
    for i, req in enumerate(_variants(tiny)):
        padded = any((a < 0).any() for n, a in req.items() if n != "dense")
        assert (servable._check_plain(req) is None) == padded, i  # entries move padding
        _same(servable, req)


BAD: list[tuple[str, Callable[[Tensors], None], str]] = [
    ("NaN", lambda r: r["dense"].__setitem__((0, 0), np.nan), "NaN or infinite"),
    ("key -2", lambda r: r["ids_t0"].__setitem__((0, 0), -2), "holds key -2"),
    ("wide bag", lambda r: r.__setitem__("ids_t0", np.zeros((5, 9), np.int64)), "allows at most"),
    ("missing", lambda r: r.pop("ids_t1"), "missing inputs"),
    ("dtype", lambda r: r.__setitem__("ids_t0", r["ids_t0"].astype(np.float32)), "integer keys"),
    ("dense dtype", lambda r: r.__setitem__("dense", r["dense"].astype(np.float64)), "FP32"),
    ("rows", lambda r: r.__setitem__("ids_t0", r["ids_t0"][:4]), "must have shape"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_request_takes_the_full_check_and_its_error(servable, tiny, case) -> None:
    _, spoil, message = case
    req = _unpadded(tiny, 5, seed=1)
    spoil(req)
    assert servable._check_plain(req) is None
    with pytest.raises(InputError, match=message):
        servable.check(req)


def test_a_batch_over_the_bound_takes_the_full_check(servable, tiny) -> None:
    req = _unpadded(tiny, servable.max_batch_size + 1, seed=1)
    assert servable._check_plain(req) is None
    with pytest.raises(InputError, match="exceeds"):
        servable.check(req)


def test_vocabulary_entries_decide_which_requests_take_one_pass(servable, tiny) -> None:
    t0, t1 = servable.tables[0], servable.tables[1]
    exported = servable.vocabulary
    cases: dict[str, dict[str, TableVocabulary] | None] = {
        "none": None,
        # identity entries: padding must be moved by the vocabulary; plain bags pass as they are
        "identity": {
            t0.name: TableVocabulary(t0.name, 10**6, t0.max_hotness, "truncate", None),
        },
        # an entry narrower than the request's bags: the vocabulary truncates them
        "narrower": {
            t1.name: TableVocabulary(t1.name, 10**6, max(1, t1.max_hotness - 1), "truncate", None)
        },
        # a key list maps every id
        "keys": {t0.name: TableVocabulary(t0.name, 3, t0.max_hotness, "truncate", (7, 8, 9))},
    }
    try:
        for kind, entries in cases.items():
            servable.vocabulary = None if entries is None else ServingVocabulary(entries, "test")
            plain, padded = _unpadded(tiny, 5, seed=1), make_request(tiny, 4, seed=2)
            # without any entry, -1 padding needs no moving
            assert (servable._check_plain(padded) is not None) == (kind == "none")
            narrower = kind == "narrower" and t1.max_hotness > 1
            takes_one_pass = kind in ("none", "identity") or (kind == "narrower" and not narrower)
            assert (servable._check_plain(plain) is not None) == takes_one_pass
            for req in (plain, padded):
                _same(servable, req)
    finally:
        servable.vocabulary = exported
    assert servable._check_plain(_unpadded(tiny, 5, seed=1)) is not None
