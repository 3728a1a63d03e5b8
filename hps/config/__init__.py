"""``ps.json``, the parameter-server configuration, in one room: its dataclasses
(:mod:`~hps.config.schema`, which documents every field), reading and checking it
(:mod:`~hps.config.parse`: :func:`load_config`, :func:`parse_config`, all errors at once in
one :class:`ConfigError`), the sections' parsers (:mod:`~hps.config.sections`), the field
helpers (:mod:`~hps.config.fields`) and HugeCTR's spellings and defaults
(:mod:`~hps.config.hugectr`)."""

from hps.config.fields import ConfigError
from hps.config.parse import (
    HUGECTR_DEFAULT_MAX_BATCH_SIZE,
    DuplicateKeyError,
    HugeCTRFieldWarning,
    load_config,
    loads_unique_keys,
    parse_config,
)
from hps.config.schema import (
    DEFAULT_OVERFLOW_MARGIN,
    MAX_BATCH_SIZE,
    MAX_PARTITIONS,
    MIN_RETRY_INTERVAL_S,
    REDIS_DEFAULT_ADDRESS,
    REDIS_DEFAULT_PORT,
    ROW_FORMAT_FIELD,
    ROW_FORMAT_VERSION,
    ROW_FORMAT_VERSION_FIELD,
    SCOPE_SEP,
    ModelConfig,
    PersistentDBConfig,
    PSConfig,
    TableSpec,
    UpdateSourceConfig,
    VolatileDBConfig,
    db_table_names,
    parse_addresses,
)

__all__ = [
    "DEFAULT_OVERFLOW_MARGIN",
    "HUGECTR_DEFAULT_MAX_BATCH_SIZE",
    "MAX_BATCH_SIZE",
    "MAX_PARTITIONS",
    "MIN_RETRY_INTERVAL_S",
    "REDIS_DEFAULT_ADDRESS",
    "REDIS_DEFAULT_PORT",
    "ROW_FORMAT_FIELD",
    "ROW_FORMAT_VERSION",
    "ROW_FORMAT_VERSION_FIELD",
    "SCOPE_SEP",
    "ConfigError",
    "DuplicateKeyError",
    "HugeCTRFieldWarning",
    "ModelConfig",
    "PSConfig",
    "PersistentDBConfig",
    "TableSpec",
    "UpdateSourceConfig",
    "VolatileDBConfig",
    "db_table_names",
    "load_config",
    "loads_unique_keys",
    "parse_addresses",
    "parse_config",
]
