"""``hps.load_config`` on random input (issue #22, the fault suite's property test).

Random byte strings, and random mutations of a valid ``ps.json`` (values replaced by values of
other types or out of range, fields deleted or added, hostile names and paths, then bytes
flipped, cut or inserted in the JSON text), each written to a file and read. Every outcome is a
config or a ``ValueError`` (``FormatVersionError`` is one) whose message names the file or the
field; never another exception type, never a hang (each read has a generous alarm).
"""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps.config import PSConfig, load_config

_HANG_S = 10  # one read of a small file takes milliseconds; this only tells a hang

VALID: dict[str, Any] = {
    "tilerec_artifact_version": 1,
    "supportlonglong": True,
    "volatile_db": {
        "type": "parallel_hash_map",
        "num_partitions": 8,
        "overflow_margin": 1000,
        "overflow_policy": "evict_oldest",
        "overflow_resolution_target": 0.8,
        "initial_cache_rate": 1.0,
        "max_batch_size": 1024,
    },
    "persistent_db": {"type": "rocks_db", "path": "pdb", "read_only": False},
    "update_source": {"type": "file_log", "path": "u.log", "poll_interval_s": 0.5},
    "models": [
        {
            "model": "dlrm",
            "max_batch_size": 64,
            "sparse_files": ["sparse/t0", "sparse/t1"],
            "embedding_table_names": ["t0", "t1"],
            "embedding_vecsize_per_table": [8, 8],
            "maxnum_catfeature_query_per_table_per_sample": [1, 3],
            "default_value_for_each_table": [0.0, 0.0],
            "gpucache": True,
            "gpucacheper": 0.5,
            "hit_rate_threshold": 0.9,
            "cache_policy": "lfu",
            "deployed_device_list": [0],
            "device": "cpu",
            "network_file": "dense.onnx",
        },
        {  # shares t0 with the first model: same sparse file and dim
            "model": "small",
            "max_batch_size": 8,
            "sparse_files": ["sparse/t0"],
            "embedding_table_names": ["t0"],
            "embedding_vecsize_per_table": [8],
            "maxnum_catfeature_query_per_table_per_sample": [1],
        },
    ],
}

# Where a message may point: the file (syntax, encoding) or a field of the document.
_WHERE = (
    "ps.json",
    "models",
    "volatile_db",
    "persistent_db",
    "update_source",
    "tilerec_artifact_version",
)

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", "../x", "/abs/x", "a/b", "x.y", "\x00", "cuda:0", "redis_cluster"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path (keys and indices) to a value inside ``doc``."""
    if isinstance(doc, dict):
        items: Any = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


@st.composite
def mutated_docs(draw: st.DrawFn) -> bytes:
    """The valid document with 1-4 structural mutations, serialised (NaN tokens allowed), then
    sometimes damaged byte-wise."""
    doc = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(doc))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(JSON_VALUES)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(JSON_VALUES)
        else:
            parent.append(draw(JSON_VALUES))
    text = json.dumps(doc).encode()
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(text)))
        cut = draw(st.sampled_from(["flip", "cut", "insert"]))
        if cut == "flip" and i < len(text):
            text = text[:i] + bytes([text[i] ^ draw(st.integers(1, 255))]) + text[i + 1 :]
        elif cut == "cut":
            text = text[:i]
        else:
            text = text[:i] + draw(st.binary(min_size=1, max_size=4)) + text[i:]
    return text


@contextmanager
def _no_hang(seconds: int) -> Iterator[None]:
    def _alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"load_config took over {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _check_outcome(path: Path, data: bytes) -> None:
    """``load_config`` on ``data``: a config, or a ``ValueError`` naming the file or a field."""
    path.write_bytes(data)
    with _no_hang(_HANG_S):
        try:
            cfg = load_config(path)
        except ValueError as e:
            msg = str(e)
            assert msg.startswith(str(path)) or msg.startswith(_WHERE), (msg, data)
            return
    assert isinstance(cfg, PSConfig)


_FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes_are_a_clear_error(tmp_path: Path, data: bytes) -> None:
    _check_outcome(tmp_path / "ps.json", data)


@_FUZZ
@given(data=mutated_docs())
def test_a_mutated_ps_json_is_a_config_or_a_clear_error(tmp_path: Path, data: bytes) -> None:
    _check_outcome(tmp_path / "ps.json", data)


def test_the_unmutated_document_is_valid(tmp_path: Path) -> None:
    (tmp_path / "ps.json").write_text(json.dumps(VALID))
    assert load_config(tmp_path / "ps.json").models[0].model == "dlrm"


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe{}",  # not UTF-8
        b"[" * 100_000,  # nested past the parser's recursion limit
        b'{"models": ' + b"1" * 5000 + b"}",  # an integer past Python's digit limit
        json.dumps(VALID).replace('"gpucacheper": 0.5', '"gpucacheper": 1' + "0" * 400).encode(),
        # ^ an integer too large for a float
        json.dumps(VALID).replace('["sparse/t0"]', '["a\\u0000b"]').encode(),
        # ^ a NUL in a path (the shared table's paths are compared resolved)
    ],
    ids=["not_utf8", "deep", "digits", "float_overflow", "nul_in_path"],
)
def test_inputs_the_json_module_rejects_oddly_are_clear_errors(tmp_path: Path, data: bytes) -> None:
    _check_outcome(tmp_path / "ps.json", data)
    with pytest.raises(ValueError):
        load_config(tmp_path / "ps.json")
