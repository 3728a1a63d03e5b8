"""Reading ``ps.json`` (:mod:`hps.config` describes the format): every section checked,
relative paths resolved against the file's folder, errors naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hps.artifact_format import ARTIFACT_VERSION, ARTIFACT_VERSION_FIELD
from hps.config import (
    ModelConfig,
    PersistentDBConfig,
    PSConfig,
    TableSpec,
    UpdateSourceConfig,
    VolatileDBConfig,
    parse_addresses,
)
from hps.config_fields import (
    check,
    enum_field,
    field,
    list_field,
    no_unknown,
    object_field,
    resolve_path,
)
from hps.types import (
    DEFAULT_LFU_DECAY_KEYS_PER_SLOT,
    CachePolicy,
    FormatVersionError,
    OverflowPolicy,
    PersistentDBType,
    UpdateSourceType,
    VolatileDBType,
)

__all__ = ["load_config", "parse_config"]


_TOP_FIELDS = {
    ARTIFACT_VERSION_FIELD,
    "supportlonglong",
    "models",
    "volatile_db",
    "persistent_db",
    "update_source",
}


def _check_address(address: str, where: str, what: str) -> None:
    """``address`` must be ``host:port[,host:port...]`` with ports in 1..65535."""
    try:
        addrs = parse_addresses(address)
    except ValueError:
        addrs = []
    check(
        bool(addrs) and all(h and 0 < p < 65536 for h, p in addrs),
        where,
        "address",
        address,
        f"'host:port[,host:port...]' with ports in 1..65535 for {what}",
    )


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


def _parse_tables(d: dict[str, Any], where: str, base: Path | None) -> tuple[TableSpec, ...]:
    """A model's tables from HugeCTR's per-table lists (one entry per table in each)."""
    names = list_field(
        d, "embedding_table_names", where, str, None, ok=bool, expected="a non-empty name"
    )
    if not names:
        raise ValueError(f"{where}.embedding_table_names: a model needs at least one table")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}.embedding_table_names: duplicate table names {dup}")
    n = len(names)
    files = list_field(d, "sparse_files", where, str, n)
    dims = list_field(
        d, "embedding_vecsize_per_table", where, int, n, ok=lambda x: x > 0, expected="> 0"
    )
    hot = list_field(
        d,
        "maxnum_catfeature_query_per_table_per_sample",
        where,
        int,
        n,
        ok=lambda x: x > 0,
        expected="> 0",
    )
    defaults = list_field(d, "default_value_for_each_table", where, float, n, default=[0.0] * n)
    return tuple(
        TableSpec(names[i], resolve_path(files[i], base), dims[i], hot[i], defaults[i])
        for i in range(n)
    )


def _parse_model(d: Any, where: str, base: Path | None) -> ModelConfig:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object, got {type(d).__name__}")
    no_unknown(d, _MODEL_FIELDS, where)
    name = field(d, "model", where, str)
    check(bool(name), where, "model", name, "a non-empty model name")
    tables = _parse_tables(d, where, base)
    mbs = field(d, "max_batch_size", where, int)
    check(mbs > 0, where, "max_batch_size", mbs, "> 0")
    per = field(d, "gpucacheper", where, float, 0.2)
    check(0.0 < per <= 1.0, where, "gpucacheper", per, "a fraction in (0, 1]")
    thr = field(d, "hit_rate_threshold", where, float, 0.9)
    check(0.0 <= thr <= 1.0, where, "hit_rate_threshold", thr, "a fraction in [0, 1]")
    decay = field(d, "cache_lfu_decay_keys_per_slot", where, float, DEFAULT_LFU_DECAY_KEYS_PER_SLOT)
    check(
        math.isfinite(decay) and decay >= 0,
        where,
        "cache_lfu_decay_keys_per_slot",
        decay,
        "looked-up keys per cache slot between LFU halvings, a finite number >= 0 (0: never)",
    )
    refresh = field(d, "cache_refresh_percentage_per_iteration", where, float, 0.0)
    check(
        0.0 <= refresh <= 1.0, where, "cache_refresh_percentage_per_iteration", refresh, "in [0, 1]"
    )
    workers = field(d, "num_of_worker_buffer_in_pool", where, int, 4)
    check(workers > 0, where, "num_of_worker_buffer_in_pool", workers, "> 0")
    device = field(d, "device", where, str, "auto")
    check(
        device in ("auto", "cpu") or device.startswith("cuda"),
        where,
        "device",
        device,
        "'auto', 'cpu' or 'cuda[:i]'",
    )
    devs = list_field(
        d,
        "deployed_device_list",
        where,
        int,
        None,
        default=[0],
        ok=lambda x: x >= 0,
        expected=">= 0",
    )
    if "maxnum_des_feature_per_sample" in d:
        field(d, "maxnum_des_feature_per_sample", where, int)
    return ModelConfig(
        model=name,
        tables=tables,
        max_batch_size=mbs,
        gpucache=field(d, "gpucache", where, bool, True),
        gpucacheper=per,
        hit_rate_threshold=thr,
        cache_policy=enum_field(d, "cache_policy", where, CachePolicy, CachePolicy.LRU),
        cache_exact=field(d, "cache_exact", where, bool, False),
        cache_lfu_decay_keys_per_slot=decay,
        cache_refresh_percentage_per_iteration=refresh,
        num_of_worker_buffer_in_pool=workers,
        deployed_device_list=tuple(devs),
        device=device,
        dense_file=resolve_path(field(d, "dense_file", where, str, ""), base),
        network_file=resolve_path(field(d, "network_file", where, str, ""), base),
    )


def _parse_vdb(d: dict[str, Any]) -> VolatileDBConfig:
    w = "volatile_db"
    no_unknown(d, set(VolatileDBConfig.__dataclass_fields__), w)
    dflt = VolatileDBConfig()
    typ = enum_field(d, "type", w, VolatileDBType, dflt.type)
    cfg = VolatileDBConfig(
        type=typ,
        address=field(d, "address", w, str, ""),
        num_partitions=field(d, "num_partitions", w, int, dflt.num_partitions),
        overflow_margin=field(d, "overflow_margin", w, int, dflt.overflow_margin),
        overflow_policy=enum_field(d, "overflow_policy", w, OverflowPolicy, dflt.overflow_policy),
        overflow_resolution_target=field(d, "overflow_resolution_target", w, float, 0.8),
        initial_cache_rate=field(d, "initial_cache_rate", w, float, 1.0),
        cache_missed_embeddings=field(d, "cache_missed_embeddings", w, bool, False),
        max_batch_size=field(d, "max_batch_size", w, int, dflt.max_batch_size),
        retry_interval_s=field(d, "retry_interval_s", w, float, dflt.retry_interval_s),
        socket_timeout_s=field(d, "socket_timeout_s", w, float, dflt.socket_timeout_s),
    )
    check(cfg.num_partitions > 0, w, "num_partitions", cfg.num_partitions, "> 0")
    check(
        cfg.overflow_margin > 0, w, "overflow_margin", cfg.overflow_margin, "> 0 rows per partition"
    )
    check(
        0.0 < cfg.overflow_resolution_target <= 1.0,
        w,
        "overflow_resolution_target",
        cfg.overflow_resolution_target,
        "a fraction in (0, 1]",
    )
    check(
        0.0 <= cfg.initial_cache_rate <= 1.0,
        w,
        "initial_cache_rate",
        cfg.initial_cache_rate,
        "a fraction in [0, 1]",
    )
    check(cfg.max_batch_size > 0, w, "max_batch_size", cfg.max_batch_size, "> 0")
    check(
        0 <= cfg.retry_interval_s <= _MAX_WAIT_S,
        w,
        "retry_interval_s",
        cfg.retry_interval_s,
        f"seconds in [0, {_MAX_WAIT_S:.0f}]",
    )
    check(
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
    no_unknown(d, set(PersistentDBConfig.__dataclass_fields__), w)
    typ = enum_field(d, "type", w, PersistentDBType, PersistentDBType.NONE)
    cfg = PersistentDBConfig(
        type=typ,
        path=resolve_path(field(d, "path", w, str, ""), base),
        read_only=field(d, "read_only", w, bool, False),
        max_batch_size=field(d, "max_batch_size", w, int, 65536),
    )
    check(cfg.max_batch_size > 0, w, "max_batch_size", cfg.max_batch_size, "> 0")
    if typ is PersistentDBType.ROCKS_DB:
        check(bool(cfg.path), w, "path", cfg.path, "a folder for the rocks_db")
    return cfg


def _parse_updates(
    d: dict[str, Any], base: Path | None, vdb: VolatileDBConfig, pdb: PersistentDBConfig
) -> UpdateSourceConfig:
    w = "update_source"
    no_unknown(d, set(UpdateSourceConfig.__dataclass_fields__), w)
    typ = enum_field(d, "type", w, UpdateSourceType, UpdateSourceType.NONE)
    cfg = UpdateSourceConfig(
        type=typ,
        path=resolve_path(field(d, "path", w, str, ""), base),
        address=field(d, "address", w, str, ""),
        stream=field(d, "stream", w, str, "hps_updates"),
        poll_interval_s=field(d, "poll_interval_s", w, float, 0.5),
        state_path=resolve_path(field(d, "state_path", w, str, ""), base),
    )
    check(
        0 <= cfg.poll_interval_s <= _MAX_WAIT_S,
        w,
        "poll_interval_s",
        cfg.poll_interval_s,
        f"seconds in [0, {_MAX_WAIT_S:.0f}]",
    )
    if typ is UpdateSourceType.FILE_LOG:
        check(bool(cfg.path), w, "path", cfg.path, "the update log file for a file_log source")
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
            check(
                False,
                w,
                "address",
                cfg.address,
                "a redis address (or a redis_cluster volatile_db.address)",
            )
        check(bool(cfg.stream), w, "stream", cfg.stream, "a non-empty stream name")
        writable_pdb = pdb.type is PersistentDBType.ROCKS_DB and not pdb.read_only
        check(
            bool(cfg.state_path) or writable_pdb,
            w,
            "state_path",
            cfg.state_path,
            "a file for the last applied stream entry id: a redis_stream source needs one "
            "unless persistent_db is a writable rocks_db (which then stores it)",
        )
    if typ is not UpdateSourceType.NONE and vdb.type is VolatileDBType.NONE:
        writable_pdb = pdb.type is PersistentDBType.ROCKS_DB and not pdb.read_only
        check(
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


def _artifact_version(doc: dict[str, Any], name: str) -> int | None:
    """The ``tilerec_artifact_version`` of a ``ps.json`` (``None`` when absent: a ``ps.json``
    written by hand or for HugeCTR)."""
    if ARTIFACT_VERSION_FIELD not in doc:
        return None
    found = doc[ARTIFACT_VERSION_FIELD]
    if found != ARTIFACT_VERSION or isinstance(found, bool) or not isinstance(found, int):
        raise FormatVersionError(
            f"{name} ({ARTIFACT_VERSION_FIELD})",
            found,
            ARTIFACT_VERSION,
            "serving artifacts of another version: write them again with this version's "
            "export.write_serving_artifacts",
        )
    return ARTIFACT_VERSION


def parse_config(doc: Any, base_dir: str | Path | None = None, name: str = "ps.json") -> PSConfig:
    """Validate a decoded ``ps.json`` document.

    Args:
        doc: the decoded JSON.
        base_dir: the folder relative paths resolve against (``None``: kept as written).
        name: the document in a version error (its path).

    Raises:
        FormatVersionError: ``tilerec_artifact_version`` is present and not
            :data:`ARTIFACT_VERSION`.
        ValueError: naming the field (``models[1].embedding_vecsize_per_table[0]``).
    """
    base = Path(base_dir) if base_dir is not None else None
    if not isinstance(doc, dict):
        raise ValueError(
            f"ps.json: expected a JSON object at the top level, got {type(doc).__name__}"
        )
    no_unknown(doc, _TOP_FIELDS, "ps.json")
    version = _artifact_version(doc, name)
    longlong = field(doc, "supportlonglong", "ps.json", bool, True)
    check(longlong, "ps.json", "supportlonglong", longlong, "true (keys are int64)")
    models_raw = field(doc, "models", "ps.json", list)
    if not models_raw:
        raise ValueError("ps.json.models: at least one model is required")
    models = tuple(_parse_model(m, f"models[{i}]", base) for i, m in enumerate(models_raw))
    names = [m.model for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"ps.json.models: duplicate model names {names}")
    vdb = _parse_vdb(object_field(doc, "volatile_db", "ps.json"))
    pdb = _parse_pdb(object_field(doc, "persistent_db", "ps.json"), base)
    upd = _parse_updates(object_field(doc, "update_source", "ps.json"), base, vdb, pdb)
    if vdb.type is VolatileDBType.NONE and pdb.type is PersistentDBType.NONE:
        raise ValueError(
            "ps.json: volatile_db.type and persistent_db.type are both 'none'; at least one "
            "database tier must hold the tables"
        )
    if pdb.type is PersistentDBType.NONE:
        check(
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
        artifact_version=version,
    )


def load_config(path: str | Path) -> PSConfig:
    """Read and validate ``ps.json`` at ``path`` (relative paths resolve against its folder).

    Raises:
        FormatVersionError: serving artifacts of another version (see :func:`parse_config`).
        ValueError: for a file that is not UTF-8 JSON text (a syntax error with line and
            column, a number past Python's limits, nesting past the parser's depth) or an
            invalid field.
    """
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "ps.json is a JSON text file"
        ) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: JSON syntax error at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply for the parser") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise ValueError(f"{path}: not a JSON document this parser reads: {e}") from None
    return parse_config(doc, base_dir=path.parent, name=str(path))
