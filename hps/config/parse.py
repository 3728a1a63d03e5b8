"""Reading ``ps.json`` (:mod:`hps.config` describes the format): every section checked,
relative paths resolved against the file's folder, every error of a file reported at once
(:class:`~hps.config.fields.ConfigError`, each error naming its field, the value and what was
expected).

HugeCTR's ``ps.json`` is read as HugeCTR's parser reads it (:mod:`hps.config.hugectr`): its
aliases (``disabled``, ``redis``, ``rocksdb``, ``oldest``, ...), numbers and booleans written as
strings, its defaults (``max_batch_size`` 64, ``embedding_table_names`` ``sparse_embedding<i>``,
a short ``default_value_for_each_table`` padded with 0.0), ``supportlonglong: false``. Its fields
tilerec does not use are accepted, and one :class:`HugeCTRFieldWarning` per read names them all.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

from hps.artifact_format import ARTIFACT_VERSION, ARTIFACT_VERSION_FIELD
from hps.config.fields import (
    ConfigError,
    Problems,
    enum_field,
    field,
    list_field,
    resolve_path,
)
from hps.config.schema import (
    MAX_BATCH_SIZE,
    ROW_FORMAT_FIELD,
    ROW_FORMAT_VERSION,
    ROW_FORMAT_VERSION_FIELD,
    ModelConfig,
    PersistentDBConfig,
    PSConfig,
    TableSpec,
    VolatileDBConfig,
)
from hps.config.sections import BATCH_RANGE, known_fields, parse_pdb, parse_updates, parse_vdb
from hps.names import NAME_RULE, is_name
from hps.rowformat import RowDtype
from hps.types import (
    DEFAULT_LFU_DECAY_KEYS_PER_SLOT,
    CachePolicy,
    FormatVersionError,
    PersistentDBType,
    VolatileDBType,
)

__all__ = ["ConfigError", "HugeCTRFieldWarning", "load_config", "parse_config"]


class HugeCTRFieldWarning(UserWarning):
    """A ``ps.json`` holds HugeCTR fields tilerec accepts and does not use (one warning per
    read, naming every such field)."""


_TOP_FIELDS = {
    ARTIFACT_VERSION_FIELD,
    "supportlonglong",
    "models",
    "volatile_db",
    "persistent_db",
    "update_source",
}

#: HugeCTR's ``max_batch_size`` of a model that names none (``parameter_server_config::init``)
HUGECTR_DEFAULT_MAX_BATCH_SIZE = 64


def _check_device(device: str, where: str, p: Problems) -> None:
    """``device`` must be ``auto``, ``cpu`` or ``cuda[:i]`` with ``i`` a CUDA device of this
    machine (a config naming a GPU the machine lacks fails here, not at the first lookup)."""
    m = re.fullmatch(r"auto|cpu|cuda(?::(\d+))?", device)
    if not p.check(m is not None, where, "device", device, "'auto', 'cpu' or 'cuda[:i]'"):
        return
    if not device.startswith("cuda"):
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(m.group(1)) if m is not None and m.group(1) else 0
    p.check(
        index < n,
        where,
        "device",
        device,
        f"a CUDA device of this machine ({n} visible), 'auto' or 'cpu'"
        if n
        else "'auto' or 'cpu': CUDA is not available on this machine "
        "(torch.cuda.is_available() is False)",
    )


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
    "cache_lfu_sampling",
    "cache_refresh_percentage_per_iteration",
    "num_of_worker_buffer_in_pool",
    "deployed_device_list",
    "device",
    "network_file",
    ROW_FORMAT_FIELD,
    ROW_FORMAT_VERSION_FIELD,
}


def _positive(x: int) -> bool:
    return x > 0


def _non_negative(x: int) -> bool:
    return x >= 0


def _table_names(d: dict[str, Any], where: str, n: int, p: Problems) -> list[str]:
    """``embedding_table_names``, or HugeCTR's ``sparse_embedding<i>`` for each sparse file."""
    default = [f"sparse_embedding{i}" for i in range(n)]
    names = p.read(
        list_field, d, "embedding_table_names", where, str, n, default, is_name, NAME_RULE,
        fallback=default,
    )  # fmt: skip
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        p.add(f"{where}.embedding_table_names: duplicate table names {dup}")
    return names


def _defaults(d: dict[str, Any], where: str, n: int, p: Problems, unused: list[str]) -> list[float]:
    """``default_value_for_each_table``: a short list is padded with 0.0 and a long one cut to
    the tables, as HugeCTR does (the values cut are reported with the unused fields)."""
    key = "default_value_for_each_table"
    values = p.read(list_field, d, key, where, float, None, [0.0] * n, fallback=[0.0] * n)
    if len(values) > n:
        unused.append(f"{where}.{key}[{n}:] ({len(values) - n} value(s) past the {n} tables)")
    return (values + [0.0] * n)[:n]


def _parse_tables(
    d: dict[str, Any], where: str, base: Path | None, p: Problems, unused: list[str]
) -> tuple[TableSpec, ...]:
    """A model's tables from HugeCTR's per-table lists, one table per ``sparse_files`` entry."""
    files: list[str] = p.read(list_field, d, "sparse_files", where, str, None, fallback=[])
    n = len(files)
    if "sparse_files" in d and not n and isinstance(d["sparse_files"], list):
        p.add(f"{where}.sparse_files: a model needs at least one table")
    names = _table_names(d, where, n, p)
    dims = p.read(
        list_field, d, "embedding_vecsize_per_table", where, int, n, ok=_positive, expected="> 0",
        fallback=[1] * n,
    )  # fmt: skip
    hot = p.read(
        list_field, d, "maxnum_catfeature_query_per_table_per_sample", where, int, n,
        ok=_positive, expected="> 0", fallback=[1] * n,
    )  # fmt: skip
    defaults = _defaults(d, where, n, p, unused)
    paths = [
        p.read(resolve_path, files[i], base, f"{where}.sparse_files[{i}]", fallback="")
        for i in range(n)
    ]
    formats = _row_formats(d, where, n, p)
    if not (len(names) == len(dims) == len(hot) == len(formats) == n):
        return ()
    return tuple(
        TableSpec(names[i], paths[i], dims[i], hot[i], defaults[i], formats[i]) for i in range(n)
    )


def _is_row_dtype(x: str) -> bool:
    return x in RowDtype._value2member_map_


def _row_formats(d: dict[str, Any], where: str, n: int, p: Problems) -> list[RowDtype]:
    """``tilerec_row_format_per_table`` (FP32 for every table when absent), which needs
    ``tilerec_row_format_version`` :data:`ROW_FORMAT_VERSION` (the layout it was written in)."""
    if ROW_FORMAT_FIELD not in d:
        return [RowDtype.FP32] * n
    names: list[str] = p.read(
        list_field, d, ROW_FORMAT_FIELD, where, str, n, ok=_is_row_dtype,
        expected=f"one of {[x.value for x in RowDtype]}", fallback=[],
    )  # fmt: skip
    version = p.read(field, d, ROW_FORMAT_VERSION_FIELD, where, int, None, fallback=None)
    if version != ROW_FORMAT_VERSION:
        has = "is missing" if version is None else f"is {version}"
        p.add(
            f"{where}.{ROW_FORMAT_VERSION_FIELD} {has}; {ROW_FORMAT_FIELD} is read in row "
            f"layout version {ROW_FORMAT_VERSION} only (hps.rowformat)"
        )
    return [RowDtype(x) for x in names] if len(names) == n else []


def _fraction(d: dict[str, Any], key: str, where: str, default: float, p: Problems) -> float:
    return p.read(field, d, key, where, float, default, fallback=default)


def _parse_model(
    d: Any, where: str, base: Path | None, p: Problems, unused: list[str]
) -> ModelConfig | None:
    if not isinstance(d, dict):
        p.add(f"{where}: expected an object, got {type(d).__name__}")
        return None
    known_fields(d, _MODEL_FIELDS, "model", where, p, unused)
    name = p.read(field, d, "model", where, str, fallback="")
    if "model" in d and isinstance(d["model"], str):
        p.check(is_name(name), where, "model", name, NAME_RULE)
    tables = _parse_tables(d, where, base, p, unused)
    mbs = p.read(field, d, "max_batch_size", where, int, HUGECTR_DEFAULT_MAX_BATCH_SIZE, fallback=1)
    p.check(0 < mbs <= MAX_BATCH_SIZE, where, "max_batch_size", mbs, BATCH_RANGE)
    per = _fraction(d, "gpucacheper", where, 0.2, p)
    p.check(0.0 < per <= 1.0, where, "gpucacheper", per, "a fraction in (0, 1]")
    thr = _fraction(d, "hit_rate_threshold", where, 0.9, p)
    p.check(
        thr >= 0.0,
        where,
        "hit_rate_threshold",
        thr,
        "a number >= 0 (1.0 or more: a miss is always read from the databases)",
    )
    decay = _fraction(d, "cache_lfu_decay_keys_per_slot", where, DEFAULT_LFU_DECAY_KEYS_PER_SLOT, p)
    p.check(
        math.isfinite(decay) and decay >= 0,
        where,
        "cache_lfu_decay_keys_per_slot",
        decay,
        "looked-up keys per cache slot between LFU halvings, a finite number >= 0 (0: never)",
    )
    lfu_sampling = p.read(field, d, "cache_lfu_sampling", where, int, 1, fallback=1)
    p.check(
        lfu_sampling >= 1,
        where,
        "cache_lfu_sampling",
        lfu_sampling,
        "an integer >= 1 (one lookup in it counts its LFU uses; 1: every lookup)",
    )
    refresh = _fraction(d, "cache_refresh_percentage_per_iteration", where, 0.0, p)
    p.check(
        0.0 <= refresh <= 1.0, where, "cache_refresh_percentage_per_iteration", refresh, "in [0, 1]"
    )
    workers = p.read(field, d, "num_of_worker_buffer_in_pool", where, int, 4, fallback=4)
    p.check(workers > 0, where, "num_of_worker_buffer_in_pool", workers, "> 0")
    device = p.read(field, d, "device", where, str, "auto", fallback="auto")
    _check_device(device, where, p)
    devs = p.read(
        list_field, d, "deployed_device_list", where, int, None, [0], _non_negative, ">= 0",
        fallback=[0],
    )  # fmt: skip
    if "deployed_device_list" in d and isinstance(d["deployed_device_list"], list):
        p.check(bool(devs), where, "deployed_device_list", devs, "at least one device id")
    network = p.read(field, d, "network_file", where, str, "", fallback="")
    return ModelConfig(
        model=name,
        tables=tables,
        max_batch_size=mbs,
        gpucache=p.read(field, d, "gpucache", where, bool, True, fallback=True),
        gpucacheper=per,
        hit_rate_threshold=thr,
        cache_policy=p.read(
            enum_field,
            d,
            "cache_policy",
            where,
            CachePolicy,
            CachePolicy.LRU,
            fallback=CachePolicy.LRU,
        ),
        cache_exact=p.read(field, d, "cache_exact", where, bool, False, fallback=False),
        cache_lfu_decay_keys_per_slot=decay,
        cache_lfu_sampling=lfu_sampling,
        cache_refresh_percentage_per_iteration=refresh,
        num_of_worker_buffer_in_pool=workers,
        deployed_device_list=tuple(devs),
        device=device,
        network_file=p.read(resolve_path, network, base, f"{where}.network_file", fallback=""),
    )


def _check_failed_keys_not_guessed(
    models: tuple[ModelConfig, ...], vdb: VolatileDBConfig, pdb: PersistentDBConfig, p: Problems
) -> None:
    """With a Redis cluster as the only database, a model must never answer a cache miss
    without reading the tiers (asynchronous insertion): while a node is down its keys would
    get the default vector for the whole outage (:mod:`hps.config`)."""
    if vdb.type is not VolatileDBType.REDIS_CLUSTER or pdb.type is not PersistentDBType.NONE:
        return
    for i, m in enumerate(models):
        p.check(
            not m.gpucache or m.cache_exact or m.hit_rate_threshold >= 1.0,
            f"models[{i}]",
            "cache_exact",
            m.cache_exact,
            "true (or hit_rate_threshold 1.0, or gpucache false, or a persistent_db) with a "
            "redis_cluster volatile_db and no persistent_db: otherwise a lookup whose cache "
            f"hit rate reaches hit_rate_threshold ({m.hit_rate_threshold}) answers its misses "
            "with the default vector without reading Redis, and while a node is down its keys "
            "would get it for the whole outage",
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


def _check_tiers(
    vdb: VolatileDBConfig, pdb: PersistentDBConfig, typeless_vdb: bool, p: Problems
) -> None:
    """Some tier must hold the tables, and without a persistent DB the volatile one all rows."""
    if vdb.type is VolatileDBType.NONE and pdb.type is PersistentDBType.NONE:
        why = " (a volatile_db section without a type is disabled, as in HugeCTR)"
        p.add(
            "ps.json: volatile_db.type and persistent_db.type are both 'none'; at least one "
            f"database tier must hold the tables{why if typeless_vdb else ''}"
        )
    if pdb.type is PersistentDBType.NONE:
        p.check(
            vdb.initial_cache_rate == 1.0,
            "volatile_db",
            "initial_cache_rate",
            vdb.initial_cache_rate,
            "1.0 without a persistent_db (the rows not loaded would be served as default "
            "vectors: no tier would hold them)",
        )


def _section(doc: dict[str, Any], key: str, p: Problems) -> dict[str, Any] | None:
    """``doc[key]`` when it is an object, ``None`` when absent (an error when not an object)."""
    v = doc.get(key)
    if v is None and key not in doc:
        return None
    if not isinstance(v, dict):
        p.add(f"ps.json.{key}: expected an object, got {type(v).__name__}")
        return {}
    return v


def _parse_models(
    doc: dict[str, Any], base: Path | None, p: Problems, unused: list[str]
) -> tuple[ModelConfig, ...]:
    raw = p.read(field, doc, "models", "ps.json", list, fallback=None)
    if raw is not None and not raw:
        p.add("ps.json.models: at least one model is required")
    parsed = [_parse_model(m, f"models[{i}]", base, p, unused) for i, m in enumerate(raw or [])]
    models = tuple(m for m in parsed if m is not None)
    names = [m.model for m in models]
    if len(set(names)) != len(names):
        p.add(f"ps.json.models: duplicate model names {names}")
    return models


def parse_config(doc: Any, base_dir: str | Path | None = None, name: str = "ps.json") -> PSConfig:
    """Validate a decoded ``ps.json`` document (ours or HugeCTR's, see the module docstring).

    Args:
        doc: the decoded JSON.
        base_dir: the folder relative paths resolve against (``None``: kept as written).
        name: the document in messages (its path).

    Returns:
        the config; a :class:`HugeCTRFieldWarning` names the HugeCTR fields it does not use.

    Raises:
        FormatVersionError: ``tilerec_artifact_version`` is present and not
            :data:`ARTIFACT_VERSION`.
        ConfigError: (a ``ValueError``) every error of the document, each naming the field
            (``models[1].embedding_vecsize_per_table[0]``), the value and what was expected.
    """
    return _parse(doc, Path(base_dir) if base_dir is not None else None, name)


def _parse(doc: Any, base: Path | None, name: str) -> PSConfig:
    """:func:`parse_config` (called by it and by :func:`load_config`, so that the warning
    points at their caller)."""
    if not isinstance(doc, dict):
        raise ValueError(
            f"ps.json: expected a JSON object at the top level, got {type(doc).__name__}"
        )
    version = _artifact_version(doc, name)
    p, unused = Problems(), list[str]()
    known_fields(doc, _TOP_FIELDS, "ps.json", "ps.json", p, unused)
    # supportlonglong false: HugeCTR's keys are 32-bit in memory but int64 in its sparse files,
    # which are read as they are; requests' int32 keys are widened
    longlong = p.read(field, doc, "supportlonglong", "ps.json", bool, True, fallback=True)
    models = _parse_models(doc, base, p, unused)
    vdb = parse_vdb(_section(doc, "volatile_db", p), p, unused)
    pdb = parse_pdb(_section(doc, "persistent_db", p), base, p, unused)
    upd = parse_updates(_section(doc, "update_source", p), base, vdb, pdb, p, unused)
    if not p.errors:  # the checks across sections, on sections that read cleanly
        typeless_vdb = isinstance(doc.get("volatile_db"), dict) and "type" not in doc["volatile_db"]
        _check_tiers(vdb, pdb, typeless_vdb, p)
        _check_failed_keys_not_guessed(models, vdb, pdb, p)
    p.raise_any(name)
    _warn_unused(name, unused)
    return PSConfig(
        models=models,
        volatile_db=vdb,
        persistent_db=pdb,
        update_source=upd,
        supportlonglong=longlong,
        artifact_version=version,
    )


def _warn_unused(name: str, unused: list[str]) -> None:
    """One :class:`HugeCTRFieldWarning` naming every unused HugeCTR field of ``name``, shown
    where ``load_config`` or ``parse_config`` was called."""
    if unused:
        warnings.warn(
            HugeCTRFieldWarning(
                f"{name}: HugeCTR field(s) tilerec accepts and does not use: {', '.join(unused)}"
            ),
            stacklevel=4,
        )


class DuplicateKeyError(ValueError):
    """A JSON object gives a key twice (the message names it and the lines of both)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def _first_duplicate_key(text: str) -> tuple[str, int, int] | None:
    """The first key that a JSON text gives twice in one object: ``(key, its line, the line of
    its first occurrence)``, or ``None``. ``text`` is valid JSON (it parsed); one pass that
    tracks, per open object, the keys it has seen."""
    stack: list[dict[str, int] | None] = []  # per open container: its keys' lines (arrays: None)
    line, i, n = 1, 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c in "{[":
            stack.append({} if c == "{" else None)
        elif c in "}]":
            stack.pop()
        elif c == '"':
            j = i + 1
            while text[j] != '"':  # a JSON string holds no raw newline or unescaped quote
                j += 2 if text[j] == "\\" else 1
            k = j + 1
            while k < n and text[k] in " \t\r\n":
                k += 1
            seen = stack[-1] if stack else None
            if k < n and text[k] == ":" and seen is not None:
                key = json.loads(text[i : j + 1])
                if key in seen:
                    return key, line, seen[key]
                seen[key] = line
            i = j
        i += 1
    return None


def loads_unique_keys(text: str) -> Any:
    """``json.loads(text)``, except that an object holding a key twice is refused.

    Raises:
        json.JSONDecodeError: a syntax error (with its line and column).
        DuplicateKeyError: a key given twice in one object (naming it and the lines of both;
            ``json.loads`` keeps the last value silently).
        ValueError: a number past Python's limits.
        RecursionError: nesting past the parser's depth.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except DuplicateKeyError as e:
        found = _first_duplicate_key(text)
        key, line, first = found if found is not None else (str(e), None, None)
        where = f" at line {line}" if line is not None else ""
        raise DuplicateKeyError(
            f"key {key!r}{where} is given twice in one object (first at line {first}); JSON "
            "keeps only the last value, so each key must be unique"
        ) from None


def load_config(path: str | Path) -> PSConfig:
    """Read and validate ``ps.json`` at ``path`` (relative paths resolve against its folder).

    Raises:
        FormatVersionError: serving artifacts of another version (see :func:`parse_config`).
        ValueError: for a file that is not UTF-8 JSON text (a syntax error with line and
            column, a key given twice in one object with the lines of both, a number past
            Python's limits, nesting past the parser's depth), or a :class:`ConfigError`
            listing every invalid field.
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
        doc = loads_unique_keys(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: JSON syntax error at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    except DuplicateKeyError as e:
        raise ValueError(f"{path}: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply for the parser") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise ValueError(f"{path}: not a JSON document this parser reads: {e}") from None
    return _parse(doc, path.parent, str(path))
