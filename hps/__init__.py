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

Rooms: this package (``config`` / ``config_parse`` read ``ps.json``, ``session`` serves
lookups (``session_stats`` its statistics, ``rwlock`` its update lock), ``parameter_server``
builds the tiers (``volatile_repair`` writes back Redis partitions that lost their rows),
``advisor`` sizes caches, ``artifact_format`` is the serving-artifact format, ``names`` the name
rule and the folder entries writers make of names, ``types`` the shared enums and errors);
:mod:`hps.storage`
the tiers and the sparse files; :mod:`hps.updates` online updates; :mod:`hps.serving` the
inference application (HPS lookups + onnxruntime behind the KServe v2 protocol,
``python -m hps.server``), which the library never imports.
"""

from hps.advisor import KeyStatistics, Recommendation, TableKeyStats, recommend
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
from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.types import (
    CachePolicy,
    CorruptRowError,
    FormatVersionError,
    OverflowPolicy,
    PersistentDBType,
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
    "KeyStatistics",
    "LookupSession",
    "ModelConfig",
    "OverflowPolicy",
    "PSConfig",
    "PersistentDBConfig",
    "PersistentDBType",
    "Recommendation",
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
    "db_table_names",
    "load_config",
    "parse_config",
    "recommend",
]
