"""``ps.json``: the parameter-server configuration, with HugeCTR's field names where they overlap.

Example (every field shown; the ones marked *ours* are not in HugeCTR)::

    {
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
                        "address": "", "state_path": ""},
      "models": [{
        "model": "dlrm", "max_batch_size": 1024,
        "sparse_files": ["sparse/t0", "sparse/t1"],
        "embedding_table_names": ["t0", "t1"],
        "embedding_vecsize_per_table": [128, 128],
        "maxnum_catfeature_query_per_table_per_sample": [1, 3],
        "default_value_for_each_table": [0.0, 0.0],
        "gpucache": true, "gpucacheper": 0.2, "hit_rate_threshold": 0.9,
        "cache_policy": "lru", "cache_exact": false,                          (ours)
        "cache_lfu_decay_keys_per_slot": 20.0,                                (ours)
        "cache_refresh_percentage_per_iteration": 0.0, "num_of_worker_buffer_in_pool": 4,
        "deployed_device_list": [0], "device": "auto"                         (device: ours)
      }]
    }

``cache_lfu_decay_keys_per_slot`` (LFU only; ignored by LRU): every cache counter is halved
after each ``value × cache slots`` looked-up keys (key occurrences in requests, hits and
misses), and so are the session's key statistics; 0 never ages. Default 20
(:data:`hps.types.DEFAULT_LFU_DECAY_KEYS_PER_SLOT`): a key must keep being looked up to stay
cached, so a drift in popularity is followed within a few periods, at ~0.01 of hit rate in a
workload that never drifts (README, HPS: the drift benchmark).

Relative paths are resolved against the folder holding ``ps.json``. Unknown fields, missing
required fields, wrong types and impossible values raise ``ValueError`` naming the field
(``models[0].gpucacheper``); JSON syntax errors name the line and column.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hps.types import (
    DEFAULT_LFU_DECAY_KEYS_PER_SLOT,
    CachePolicy,
    OverflowPolicy,
    PersistentDBType,
    UpdateSourceType,
    VolatileDBType,
)

_MISSING = object()
#: HugeCTR's default for ``overflow_margin`` is "unbounded"; ours is a large finite row count.
DEFAULT_OVERFLOW_MARGIN = 2**40  # rows


@dataclass(frozen=True)
class TableSpec:
    """One embedding table of a model: name, sparse-file folder, row width, default value."""

    name: str
    sparse_file: str
    dim: int
    max_query_per_sample: int
    default_value: float = 0.0


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
    cache_refresh_percentage_per_iteration: float = 0.0
    num_of_worker_buffer_in_pool: int = 4
    deployed_device_list: tuple[int, ...] = (0,)
    device: str = "auto"
    dense_file: str = ""
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


def parse_addresses(address: str) -> list[tuple[str, int]]:
    """``"host:port[,host:port...]"`` → ``[(host, port), ...]`` (``ValueError`` for a port
    that is not an integer)."""
    out = []
    for part in filter(None, (p.strip() for p in address.split(","))):
        host, _, port = part.rpartition(":")
        out.append((host, int(port)))
    return out


def _check_address(address: str, where: str, what: str) -> None:
    """``address`` must be ``host:port[,host:port...]`` with ports in 1..65535."""
    try:
        addrs = parse_addresses(address)
    except ValueError:
        addrs = []
    _check(
        bool(addrs) and all(h and 0 < p < 65536 for h, p in addrs),
        where,
        "address",
        address,
        f"'host:port[,host:port...]' with ports in 1..65535 for {what}",
    )


@dataclass(frozen=True)
class PersistentDBConfig:
    type: PersistentDBType = PersistentDBType.NONE
    path: str = ""
    read_only: bool = False
    max_batch_size: int = 65536


@dataclass(frozen=True)
class UpdateSourceConfig:
    type: UpdateSourceType = UpdateSourceType.NONE
    path: str = ""
    address: str = ""
    stream: str = "hps_updates"
    poll_interval_s: float = 0.5
    state_path: str = ""


@dataclass(frozen=True)
class PSConfig:
    """A parsed, validated ``ps.json``."""

    models: tuple[ModelConfig, ...]
    volatile_db: VolatileDBConfig = field(default_factory=VolatileDBConfig)
    persistent_db: PersistentDBConfig = field(default_factory=PersistentDBConfig)
    update_source: UpdateSourceConfig = field(default_factory=UpdateSourceConfig)
    supportlonglong: bool = True

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.model == name:
                return m
        raise ValueError(f"ps.json has no model {name!r}; models: {[m.model for m in self.models]}")

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
            models.append(d)

        def enums(d: dict[str, Any]) -> dict[str, Any]:
            return {k: (v.value if hasattr(v, "value") else v) for k, v in d.items()}

        return {
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


# --------------------------------------------------------------------------------- parsing


def _type_name(t: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
    }[t]


def _get(d: dict[str, Any], key: str, where: str, typ: type, default: Any = _MISSING) -> Any:
    if key not in d:
        if default is _MISSING:
            raise ValueError(f"{where}.{key}: required field is missing")
        return default
    v = d[key]
    ok = isinstance(v, typ) and not (typ in (int, float) and isinstance(v, bool))
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        raise ValueError(
            f"{where}.{key}: expected {_type_name(typ)}, got {v!r} ({type(v).__name__})"
        )
    if typ is float and not math.isfinite(v):  # json.loads takes NaN and Infinity
        raise ValueError(f"{where}.{key}: {v!r} is impossible; expected a finite number")
    return v


def _check(ok: bool, where: str, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{where}.{key}: {value!r} is impossible; expected {expected}")


def _enum(d: dict[str, Any], key: str, where: str, enum: type, default: Any) -> Any:
    v = _get(d, key, where, str, default.value)
    try:
        return enum(v)
    except ValueError:
        raise ValueError(f"{where}.{key}: {v!r} is not one of {[e.value for e in enum]}") from None


def _no_unknown(d: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _obj(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ValueError(f"{where}.{key}: expected an object, got {type(v).__name__}")
    return v


def _list(
    d: dict[str, Any],
    key: str,
    where: str,
    item: type,
    n: int | None,
    default: Any = _MISSING,
    check: Callable[[Any], bool] | None = None,
    expected: str = "",
) -> list[Any]:
    v = _get(d, key, where, list, default)
    if n is not None and len(v) != n:
        raise ValueError(f"{where}.{key}: expected {n} entries (one per table), got {len(v)}")
    out = []
    for i, x in enumerate(v):
        ok = (
            isinstance(x, item) and not isinstance(x, bool)
            if item is not bool
            else isinstance(x, bool)
        )
        if item is float and isinstance(x, int) and not isinstance(x, bool):
            ok, x = True, float(x)
        if not ok:
            raise ValueError(f"{where}.{key}[{i}]: expected {_type_name(item)}, got {x!r}")
        if item is float and not math.isfinite(x):
            raise ValueError(f"{where}.{key}[{i}]: {x!r} is impossible; expected a finite number")
        if check is not None and not check(x):
            raise ValueError(f"{where}.{key}[{i}]: {x!r} is impossible; expected {expected}")
        out.append(x)
    return out


def _resolve(p: str, base: Path | None) -> str:
    if not p or base is None or Path(p).is_absolute():
        return p
    return str(base / p)


_MAX_WAIT_S = 86400.0  # a day: the longest poll / retry interval or timeout ps.json may ask for


_MODEL_FIELDS = {
    "model",
    "sparse_files",
    "embedding_table_names",
    "embedding_vecsize_per_table",
    "maxnum_catfeature_query_per_table_per_sample",
    "default_value_for_each_table",
    "max_batch_size",
    "gpucache",
    "gpucacheper",
    "hit_rate_threshold",
    "cache_policy",
    "cache_exact",
    "cache_lfu_decay_keys_per_slot",
    "cache_refresh_percentage_per_iteration",
    "num_of_worker_buffer_in_pool",
    "deployed_device_list",
    "device",
    "dense_file",
    "network_file",
    "maxnum_des_feature_per_sample",
}


def _parse_model(d: Any, where: str, base: Path | None) -> ModelConfig:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object, got {type(d).__name__}")
    _no_unknown(d, _MODEL_FIELDS, where)
    name = _get(d, "model", where, str)
    _check(bool(name), where, "model", name, "a non-empty model name")
    names = _list(
        d, "embedding_table_names", where, str, None, check=bool, expected="a non-empty name"
    )
    if not names:
        raise ValueError(f"{where}.embedding_table_names: a model needs at least one table")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}.embedding_table_names: duplicate table names {dup}")
    n = len(names)
    files = _list(d, "sparse_files", where, str, n)
    dims = _list(
        d, "embedding_vecsize_per_table", where, int, n, check=lambda x: x > 0, expected="> 0"
    )
    hot = _list(
        d,
        "maxnum_catfeature_query_per_table_per_sample",
        where,
        int,
        n,
        check=lambda x: x > 0,
        expected="> 0",
    )
    defaults = _list(d, "default_value_for_each_table", where, float, n, default=[0.0] * n)
    mbs = _get(d, "max_batch_size", where, int)
    _check(mbs > 0, where, "max_batch_size", mbs, "> 0")
    per = _get(d, "gpucacheper", where, float, 0.2)
    _check(0.0 < per <= 1.0, where, "gpucacheper", per, "a fraction in (0, 1]")
    thr = _get(d, "hit_rate_threshold", where, float, 0.9)
    _check(0.0 <= thr <= 1.0, where, "hit_rate_threshold", thr, "a fraction in [0, 1]")
    decay = _get(d, "cache_lfu_decay_keys_per_slot", where, float, DEFAULT_LFU_DECAY_KEYS_PER_SLOT)
    _check(
        math.isfinite(decay) and decay >= 0,
        where,
        "cache_lfu_decay_keys_per_slot",
        decay,
        "looked-up keys per cache slot between LFU halvings, a finite number >= 0 (0: never)",
    )
    refresh = _get(d, "cache_refresh_percentage_per_iteration", where, float, 0.0)
    _check(
        0.0 <= refresh <= 1.0, where, "cache_refresh_percentage_per_iteration", refresh, "in [0, 1]"
    )
    workers = _get(d, "num_of_worker_buffer_in_pool", where, int, 4)
    _check(workers > 0, where, "num_of_worker_buffer_in_pool", workers, "> 0")
    device = _get(d, "device", where, str, "auto")
    _check(
        device in ("auto", "cpu") or device.startswith("cuda"),
        where,
        "device",
        device,
        "'auto', 'cpu' or 'cuda[:i]'",
    )
    devs = _list(
        d,
        "deployed_device_list",
        where,
        int,
        None,
        default=[0],
        check=lambda x: x >= 0,
        expected=">= 0",
    )
    if "maxnum_des_feature_per_sample" in d:
        _get(d, "maxnum_des_feature_per_sample", where, int)
    tables = tuple(
        TableSpec(names[i], _resolve(files[i], base), dims[i], hot[i], defaults[i])
        for i in range(n)
    )
    return ModelConfig(
        model=name,
        tables=tables,
        max_batch_size=mbs,
        gpucache=_get(d, "gpucache", where, bool, True),
        gpucacheper=per,
        hit_rate_threshold=thr,
        cache_policy=_enum(d, "cache_policy", where, CachePolicy, CachePolicy.LRU),
        cache_exact=_get(d, "cache_exact", where, bool, False),
        cache_lfu_decay_keys_per_slot=decay,
        cache_refresh_percentage_per_iteration=refresh,
        num_of_worker_buffer_in_pool=workers,
        deployed_device_list=tuple(devs),
        device=device,
        dense_file=_resolve(_get(d, "dense_file", where, str, ""), base),
        network_file=_resolve(_get(d, "network_file", where, str, ""), base),
    )


def _parse_vdb(d: dict[str, Any]) -> VolatileDBConfig:
    w = "volatile_db"
    _no_unknown(d, set(VolatileDBConfig.__dataclass_fields__), w)
    dflt = VolatileDBConfig()
    typ = _enum(d, "type", w, VolatileDBType, dflt.type)
    cfg = VolatileDBConfig(
        type=typ,
        address=_get(d, "address", w, str, ""),
        num_partitions=_get(d, "num_partitions", w, int, dflt.num_partitions),
        overflow_margin=_get(d, "overflow_margin", w, int, dflt.overflow_margin),
        overflow_policy=_enum(d, "overflow_policy", w, OverflowPolicy, dflt.overflow_policy),
        overflow_resolution_target=_get(d, "overflow_resolution_target", w, float, 0.8),
        initial_cache_rate=_get(d, "initial_cache_rate", w, float, 1.0),
        cache_missed_embeddings=_get(d, "cache_missed_embeddings", w, bool, False),
        max_batch_size=_get(d, "max_batch_size", w, int, dflt.max_batch_size),
        retry_interval_s=_get(d, "retry_interval_s", w, float, dflt.retry_interval_s),
        socket_timeout_s=_get(d, "socket_timeout_s", w, float, dflt.socket_timeout_s),
    )
    _check(cfg.num_partitions > 0, w, "num_partitions", cfg.num_partitions, "> 0")
    _check(
        cfg.overflow_margin > 0, w, "overflow_margin", cfg.overflow_margin, "> 0 rows per partition"
    )
    _check(
        0.0 < cfg.overflow_resolution_target <= 1.0,
        w,
        "overflow_resolution_target",
        cfg.overflow_resolution_target,
        "a fraction in (0, 1]",
    )
    _check(
        0.0 <= cfg.initial_cache_rate <= 1.0,
        w,
        "initial_cache_rate",
        cfg.initial_cache_rate,
        "a fraction in [0, 1]",
    )
    _check(cfg.max_batch_size > 0, w, "max_batch_size", cfg.max_batch_size, "> 0")
    _check(
        0 <= cfg.retry_interval_s <= _MAX_WAIT_S,
        w,
        "retry_interval_s",
        cfg.retry_interval_s,
        f"seconds in [0, {_MAX_WAIT_S:.0f}]",
    )
    _check(
        0 < cfg.socket_timeout_s <= _MAX_WAIT_S,
        w,
        "socket_timeout_s",
        cfg.socket_timeout_s,
        f"seconds in (0, {_MAX_WAIT_S:.0f}]",
    )
    if typ is VolatileDBType.REDIS_CLUSTER:
        _check_address(cfg.address, w, "a redis_cluster")
    return cfg


def _parse_pdb(d: dict[str, Any], base: Path | None) -> PersistentDBConfig:
    w = "persistent_db"
    _no_unknown(d, set(PersistentDBConfig.__dataclass_fields__), w)
    typ = _enum(d, "type", w, PersistentDBType, PersistentDBType.NONE)
    cfg = PersistentDBConfig(
        type=typ,
        path=_resolve(_get(d, "path", w, str, ""), base),
        read_only=_get(d, "read_only", w, bool, False),
        max_batch_size=_get(d, "max_batch_size", w, int, 65536),
    )
    _check(cfg.max_batch_size > 0, w, "max_batch_size", cfg.max_batch_size, "> 0")
    if typ is PersistentDBType.ROCKS_DB:
        _check(bool(cfg.path), w, "path", cfg.path, "a folder for the rocks_db")
    return cfg


def _parse_updates(
    d: dict[str, Any], base: Path | None, vdb: VolatileDBConfig, pdb: PersistentDBConfig
) -> UpdateSourceConfig:
    w = "update_source"
    _no_unknown(d, set(UpdateSourceConfig.__dataclass_fields__), w)
    typ = _enum(d, "type", w, UpdateSourceType, UpdateSourceType.NONE)
    cfg = UpdateSourceConfig(
        type=typ,
        path=_resolve(_get(d, "path", w, str, ""), base),
        address=_get(d, "address", w, str, ""),
        stream=_get(d, "stream", w, str, "hps_updates"),
        poll_interval_s=_get(d, "poll_interval_s", w, float, 0.5),
        state_path=_resolve(_get(d, "state_path", w, str, ""), base),
    )
    _check(
        0 <= cfg.poll_interval_s <= _MAX_WAIT_S,
        w,
        "poll_interval_s",
        cfg.poll_interval_s,
        f"seconds in [0, {_MAX_WAIT_S:.0f}]",
    )
    if typ is UpdateSourceType.FILE_LOG:
        _check(bool(cfg.path), w, "path", cfg.path, "the update log file for a file_log source")
    if typ is UpdateSourceType.REDIS_STREAM:
        if cfg.address:
            _check_address(cfg.address, w, "a redis_stream source")
        elif vdb.address:  # the volatile db's redis is the stream's
            _check_address(
                vdb.address,
                "volatile_db",
                "the redis_stream source (update_source.address is empty)",
            )
        else:
            _check(
                False,
                w,
                "address",
                cfg.address,
                "a redis address (or a redis_cluster volatile_db.address)",
            )
        _check(bool(cfg.stream), w, "stream", cfg.stream, "a non-empty stream name")
        writable_pdb = pdb.type is PersistentDBType.ROCKS_DB and not pdb.read_only
        _check(
            bool(cfg.state_path) or writable_pdb,
            w,
            "state_path",
            cfg.state_path,
            "a file for the last applied stream entry id: a redis_stream source needs one "
            "unless persistent_db is a writable rocks_db (which then stores it)",
        )
    if typ is not UpdateSourceType.NONE and vdb.type is VolatileDBType.NONE:
        writable_pdb = pdb.type is PersistentDBType.ROCKS_DB and not pdb.read_only
        _check(
            writable_pdb,
            w,
            "type",
            typ.value,
            "a source whose updates some tier keeps: with volatile_db 'none' the persistent_db "
            "must be a rocks_db that is not read_only (else updates reach only cached copies "
            "and are lost on eviction and restart)",
        )
    return cfg


def _check_shared_tables(models: tuple[ModelConfig, ...]) -> None:
    """Tables are keyed by name in the databases: models may share a table only when they
    name the same rows (same sparse file and dim)."""
    seen: dict[str, tuple[str, TableSpec]] = {}
    for m in models:
        for t in m.tables:
            if t.name not in seen:
                seen[t.name] = (m.model, t)
                continue
            other, u = seen[t.name]
            if (Path(u.sparse_file).resolve() if u.sparse_file else "") != (
                Path(t.sparse_file).resolve() if t.sparse_file else ""
            ) or u.dim != t.dim:
                raise ValueError(
                    f"ps.json.models: table {t.name!r} of model {m.model!r} (sparse file "
                    f"{t.sparse_file!r}, dim {t.dim}) and of model {other!r} (sparse file "
                    f"{u.sparse_file!r}, dim {u.dim}) differ; the databases key tables by name, so "
                    "models may share a table only with the same sparse file and dim: rename one"
                )


def parse_config(doc: Any, base_dir: str | Path | None = None) -> PSConfig:
    """Validate a decoded ``ps.json`` document.

    Raises:
        ValueError: naming the field (``models[1].embedding_vecsize_per_table[0]``).
    """
    base = Path(base_dir) if base_dir is not None else None
    if not isinstance(doc, dict):
        raise ValueError(
            f"ps.json: expected a JSON object at the top level, got {type(doc).__name__}"
        )
    _no_unknown(
        doc,
        {"supportlonglong", "models", "volatile_db", "persistent_db", "update_source"},
        "ps.json",
    )
    longlong = _get(doc, "supportlonglong", "ps.json", bool, True)
    _check(longlong, "ps.json", "supportlonglong", longlong, "true (keys are int64)")
    models_raw = _get(doc, "models", "ps.json", list)
    if not models_raw:
        raise ValueError("ps.json.models: at least one model is required")
    models = tuple(_parse_model(m, f"models[{i}]", base) for i, m in enumerate(models_raw))
    names = [m.model for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"ps.json.models: duplicate model names {names}")
    vdb = _parse_vdb(_obj(doc, "volatile_db", "ps.json"))
    pdb = _parse_pdb(_obj(doc, "persistent_db", "ps.json"), base)
    upd = _parse_updates(_obj(doc, "update_source", "ps.json"), base, vdb, pdb)
    if vdb.type is VolatileDBType.NONE and pdb.type is PersistentDBType.NONE:
        raise ValueError(
            "ps.json: volatile_db.type and persistent_db.type are both 'none'; at least one "
            "database tier must hold the tables"
        )
    if pdb.type is PersistentDBType.NONE:
        _check(
            vdb.initial_cache_rate == 1.0,
            "volatile_db",
            "initial_cache_rate",
            vdb.initial_cache_rate,
            "1.0 without a persistent_db (the rows not loaded would be served as default "
            "vectors: no tier would hold them)",
        )
    _check_shared_tables(models)
    return PSConfig(
        models=models,
        volatile_db=vdb,
        persistent_db=pdb,
        update_source=upd,
        supportlonglong=longlong,
    )


def load_config(path: str | Path) -> PSConfig:
    """Read and validate ``ps.json`` at ``path`` (relative paths resolve against its folder).

    Raises:
        ValueError: for a JSON syntax error (with line and column) or an invalid field.
    """
    path = Path(path)
    text = path.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: JSON syntax error at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    return parse_config(doc, base_dir=path.parent)
