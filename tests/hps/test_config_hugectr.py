"""HugeCTR's ``ps.json`` read as HugeCTR reads it: the real configs of its repository
(``tests/hps/data/hugectr_configs``, sources in its README), its aliases, string numbers and
defaults, one warning naming its fields we do not use, and every error of a file at once.

HugeCTR's parser is ``parameter_server_config::init`` in ``HugeCTR/src/hps/inference_utils.cpp``
(NVIDIA-Merlin/HugeCTR at ``af9025667eb3f66b959fc861061cfa3ac721a887``).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hps.config import ConfigError, HugeCTRFieldWarning, load_config, parse_config
from hps.parameter_server import HierarchicalParameterServer
from hps.storage.sparse_files import write_table
from hps.types import OverflowPolicy, PersistentDBType, UpdateSourceType, VolatileDBType

DATA = Path(__file__).parent / "data" / "hugectr_configs"
CONFIGS = sorted(DATA.glob("*.ps.json"))

#: the fields tilerec uses, per section (written out here, apart from the parser's own sets)
OURS = {
    "ps.json": {"supportlonglong", "models", "volatile_db", "persistent_db", "update_source"},
    "model": {
        "model", "max_batch_size", "sparse_files", "embedding_table_names",
        "embedding_vecsize_per_table", "maxnum_catfeature_query_per_table_per_sample",
        "default_value_for_each_table", "gpucache", "gpucacheper", "hit_rate_threshold",
        "cache_refresh_percentage_per_iteration", "num_of_worker_buffer_in_pool",
        "deployed_device_list", "network_file",
    },
    "volatile_db": {
        "type", "address", "num_partitions", "overflow_margin", "overflow_policy",
        "overflow_resolution_target", "initial_cache_rate", "cache_missed_embeddings",
        "max_batch_size",
    },
    "persistent_db": {"type", "path", "read_only", "max_batch_size"},
    "update_source": set(),  # HugeCTR's update source is Kafka, which tilerec does not consume
}  # fmt: skip


def _load(path: Path) -> tuple[Any, list[str]]:
    """``load_config(path)`` and the messages of the HugeCTRFieldWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path)
    return cfg, [str(w.message) for w in caught if w.category is HugeCTRFieldWarning]


def _unused_in(doc: dict[str, Any]) -> set[str]:
    """The fields of ``doc`` tilerec does not use, as the warning names them."""
    out = {f"ps.json.{k}" for k in set(doc) - OURS["ps.json"]}
    for i, m in enumerate(doc["models"]):
        out |= {f"models[{i}].{k}" for k in set(m) - OURS["model"]}
    for section in ("volatile_db", "persistent_db", "update_source"):
        out |= {f"{section}.{k}" for k in set(doc.get(section, {})) - OURS[section] - {"type"}}
    if doc.get("update_source", {}).get("type", "").startswith("kafka"):
        out.add("update_source.type")  # no Kafka consumer
    if doc.get("volatile_db", {}).get("type", "").startswith("multi_process"):
        out.add("volatile_db.type")  # not shared between processes
    return out


def test_at_least_fifteen_real_configs_are_kept() -> None:
    assert len(CONFIGS) >= 15
    readme = (DATA / "README.md").read_text()
    assert all(f"`{p.name}`" in readme for p in CONFIGS), "each file's source is in the README"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_real_hugectr_config_loads_and_names_its_unused_fields(path: Path) -> None:
    doc = json.loads(path.read_text())
    cfg, messages = _load(path)
    assert [m.model for m in cfg.models] == [m["model"] for m in doc["models"]]
    for m, raw in zip(cfg.models, doc["models"], strict=True):
        n = len(raw["sparse_files"])
        assert [t.dim for t in m.tables] == [int(x) for x in raw["embedding_vecsize_per_table"]]
        assert [t.name for t in m.tables] == raw.get(
            "embedding_table_names", [f"sparse_embedding{i}" for i in range(n)]
        )
        assert m.max_batch_size == int(raw.get("max_batch_size", 64))
    unused = _unused_in(doc)
    if not unused:
        assert messages == []
        return
    assert len(messages) == 1, "one warning per file"
    named = messages[0].split("does not use: ", 1)[1]
    assert {n.split(" (")[0] for n in named.split(", ")} == unused


@pytest.mark.parametrize(
    "name",
    ["hps_trt_integration_test_for_pytorch.ps.json", "hierarchical_parameter_server_demo.ps.json"],
)
def test_a_real_hugectr_config_serves_its_sparse_files(tmp_path: Path, name: str) -> None:
    """HugeCTR's ``ps.json`` (``supportlonglong: false`` in the first) beside sparse files in
    HugeCTR's layout: rows come back exactly, a key no file holds gets the table's default."""
    (tmp_path / "ps.json").write_text((DATA / name).read_text())
    raw = json.loads((DATA / name).read_text())["models"][0]
    dim = raw["embedding_vecsize_per_table"][0]
    keys = np.arange(0, 40, 4, dtype=np.int64)  # 0, 4, ..., 36
    rows = (keys[:, None] * 1000 + np.arange(dim)).astype(np.float32)  # integer-valued: exact
    write_table(tmp_path / raw["sparse_files"][0], keys, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HugeCTRFieldWarning)
        ps = HierarchicalParameterServer.from_config(tmp_path / "ps.json")
    try:
        table = raw.get("embedding_table_names", ["sparse_embedding0"])[0]
        got = ps.session(raw["model"]).lookup(table, torch.tensor([[8, 3], [36, 0]]))
    finally:
        ps.close()
    default = torch.full((dim,), float(raw["default_value_for_each_table"][0]))
    want = torch.stack(
        [torch.from_numpy(rows[2]), default, torch.from_numpy(rows[9]), torch.from_numpy(rows[0])]
    )
    assert torch.equal(got.reshape(4, dim), want)


def test_strings_for_numbers_and_booleans_mean_the_numbers() -> None:
    """HugeCTR's CI template wrote numbers, booleans and device ids as JSON strings."""
    cfg, _ = _load(DATA / "ci_ps_template_strings.ps.json")
    m = cfg.models[0]
    assert (m.max_batch_size, m.num_of_worker_buffer_in_pool) == (1, 6)
    assert (m.gpucache, m.gpucacheper, m.hit_rate_threshold) == (True, 0.5, 1.1)
    assert m.cache_refresh_percentage_per_iteration == 0.2
    assert m.deployed_device_list == (0,) and m.tables[0].default_value == 0.0
    assert cfg.persistent_db.type is PersistentDBType.NONE  # "disabled"
    v37, _ = _load(DATA / "ci_ps_template_v3_7.ps.json")
    assert v37.models[0].deployed_device_list == (0, 3)
    assert v37.volatile_db.overflow_policy is OverflowPolicy.EVICT_OLDEST


def test_the_documented_redis_and_rocksdb_config_means_what_hugectr_says() -> None:
    cfg, messages = _load(DATA / "hps_database_backend_doc.ps.json")
    v, p = cfg.volatile_db, cfg.persistent_db
    assert v.type is VolatileDBType.REDIS_CLUSTER and v.num_partitions == 8
    assert v.addresses() == [("127.0.0.1", 7003), ("127.0.0.1", 7004), ("127.0.0.1", 7005)]
    assert (v.overflow_margin, v.overflow_policy) == (10_000_000, OverflowPolicy.EVICT_RANDOM)
    assert (p.type, p.path, p.max_batch_size) == (PersistentDBType.ROCKS_DB, "/tmp/rocksdb", 65536)
    assert cfg.update_source.type is UpdateSourceType.NONE
    assert (
        "update_source.type ('kafka_message_queue': no Kafka consumer; updates are not applied)"
        in messages[0]
    )
    assert "volatile_db.password" in messages[0] and "volatile_db.enable_tls" in messages[0]


def _doc(model: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    m = {
        "model": "m",
        "sparse_files": ["a", "b"],
        "embedding_vecsize_per_table": [4, 8],
        "maxnum_catfeature_query_per_table_per_sample": [1, 2],
        "deployed_device_list": [0],
        "default_value_for_each_table": [0.5, 0.5],
        **(model or {}),
    }
    return {"supportlonglong": True, "models": [m], **top}


@pytest.mark.parametrize(
    "section, value, expected",
    [
        ("volatile_db", "disabled", VolatileDBType.NONE),
        ("volatile_db", "disable", VolatileDBType.NONE),
        ("volatile_db", "hashmap", VolatileDBType.HASH_MAP),
        ("volatile_db", "hash", VolatileDBType.HASH_MAP),
        ("volatile_db", "map", VolatileDBType.HASH_MAP),
        ("volatile_db", "parallel_hashmap", VolatileDBType.PARALLEL_HASH_MAP),
        ("volatile_db", "parallel_hash", VolatileDBType.PARALLEL_HASH_MAP),
        ("volatile_db", "parallel_map", VolatileDBType.PARALLEL_HASH_MAP),
        ("volatile_db", "multi_process_hash_map", VolatileDBType.PARALLEL_HASH_MAP),
        ("volatile_db", "multi_process_map", VolatileDBType.PARALLEL_HASH_MAP),
        ("volatile_db", "redis", VolatileDBType.REDIS_CLUSTER),
        ("persistent_db", "rocksdb", PersistentDBType.ROCKS_DB),
        ("persistent_db", "rocks", PersistentDBType.ROCKS_DB),
        ("persistent_db", "disabled", PersistentDBType.NONE),
    ],
)
def test_database_aliases_mean_hugectrs_types(section: str, value: str, expected: Any) -> None:
    other = "persistent_db" if section == "volatile_db" else "volatile_db"
    other_value = {"type": "rocks_db", "path": "p"} if other == "persistent_db" else {}
    doc = _doc(**{section: {"type": value}, other: other_value or {"type": "hash_map"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HugeCTRFieldWarning)
        cfg = parse_config(doc, "/srv")
    assert getattr(cfg, section).type is expected


@pytest.mark.parametrize(
    "value, expected",
    [
        ("oldest", OverflowPolicy.EVICT_OLDEST),
        ("random", OverflowPolicy.EVICT_RANDOM),
        ("least_used", OverflowPolicy.EVICT_LEAST_USED),
    ],
)
def test_overflow_policy_aliases(value: str, expected: OverflowPolicy) -> None:
    cfg = parse_config(_doc(volatile_db={"type": "hash_map", "overflow_policy": value}))
    assert cfg.volatile_db.overflow_policy is expected


def test_hugectr_defaults_are_taken() -> None:
    """``parameter_server_config::init``: ``max_batch_size`` 64, table names
    ``sparse_embedding<i>``, a short ``default_value_for_each_table`` padded with 0.0; a
    ``volatile_db`` without a type is disabled; a rocks_db without a path is
    ``<temp dir>/rocksdb``; a redis_cluster without an address is 127.0.0.1:7000."""
    cfg = parse_config(_doc({"default_value_for_each_table": [0.5]}), "/srv")
    m = cfg.models[0]
    assert m.max_batch_size == 64
    assert [t.name for t in m.tables] == ["sparse_embedding0", "sparse_embedding1"]
    assert [t.default_value for t in m.tables] == [0.5, 0.0]
    cfg = parse_config(_doc(volatile_db={}, persistent_db={"type": "rocks_db"}))
    assert cfg.volatile_db.type is VolatileDBType.NONE
    assert cfg.persistent_db.path == str(Path(tempfile.gettempdir()) / "rocksdb")
    with pytest.raises(ValueError, match=r"without a type is disabled, as in HugeCTR"):
        parse_config(_doc(volatile_db={"num_partitions": 4}))
    cfg = parse_config(_doc({"cache_exact": True}, volatile_db={"type": "redis"}))
    assert cfg.volatile_db.addresses() == [("127.0.0.1", 7000)]
    cfg = parse_config(_doc({"cache_exact": True}, volatile_db={"type": "redis", "address": "h"}))
    assert cfg.volatile_db.addresses() == [("h", 6379)]  # Redis's port, as HugeCTR's client


def test_supportlonglong_false_loads_and_round_trips() -> None:
    cfg = parse_config(_doc(supportlonglong=False, volatile_db={"type": "hash_map"}))
    assert cfg.supportlonglong is False
    assert parse_config(cfg.to_dict()) == cfg


def test_extra_default_values_are_cut_with_a_warning() -> None:
    doc = _doc({"default_value_for_each_table": [0.5, 0.25, 9.0]})
    with pytest.warns(HugeCTRFieldWarning, match=r"default_value_for_each_table\[2:\] \(1 value"):
        cfg = parse_config(doc)
    assert [t.default_value for t in cfg.models[0].tables] == [0.5, 0.25]


def test_unused_fields_warn_once_naming_each(tmp_path: Path) -> None:
    doc = _doc(
        {"refresh_delay": 0, "use_context_stream": False, "embedding_cache_type": "dynamic"},
        fuse_embedding_table=False,
        volatile_db={"type": "redis_cluster", "address": "r:7000", "num_node_connections": 5},
        persistent_db={"type": "rocks_db", "path": "p", "num_threads": 16},
    )
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    _, messages = _load(tmp_path / "ps.json")
    assert messages == [
        f"{tmp_path / 'ps.json'}: HugeCTR field(s) tilerec accepts and does not use: "
        "ps.json.fuse_embedding_table, models[0].embedding_cache_type, models[0].refresh_delay, "
        "models[0].use_context_stream, volatile_db.num_node_connections, persistent_db.num_threads"
    ]


def test_a_file_with_three_mistakes_reports_three_errors(tmp_path: Path) -> None:
    doc = _doc(
        {"gpucacheper": "lots", "embedding_vecsize_per_table": [4, 0]},
        volatile_db={"type": "redis_clustr"},
    )
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "ps.json")
    assert e.value.errors == (
        "models[0].embedding_vecsize_per_table[1]: 0 is impossible; expected > 0",
        "models[0].gpucacheper: expected a number, got 'lots' (str)",
        "volatile_db.type: 'redis_clustr' is not one of ['none', 'hash_map', 'parallel_hash_map', "
        "'redis_cluster', 'disabled', 'disable', 'hashmap', 'hash', 'map', 'parallel_hashmap', "
        "'parallel_hash', 'parallel_map', 'redis', 'multi_process_hash_map', "
        "'multi_process_hashmap', 'multi_process_hash', 'multi_process_map']",
    )
    assert str(e.value).startswith(f"{tmp_path / 'ps.json'}: 3 errors:\n  models[0].embedding")


def test_a_semicolon_in_a_redis_address_is_refused() -> None:
    """HugeCTR splits ``address`` on ``,``: ``a:7000;b:7000`` would be one host."""
    doc = _doc({"cache_exact": True}, volatile_db={"type": "redis", "address": "a:7000;b:7000"})
    with pytest.raises(ValueError, match=r"volatile_db\.address: 'a:7000;b:7000' is impossible.*"
                       r"separated by ',' \(as HugeCTR splits them\), not ';'"):  # fmt: skip
        parse_config(doc)


def test_an_empty_device_list_is_refused() -> None:
    """HugeCTR takes the list's last entry, which an empty list does not have."""
    with pytest.raises(ValueError, match=r"models\[0\]\.deployed_device_list: \[\] is impossible"):
        parse_config(_doc({"deployed_device_list": []}))


def test_the_warning_points_at_the_caller(tmp_path: Path) -> None:
    (tmp_path / "ps.json").write_text(json.dumps(_doc({"refresh_delay": 0})))
    with pytest.warns(HugeCTRFieldWarning) as record:
        load_config(tmp_path / "ps.json")
    assert record[0].filename == __file__


def test_tls_is_refused_not_ignored() -> None:
    doc = _doc({"cache_exact": True}, volatile_db={"type": "redis", "enable_tls": True})
    with pytest.raises(ValueError, match=r"volatile_db\.enable_tls: True is impossible"):
        parse_config(doc)
