"""The exported ``ps.json`` is one HugeCTR's own parser reads: every field it requires is present,
and every field it reads has the JSON type it takes.

The fields, their types and which are required come from ``parameter_server_config::init`` in
``HugeCTR/src/hps/inference_utils.cpp`` of NVIDIA-Merlin/HugeCTR at
``af9025667eb3f66b959fc861061cfa3ac721a887`` (the last commit with the HPS):

- line 383 ``get_value_from_json<bool>(hps_config, "supportlonglong")``: required;
  line 507 ``get_json(hps_config, "models")``: required, non-empty (line 508);
- lines 392-407 ``update_source``, 415-431 ``persistent_db``, 441-499 ``volatile_db``: optional
  sections of optional, typed fields (``get_value_from_json_soft``); the ``type`` strings are
  matched against ``get_hps_database_type`` (lines 849-902), ``get_hps_overflow_policy``
  (962-993) and ``get_hps_updatesource_type`` (904-928), and a value it does not know
  silently becomes the default;
- per model, lines 513-674: ``get_json`` (required) for ``sparse_files`` (521),
  ``deployed_device_list`` (557; line 564 takes its ``.back()``, so it must not be empty),
  ``maxnum_catfeature_query_per_table_per_sample`` (567), ``embedding_vecsize_per_table`` (579)
  and ``default_value_for_each_table`` (590); the others are soft, typed as listed below.

``get<size_t>`` / ``get<int>`` / ``get<float>`` / ``get<bool>`` / ``get<std::string>`` are
nlohmann::json conversions: a JSON integer (non-negative for ``size_t``), a number, a boolean,
a string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from export.artifacts import write_serving_artifacts

REQUIRED = object()

TOP = {"supportlonglong": ("bool", REQUIRED), "models": ("models", REQUIRED)}
MODEL = {
    "model": ("string", None),  # 513
    "max_batch_size": ("size_t", None),  # 519
    "sparse_files": ("string[]", REQUIRED),  # 521
    "gpucache": ("bool", None),  # 529
    "hit_rate_threshold": ("float", None),  # 531
    "gpucacheper": ("float", None),  # 533
    "dense_file": ("string", None),  # 536
    "num_of_worker_buffer_in_pool": ("int", None),  # 546
    "num_of_refresher_buffer_in_pool": ("int", None),  # 550
    "cache_refresh_percentage_per_iteration": ("float", None),  # 554
    "deployed_device_list": ("int[]+", REQUIRED),  # 557, 564
    "maxnum_catfeature_query_per_table_per_sample": ("size_t[]", REQUIRED),  # 567
    "embedding_vecsize_per_table": ("size_t[]", REQUIRED),  # 579
    "default_value_for_each_table": ("float[]", REQUIRED),  # 590
    "maxnum_des_feature_per_sample": ("int", None),  # 609
    "refresh_delay": ("float", None),  # 612
    "refresh_interval": ("int", None),  # 615
    "embedding_table_names": ("string[]", None),  # 618
    "use_static_table": ("bool", None),  # 650
    "embedding_cache_type": ("string", None),  # 653
    "use_context_stream": ("bool", None),  # 661
    "use_hctr_cache_implementation": ("bool", None),  # 664
    "thread_pool_size": ("int", None),  # 668
    "init_ec": ("bool", None),  # 670
    "enable_pagelock": ("bool", None),  # 672
    "fp8_quant": ("bool", None),  # 674
}
VOLATILE = {
    "type": ("database", None),
    **{k: ("string", None) for k in ("address", "user_name", "password", "shared_memory_name")},
    **{
        k: ("size_t", None)
        for k in (
            "num_partitions", "allocation_rate", "shared_memory_size", "num_node_connections",
            "max_batch_size", "overflow_margin",
        )
    },
    **{k: ("bool", None) for k in ("shared_memory_auto_remove", "enable_tls", "cache_missed_embeddings")},
    **{
        k: ("string", None)
        for k in ("tls_ca_certificate", "tls_client_certificate", "tls_client_key", "tls_server_name_identification")
    },
    "overflow_policy": ("overflow", None),
    "overflow_resolution_target": ("float", None),
    "initial_cache_rate": ("float", None),
    "update_filters": ("string[]", None),
}  # fmt: skip
PERSISTENT = {
    "type": ("database", None),
    "path": ("string", None),
    "num_threads": ("size_t", None),
    "read_only": ("bool", None),
    "max_batch_size": ("size_t", None),
    "update_filters": ("string[]", None),
}
UPDATES = {
    "type": ("update_source", None),
    "brokers": ("string", None),
    **{
        k: ("size_t", None)
        for k in (
            "metadata_refresh_interval_ms", "receive_buffer_size", "poll_timeout_ms",
            "max_batch_size", "failure_backoff_ms", "max_commit_interval",
        )
    },
}  # fmt: skip

#: the enum spellings HugeCTR knows (inference_utils.cpp lines 849-993 and the names of
#: ``hctr_enum_to_c_str`` in HugeCTR/include/hps/inference_utils.hpp lines 71-129)
NAMES = {
    "database": {
        "disabled", "disable", "none", "hash_map", "hashmap", "hash", "map", "parallel_hash_map",
        "parallel_hashmap", "parallel_hash", "parallel_map", "multi_process_hash_map",
        "multi_process_hashmap", "multi_process_hash", "multi_process_map", "redis_cluster",
        "redis", "rocks_db", "rocksdb", "rocks",
    },
    "overflow": {"evict_random", "random", "evict_least_used", "least_used", "evict_oldest", "oldest"},
    "update_source": {"null", "none", "kafka_message_queue", "kafka_mq", "kafka"},
}  # fmt: skip


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind_ok(kind: str, v: Any) -> bool:
    """Whether ``v`` (decoded JSON) converts to what HugeCTR's ``get<...>`` of ``kind`` wants."""
    if kind.endswith("[]+"):
        return isinstance(v, list) and bool(v) and all(_kind_ok(kind[:-3], x) for x in v)
    if kind.endswith("[]"):
        return isinstance(v, list) and all(_kind_ok(kind[:-2], x) for x in v)
    if kind in NAMES:
        return isinstance(v, str) and v in NAMES[kind]
    return {
        "bool": isinstance(v, bool),
        "string": isinstance(v, str),
        "int": _is_int(v) and -(2**31) <= v < 2**31,
        "size_t": _is_int(v) and 0 <= v < 2**64,
        "float": (_is_int(v) or isinstance(v, float)) and not isinstance(v, bool),
    }[kind]


def _check_section(d: Any, spec: dict[str, tuple[str, Any]], where: str) -> list[str]:
    if not isinstance(d, dict):
        return [f"{where}: not an object"]
    out = [
        f"{where}.{k}: required by HugeCTR" for k, (_, req) in spec.items() if req and k not in d
    ]
    out += [
        f"{where}.{k}: {d[k]!r} is not HugeCTR's {kind}"
        for k, (kind, _) in spec.items()
        if k in d and kind != "models" and not _kind_ok(kind, d[k])
    ]
    return out


def hugectr_problems(doc: dict[str, Any]) -> list[str]:
    """What HugeCTR's parser would refuse or misread in ``doc`` (empty: it reads it)."""
    out = _check_section(doc, TOP, "ps.json")
    for key, spec in (
        ("volatile_db", VOLATILE),
        ("persistent_db", PERSISTENT),
        ("update_source", UPDATES),
    ):
        if key in doc:
            out += _check_section(doc[key], spec, key)
    models = doc.get("models")
    if not isinstance(models, list) or not models:
        return [*out, "ps.json.models: HugeCTR needs a non-empty list"]
    for i, m in enumerate(models):
        out += _check_section(m, MODEL, f"models[{i}]")
    return out  # fmt: skip


def test_the_checker_passes_hugectrs_own_config_and_catches_what_it_requires() -> None:
    path = Path(__file__).parents[1] / "hps" / "data" / "hugectr_configs"
    doc = json.loads((path / "hps_database_backend_doc.ps.json").read_text())
    assert hugectr_problems(doc) == []
    del doc["models"][0]["deployed_device_list"]
    doc["models"][0]["max_batch_size"] = "64"
    doc["volatile_db"]["type"] = "redis_clustr"
    assert hugectr_problems(doc) == [
        "volatile_db.type: 'redis_clustr' is not HugeCTR's database",
        "models[0].deployed_device_list: required by HugeCTR",
        "models[0].max_batch_size: '64' is not HugeCTR's size_t",
    ]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    out = tmp_path_factory.mktemp("art")
    cfg = write_serving_artifacts(build_model(get_workload("tiny"), seed=1).eval(), out)
    return json.loads((out / "ps.json").read_text()), cfg


def test_exported_psjson_is_one_hugectr_reads(exported: tuple[dict[str, Any], Any]) -> None:
    doc, cfg = exported
    assert hugectr_problems(doc) == []
    m = doc["models"][0]
    assert m["deployed_device_list"] == [0]
    tables = cfg.models[0].tables
    assert m["embedding_vecsize_per_table"] == [t.dim for t in tables]
    assert m["embedding_table_names"] == [t.name for t in tables]


def test_the_config_written_back_is_one_hugectr_reads(exported: tuple[dict[str, Any], Any]) -> None:
    """``PSConfig.to_dict`` (every field at its value) too."""
    _, cfg = exported
    assert hugectr_problems(json.loads(json.dumps(cfg.to_dict()))) == []
