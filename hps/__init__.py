"""hps: a hierarchical parameter server for the embedding tables of a recommendation model,
after HugeCTR's HPS (whose own is deprecated), and the inference application around it.

A key is looked up through tiers, fastest first, and the row is returned from the first that
holds it: the embedding cache (set-associative, LRU or LFU, on the compute device) → the
volatile DB (an in-process hash map, or a Redis cluster) → the persistent DB (RocksDB, every
row) → the table's default vector for a key found nowhere. A key whose tier failed is never
given the default vector: it falls through, or the lookup raises ``TierUnavailableError``.
``ps.json`` (HugeCTR's format) says which tiers, tables and models; online updates from the
trainer reach every tier.

    >>> from hps import HierarchicalParameterServer
    >>> ps = HierarchicalParameterServer.from_config("out/ps.json")       # doctest: +SKIP
    >>> rows = ps.session("dlrm").lookup("t0", torch.tensor([[3, 9]]))   # doctest: +SKIP

Rooms: this package (the ``config`` package reads ``ps.json``, ``session`` serves
lookups (``session_stats`` its statistics, ``rwlock`` its update lock), ``parameter_server``
builds the tiers (``volatile_repair`` writes back Redis partitions that lost their rows),
``advisor`` sizes caches, ``artifact_format`` is the serving-artifact format, ``names`` the name
rule and the folder entries writers make of names, ``types`` the shared enums and errors,
``rowformat`` the byte layout of a table row in each dtype (fp32 … int2, FBGEMM's), a leaf
that ``embark`` and ``export`` import; names are imported on first use, so importing the leaf
imports nothing else of hps);
:mod:`hps.storage`
the tiers and the sparse files; :mod:`hps.updates` online updates; :mod:`hps.serving` the
inference application (HPS lookups + onnxruntime behind the KServe v2 protocol,
``python -m hps.server``), which the library never imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hps.advisor import (
        KeyStatistics,
        Recommendation,
        TableKeyStats,
        cache_slot_bytes,
        recommend,
    )
    from hps.artifact_format import ARTIFACT_VERSION, ServingMetadata
    from hps.config import (
        ConfigError,
        HugeCTRFieldWarning,
        ModelConfig,
        PersistentDBConfig,
        PSConfig,
        TableSpec,
        UpdateSourceConfig,
        VolatileDBConfig,
        db_table_names,
        load_config,
        parse_config,
    )
    from hps.key_counts import KeyCounts
    from hps.parameter_server import HierarchicalParameterServer
    from hps.rowformat import RowDtype, RowFormatError
    from hps.session import LookupSession, SessionTable
    from hps.types import (
        CachePolicy,
        CorruptRowError,
        FormatVersionError,
        OverflowPolicy,
        PersistentDBType,
        Pooling,
        StorageBackend,
        Tier,
        TierRead,
        TierUnavailableError,
        UpdateSourceType,
        VolatileDBType,
        VolatileUnavailableError,
    )
    from hps.updates.file_log import StaleOffsetError
    from hps.updates.record import CorruptRecordError, InvalidUpdateError

# Names are imported on first use, so that importing a leaf (hps.rowformat, which embark and
# export import) does not import the tiers, the sessions and the config parser.
_EXPORTS = {
    "KeyStatistics": "hps.advisor",
    "Recommendation": "hps.advisor",
    "TableKeyStats": "hps.advisor",
    "recommend": "hps.advisor",
    "cache_slot_bytes": "hps.advisor",
    "ARTIFACT_VERSION": "hps.artifact_format",
    "ServingMetadata": "hps.artifact_format",
    "ModelConfig": "hps.config",
    "PersistentDBConfig": "hps.config",
    "PSConfig": "hps.config",
    "TableSpec": "hps.config",
    "UpdateSourceConfig": "hps.config",
    "VolatileDBConfig": "hps.config",
    "db_table_names": "hps.config",
    "ConfigError": "hps.config",
    "HugeCTRFieldWarning": "hps.config",
    "load_config": "hps.config",
    "parse_config": "hps.config",
    "KeyCounts": "hps.key_counts",
    "HierarchicalParameterServer": "hps.parameter_server",
    "RowDtype": "hps.rowformat",
    "RowFormatError": "hps.rowformat",
    "LookupSession": "hps.session",
    "SessionTable": "hps.session",
    "CachePolicy": "hps.types",
    "CorruptRowError": "hps.types",
    "FormatVersionError": "hps.types",
    "OverflowPolicy": "hps.types",
    "PersistentDBType": "hps.types",
    "Pooling": "hps.types",
    "StorageBackend": "hps.types",
    "Tier": "hps.types",
    "TierRead": "hps.types",
    "TierUnavailableError": "hps.types",
    "UpdateSourceType": "hps.types",
    "VolatileDBType": "hps.types",
    "VolatileUnavailableError": "hps.types",
    "StaleOffsetError": "hps.updates.file_log",
    "CorruptRecordError": "hps.updates.record",
    "InvalidUpdateError": "hps.updates.record",
}

__all__ = [
    "ARTIFACT_VERSION",
    "CachePolicy",
    "ConfigError",
    "CorruptRecordError",
    "CorruptRowError",
    "FormatVersionError",
    "HierarchicalParameterServer",
    "HugeCTRFieldWarning",
    "InvalidUpdateError",
    "KeyCounts",
    "KeyStatistics",
    "LookupSession",
    "ModelConfig",
    "OverflowPolicy",
    "PSConfig",
    "PersistentDBConfig",
    "PersistentDBType",
    "Pooling",
    "Recommendation",
    "RowDtype",
    "RowFormatError",
    "ServingMetadata",
    "SessionTable",
    "StaleOffsetError",
    "StorageBackend",
    "TableKeyStats",
    "TableSpec",
    "Tier",
    "TierRead",
    "TierUnavailableError",
    "UpdateSourceConfig",
    "UpdateSourceType",
    "VolatileDBConfig",
    "VolatileDBType",
    "VolatileUnavailableError",
    "cache_slot_bytes",
    "db_table_names",
    "load_config",
    "parse_config",
    "recommend",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
