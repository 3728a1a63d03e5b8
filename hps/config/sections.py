"""Reading the database and update-source sections of ``ps.json`` (``volatile_db``,
``persistent_db``, ``update_source``; :mod:`hps.config` describes them), HugeCTR's spellings
and defaults included (:mod:`hps.config.hugectr`). Every error goes to a
:class:`~hps.config.fields.Problems`, so a file reports all of its errors at once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hps.config.fields import Problems, enum_field, field, resolve_path
from hps.config.hugectr import (
    DATABASE_ALIASES,
    HUGECTR_ONLY,
    KAFKA_UPDATE_SOURCE,
    MULTI_PROCESS_HASH_MAP,
    OVERFLOW_ALIASES,
    UPDATE_SOURCE_ALIASES,
    VOLATILE_ALIASES,
)
from hps.config.schema import (
    MAX_BATCH_SIZE,
    MAX_PARTITIONS,
    MIN_RETRY_INTERVAL_S,
    REDIS_DEFAULT_ADDRESS,
    PersistentDBConfig,
    UpdateSourceConfig,
    VolatileDBConfig,
    parse_addresses,
)
from hps.types import OverflowPolicy, PersistentDBType, UpdateSourceType, VolatileDBType

__all__ = ["known_fields", "parse_pdb", "parse_updates", "parse_vdb"]

_MAX_WAIT_S = 86400.0  # a day: the longest poll / retry interval or timeout ps.json may ask for
BATCH_RANGE = f"an integer in [1, {MAX_BATCH_SIZE}] (hps.config.MAX_BATCH_SIZE)"


def known_fields(
    d: dict[str, Any], ours: set[str], section: str, where: str, p: Problems, unused: list[str]
) -> None:
    """Record an error for each field of ``d`` neither we nor HugeCTR know, and add the
    HugeCTR-only fields of ``d`` (:data:`hps.config.hugectr.HUGECTR_ONLY`) to ``unused``."""
    hugectr = HUGECTR_ONLY[section]
    unknown = sorted(set(d) - ours - hugectr)
    if unknown:
        p.add(f"{where}: unknown field(s) {unknown}; allowed: {sorted(ours | hugectr)}")
    unused.extend(f"{where}.{k}" for k in sorted(set(d) & hugectr - ours))


def check_address(address: str, where: str, what: str, p: Problems) -> None:
    """``address`` must be ``host[:port][,host[:port]...]`` with ports in 1..65535 (a host
    without a port is Redis's 6379, as in HugeCTR). A ``;`` is refused: HugeCTR splits the
    list on ``,`` only, so ``a:7000;b:7000`` would be one host name."""
    if ";" in address:
        p.check(
            False,
            where,
            "address",
            address,
            f"'host[:port][,host[:port]...]' for {what}: addresses are separated by ',' "
            "(as HugeCTR splits them), not ';'",
        )
        return
    try:
        addrs = parse_addresses(address)
    except ValueError:
        addrs = []
    p.check(
        bool(addrs) and all(h and 0 < port < 65536 for h, port in addrs),
        where,
        "address",
        address,
        f"'host:port[,host:port...]' with ports in 1..65535 for {what}",
    )


def _get(p: Problems, d: dict[str, Any], where: str, key: str, typ: type, default: Any) -> Any:
    """``d[key]`` of type ``typ`` (``default`` when absent or, recorded in ``p``, invalid)."""
    return p.read(field, d, key, where, typ, default, fallback=default)


def _path(p: Problems, d: dict[str, Any], where: str, key: str, base: Path | None) -> str:
    """``d[key]``, a path resolved against ``base`` (``""`` when absent or invalid)."""
    raw = _get(p, d, where, key, str, "")
    return p.read(resolve_path, raw, base, f"{where}.{key}", fallback="")


def _vdb_type(d: dict[str, Any], p: Problems, unused: list[str]) -> VolatileDBType:
    """``volatile_db.type``: a section without one is disabled, as in HugeCTR (its parser
    passes ``DatabaseType_t::Disabled`` as the default when the section is present)."""
    w = "volatile_db"
    raw = d.get("type")
    if isinstance(raw, str) and raw in MULTI_PROCESS_HASH_MAP:
        unused.append(f"volatile_db.type ({raw!r}: served as a process-local parallel_hash_map)")
        return VolatileDBType.PARALLEL_HASH_MAP
    return p.read(
        enum_field,
        d,
        "type",
        w,
        VolatileDBType,
        VolatileDBType.NONE,
        VOLATILE_ALIASES,
        fallback=VolatileDBType.NONE,
    )


def parse_vdb(d: dict[str, Any] | None, p: Problems, unused: list[str]) -> VolatileDBConfig:
    """The ``volatile_db`` section (``None``: absent, the default parallel hash map)."""
    if d is None:
        return VolatileDBConfig()
    w = "volatile_db"
    known_fields(d, set(VolatileDBConfig.__dataclass_fields__), w, w, p, unused)
    dflt = VolatileDBConfig()
    typ = _vdb_type(d, p, unused)

    redis = typ is VolatileDBType.REDIS_CLUSTER
    address = _get(p, d, w, "address", str, REDIS_DEFAULT_ADDRESS if redis else "")
    cfg = VolatileDBConfig(
        type=typ,
        address=address,
        num_partitions=_get(p, d, w, "num_partitions", int, dflt.num_partitions),
        overflow_margin=_get(p, d, w, "overflow_margin", int, dflt.overflow_margin),
        overflow_policy=p.read(
            enum_field,
            d,
            "overflow_policy",
            w,
            OverflowPolicy,
            dflt.overflow_policy,
            OVERFLOW_ALIASES,
            fallback=dflt.overflow_policy,
        ),
        overflow_resolution_target=_get(p, d, w, "overflow_resolution_target", float, 0.8),
        initial_cache_rate=_get(p, d, w, "initial_cache_rate", float, 1.0),
        cache_missed_embeddings=_get(p, d, w, "cache_missed_embeddings", bool, False),
        max_batch_size=_get(p, d, w, "max_batch_size", int, dflt.max_batch_size),
        retry_interval_s=_get(p, d, w, "retry_interval_s", float, dflt.retry_interval_s),
        socket_timeout_s=_get(p, d, w, "socket_timeout_s", float, dflt.socket_timeout_s),
    )
    _check_vdb(cfg, p)
    if _get(p, d, w, "enable_tls", bool, False):
        p.check(
            False,
            w,
            "enable_tls",
            True,
            "false: tilerec connects to Redis without TLS (terminate TLS in front of the "
            "cluster, or serve it on a private network)",
        )
    if typ is VolatileDBType.REDIS_CLUSTER:
        check_address(cfg.address, w, "a redis_cluster", p)
    return cfg


def _check_vdb(cfg: VolatileDBConfig, p: Problems) -> None:
    w = "volatile_db"
    p.check(
        0 < cfg.num_partitions <= MAX_PARTITIONS,
        w,
        "num_partitions",
        cfg.num_partitions,
        f"an integer in [1, {MAX_PARTITIONS}] (hps.config.MAX_PARTITIONS)",
    )
    p.check(
        cfg.overflow_margin > 0, w, "overflow_margin", cfg.overflow_margin, "> 0 rows per partition"
    )
    p.check(
        0.0 < cfg.overflow_resolution_target <= 1.0,
        w,
        "overflow_resolution_target",
        cfg.overflow_resolution_target,
        "a fraction in (0, 1]",
    )
    p.check(
        0.0 <= cfg.initial_cache_rate <= 1.0,
        w,
        "initial_cache_rate",
        cfg.initial_cache_rate,
        "a fraction in [0, 1]",
    )
    p.check(
        0 < cfg.max_batch_size <= MAX_BATCH_SIZE,
        w,
        "max_batch_size",
        cfg.max_batch_size,
        BATCH_RANGE,
    )
    p.check(
        0 <= cfg.retry_interval_s <= _MAX_WAIT_S,
        w,
        "retry_interval_s",
        cfg.retry_interval_s,
        f"seconds in [0, {_MAX_WAIT_S:.0f}]",
    )
    p.check(
        0 < cfg.socket_timeout_s <= _MAX_WAIT_S,
        w,
        "socket_timeout_s",
        cfg.socket_timeout_s,
        f"seconds in (0, {_MAX_WAIT_S:.0f}]",
    )


def parse_pdb(
    d: dict[str, Any] | None, base: Path | None, p: Problems, unused: list[str]
) -> PersistentDBConfig:
    """The ``persistent_db`` section (``None``: absent, no persistent database). A
    ``rocks_db`` without a ``path`` is ``<temp dir>/rocksdb``, as in HugeCTR."""
    if d is None:
        return PersistentDBConfig()
    w = "persistent_db"
    known_fields(d, set(PersistentDBConfig.__dataclass_fields__), w, w, p, unused)
    typ = p.read(
        enum_field,
        d,
        "type",
        w,
        PersistentDBType,
        PersistentDBType.NONE,
        DATABASE_ALIASES,
        fallback=PersistentDBType.NONE,
    )
    default_path = (
        str(Path(tempfile.gettempdir()) / "rocksdb") if typ is PersistentDBType.ROCKS_DB else ""
    )
    path = p.read(field, d, "path", w, str, default_path, fallback="")
    cfg = PersistentDBConfig(
        type=typ,
        path=p.read(resolve_path, path, base, f"{w}.path", fallback=""),
        read_only=p.read(field, d, "read_only", w, bool, False, fallback=False),
        max_batch_size=p.read(field, d, "max_batch_size", w, int, 65536, fallback=65536),
    )
    p.check(
        0 < cfg.max_batch_size <= MAX_BATCH_SIZE,
        w,
        "max_batch_size",
        cfg.max_batch_size,
        BATCH_RANGE,
    )
    if typ is PersistentDBType.ROCKS_DB and path:
        _check_folder_path(cfg.path, w, "path", "a folder for the rocks_db", p)
    elif typ is PersistentDBType.ROCKS_DB and isinstance(d.get("path"), str):  # "" written
        p.check(False, w, "path", cfg.path, "a folder for the rocks_db")
    return cfg


def _check_folder_path(path: str, where: str, key: str, expected: str, p: Problems) -> None:
    """``path`` must be a folder or not exist yet, and no existing part of it a file."""
    q0 = Path(path)
    for q in (q0, *q0.parents):
        if q.exists():
            what = "is a file" if q == q0 else f"lies under the file {str(q)!r}"
            p.check(q.is_dir(), where, key, path, f"{expected} (it {what})")
            return


def _update_type(d: dict[str, Any], p: Problems, unused: list[str]) -> UpdateSourceType:
    """``update_source.type``; HugeCTR's Kafka source is read as ``none`` and reported with
    the unused fields (tilerec consumes no Kafka topic)."""
    raw = d.get("type")
    if isinstance(raw, str) and raw in KAFKA_UPDATE_SOURCE:
        unused.append(f"update_source.type ({raw!r}: no Kafka consumer; updates are not applied)")
        return UpdateSourceType.NONE
    return p.read(
        enum_field,
        d,
        "type",
        "update_source",
        UpdateSourceType,
        UpdateSourceType.NONE,
        UPDATE_SOURCE_ALIASES,
        fallback=UpdateSourceType.NONE,
    )


def parse_updates(
    d: dict[str, Any] | None,
    base: Path | None,
    vdb: VolatileDBConfig,
    pdb: PersistentDBConfig,
    p: Problems,
    unused: list[str],
) -> UpdateSourceConfig:
    """The ``update_source`` section (``None``: absent, no online updates)."""
    if d is None:
        return UpdateSourceConfig()
    w = "update_source"
    known_fields(d, set(UpdateSourceConfig.__dataclass_fields__), w, w, p, unused)
    typ = _update_type(d, p, unused)

    cfg = UpdateSourceConfig(
        type=typ,
        path=_path(p, d, w, "path", base),
        address=p.read(field, d, "address", w, str, "", fallback=""),
        stream=p.read(field, d, "stream", w, str, "hps_updates", fallback="hps_updates"),
        poll_interval_s=p.read(field, d, "poll_interval_s", w, float, 0.5, fallback=0.5),
        state_path=_path(p, d, w, "state_path", base),
        max_retry_interval_s=p.read(
            field, d, "max_retry_interval_s", w, float, 60.0, fallback=60.0
        ),
        unready_after_failures=p.read(field, d, "unready_after_failures", w, int, 5, fallback=5),
        unready_after_s=p.read(field, d, "unready_after_s", w, float, 60.0, fallback=60.0),
    )
    p.check(
        0 <= cfg.poll_interval_s <= _MAX_WAIT_S,
        w,
        "poll_interval_s",
        cfg.poll_interval_s,
        f"seconds in [0, {_MAX_WAIT_S:.0f}]",
    )
    least = max(cfg.poll_interval_s, MIN_RETRY_INTERVAL_S)
    p.check(
        least <= cfg.max_retry_interval_s <= _MAX_WAIT_S,
        w,
        "max_retry_interval_s",
        cfg.max_retry_interval_s,
        f"seconds in [{least:g} (>= poll_interval_s and {MIN_RETRY_INTERVAL_S}), {_MAX_WAIT_S:.0f}]",
    )
    p.check(
        cfg.unready_after_failures >= 1,
        w,
        "unready_after_failures",
        cfg.unready_after_failures,
        "an integer >= 1",
    )
    p.check(
        0 < cfg.unready_after_s <= _MAX_WAIT_S,
        w,
        "unready_after_s",
        cfg.unready_after_s,
        f"seconds in (0, {_MAX_WAIT_S:.0f}]",
    )
    if typ is UpdateSourceType.FILE_LOG:
        p.check(bool(cfg.path), w, "path", cfg.path, "the update log file for a file_log source")
    if typ is UpdateSourceType.REDIS_STREAM:
        _check_stream(cfg, vdb, pdb, p)
    if typ is not UpdateSourceType.NONE and vdb.type is VolatileDBType.NONE:
        writable_pdb = pdb.type is PersistentDBType.ROCKS_DB and not pdb.read_only
        p.check(
            writable_pdb,
            w,
            "type",
            typ.value,
            "a source whose updates some tier keeps: with volatile_db 'none' the persistent_db "
            "must be a rocks_db that is not read_only (else updates reach only cached copies "
            "and are lost on eviction and restart)",
        )
    return cfg


def _check_stream(
    cfg: UpdateSourceConfig, vdb: VolatileDBConfig, pdb: PersistentDBConfig, p: Problems
) -> None:
    """A ``redis_stream`` source needs an address, a stream name and a place for its offset."""
    w = "update_source"
    if cfg.address:
        check_address(cfg.address, w, "a redis_stream source", p)
    elif vdb.address:  # the volatile db's redis is the stream's
        check_address(
            vdb.address,
            "volatile_db",
            "the redis_stream source (update_source.address is empty)",
            p,
        )
    else:
        p.check(
            False,
            w,
            "address",
            cfg.address,
            "a redis address (or a redis_cluster volatile_db.address)",
        )
    p.check(bool(cfg.stream), w, "stream", cfg.stream, "a non-empty stream name")
    writable_pdb = pdb.type is PersistentDBType.ROCKS_DB and not pdb.read_only
    p.check(
        bool(cfg.state_path) or writable_pdb,
        w,
        "state_path",
        cfg.state_path,
        "a file for the last applied stream entry id: a redis_stream source needs one "
        "unless persistent_db is a writable rocks_db (which then stores it)",
    )
