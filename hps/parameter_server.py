"""The hierarchical parameter server: builds the tiers a ``ps.json`` describes, loads the
sparse files into them and hands out one :class:`~hps.session.LookupSession` per model.

>>> hps = HierarchicalParameterServer.from_config("ps.json")   # doctest: +SKIP
>>> rows = hps.session("dlrm").lookup("t0", torch.tensor([[3, 9], [9, 1]]))  # (2, 2, dim)

Loading: the persistent DB (when writable) gets every row of every table once (a table
already loaded is not reloaded); the volatile DB gets the first ``initial_cache_rate`` of
each table's rows; each table's cache gets ``ceil(gpucacheper × rows)`` slots (LFU counters
halved every ``cache_lfu_decay_keys_per_slot`` × slots looked-up keys), warmed up from the
hottest keys when the caller has statistics (:meth:`LookupSession.warm_up`). A CPU cache
above the in-process hash map is exclusive with it: each row is held by one of the two
(:mod:`hps.storage.volatile`).

A table's rows in the volatile DB are marked loaded once all are in
(:meth:`~hps.types.StorageBackend.mark_loaded`): a Redis partition that later loses them (its
node restarted empty) fails its reads instead of answering "not found", and
:meth:`HierarchicalParameterServer.start_background` runs the repair that writes it back
(:mod:`hps.volatile_repair`).

Restarts keep online updates: when a writable persistent DB already held a table (a restart),
the volatile DB is filled with that table's rows *as the persistent DB holds them* (online
updates included; keys from the sparse files, values from RocksDB), and the applier resumes
after the offset stored with them. That holds while the sparse files are the ones the table was
loaded from (recorded with it, :mod:`hps.storage.sparse_source`): a table whose files changed
(another export put in place) is dropped and loaded again from them, its online updates with
it, by a loading start; a start that does not load refuses it (the error says how to reset). Without a writable persistent DB the only record of the
applied updates is the offset file, while the volatile DB was just rebuilt from the sparse
files: the offset file is then cleared, so the applier replays the update source from its
start (rows are absolute values: replaying is idempotent). A Redis stream trimmed with
``MAXLEN`` replays only what it still holds. A replica built with ``load=False`` over a shared
Redis cluster keeps its offset (that Redis still holds the updates).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from pathlib import Path

import numpy as np
import torch

from hps.config import ModelConfig, PSConfig, TableSpec, db_table_names, load_config
from hps.rowformat import RowDtype, RowFormatError, row_bytes
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache, StaticEmbeddingCache, dense_key_bound
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import RedisClusterBackend
from hps.storage.row_codec import RowCodec
from hps.storage.sparse_files import has_table_rows, read_table, read_table_rows
from hps.storage.sparse_source import SparseSource
from hps.storage.volatile import HashMapBackend
from hps.types import (
    PersistentDBType,
    StorageBackend,
    TierUnavailableError,
    UpdateSourceType,
    VolatileDBType,
    VolatileUnavailableError,
)
from hps.updates.applier import OffsetFile, UpdateApplier
from hps.updates.file_log import FileLogSource
from hps.updates.health import RetryPolicy, UpdateHealth, UpdateStatus, skip_request_path
from hps.updates.redis_stream import RedisStreamSource, redis_client
from hps.updates.transport import UpdateSource
from hps.volatile_repair import VolatileRepair

log = logging.getLogger(__name__)

_LOAD_CHUNK = 262144  # rows per insert while loading sparse files
_MIN_REPAIR_INTERVAL_S = 0.1  # the volatile repair checks at most this often


def build_volatile(cfg: PSConfig) -> StorageBackend | None:
    """The volatile DB a config describes (``None`` for ``type: none``)."""
    v = cfg.volatile_db
    if v.type is VolatileDBType.NONE:
        return None
    if v.type is VolatileDBType.REDIS_CLUSTER:
        # with a persistent DB every row can be served while the cluster is unreachable
        return RedisClusterBackend(
            v.addresses(),
            num_partitions=v.num_partitions,
            max_batch_size=v.max_batch_size,
            retry_interval_s=v.retry_interval_s,
            socket_timeout_s=v.socket_timeout_s,
            start_down=cfg.persistent_db.type is not PersistentDBType.NONE,
        )
    parts = 1 if v.type is VolatileDBType.HASH_MAP else v.num_partitions
    return HashMapBackend(
        num_partitions=parts,
        overflow_margin=v.overflow_margin,
        overflow_policy=v.overflow_policy,
        overflow_resolution_target=v.overflow_resolution_target,
    )


def build_persistent(cfg: PSConfig) -> RocksDBBackend | None:
    """The persistent DB a config describes (``None`` for ``type: none``)."""
    p = cfg.persistent_db
    if p.type is PersistentDBType.NONE:
        return None
    return RocksDBBackend(p.path, read_only=p.read_only, max_batch_size=p.max_batch_size)


def resolve_device(model: ModelConfig) -> torch.device:
    """Where a model's caches and returned rows live: ``device`` of ``ps.json``; ``auto`` is
    the *last* entry of ``deployed_device_list`` when CUDA is available, else the CPU.

    The last, as HugeCTR takes it: its parser sets ``device_id = deployed_devices.back()``
    (``parameter_server_config`` in ``HugeCTR/src/hps/inference_utils.cpp``), and the embedding
    cache of a model lives on ``device_id``."""
    if model.device == "auto":
        return (
            torch.device("cuda", model.deployed_device_list[-1])
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    return torch.device(model.device)


def _read_sparse(
    table: str, folder: str, dim: int, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_table` of ``table``'s sparse folder, its errors naming the table."""
    try:
        return read_table(folder, dim, check_finite=check_finite)
    except ValueError as e:
        raise ValueError(f"table {table!r}: {e}") from None


class HierarchicalParameterServer:
    """Owns the shared databases and one lookup session per model.

    Args:
        cfg: a validated config.
        load: load the sparse files into the databases (skip in a replica that only reads a
            shared, already loaded Redis cluster / read-only RocksDB).
    """

    def __init__(self, cfg: PSConfig, load: bool = True) -> None:
        self.cfg = cfg
        self.volatile = build_volatile(cfg)
        self.persistent = build_persistent(cfg)
        self.num_rows: dict[str, int] = {}  # database name → rows
        # database name → the table's keys, while the sessions are built (static caches)
        self._table_keys: dict[str, np.ndarray] = {}
        self._db_names = db_table_names(cfg.models)  # (model, table) → database name
        self._sessions: dict[str, LookupSession] = {}
        self._stops: list[threading.Event] = []
        self.repair: VolatileRepair | None = None  # set by start_background for a Redis tier
        self.applier: UpdateApplier | None = None  # set by start_background with updates
        # shared by every applier built here and read by the sessions (readiness, statistics)
        self.update_health = UpdateHealth(RetryPolicy.of(cfg.update_source))
        for model in cfg.models:
            for t in self.db_specs(model):
                self._check_persistent_source(t, load)
                for db in (self.volatile, self.persistent):
                    if db is not None:
                        db.create_table(t.name, t.dim, t.row_format)
                if load:
                    self._load_table(t.name, t.sparse_file, t.dim, t.row_format)
                elif t.name not in self.num_rows:
                    self.num_rows[t.name] = self._known_rows(t.name, t.sparse_file, t.dim)
            self._sessions[model.model] = self._make_session(model)
        self._table_keys.clear()
        if self._volatile_rebuilt(load):
            self._reset_update_offset()

    def db_specs(self, model: ModelConfig) -> list[TableSpec]:
        """``model``'s tables as the databases hold them: each named by its database name
        (:meth:`hps.config.PSConfig.db_table`: ``t0``, or ``<model>.t0`` where models name
        ``t0`` with other rows)."""
        return [
            dataclasses.replace(t, name=self._db_names[(model.model, t.name)]) for t in model.tables
        ]

    @classmethod
    def from_config(cls, path: str | Path, load: bool = True) -> HierarchicalParameterServer:
        """The parameter server of the ``ps.json`` at ``path`` (see :func:`hps.config.load_config`).

        Raises:
            ValueError: an invalid ``ps.json`` (naming the field), or a sparse file that does
                not match it.
        """
        return cls(load_config(path), load=load)

    def session(self, model: str) -> LookupSession:
        """The lookup session of ``model`` (``ValueError`` naming the models for another name)."""
        try:
            return self._sessions[model]
        except KeyError:
            raise ValueError(f"no model {model!r}; models: {sorted(self._sessions)}") from None

    def _known_rows(self, table: str, sparse_file: str, dim: int) -> int:
        loaded = self.persistent.loaded_rows(table) if self.persistent is not None else None
        if loaded is not None:
            return loaded
        if sparse_file and Path(sparse_file).exists():
            if has_table_rows(sparse_file):
                return int((Path(sparse_file) / "key").stat().st_size // 8)
            return int(_read_sparse(table, sparse_file, dim, check_finite=False)[0].shape[0])
        raise ValueError(
            f"table {table!r}: cannot size its cache without its sparse file "
            f"{sparse_file!r} or a loaded persistent db"
        )

    def _check_persistent_source(self, t: TableSpec, load: bool) -> None:
        """Make sure the persistent DB serves ``t`` from the sparse files ``ps.json`` names.

        A table the persistent DB loaded from other files (another export put in place of
        the sparse folder), or with no record of its files, is dropped and loaded again by a
        start that loads into a writable DB, once the new files have passed
        :func:`read_table`'s checks (a Redis volatile DB's copy of it is deleted first); any
        other start refuses it. A replica without the sparse
        files (``load=False``) has nothing to compare and trusts the DB.

        Raises:
            ValueError: naming the table, both sets of files and how to reset the DB; or, from
                :func:`read_table`, new sparse files that cannot be loaded (nothing dropped).
        """
        pdb = self.persistent
        if pdb is None or pdb.loaded_rows(t.name) is None:
            return
        if not load and not (t.sparse_file and Path(t.sparse_file).exists()):
            return
        recorded = SparseSource.from_json(pdb.loaded_source(t.name))
        if recorded is not None and recorded.matches(t.sparse_file):
            return
        was = recorded.describe() if recorded is not None else "no record of its files"
        if not load or pdb.read_only:
            how = (
                "It is opened read-only here: start one server on it with "
                "persistent_db.read_only false (it loads changed tables again)"
                if pdb.read_only
                else "This start does not load (load=False): start the loading server first "
                "(it loads changed tables again)"
            )
            raise ValueError(
                f"persistent db {pdb.path!r}: table {t.name!r} was loaded from other sparse "
                f"files ({was}) than {t.sparse_file!r} holds now; it would serve the old rows "
                f"with the new model. {how}, or stop every server using it and delete "
                f"{pdb.path!r} (it is loaded from the sparse files on the next start)"
            )
        if has_table_rows(t.sparse_file):  # the new files load: only then drop the old rows
            read_table_rows(t.sparse_file, t.row_format, t.dim, t.name)
        else:
            read_table(t.sparse_file, t.dim)
        if isinstance(self.volatile, RedisClusterBackend):  # it outlives a restart too
            try:
                self.volatile.clear(t.name)  # first: a failed clear leaves the record in place
            except VolatileUnavailableError as e:
                raise ValueError(
                    f"table {t.name!r} changed since the persistent db {pdb.path!r} loaded it and "
                    f"must be loaded again, but the redis_cluster volatile db, which may hold its "
                    f"old rows, cannot be cleared ({e}); start again once the cluster answers"
                ) from None
        log.warning(
            "persistent db %s: table %r was loaded from other sparse files (%s) than %s holds "
            "now: dropping its rows (and the online updates applied to them) to load it again",
            pdb.path,
            t.name,
            was,
            t.sparse_file,
        )
        pdb.drop_table(t.name)

    def _load_table(self, name: str, folder: str, dim: int, row_format: RowDtype) -> None:
        try:
            self._load_rows(name, folder, dim, row_format)
        except RowFormatError as e:  # a row the table's format cannot hold: name the files
            raise RowFormatError(f"table {name!r}, sparse folder {folder!r}: {e}") from None

    def _load_rows(self, name: str, folder: str, dim: int, row_format: RowDtype) -> None:
        if name in self.num_rows:
            return  # shared by two models: loaded once
        if row_format is not RowDtype.FP32 and has_table_rows(folder):
            keys, vecs = read_table_rows(folder, row_format, dim, name)  # stored bytes
        else:  # float32 rows (quantized on their way into the tiers)
            keys, vecs = _read_sparse(name, folder, dim)
            vecs = RowCodec(dim, row_format, f"table {name!r}").encode(vecs)
        n = int(keys.shape[0])
        self.num_rows[name] = n
        self._table_keys[name] = keys
        pdb = self.persistent
        from_pdb = None  # the persistent db, when it holds newer rows than the sparse files
        if pdb is not None and not pdb.read_only:
            if pdb.loaded_rows(name) is None:
                source = SparseSource.of(folder).to_json()
                pdb.bulk_load(name, keys, vecs, chunk=_LOAD_CHUNK, source=source)
                log.info("persistent db: loaded %d rows of %s", n, name)
            else:
                from_pdb = pdb  # loaded by an earlier start: it has the online updates since
        if self.volatile is not None:
            self._load_volatile(self.volatile, name, keys, vecs, from_pdb)

    def _load_volatile(
        self,
        vdb: StorageBackend,
        name: str,
        keys: np.ndarray,
        vecs: np.ndarray,
        from_pdb: RocksDBBackend | None,
    ) -> None:
        """The first ``initial_cache_rate`` of a table's rows (``vecs (n, row_bytes) uint8``,
        stored bytes) into the volatile DB (values from
        ``from_pdb`` where it holds them), then its mark (:meth:`StorageBackend.mark_loaded`:
        a load that stopped leaves the table unmarked, so its reads fail, none is guessed)."""
        n = int(keys.shape[0])
        m = int(round(self.cfg.volatile_db.initial_cache_rate * n))
        complete = True
        for s in range(0, m, _LOAD_CHUNK):
            e = min(s + _LOAD_CHUNK, m)
            k = np.ascontiguousarray(keys[s:e], dtype=np.int64)
            v = np.ascontiguousarray(vecs[s:e])  # stored bytes
            if from_pdb is not None:  # its bytes as they are (a quantized row keeps them)
                rows, found = from_pdb.lookup_rows(name, k)
                v = np.where(found[:, None], rows, v)
            try:
                vdb.insert_rows(name, k, v)
            except VolatileUnavailableError as err:
                log.error("volatile db: loading %s stopped at row %d of %d: %s", name, s, m, err)
                complete = False
                break
        if complete:
            try:
                vdb.mark_loaded(name)
            except VolatileUnavailableError as err:
                log.error("volatile db: marking %s as loaded failed: %s", name, err)
        log.info(
            "volatile db (%s): loaded %d of %d rows of %s from the %s",
            vdb.name,
            m,
            n,
            name,
            "persistent db" if from_pdb is not None else "sparse files",
        )
        if self.persistent is None and isinstance(vdb, HashMapBackend):
            held = vdb.size(name)
            if held < n:  # evicted while loading: no tier holds the rest
                margin = self.cfg.volatile_db.overflow_margin
                raise ValueError(
                    f"table {name!r}: the volatile db holds {held} of its {n} rows after loading "
                    f"(overflow_margin {margin} rows per partition, "
                    f"{vdb.num_partitions} partitions) and there is no persistent_db, "
                    "so the evicted rows would be served as default vectors; raise "
                    "volatile_db.overflow_margin or add a persistent_db"
                )

    def _volatile_rebuilt(self, load: bool) -> bool:
        """Whether this start left the volatile DB without the online updates applied before
        it (rebuilt from the sparse files, or an empty in-process map) while no writable
        persistent DB holds them."""
        if self.volatile is None or self.cfg.update_source.type is UpdateSourceType.NONE:
            return False
        if self.persistent is not None and not self.persistent.read_only:
            return False  # the rows and the offset live together in the persistent db
        return load or self.cfg.volatile_db.type is not VolatileDBType.REDIS_CLUSTER

    def _offset_path(self) -> str | None:
        """Where the applied-update offset lives when there is no writable persistent DB."""
        u = self.cfg.update_source
        if u.type is UpdateSourceType.FILE_LOG:
            return u.state_path or u.path + ".offset"
        return u.state_path or None

    def _reset_update_offset(self) -> None:
        path = self._offset_path()
        if path is None:
            return
        f = OffsetFile(path)
        old = f.load()
        if old is not None:
            log.info(
                "update offset %s was %s; the volatile db was rebuilt without the updates applied "
                "so far, so the update source is replayed from its start",
                path,
                old,
            )
            f.clear()

    def _make_session(self, model: ModelConfig) -> LookupSession:
        device = resolve_device(model)
        tables = []
        for t, db in zip(model.tables, self.db_specs(model), strict=True):
            cache = self._make_cache(model, t, db.name, device) if model.gpucache else None
            tables.append(
                SessionTable(
                    t.name,
                    t.dim,
                    t.default_value,
                    model.max_keys_per_lookup(t.name),
                    cache,
                    db_name=db.name,
                )
            )
        session = LookupSession(
            tables,
            update_health=self.update_health,
            volatile=self.volatile,
            persistent=self.persistent,
            hit_rate_threshold=model.hit_rate_threshold,
            exact=model.cache_exact,
            max_concurrent=model.num_of_worker_buffer_in_pool,
            cache_missed_embeddings=self.cfg.volatile_db.cache_missed_embeddings,
            device=device,
        )
        for st in tables:  # a static cache holds its whole table from the start
            if isinstance(st.cache, StaticEmbeddingCache):
                try:
                    session.warm_up(st.name, self._table_keys[st.db_name])
                except TierUnavailableError as e:  # filled by the lookups' misses instead
                    log.warning("static cache of %s not filled at start: %s", st.db_name, e)
        return session

    def _make_cache(
        self, model: ModelConfig, t: TableSpec, db_name: str, device: torch.device
    ) -> EmbeddingCache:
        """``t``'s cache: ``ceil(gpucacheper × rows)`` slots, static (one fixed slot per key,
        :mod:`hps.storage.cache.static`) when that covers every row of a table whose keys this
        start loaded, on the CPU; set-associative otherwise. Exclusive with the in-process
        hash map (:meth:`_attach`)."""
        cap = max(1, math.ceil(model.gpucacheper * self.num_rows[db_name]))
        keys = self._table_keys.get(db_name)
        cache: EmbeddingCache
        if keys is not None and cap >= keys.size and device.type == "cpu":
            cache = StaticEmbeddingCache(
                keys, t.dim, policy=model.cache_policy, device=device, row_format=t.row_format
            )
        else:
            cache = EmbeddingCache(
                cap,
                t.dim,
                policy=model.cache_policy,
                device=device,
                lfu_decay_keys_per_slot=model.cache_lfu_decay_keys_per_slot,
                lfu_sampling=model.cache_lfu_sampling,
                row_format=t.row_format,
                key_bound=self._key_bound(db_name, cap, t) if device.type == "cpu" else None,
            )
        self._attach(db_name, cache)
        return cache

    def _key_bound(self, db_name: str, capacity: int, t: TableSpec) -> int | None:
        """The dense key index's bound for a set-associative cache of ``t``
        (:func:`~hps.storage.cache.dense_key_bound`): past the largest key this start loaded,
        or the table's row count (keys ``0 .. rows - 1``) when none were loaded; ``None`` when
        the index would not pay for its memory."""
        keys = self._table_keys.get(db_name)
        end = int(keys.max()) + 1 if keys is not None and keys.size else self.num_rows[db_name]
        return dense_key_bound(end, capacity, row_bytes(RowDtype(t.row_format), t.dim))

    def _attach(self, name: str, cache: EmbeddingCache) -> None:
        """Make ``cache`` exclusive with the in-process hash map's table ``name`` when both
        live in host memory, so no row is held twice there (:mod:`hps.storage.volatile`); a
        table that two models cache is exclusive with the first model's cache (the second
        holds copies)."""
        vdb = self.volatile
        if isinstance(vdb, HashMapBackend) and cache.device.type == "cpu":
            if vdb.front(name) is None:
                vdb.attach_cache(name, cache)

    def update_applier(self) -> UpdateApplier | None:
        """The applier of ``update_source`` (``None`` for ``type: none``); call ``.poll()`` or
        ``.start(update_source.poll_interval_s)``. The offset lives in the persistent DB when it
        is writable, else in ``state_path`` (default: ``<log path>.offset`` for a file log),
        which a start that rebuilt the volatile DB clears (see the module docstring)."""
        u = self.cfg.update_source
        if u.type is UpdateSourceType.NONE:
            return None
        source: UpdateSource
        if u.type is UpdateSourceType.FILE_LOG:
            source = FileLogSource(u.path)
        else:
            vdb = self.cfg.volatile_db
            address = u.address or vdb.address
            cluster = not u.address and vdb.type is VolatileDBType.REDIS_CLUSTER
            source = RedisStreamSource(redis_client(address, cluster=cluster), u.stream)
        return UpdateApplier(
            source,
            self._sessions.values(),
            self.volatile,
            self.persistent,
            offset_file=self._offset_path(),
            name=f"{u.type.value}:{u.stream if u.path == '' else u.path}",
            health=self.update_health,
            skip_request=skip_request_path(self.cfg),
        )

    def update_status(self) -> UpdateStatus:
        """The online updates' health with the readiness policy applied
        (:mod:`hps.updates.health`; always ready without an update source). The servers'
        readiness and statistics read it (through each model's session)."""
        return self.update_health.status()

    def skip_update(self, offset: str, log_id: str | None = None) -> None:
        """Skip the update record refused now (:meth:`UpdateApplier.skip`) in the running
        poller started by :meth:`start_background`.

        Raises:
            ValueError: no poller runs, no record is refused, or another record is.
        """
        if self.applier is None:
            raise ValueError("no online-update poller runs (start_background was not called)")
        self.applier.skip(offset, log_id)

    def start_background(self, refresh_interval_s: float = 10.0) -> list[threading.Event]:
        """Start the periodic work a config asks for: each model's cache refresh (every
        ``refresh_interval_s``, ``cache_refresh_percentage_per_iteration`` of the slots each
        time; skipped when 0) and the online-update poller (every
        ``update_source.poll_interval_s``) and, for a Redis volatile DB, the repair of
        partitions that lost their rows (:mod:`hps.volatile_repair`; checked every
        ``volatile_db.retry_interval_s`` after the cluster reported trouble). The updates already in the source are applied
        first, before this returns (after a restart that replays the log, the server must not
        report ready while serving rows older than before it); a corrupt record there is
        logged and retried by the poller, as later. Returns the stop events (set them to stop).

        Raises:
            FormatVersionError: the update log is of another format version.
        """
        stops: list[threading.Event] = []
        for m in self.cfg.models:
            if m.gpucache and m.cache_refresh_percentage_per_iteration > 0:
                stops.append(
                    self._sessions[m.model].start_refresh(
                        refresh_interval_s, m.cache_refresh_percentage_per_iteration
                    )
                )
        if isinstance(self.volatile, RedisClusterBackend):
            self.repair = VolatileRepair(
                self.volatile,
                self.persistent,
                list({t.name: t for m in self.cfg.models for t in self.db_specs(m)}.values()),
                list(self._sessions.values()),
                self.cfg.volatile_db.initial_cache_rate,
                has_updates=self.cfg.update_source.type is not UpdateSourceType.NONE,
            )
            interval = max(self.cfg.volatile_db.retry_interval_s, _MIN_REPAIR_INTERVAL_S)
            stops.append(self.repair.start(interval))
        applier = self.update_applier()
        if applier is not None:
            n = applier.attempt(first=True)
            if n:
                log.info("online updates: applied %d pending record(s) before serving", n)
            self.applier = applier
            stops.append(applier.start(self.cfg.update_source.poll_interval_s))
        self._stops.extend(stops)
        return stops

    def close(self) -> None:
        """Stop the background work and close the sessions and the databases."""
        for ev in self._stops:
            ev.set()
        for s in self._sessions.values():
            s.close()
        for db in (self.volatile, self.persistent):
            if db is not None:
                db.close()
