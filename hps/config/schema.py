"""``ps.json``: the parameter-server configuration, with HugeCTR's field names where they overlap;
its dataclasses here, reading and checking it in :mod:`hps.config.parse` (``hps.load_config``).

Example (every field shown; the ones marked *ours* are not in HugeCTR)::

    {
      "tilerec_artifact_version": 1,                                          (ours)
      "supportlonglong": true,
      "volatile_db": {"type": "parallel_hash_map", "num_partitions": 8,
                      "overflow_margin": 10000000, "overflow_policy": "evict_oldest",
                      "overflow_resolution_target": 0.8, "initial_cache_rate": 1.0,
                      "cache_missed_embeddings": false, "max_batch_size": 65536,
                      "address": "127.0.0.1:7000,127.0.0.1:7001"},
      "persistent_db": {"type": "rocks_db", "path": "pdb", "read_only": false,
                        "max_batch_size": 65536},
      "update_source": {"type": "file_log", "path": "updates.log",            (ours)
                        "stream": "hps_updates", "poll_interval_s": 0.5,
                        "address": "", "state_path": "",
                        "max_retry_interval_s": 60, "unready_after_failures": 5,
                        "unready_after_s": 60},
      "models": [{
        "model": "dlrm", "max_batch_size": 1024,
        "sparse_files": ["sparse/t0", "sparse/t1"],
        "embedding_table_names": ["t0", "t1"],
        "embedding_vecsize_per_table": [128, 128],
        "maxnum_catfeature_query_per_table_per_sample": [1, 3],
        "default_value_for_each_table": [0.0, 0.0],
        "gpucache": true, "gpucacheper": 0.2, "hit_rate_threshold": 0.9,
        "cache_policy": "lru", "cache_exact": false,                          (ours)
        "cache_lfu_decay_keys_per_slot": 20.0, "cache_lfu_sampling": 1,       (ours)
        "cache_refresh_percentage_per_iteration": 0.0, "num_of_worker_buffer_in_pool": 4,
        "deployed_device_list": [0], "device": "auto"                         (device: ours)
      }]
    }

``cache_lfu_decay_keys_per_slot`` (LFU only; ignored by LRU): every cache counter is halved
after each ``value × cache slots`` looked-up keys (key occurrences in requests, hits and
misses), and so are the session's key statistics; 0 never ages. Default 20
(:data:`hps.types.DEFAULT_LFU_DECAY_KEYS_PER_SLOT`): a key must keep being looked up to stay
cached, so a drift in popularity is followed within a few periods, at ~0.01 of hit rate in a
workload that never drifts (``docs/hps.md``, LFU aging).

``cache_lfu_sampling`` (LFU only; ignored by LRU): a set-associative cache counts the uses of
one lookup in this many, each hit of that lookup as that many uses (the same expected count;
the other lookups read and write no counter); 1 (the default) counts every lookup. 8 made 26
pooled tables' lookups 7–15 % faster and cost 0.012 of unique-key hit rate on a stationary Zipf
stream (``docs/hps/caches.md``, LFU use sampling).

``tilerec_artifact_version`` is the version of the serving-artifact format that
``export.write_serving_artifacts`` writes (this ``ps.json``, the sparse files and the dense
graph with its ``tilerec.serving`` metadata): present, it must be :data:`hps.artifact_format.ARTIFACT_VERSION`, else
:class:`~hps.types.FormatVersionError` names the file, the version found and the one read.
It is absent from a ``ps.json`` written by hand or for HugeCTR, which describes no artifacts
of ours. It sits at the top level because HugeCTR's own parser
(``parameter_server_config`` in ``HugeCTR/src/hps/inference_utils.cpp``) looks every field up
by name and never walks an object's keys, so a key it does not know is ignored and our
``ps.json`` stays one that HugeCTR reads.

A ``ps.json`` written for HugeCTR is read as HugeCTR's parser reads it (aliases, numbers as
strings, its defaults, ``supportlonglong: false``; :mod:`hps.config.parse`,
:mod:`hps.config.hugectr`), and its fields tilerec does not use load with one warning naming
them. Relative paths are resolved against the folder holding ``ps.json``. Unknown fields,
missing required fields, wrong types and impossible values are errors naming the field
(``models[0].gpucacheper``), all of a file's errors raised at once as one
:class:`~hps.config.fields.ConfigError` (a ``ValueError``); JSON syntax errors name the line
and column. Among the impossible
values: ``volatile_db.num_partitions`` above :data:`MAX_PARTITIONS`; any ``max_batch_size``
(a model's samples per request, a database's keys per command) above :data:`MAX_BATCH_SIZE`;
a ``device`` other than ``auto``, ``cpu`` or ``cuda[:i]``, or a ``cuda`` device this machine
does not have; a ``persistent_db.path`` that is a file or lies under one. Model and table names
follow the name rule of :mod:`hps.names` (``models[0].model``: 1 to 128 ASCII letters, digits,
``_`` or ``-``, not starting with ``-``).

A key that may exist but cannot be read (its tier failed) is never answered with the table's
default vector: the lookup falls through to a persistent DB holding every row, or is refused
(:class:`~hps.types.TierUnavailableError`; the server answers 503). A configuration that
cannot keep to this is refused: with ``volatile_db.type: redis_cluster`` (a tier that fails:
nodes go down, restart empty) and no ``persistent_db``, every model with ``gpucache`` must
have ``cache_exact: true`` or ``hit_rate_threshold: 1.0``. Otherwise a lookup whose cache
hit rate reaches the threshold answers its misses with the default vector *without reading
any tier* (HugeCTR's asynchronous insertion), and while a node is down the background fill
fails every time, so its keys would get the default vector for the whole outage.

**Tables are scoped by model.** Two models may name a table alike: with the same rows (the same
sparse folder and ``dim``) they share it (loaded once, one copy in each database, an online
update reaches both); with other rows each model has its own. A table's *database name*
(:meth:`PSConfig.db_table`), under which every tier keys it and an update record names it, is::

    its name                 t0          no two models name a table t0 with other rows
    <model>.<table>          foo.t0      models name a table t0 with other rows (every one of them)

``.`` never occurs in a name (:mod:`hps.names`), so a scoped name never equals a plain one.
HugeCTR keys every table by model and name (``hps_et.<model>.<table>``); a single-model
deployment keeps the plain names here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hps.artifact_format import ARTIFACT_VERSION_FIELD
from hps.rowformat import RowDtype
from hps.types import (
    DEFAULT_LFU_DECAY_KEYS_PER_SLOT,
    CachePolicy,
    OverflowPolicy,
    PersistentDBType,
    UpdateSourceType,
    VolatileDBType,
)

#: A model's per-table row formats (ours; HugeCTR's parser ignores fields it does not know):
#: ``"tilerec_row_format_per_table": ["int8", "fp32"]`` (:class:`hps.rowformat.RowDtype`
#: values), with ``"tilerec_row_format_version": 1``, the layout version: version 1 is
#: :mod:`hps.rowformat`'s (FBGEMM's: float16 scale and bias first, then the packed values).
ROW_FORMAT_FIELD = "tilerec_row_format_per_table"
ROW_FORMAT_VERSION_FIELD = "tilerec_row_format_version"
ROW_FORMAT_VERSION = 1

#: HugeCTR's default for ``overflow_margin`` is "unbounded"; ours is a large finite row count.
DEFAULT_OVERFLOW_MARGIN = 2**40  # rows

#: Most ``volatile_db.num_partitions``: partitions only spread locks and Redis hash slots,
#: which a few dozen already do (HugeCTR's default is 16).
MAX_PARTITIONS = 1024

#: Most ``max_batch_size`` of a model (samples per request) and of a database (keys per Redis
#: command or RocksDB multi-get): 2**24 keys are 128 MiB of int64 per lookup, and a Redis
#: command of 2**24 fields (~22 bytes each with its framing) is 0.37 GiB, within Redis's 1 GiB
#: ``client-query-buffer-limit``. More is a typo, not a workload.
MAX_BATCH_SIZE = 2**24


@dataclass(frozen=True)
class TableSpec:
    """One embedding table of a model: name, sparse-file folder, row width, default value."""

    name: str
    sparse_file: str
    dim: int
    max_query_per_sample: int
    default_value: float = 0.0
    #: how every tier stores the rows (``tilerec_row_format_per_table``; the sparse files
    #: hold them as ``emb_rows`` in this format, or float32 ``emb_vector`` quantized on load)
    row_format: RowDtype = RowDtype.FP32


@dataclass(frozen=True)
class ModelConfig:
    """One ``models[]`` entry."""

    model: str
    tables: tuple[TableSpec, ...]
    max_batch_size: int
    gpucache: bool = True
    gpucacheper: float = 0.2
    hit_rate_threshold: float = 0.9
    cache_policy: CachePolicy = CachePolicy.LRU
    cache_exact: bool = False
    cache_lfu_decay_keys_per_slot: float = DEFAULT_LFU_DECAY_KEYS_PER_SLOT
    cache_lfu_sampling: int = 1
    cache_refresh_percentage_per_iteration: float = 0.0
    num_of_worker_buffer_in_pool: int = 4
    deployed_device_list: tuple[int, ...] = (0,)
    device: str = "auto"
    network_file: str = ""

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise ValueError(
            f"model {self.model!r} has no table {name!r}; tables: {[t.name for t in self.tables]}"
        )

    def max_keys_per_lookup(self, table: str) -> int:
        """Largest number of keys one lookup of ``table`` may carry."""
        return self.max_batch_size * self.table(table).max_query_per_sample


@dataclass(frozen=True)
class VolatileDBConfig:
    type: VolatileDBType = VolatileDBType.PARALLEL_HASH_MAP
    address: str = ""
    num_partitions: int = 8
    overflow_margin: int = DEFAULT_OVERFLOW_MARGIN
    overflow_policy: OverflowPolicy = OverflowPolicy.EVICT_RANDOM
    overflow_resolution_target: float = 0.8
    initial_cache_rate: float = 1.0
    cache_missed_embeddings: bool = False
    max_batch_size: int = 65536
    retry_interval_s: float = 1.0
    socket_timeout_s: float = 1.0

    def addresses(self) -> list[tuple[str, int]]:
        """``address`` ("h:p,h:p") parsed into ``[(host, port), ...]``."""
        return parse_addresses(self.address)


#: Redis's own port, taken for a host written without one (HugeCTR's Redis client does so)
REDIS_DEFAULT_PORT = 6379
#: ``volatile_db.address`` of a ``redis_cluster`` that names none (HugeCTR's default)
REDIS_DEFAULT_ADDRESS = "127.0.0.1:7000"


def parse_addresses(address: str) -> list[tuple[str, int]]:
    """``"host[:port][,host[:port]...]"`` → ``[(host, port), ...]``; a host without a port
    gets :data:`REDIS_DEFAULT_PORT` (``ValueError`` for a port that is not an integer)."""
    out = []
    for part in filter(None, (p.strip() for p in address.split(","))):
        host, colon, port = part.rpartition(":")
        out.append((host, int(port)) if colon else (part, REDIS_DEFAULT_PORT))
    return out


@dataclass(frozen=True)
class PersistentDBConfig:
    type: PersistentDBType = PersistentDBType.NONE
    path: str = ""
    read_only: bool = False
    max_batch_size: int = 65536


#: retries of a failing update source are at least this far apart (seconds), also with a poll
#: interval of 0: a stuck record must not spin a core
MIN_RETRY_INTERVAL_S = 0.05


@dataclass(frozen=True)
class UpdateSourceConfig:
    type: UpdateSourceType = UpdateSourceType.NONE
    path: str = ""
    address: str = ""
    stream: str = "hps_updates"
    poll_interval_s: float = 0.5
    state_path: str = ""
    #: retries of a failing update source back off up to this many seconds apart, and the
    #: server is not ready after ``unready_after_failures`` failures in a row or
    #: ``unready_after_s`` seconds of them (:mod:`hps.updates.health`)
    max_retry_interval_s: float = 60.0
    unready_after_failures: int = 5
    unready_after_s: float = 60.0


#: separates the model from the table in a scoped database name (``foo.t0``)
SCOPE_SEP = "."


def _same_rows(a: TableSpec, b: TableSpec) -> bool:
    """Whether two tables name the same rows: the same sparse folder and row width."""
    fa = Path(a.sparse_file).resolve() if a.sparse_file else ""
    fb = Path(b.sparse_file).resolve() if b.sparse_file else ""
    return fa == fb and a.dim == b.dim and a.row_format is b.row_format


def db_table_names(models: tuple[ModelConfig, ...]) -> dict[tuple[str, str], str]:
    """``(model, table) → database name`` of every table of ``models`` (see the module
    docstring): the table's name, or ``<model>.<table>`` where models name it with other rows."""
    first: dict[str, TableSpec] = {}
    scoped: set[str] = set()
    for m in models:
        for t in m.tables:
            u = first.setdefault(t.name, t)
            if not _same_rows(u, t):
                scoped.add(t.name)
    return {
        (m.model, t.name): f"{m.model}{SCOPE_SEP}{t.name}" if t.name in scoped else t.name
        for m in models
        for t in m.tables
    }


@dataclass(frozen=True)
class PSConfig:
    """A parsed, validated ``ps.json``."""

    models: tuple[ModelConfig, ...]
    volatile_db: VolatileDBConfig = dataclasses.field(default_factory=VolatileDBConfig)
    persistent_db: PersistentDBConfig = dataclasses.field(default_factory=PersistentDBConfig)
    update_source: UpdateSourceConfig = dataclasses.field(default_factory=UpdateSourceConfig)
    supportlonglong: bool = True
    #: ``tilerec_artifact_version``: set in the ``ps.json`` of serving artifacts, ``None`` in
    #: one written by hand or for HugeCTR
    artifact_version: int | None = None

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.model == name:
                return m
        raise ValueError(f"ps.json has no model {name!r}; models: {[m.model for m in self.models]}")

    def db_table(self, model: str, table: str) -> str:
        """The database name of ``model``'s table ``table``: ``table``, or ``<model>.<table>``
        where models name ``table`` with other rows (module docstring).

        Raises:
            ValueError: no such model, or the model has no such table (naming what it has).
        """
        self.model(model).table(table)
        return db_table_names(self.models)[(model, table)]

    def to_dict(self) -> dict[str, Any]:
        """The ``ps.json`` document (HugeCTR's per-table lists) for this config."""
        models = []
        for m in self.models:
            d = {k: v for k, v in asdict(m).items() if k != "tables"}
            d["cache_policy"] = m.cache_policy.value
            d["deployed_device_list"] = list(m.deployed_device_list)
            d["sparse_files"] = [t.sparse_file for t in m.tables]
            d["embedding_table_names"] = [t.name for t in m.tables]
            d["embedding_vecsize_per_table"] = [t.dim for t in m.tables]
            d["maxnum_catfeature_query_per_table_per_sample"] = [
                t.max_query_per_sample for t in m.tables
            ]
            d["default_value_for_each_table"] = [t.default_value for t in m.tables]
            if any(t.row_format is not RowDtype.FP32 for t in m.tables):
                d[ROW_FORMAT_VERSION_FIELD] = ROW_FORMAT_VERSION
                d[ROW_FORMAT_FIELD] = [t.row_format.value for t in m.tables]
            models.append(d)

        def enums(d: dict[str, Any]) -> dict[str, Any]:
            return {k: (v.value if hasattr(v, "value") else v) for k, v in d.items()}

        version = (
            {} if self.artifact_version is None else {ARTIFACT_VERSION_FIELD: self.artifact_version}
        )
        return {
            **version,
            "supportlonglong": self.supportlonglong,
            "volatile_db": enums(asdict(self.volatile_db)),
            "persistent_db": enums(asdict(self.persistent_db)),
            "update_source": enums(asdict(self.update_source)),
            "models": models,
        }

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path
