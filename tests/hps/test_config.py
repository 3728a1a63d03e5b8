from __future__ import annotations

import json
from pathlib import Path

import pytest

from hps.artifact_format import ARTIFACT_VERSION
from hps.config import load_config, parse_config
from hps.types import CachePolicy, FormatVersionError, OverflowPolicy, VolatileDBType


def _doc(**model_over):
    m = {
        "model": "dlrm",
        "max_batch_size": 64,
        "sparse_files": ["s/t0", "s/t1"],
        "embedding_table_names": ["t0", "t1"],
        "embedding_vecsize_per_table": [8, 4],
        "maxnum_catfeature_query_per_table_per_sample": [1, 3],
        "default_value_for_each_table": [0.0, -1.0],
    }
    m.update(model_over)
    return {
        "supportlonglong": True,
        "volatile_db": {"type": "parallel_hash_map"},
        "persistent_db": {"type": "rocks_db", "path": "pdb"},
        "models": [m],
    }


def test_valid_config_round_trips(tmp_path: Path) -> None:
    p = tmp_path / "ps.json"
    p.write_text(json.dumps(_doc(gpucacheper=0.5, cache_policy="lfu")))
    cfg = load_config(p)
    m = cfg.model("dlrm")
    assert [t.name for t in m.tables] == ["t0", "t1"]
    assert m.tables[1].dim == 4 and m.tables[1].default_value == -1.0
    assert m.tables[0].sparse_file == str(tmp_path / "s/t0")  # relative to ps.json
    assert (
        m.cache_policy is CachePolicy.LFU and m.gpucacheper == 0.5 and m.hit_rate_threshold == 0.9
    )
    assert m.max_keys_per_lookup("t1") == 64 * 3
    assert cfg.volatile_db.type is VolatileDBType.PARALLEL_HASH_MAP
    assert cfg.volatile_db.overflow_policy is OverflowPolicy.EVICT_RANDOM
    again = parse_config(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda d: d["models"][0].update(gpucahceper=0.1),
            r"models\[0\]: unknown field\(s\) \['gpucahceper'\]",
        ),
        (lambda d: d.update(extra=1), r"ps.json: unknown field\(s\) \['extra'\]"),
        (
            lambda d: d["models"][0].pop("maxnum_catfeature_query_per_table_per_sample"),
            r"models\[0\]\.maxnum_catfeature_query_per_table_per_sample: required field is missing",
        ),
        (
            lambda d: d["models"][0].update(max_batch_size="sixty-four"),
            r"models\[0\]\.max_batch_size: expected an integer",
        ),
        (lambda d: d["models"][0].update(gpucache=1), r"models\[0\]\.gpucache: expected a boolean"),
        (
            lambda d: d["models"][0].update(gpucacheper=1.5),
            r"models\[0\]\.gpucacheper: 1.5 is impossible",
        ),
        (
            lambda d: d["models"][0].update(hit_rate_threshold=-0.1),
            r"models\[0\]\.hit_rate_threshold",
        ),
        (
            lambda d: d["models"][0].update(embedding_vecsize_per_table=[8, 0]),
            r"models\[0\]\.embedding_vecsize_per_table\[1\]: 0 is impossible",
        ),
        (
            lambda d: d["models"][0].update(embedding_vecsize_per_table=[8]),
            r"models\[0\]\.embedding_vecsize_per_table: expected 2 entries",
        ),
        (
            lambda d: d["models"][0].update(embedding_table_names=["t0", "t0"]),
            r"duplicate table names \['t0'\]",
        ),
        (
            lambda d: d["models"][0].update(cache_policy="fifo"),
            r"models\[0\]\.cache_policy: 'fifo' is not one of",
        ),
        (
            lambda d: d["volatile_db"].update(overflow_policy="evict_all"),
            r"volatile_db\.overflow_policy",
        ),
        (
            lambda d: d["volatile_db"].update(overflow_resolution_target=0),
            r"volatile_db\.overflow_resolution_target",
        ),
        (
            lambda d: d["volatile_db"].update(num_partitions=0),
            r"volatile_db\.num_partitions: 0 is impossible",
        ),
        (
            lambda d: d["volatile_db"].update(type="redis_cluster", address="localhost:x"),
            r"volatile_db\.address",
        ),
        (lambda d: d["persistent_db"].update(path=""), r"persistent_db\.path"),
        (lambda d: d.update(update_source={"type": "file_log"}), r"update_source\.path"),
        (
            lambda d: d.update(update_source={"type": "redis_stream", "address": "localhost:x"}),
            r"update_source\.address: 'localhost:x' is impossible; expected 'host:port",
        ),
        (
            lambda d: d.update(update_source={"type": "redis_stream", "address": "h:6379,h:70000"}),
            r"update_source\.address: 'h:6379,h:70000' is impossible.*1\.\.65535",
        ),
        (
            lambda d: d.update(update_source={"type": "redis_stream"}),
            r"update_source\.address: '' is impossible",
        ),
        (
            lambda d: (
                d["persistent_db"].update(read_only=True),
                d.update(update_source={"type": "redis_stream", "address": "h:6379"}),
            ),
            r"update_source\.state_path: '' is impossible.*writable rocks_db",
        ),
        (
            lambda d: (
                d["persistent_db"].update(type="none"),
                d.update(update_source={"type": "redis_stream", "address": "h:6379"}),
            ),
            r"update_source\.state_path",
        ),
        (
            lambda d: (
                d["volatile_db"].update(type="none"),
                d["persistent_db"].update(read_only=True),
                d.update(update_source={"type": "file_log", "path": "u.log"}),
            ),
            r"update_source\.type: 'file_log' is impossible.*rocks_db that is not read_only",
        ),
        (
            lambda d: d.update(supportlonglong="yes"),
            r"ps.json\.supportlonglong: expected a boolean",
        ),
        (
            lambda d: (
                d["volatile_db"].update(type="none"),
                d["persistent_db"].update(type="none"),
            ),
            r"at least one\s+database tier",
        ),
        (lambda d: d.update(models=[]), r"models: at least one model"),
        # json.loads takes NaN and Infinity: every number in ps.json must be finite
        (
            lambda d: d["models"][0].update(default_value_for_each_table=[0.0, float("nan")]),
            r"models\[0\]\.default_value_for_each_table\[1\]: nan is impossible; expected a finite",
        ),
        (
            lambda d: d["models"][0].update(gpucacheper=float("nan")),
            r"models\[0\]\.gpucacheper: nan is impossible",
        ),
        (
            lambda d: d.update(
                update_source={"type": "file_log", "path": "u.log", "poll_interval_s": float("inf")}
            ),
            r"update_source\.poll_interval_s: inf is impossible; expected a finite",
        ),
        (
            lambda d: d.update(
                update_source={"type": "file_log", "path": "u.log", "poll_interval_s": 1e12}
            ),
            r"update_source\.poll_interval_s: 1000000000000.0 is impossible; expected seconds in \[0, 86400\]",
        ),
        (
            lambda d: d["volatile_db"].update(retry_interval_s=float("inf")),
            r"volatile_db\.retry_interval_s: inf",
        ),
        (
            lambda d: d["volatile_db"].update(socket_timeout_s=1e9),
            r"volatile_db\.socket_timeout_s: 1000000000.0",
        ),
        # without a persistent db, rows the volatile db does not load are held by no tier
        (
            lambda d: (
                d["persistent_db"].update(type="none"),
                d["volatile_db"].update(initial_cache_rate=0.5),
            ),
            r"volatile_db\.initial_cache_rate: 0\.5 is impossible; expected 1\.0 without a persistent_db",
        ),
    ],
)
def test_bad_config_names_the_field(mutate, match: str) -> None:
    d = _doc()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        parse_config(d)


def test_models_may_share_a_table_with_the_same_rows(tmp_path: Path) -> None:
    """The same sparse file and dim under one name (relative or absolute path): loaded once."""
    d = _doc()
    d["models"].append(
        {**d["models"][0], "model": "other", "sparse_files": [str(tmp_path / "s" / "t0"), "s/t1"]}
    )
    cfg = parse_config(d, tmp_path)
    assert [m.model for m in cfg.models] == ["dlrm", "other"]
    assert cfg.model("other").tables[0].sparse_file == cfg.model("dlrm").tables[0].sparse_file
    assert cfg.db_table("other", "t0") == cfg.db_table("dlrm", "t0") == "t0"  # one table


def test_redis_stream_sources_that_can_resume_are_accepted() -> None:
    d = _doc()
    d["update_source"] = {"type": "redis_stream", "address": "127.0.0.1:6379"}  # offset in rocks_db
    assert parse_config(d).update_source.address == "127.0.0.1:6379"
    d["persistent_db"] = {"type": "none"}
    d["update_source"]["state_path"] = "stream.offset"
    assert parse_config(d, "/srv").update_source.state_path == "/srv/stream.offset"


def test_json_syntax_error_gives_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "ps.json"
    p.write_text('{\n  "models": [\n    {"model": "m",}\n  ]\n}\n')
    with pytest.raises(ValueError, match=r"line 3 column 19"):
        load_config(p)


def test_the_artifact_version_is_read_and_another_is_refused(tmp_path: Path) -> None:
    """``tilerec_artifact_version`` (serving artifacts) must be this hps's; a ps.json without it
    (written by hand or for HugeCTR) is read as it is."""
    assert parse_config(_doc()).artifact_version is None
    cfg = parse_config({**_doc(), "tilerec_artifact_version": ARTIFACT_VERSION})
    assert cfg.artifact_version == ARTIFACT_VERSION
    assert cfg.to_dict()["tilerec_artifact_version"] == ARTIFACT_VERSION
    assert parse_config(cfg.to_dict()) == cfg
    p = tmp_path / "ps.json"
    for found in (ARTIFACT_VERSION + 1, "1", True, None):
        p.write_text(json.dumps({**_doc(), "tilerec_artifact_version": found}))
        with pytest.raises(FormatVersionError) as ei:
            load_config(p)
        msg = str(ei.value)
        has = "has no format version" if found is None else f"has format version {found!r}"
        assert str(p) in msg and has in msg
        assert f"reads format version {ARTIFACT_VERSION} only" in msg
        assert (ei.value.found, ei.value.expected) == (found, ARTIFACT_VERSION)


@pytest.mark.parametrize("bad", ["", "a/b", "../t", "/abs/t", "x.y", "-t", "t 0"])
def test_model_and_table_names_follow_the_name_rule(bad: str) -> None:
    """A model name is a URL path segment, a table name a folder and a database key."""
    with pytest.raises(ValueError, match=r"models\[0\]\.model: .* impossible; expected 1 to 128"):
        parse_config(_doc(model=bad))
    with pytest.raises(
        ValueError, match=r"models\[0\]\.embedding_table_names\[1\]: .* expected 1 to 128 ASCII"
    ):
        parse_config(_doc(embedding_table_names=["t0", bad]))
    assert parse_config(_doc(model="dlrm-v2", embedding_table_names=["t0", "3d_1"]))


@pytest.mark.parametrize(
    "section, key",
    [
        ("models", "sparse_files"),
        ("models", "network_file"),
        ("persistent_db", "path"),
        ("update_source", "path"),
    ],
)
def test_a_path_with_a_nul_names_its_field(section: str, key: str) -> None:
    d = _doc()
    d["update_source"] = {"type": "file_log", "path": "u.log"}
    if section == "models":
        d["models"][0][key] = ["s/t0", "s/\0"] if key == "sparse_files" else "a\0b"
        where = (
            r"models\[0\]\.sparse_files\[1\]" if key == "sparse_files" else rf"models\[0\]\.{key}"
        )
    else:
        d[section][key] = "a\0b"
        where = rf"{section}\.{key}"
    with pytest.raises(ValueError, match=rf"{where}: .* expected a path \(it holds a NUL\)"):
        parse_config(d)


@pytest.mark.parametrize(
    "data, match",
    [
        (b'\xff{"models": []}', r"not UTF-8 text \(byte 0xff at offset 0\)"),
        (b"[" * 100_000, "JSON nested too deeply"),
        (b'{"models": ' + b"7" * 5000 + b"}", "not a JSON document this parser reads: Exceeds"),
    ],
)
def test_a_file_json_cannot_read_is_a_value_error_naming_it(
    tmp_path: Path, data: bytes, match: str
) -> None:
    p = tmp_path / "ps.json"
    p.write_bytes(data)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/ps.json: {match}"):
        load_config(p)


def test_a_number_too_large_for_a_float_is_impossible() -> None:
    with pytest.raises(ValueError, match=r"models\[0\]\.gpucacheper: 1000000.* is impossible"):
        parse_config(_doc(gpucacheper=10**400))
    with pytest.raises(
        ValueError, match=r"default_value_for_each_table\[0\]: 1000.* expected a finite number"
    ):
        parse_config(_doc(default_value_for_each_table=[10**400, 0.0]))


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path) -> None:
    """``json.loads`` keeps the last of two equal keys silently: a ps.json that gives one twice
    (in a section, in a model, at the top) is refused naming the key and both lines."""
    model = (
        '{"model": "m", "sparse_files": ["t0"], "embedding_table_names": ["t0"],\n'
        ' "embedding_vecsize_per_table": [4], "maxnum_catfeature_query_per_table_per_sample": [1]'
    )
    p = tmp_path / "ps.json"
    p.write_text('{"models": [' + model + '}],\n "volatile_db": {"type": "hash_map"}}')
    load_config(p)  # valid as written
    cases = [
        ('{"models": [' + model + '}],\n "volatile_db": {"type": "hash_map",\n'
         ' "type": "redis_cluster"}}', "type", 4, 3),
        ('{"models": [' + model + ',\n "model": "n"}]}', "model", 3, 1),
        ('{"models": [],\n\n "models": [' + model + "}]}", "models", 3, 1),
    ]  # fmt: skip
    for text, key, line, first in cases:
        p.write_text(text)
        with pytest.raises(ValueError) as e:
            load_config(p)
        assert str(e.value) == (
            f"{p}: key {key!r} at line {line} is given twice in one object (first at line "
            f"{first}); JSON keeps only the last value, so each key must be unique"
        )


def test_ps_json_carries_the_lfu_sampling_and_its_default() -> None:
    assert parse_config(_doc(cache_policy="lfu")).models[0].cache_lfu_sampling == 1
    cfg = parse_config(_doc(cache_policy="lfu", cache_lfu_sampling=8))
    assert cfg.models[0].cache_lfu_sampling == 8
    assert cfg.to_dict()["models"][0]["cache_lfu_sampling"] == 8
    assert parse_config(cfg.to_dict()).models[0].cache_lfu_sampling == 8


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_ps_json_refuses_a_bad_lfu_sampling_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"models\[0\]\.cache_lfu_sampling"):
        parse_config(_doc(cache_policy="lfu", cache_lfu_sampling=bad))
