"""Tables scoped by model: two models may name a table alike with other rows (HugeCTR's own unit
tests do: models ``foo`` and ``bar`` both name ``sparse_embedding0``, 16 and 64 floats wide).
Each model's lookups, defaults, cache and online updates see its own table; every tier keys the
two apart (``foo.sparse_embedding0``, ``bar.sparse_embedding0``); a table no two models name
with other rows keeps its own name. Also: ``device: auto`` takes the last deployed device, as
HugeCTR does.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import redis
import torch

from hps.config import (
    HugeCTRFieldWarning,
    ModelConfig,
    TableSpec,
    db_table_names,
    load_config,
    parse_config,
)
from hps.parameter_server import HierarchicalParameterServer, resolve_device
from hps.storage.cache import StaticEmbeddingCache
from hps.storage.persistent import RocksDBBackend
from hps.storage.redis_cluster import partition_name
from hps.storage.sparse_files import write_table
from hps.updates.file_log import FileLogPublisher
from hps.updates.record import InvalidUpdateError, UpdateBatch
from hps.updates.trainer_callback import PublishUpdatesCallback
from hps.updates.transport import UpdatePublisher

DATA = Path(__file__).parent / "data" / "hugectr_configs"
TWO_FOOS = ["hps_tf_unit_test_hps.ps.json", "hps_trt_unit_test_hps.ps.json"]
T0, T1 = "sparse_embedding0", "sparse_embedding1"
KEYS = np.arange(0, 60, 3, dtype=np.int64)  # 20 keys, 0 .. 57
QUERY = torch.tensor([[3, 9], [57, 1]])  # key 1 is in no sparse file


def _rows(file_index: int, dim: int) -> np.ndarray:
    """Integer-valued rows (exact in float32), different in every sparse file."""
    return (file_index * 1_000_000 + KEYS[:, None] * 1000 + np.arange(dim)).astype(np.float32)


def _deploy(tmp_path: Path, name: str, **sections: Any) -> dict[tuple[str, str], np.ndarray]:
    """HugeCTR's ``ps.json`` ``name`` (with ``sections`` added) beside generated sparse files;
    returns ``(model, table) → rows`` (for :data:`KEYS`)."""
    doc = json.loads((DATA / name).read_text())
    doc.update(sections)
    (tmp_path / "ps.json").write_text(json.dumps(doc))
    want: dict[tuple[str, str], np.ndarray] = {}
    files = 0
    for m in doc["models"]:
        for f, t, dim in zip(
            m["sparse_files"], m["embedding_table_names"], m["embedding_vecsize_per_table"]
        ):
            files += 1
            want[(m["model"], t)] = _rows(files, dim)
            write_table(tmp_path / f, KEYS, want[(m["model"], t)])
    return want


def _start(tmp_path: Path) -> HierarchicalParameterServer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HugeCTRFieldWarning)
        return HierarchicalParameterServer.from_config(tmp_path / "ps.json")


def _expected(rows: np.ndarray, default: float = 1.0) -> torch.Tensor:
    """The rows :data:`QUERY` must get: keys 3, 9, 57 from ``rows``, key 1 the default (1.0)."""
    r = torch.from_numpy(rows)
    return torch.stack([r[1], r[3], r[19], torch.full((rows.shape[1],), default)]).reshape(2, 2, -1)


def _hits(ps: HierarchicalParameterServer, model: str, table: str) -> dict[str, int]:
    """Distinct keys of ``model``'s lookups of ``table`` served by each tier so far."""
    return cast(dict[str, int], ps.session(model).stats(table)["hits_unique"])


def _static(ps: HierarchicalParameterServer, model: str, table: str) -> bool:
    """Whether ``model``'s cache of ``table`` is static (filled with the whole table at start)."""
    return isinstance(ps.session(model).tables[table].cache, StaticEmbeddingCache)


def _check_each_model_reads_its_own(
    ps: HierarchicalParameterServer, want: dict[tuple[str, str], np.ndarray]
) -> None:
    """Every table of every model, twice (the second time from the model's cache)."""
    for _ in range(2):
        for (model, table), rows in want.items():
            got = ps.session(model).lookup(table, QUERY)
            assert torch.equal(got, _expected(rows)), (model, table)
    for model, table in want:
        hits = _hits(ps, model, table)
        # 3, 9, 57 cached on the second pass; a static cache (the whole table) holds them
        # from the start, so both passes hit
        if _static(ps, model, table):
            assert hits["volatile"] == hits["persistent"] == 0, (model, table, hits)
        else:
            assert hits["cache"] == 3, (model, table, hits)


@pytest.mark.parametrize("name", TWO_FOOS)
def test_the_configs_with_two_foos_load_with_tables_scoped_by_model(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HugeCTRFieldWarning)
        cfg = load_config(DATA / name)
    assert [(t.name, t.dim) for m in cfg.models for t in m.tables] == [
        (T0, 16),
        (T0, 64),
        (T1, 32),
    ]
    assert db_table_names(cfg.models) == {
        ("foo", T0): "foo.sparse_embedding0",
        ("bar", T0): "bar.sparse_embedding0",
        ("bar", T1): T1,  # named by one model only: its own name
    }
    with pytest.raises(ValueError, match=r"model 'foo' has no table 'sparse_embedding1'"):
        cfg.db_table("foo", T1)


@pytest.mark.parametrize("name", TWO_FOOS)
def test_each_model_reads_its_own_rows_through_cache_and_volatile_db(
    tmp_path: Path, name: str
) -> None:
    want = _deploy(tmp_path, name)
    ps = _start(tmp_path)
    try:
        _check_each_model_reads_its_own(ps, want)
        vdb = ps.volatile
        assert vdb is not None
        sizes = {t: vdb.size(t) for t in ("foo.sparse_embedding0", "bar.sparse_embedding0", T1)}
        assert sizes == dict.fromkeys(sizes, KEYS.size)
        assert vdb.lookup("foo.sparse_embedding0", KEYS)[0].shape == (KEYS.size, 16)
        assert np.array_equal(vdb.lookup("bar.sparse_embedding0", KEYS)[0], want[("bar", T0)])
    finally:
        ps.close()


def test_each_model_reads_its_own_rows_from_rocksdb(tmp_path: Path) -> None:
    """Half of each table in the volatile DB, every row in RocksDB: the other half comes from
    RocksDB, from each model's own column family."""
    want = _deploy(
        tmp_path,
        TWO_FOOS[0],
        volatile_db={"type": "parallel_hash_map", "initial_cache_rate": 0.5},
        persistent_db={"type": "rocks_db", "path": "pdb"},
    )
    ps = _start(tmp_path)
    try:
        _check_each_model_reads_its_own(ps, want)
        for model, table in want:
            hits = _hits(ps, model, table)
            # the first 10 rows (keys 0 .. 27) were loaded: 3 and 9 from there, 57 from RocksDB
            # a static cache was filled at start from the same two tiers (its rows checked)
            tiers = (0, 0) if _static(ps, model, table) else (2, 1)
            assert (hits["volatile"], hits["persistent"]) == tiers, (model, table, hits)
    finally:
        ps.close()
    pdb = RocksDBBackend(tmp_path / "pdb", read_only=True)
    try:
        assert pdb.has_table("foo.sparse_embedding0") and pdb.has_table("bar.sparse_embedding0")
        assert pdb.has_table(T1) and not pdb.has_table(T0)
        assert np.array_equal(pdb.lookup("foo.sparse_embedding0", KEYS)[0], want[("foo", T0)])
        assert np.array_equal(pdb.lookup("bar.sparse_embedding0", KEYS)[0], want[("bar", T0)])
    finally:
        pdb.close()


@pytest.mark.redis
def test_each_model_reads_its_own_rows_from_redis(redis_cluster: Any, tmp_path: Path) -> None:
    """The Redis hashes of the two tables are ``hps_et.foo.sparse_embedding0.p<p>`` and
    ``hps_et.bar.sparse_embedding0.p<p>``; no hash is named by the bare table name."""
    parts = 4
    want = _deploy(
        tmp_path,
        TWO_FOOS[1],
        volatile_db={
            "type": "redis_cluster",
            "address": redis_cluster.address,
            "num_partitions": parts,
        },
        persistent_db={"type": "rocks_db", "path": "pdb"},
    )
    ps = _start(tmp_path)
    try:
        _check_each_model_reads_its_own(ps, want)
        for model in ("foo", "bar"):
            assert _hits(ps, model, T0)["persistent"] == 0
    finally:
        ps.close()
    nodes = [redis.Redis(port=p) for p in redis_cluster.ports]
    try:
        held = {
            t: sum(
                nodes[redis_cluster.owner(partition_name(t, p))].hlen(partition_name(t, p))
                for p in range(parts)
            )
            for t in ("foo.sparse_embedding0", "bar.sparse_embedding0", T0)
        }
    finally:
        for n in nodes:
            n.close()
    # each partition's hash holds its rows and the load mark
    assert held == {
        "foo.sparse_embedding0": KEYS.size + parts,
        "bar.sparse_embedding0": KEYS.size + parts,
        T0: 0,
    }


def test_an_online_update_reaches_its_own_models_table_only(tmp_path: Path) -> None:
    want = _deploy(
        tmp_path,
        TWO_FOOS[0],
        update_source={"type": "file_log", "path": "updates.log"},
        persistent_db={"type": "rocks_db", "path": "pdb"},
    )
    ps = _start(tmp_path)
    try:
        _check_each_model_reads_its_own(ps, want)  # every row cached
        new = np.full((2, 16), -7.0, np.float32)
        pub = FileLogPublisher(tmp_path / "updates.log")
        pub.publish({"foo.sparse_embedding0": (np.array([3, 9], np.int64), new)})
        applier = ps.update_applier()
        assert applier is not None and applier.poll() == 1
        foo = want[("foo", T0)].copy()
        foo[[1, 3]] = new
        assert torch.equal(ps.session("foo").lookup(T0, QUERY), _expected(foo))
        assert torch.equal(ps.session("bar").lookup(T0, QUERY), _expected(want[("bar", T0)]))
        cached = 9 if _static(ps, "foo", T0) else 6  # a static cache: hits from the first pass
        assert _hits(ps, "foo", T0)["cache"] == cached  # the update, cached
        vdb, pdb = ps.volatile, ps.persistent
        assert vdb is not None and pdb is not None
        for db in (vdb, pdb):
            assert np.array_equal(db.lookup("foo.sparse_embedding0", KEYS)[0], foo)
            assert np.array_equal(db.lookup("bar.sparse_embedding0", KEYS)[0], want[("bar", T0)])
        # the bare name is ambiguous here: refused, naming the names to use, nothing written
        before = pdb.lookup("bar.sparse_embedding0", KEYS)[0]
        with pytest.raises(
            InvalidUpdateError,
            match=r"unknown table 'sparse_embedding0'.*models name 'sparse_embedding0' with "
            r"other rows.*\['bar.sparse_embedding0', 'foo.sparse_embedding0'\]",
        ):
            applier.apply({T0: (np.array([3], np.int64), np.zeros((1, 64), np.float32))}, "x")
        assert np.array_equal(pdb.lookup("bar.sparse_embedding0", KEYS)[0], before)
    finally:
        ps.close()


class _Recorder(UpdatePublisher):
    """A publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.batches: list[UpdateBatch] = []

    def publish(self, batch: UpdateBatch) -> str:
        self.batches.append(batch)
        return str(len(self.batches))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0, self.t1 = torch.nn.Embedding(4, 2), torch.nn.Embedding(4, 2)
        self.embeddings = torch.nn.ModuleDict({T0: self.t0, T1: self.t1})


def test_a_trainer_publishes_under_the_scoped_names_it_is_given() -> None:
    pub, model = _Recorder(), _Model()
    cb = PublishUpdatesCallback(pub, record_names={T0: "bar.sparse_embedding0"})
    cb.on_train_begin(model)
    with torch.no_grad():
        model.t0.weight[2] += 1.0
        model.t1.weight[1] += 1.0
    assert cb.publish_changes(model) == 2
    (batch,) = pub.batches
    assert sorted(batch) == ["bar.sparse_embedding0", T1]
    assert batch["bar.sparse_embedding0"][0].tolist() == [2]
    assert torch.equal(torch.from_numpy(batch["bar.sparse_embedding0"][1]), model.t0.weight[2:3])


def _model(name: str, sparse_file: str, dim: int) -> dict[str, Any]:
    return {
        "model": name,
        "max_batch_size": 4,
        "sparse_files": [sparse_file],
        "embedding_table_names": ["t0"],
        "embedding_vecsize_per_table": [dim],
        "maxnum_catfeature_query_per_table_per_sample": [1],
    }


@pytest.mark.parametrize(
    "models, names",
    [
        ([("a", "s/t0", 4)], ["t0"]),  # one model: its tables keep their names
        ([("a", "s/t0", 4), ("b", "s/t0", 4)], ["t0", "t0"]),  # the same rows: shared
        ([("a", "s/t0", 4), ("b", "s/u0", 4)], ["a.t0", "b.t0"]),  # other files
        ([("a", "s/t0", 4), ("b", "s/t0", 8)], ["a.t0", "b.t0"]),  # another width
        # once two models disagree, every model naming t0 is scoped, even one sharing rows
        ([("a", "s/t0", 4), ("b", "s/u0", 4), ("c", "s/t0", 4)], ["a.t0", "b.t0", "c.t0"]),
    ],
)
def test_database_names(
    tmp_path: Path, models: list[tuple[str, str, int]], names: list[str]
) -> None:
    cfg = parse_config({"models": [_model(*m) for m in models]}, tmp_path)
    assert [cfg.db_table(m.model, "t0") for m in cfg.models] == names


def test_device_auto_is_the_last_deployed_device_as_in_hugectr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HugeCTR: ``params.device_id = params.deployed_devices.back()`` (inference_utils.cpp)."""
    model = ModelConfig(
        "m", (TableSpec("t0", "", 4, 1),), 4, deployed_device_list=(0, 3), device="auto"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(model) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(model) == torch.device("cpu")
