"""Tabular sources: the four inputs give the same batches; splits, vocabularies and dense
statistics come from the training rows only; ranks cut global batches as CriteoBinary does;
the fitted state round-trips; a Parquet file larger than the memory allowed reads in bounded
memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embark.data import (
    Categorical,
    ColumnTransform,
    Dense,
    OOVPolicy,
    Preprocessor,
    Split,
    Splits,
    TabularSource,
    TabularSpec,
    local_range,
)
from embark.types import HotnessPolicy

ROOT = Path(__file__).resolve().parents[3]


def _frame(n: int = 500, seed: int = 0) -> pd.DataFrame:
    g = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "user": g.integers(0, 60, n),
            "city": g.choice(["paris", "lyon", "nice", "brest"], n),
            "tags": ["|".join(map(str, g.integers(0, 9, g.integers(0, 4)))) for _ in range(n)],
            "count": g.integers(0, 1000, n).astype(np.float64),
            "t": np.arange(n, dtype=np.int64) * 10,
            "y": g.integers(0, 2, n),
        }
    )


SPEC = TabularSpec(
    categorical=(
        Categorical("user", min_count=2),
        Categorical("city"),
        Categorical("tags", multi_hot=True, separator="|"),
    ),
    dense=(Dense("count", ColumnTransform.LOG1P_STANDARDIZE), Dense("t", ColumnTransform.NONE)),
    label="y",
    splits=Splits(fractions=(0.6, 0.2, 0.2), seed=3),
)


def _sources(
    tmp_path: Path, df: pd.DataFrame, spec: TabularSpec = SPEC
) -> dict[str, TabularSource]:
    df.to_parquet(tmp_path / "d.parquet", index=False, row_group_size=97)
    df.to_csv(tmp_path / "d.csv", index=False)
    return {
        "pandas": TabularSource.from_pandas(df, spec, chunk_rows=64),
        "arrow": TabularSource.from_arrow(pa.Table.from_pandas(df), spec, chunk_rows=1000),
        "parquet": TabularSource.from_parquet(tmp_path / "d.parquet", spec, chunk_rows=50),
        "csv": TabularSource.from_csv(tmp_path / "d.csv", spec, chunk_rows=33),
    }


def _same(a, b) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and a.sparse.equals(b.sparse)
    )


def test_every_source_gives_the_same_fit_and_batches(tmp_path) -> None:
    df = _frame()
    df.loc[5, "tags"] = ""  # an empty bag
    sources = _sources(tmp_path, df)
    preps = {k: s.fit() for k, s in sources.items()}
    ref = preps["pandas"]
    for k, p in preps.items():
        assert p.vocabularies == ref.vocabularies, k
        assert p.hotness == ref.hotness and p.train_rows == ref.train_rows, k
        np.testing.assert_allclose(p.dense_mean, ref.dense_mean, rtol=1e-12)
    want = list(sources["pandas"].batches(ref, Split.EVAL, 16))
    for k, s in sources.items():
        got = list(s.batches(ref, Split.EVAL, 16))
        assert len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want)), k


def test_split_is_deterministic_disjoint_and_covers_every_row(tmp_path) -> None:
    df = _frame(2000)
    src = TabularSource.from_pandas(df, SPEC, chunk_rows=128)
    again = TabularSource.from_pandas(df, SPEC, chunk_rows=999)
    parts = {}
    for split in (Split.TRAIN, Split.EVAL, Split.TEST):
        t = [c.column("t").to_pylist() for c in src.split_chunks(split)]
        parts[split] = sorted(x for chunk in t for x in chunk)
        t2 = [c.column("t").to_pylist() for c in again.split_chunks(split)]
        assert parts[split] == sorted(x for chunk in t2 for x in chunk)  # chunking-independent
    allrows = sorted(parts[Split.TRAIN] + parts[Split.EVAL] + parts[Split.TEST])
    assert allrows == df["t"].tolist()
    n = len(df)
    assert abs(len(parts[Split.TRAIN]) / n - 0.6) < 0.04
    assert abs(len(parts[Split.TEST]) / n - 0.2) < 0.04


def test_time_split_cuts_by_the_time_column() -> None:
    df = _frame(1000)
    spec = TabularSpec(
        SPEC.categorical, SPEC.dense, "y", splits=Splits((0.7, 0.1, 0.2), time_column="t")
    )
    src = TabularSource.from_pandas(df, spec, chunk_rows=100)
    lo, hi = src.time_cuts()
    train = np.concatenate([c.column("t").to_numpy() for c in src.split_chunks(Split.TRAIN)])
    test = np.concatenate([c.column("t").to_numpy() for c in src.split_chunks(Split.TEST)])
    assert train.max() < lo <= hi <= test.min()
    assert len(train) == 700 - 1 or len(train) == 700  # the quantile's side of the cut
    fixed = TabularSpec(
        SPEC.categorical, SPEC.dense, "y", splits=Splits(time_column="t", time_cuts=(100.0, 200.0))
    )
    src = TabularSource.from_pandas(df, fixed)
    ev = np.concatenate([c.column("t").to_numpy() for c in src.split_chunks(Split.EVAL)])
    assert ev.tolist() == list(range(100, 200, 10))


def test_vocabularies_and_statistics_come_from_training_rows_only() -> None:
    df = _frame(3000)
    src = TabularSource.from_pandas(df, SPEC)
    prep = src.fit()
    train = pd.concat([c.to_pandas() for c in src.split_chunks(Split.TRAIN)])
    counts = train["user"].value_counts()
    kept = sorted(counts[counts >= 2].index.tolist(), key=lambda k: (-counts[k], k))
    assert list(prep.vocabularies["user"].keys) == kept  # by count, ties by id
    x = np.log1p(train["count"].to_numpy())
    np.testing.assert_allclose(prep.dense_mean[0], x.mean(), rtol=1e-10)
    np.testing.assert_allclose(prep.dense_std[0], x.std(), rtol=1e-10)
    tags = train["tags"].map(lambda s: len([t for t in s.split("|") if t]))
    assert prep.hotness["tags"] == tags.max() and prep.hotness["user"] == 1
    w = prep.workload(dim=8, table_overrides={"city": {"dim": 4}})
    assert [(t.name, t.num_rows, t.dim) for t in w.tables] == [
        ("user", len(kept) + 1, 8),
        ("city", 5, 4),
        ("tags", 10, 8),
    ]
    with pytest.raises(ValueError, match="'user': \\['num_rows'\\] come from the vocabulary"):
        prep.workload(table_overrides={"user": {"num_rows": 3}})
    with pytest.raises(ValueError, match="no table 'nope'"):
        prep.workload(table_overrides={"nope": {"dim": 3}})


def test_unknown_ids_go_to_the_reserved_row_or_hashed_buckets() -> None:
    df = _frame(400)
    spec = TabularSpec(
        (Categorical("user", max_size=5), Categorical("city", oov=OOVPolicy.HASH, oov_buckets=3)),
        SPEC.dense,
        "y",
    )
    prep = TabularSource.from_pandas(df, spec).fit()
    rows = df.head(4).assign(user=[10**9, -5, 123456, 1], city=["rome", "oslo", "rome", "paris"])
    sp = prep.encode(rows).sparse
    users = sp.values_for("user").tolist()
    assert users[:3] == [5, 5, 5]  # 5 known ids, row 5 reserved
    cities = sp.values_for("city").tolist()
    assert cities[0] == cities[2] and all(4 <= c < 7 for c in cities[:3])
    assert cities[3] == list(prep.vocabularies["city"].keys).index("paris")


def test_ranks_cut_each_global_batch_as_criteo_binary_does() -> None:
    df = _frame(700)
    src = TabularSource.from_pandas(df, SPEC, chunk_rows=77)
    prep = src.fit()
    for shuffle in (False, True):
        kw = dict(shuffle=shuffle, seed=4, epoch=1, shuffle_window=150)
        world = list(src.batches(prep, Split.TRAIN, 30, **kw))
        ranks = [
            list(src.batches(prep, Split.TRAIN, 30, rank=r, world_size=3, **kw)) for r in range(3)
        ]
        assert all(len(r) == len(world) for r in ranks)
        for i, whole in enumerate(world):
            dense = torch.cat([ranks[r][i].dense for r in range(3)])
            assert torch.equal(dense, whole.dense)
            lo, hi = local_range(whole.batch_size, 1, 3)
            assert ranks[1][i].batch_size == hi - lo
    plain = torch.cat([b.labels for b in src.batches(prep, Split.TRAIN, 30)])
    shuffled = [
        torch.cat([b.dense for b in src.batches(prep, Split.TRAIN, 30, shuffle=True, epoch=e)])
        for e in (0, 1)
    ]
    assert not torch.equal(shuffled[0], shuffled[1]) and plain.numel() == shuffled[0].shape[0]
    assert len(list(src.batches(prep, Split.TRAIN, 30, drop_last=True))) == plain.numel() // 30


def test_hotness_policy_applies_to_source_bags() -> None:
    df = _frame(300)
    df.loc[df.index[-1], "tags"] = "1|2|3|4|5|6|7"
    spec = TabularSpec(
        (Categorical("tags", multi_hot=True, separator="|", hotness=3),),
        SPEC.dense,
        "y",
        splits=Splits((1.0, 0.0, 0.0)),
    )
    from embark.data import HotnessError

    with pytest.raises(HotnessError, match="table 'tags': sample .* bag of 7 ids but hotness"):
        src = TabularSource.from_pandas(df, spec)
        list(src.batches(src.fit(), Split.TRAIN, 1000))
    trunc = TabularSpec(
        (
            Categorical(
                "tags",
                multi_hot=True,
                separator="|",
                hotness=3,
                hotness_policy=HotnessPolicy.TRUNCATE,
            ),
        ),
        SPEC.dense,
        "y",
        splits=Splits((1.0, 0.0, 0.0)),
    )
    src = TabularSource.from_pandas(df, trunc)
    (b,) = src.batches(src.fit(), Split.TRAIN, 1000)
    assert int(b.sparse.lengths.max()) == 3


def test_preprocessor_round_trips_and_refuses_other_versions(tmp_path) -> None:
    prep = TabularSource.from_pandas(_frame(), SPEC).fit()
    prep.save(tmp_path / "m")
    back = Preprocessor.load(tmp_path / "m")
    assert back == prep and back.vocabularies == prep.vocabularies
    rows = _frame(20, seed=9)
    assert _same(back.encode(rows), prep.encode(rows))
    doc = json.loads((tmp_path / "m" / "vocabulary.json").read_text())
    assert doc["format"] == "tilerec.vocabulary" and doc["version"] == 1
    doc["version"] = 2
    (tmp_path / "m" / "vocabulary.json").write_text(json.dumps(doc))
    with pytest.raises(
        ValueError, match="tilerec.vocabulary version 2; this embark reads version 1"
    ):
        Preprocessor.load(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["tabular.json", "vocabulary.json"]


def test_missing_columns_are_named(tmp_path) -> None:
    df = _frame().drop(columns=["city"])
    for src in _sources(tmp_path, df).values():
        with pytest.raises(KeyError, match=r"no column\(s\) \['city'\]"):
            src.fit()


_BOUNDED = """
import resource, sys
import pyarrow.parquet as pq
from embark.data import Categorical, Dense, Split, TabularSource, TabularSpec
spec = TabularSpec((Categorical("id"),), tuple(Dense(f"x{j}") for j in range(4)), "y")
warm = TabularSource.from_parquet(sys.argv[2], spec, chunk_rows=256)  # import everything first
list(warm.batches(warm.fit(), Split.TRAIN, 256))
def vm():
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmSize"))
limit = vm() + int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
src = TabularSource.from_parquet(sys.argv[1], spec, chunk_rows=8192)
prep = src.fit()
rows = sum(b.batch_size for b in src.batches(prep, Split.TRAIN, 8192))
try:
    pq.read_table(sys.argv[1], use_threads=False, pre_buffer=False)
    whole = "read"
except MemoryError:
    whole = "refused"
print(prep.train_rows, rows, whole)
"""


@pytest.mark.slow
def test_a_parquet_file_larger_than_the_address_space_allowed_streams(tmp_path) -> None:
    g = np.random.default_rng(0)
    schema = pa.schema(
        [("id", pa.int64())] + [(f"x{j}", pa.float64()) for j in range(4)] + [("y", pa.int64())]
    )
    big, n_groups, rows = tmp_path / "big.parquet", 24, 100_000
    with pq.ParquetWriter(big, schema, compression="none", use_dictionary=False) as w:
        for _ in range(n_groups):
            cols = {"id": g.integers(0, 500, rows), **{f"x{j}": g.random(rows) for j in range(4)}}
            w.write_table(pa.table({**cols, "y": g.integers(0, 2, rows)}, schema=schema))
    small = tmp_path / "small.parquet"
    pq.write_table(pa.Table.from_batches([next(pq.ParquetFile(big).iter_batches(1000))]), small)
    allowance = 40 << 20
    assert big.stat().st_size > 2 * allowance  # 110 MiB file, 40 MiB of address space
    # The system allocator and one malloc arena: jemalloc (Arrow's default pool) keeps address
    # space reserved ahead, under which a limit set after the warm-up would not bind.
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "ARROW_DEFAULT_MEMORY_POOL": "system",
        "MALLOC_ARENA_MAX": "1",
    }
    r = subprocess.run(
        [sys.executable, "-c", _BOUNDED, str(big), str(small), str(allowance)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    train, batched, whole = r.stdout.split()
    assert int(train) == int(batched) and 0.75 < int(train) / (n_groups * rows) < 0.85
    assert whole == "refused"  # the limit binds: the file cannot be read whole under it
