"""What HugeCTR's own ``ps.json`` parser accepts that is not spelled our way: the aliases of its
enum values, and the fields it reads (or its configs carry) that tilerec does not use.

Source: ``parameter_server_config::init`` and ``get_hps_database_type`` /
``get_hps_overflow_policy`` / ``get_hps_updatesource_type`` in
``HugeCTR/src/hps/inference_utils.cpp``, and the structs with their defaults in
``HugeCTR/include/hps/inference_utils.hpp`` (NVIDIA-Merlin/HugeCTR at
``af9025667eb3f66b959fc861061cfa3ac721a887``, the last commit before HugeCTR v25.03 removed the
HPS). Each enum value is matched exactly (lower case, no trimming), like HugeCTR's parser does.

Two deliberate differences: HugeCTR maps a value it does not know (``"redis_clustr"``) to the
field's default, silently; :func:`hps.load_config` refuses it, naming the value and the ones it
takes. And a field neither HugeCTR nor tilerec knows is refused as well (HugeCTR ignores it):
a misspelt field name would otherwise be a setting silently not applied.
"""

from __future__ import annotations

from types import MappingProxyType

from hps.types import OverflowPolicy, UpdateSourceType

__all__ = [
    "DATABASE_ALIASES",
    "HUGECTR_ONLY",
    "KAFKA_UPDATE_SOURCE",
    "MULTI_PROCESS_HASH_MAP",
    "OVERFLOW_ALIASES",
    "UPDATE_SOURCE_ALIASES",
    "VOLATILE_ALIASES",
]

#: ``volatile_db.type`` / ``persistent_db.type`` spellings (``get_hps_database_type``) and the
#: database type each means. ``disabled`` is HugeCTR's name of our ``none``.
DATABASE_ALIASES = MappingProxyType(
    {
        "disabled": "none",
        "disable": "none",
        "hashmap": "hash_map",
        "hash": "hash_map",
        "map": "hash_map",
        "parallel_hashmap": "parallel_hash_map",
        "parallel_hash": "parallel_hash_map",
        "parallel_map": "parallel_hash_map",
        "redis": "redis_cluster",
        "rocksdb": "rocks_db",
        "rocks": "rocks_db",
    }
)

#: HugeCTR's hash map in shared memory (``/dev/shm``), shared by the processes of one machine,
#: and its aliases. tilerec serves it as a process-local ``parallel_hash_map`` (each server
#: process loads its own copy), and says so in the unused-fields warning.
MULTI_PROCESS_HASH_MAP = (
    "multi_process_hash_map",
    "multi_process_hashmap",
    "multi_process_hash",
    "multi_process_map",
)

#: ``volatile_db.overflow_policy`` spellings (``get_hps_overflow_policy``).
OVERFLOW_ALIASES = MappingProxyType(
    {
        "random": OverflowPolicy.EVICT_RANDOM.value,
        "least_used": OverflowPolicy.EVICT_LEAST_USED.value,
        "oldest": OverflowPolicy.EVICT_OLDEST.value,
    }
)

#: ``update_source.type`` spellings (``get_hps_updatesource_type``): ``null`` is our ``none``.
UPDATE_SOURCE_ALIASES = MappingProxyType({"null": UpdateSourceType.NONE.value})

#: HugeCTR's Kafka update source and its aliases: tilerec consumes no Kafka topic (its update
#: sources are a file log and Redis Streams), so such a source is read as ``none`` with a warning.
KAFKA_UPDATE_SOURCE = frozenset({"kafka_message_queue", "kafka_mq", "kafka"})

#: Fields HugeCTR reads (or that its shipped configs carry) which tilerec accepts and does not
#: use, per section: a file holding them loads, with one warning naming every one found.
HUGECTR_ONLY = MappingProxyType(
    {
        "ps.json": frozenset({"fuse_embedding_table"}),
        "volatile_db": frozenset(
            {
                "user_name",
                "password",
                "algorithm",
                "allocation_rate",
                "shared_memory_size",
                "shared_memory_name",
                "shared_memory_auto_remove",
                "num_node_connections",
                "max_get_batch_size",
                "max_set_batch_size",
                "enable_tls",
                "tls_ca_certificate",
                "tls_client_certificate",
                "tls_client_key",
                "tls_server_name_identification",
                "refresh_time_after_fetch",
                "initialize_after_startup",
                "update_filters",
            }
        ),
        "persistent_db": frozenset(
            {
                "num_threads",
                "max_get_batch_size",
                "max_set_batch_size",
                "initialize_after_startup",
                "update_filters",
            }
        ),
        "update_source": frozenset(
            {
                "brokers",
                "metadata_refresh_interval_ms",
                "receive_buffer_size",
                "max_receive_buffer_size",
                "poll_timeout_ms",
                "max_batch_size",
                "failure_backoff_ms",
                "max_commit_interval",
            }
        ),
        "model": frozenset(
            {
                "dense_file",
                "num_of_refresher_buffer_in_pool",
                "maxnum_des_feature_per_sample",
                "refresh_delay",
                "refresh_interval",
                "fuse_embedding_table",
                "use_static_table",
                "embedding_cache_type",
                "use_context_stream",
                "use_hctr_cache_implementation",
                "thread_pool_size",
                "init_ec",
                "enable_pagelock",
                "fp8_quant",
                "mixed_precision",
                "label_dim",
                "slot_num",
                "non_trainable_params_file",
            }
        ),
    }
)

#: every ``volatile_db.type`` spelling: HugeCTR's database aliases and its multi-process map
VOLATILE_ALIASES = MappingProxyType(
    {**DATABASE_ALIASES, **dict.fromkeys(MULTI_PROCESS_HASH_MAP, "parallel_hash_map")}
)
