from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from embark.data.batch import Batch, local_batch
from embark.data.binary import CriteoBinary, expand_multi_hot
from embark.data.convert import convert_criteo
from embark.data.criteo import CriteoTSV
from embark.data.criteo_sample import write_criteo_like
from embark.data.manifest import DenseTransform
from embark.models.workloads import get_workload

W = get_workload("dlrm_dcnv2").scaled(100_000)
ROOT = Path(__file__).resolve().parents[3]


def _same(a: Batch, b: Batch) -> None:
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.dense, b.dense)
    assert a.sparse.keys == b.sparse.keys
    assert torch.equal(a.sparse.values, b.sparse.values)
    assert torch.equal(a.sparse.lengths, b.sparse.lengths)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[list[Path], Path]:
    """Two inputs (one gzipped; 700 + 333 lines) and their conversion."""
    d = tmp_path_factory.mktemp("criteo")
    a = write_criteo_like(d / "day_0", 700, seed=11)
    b = write_criteo_like(d / "day_1.gz", 333, seed=12)
    convert_criteo([a, b], d / "bin", chunk_bytes=30_000)
    return [a, b], d / "bin"


@pytest.mark.parametrize("batch_size", [64, 1000, 4096])
def test_batches_equal_criteo_tsv(data, batch_size):
    tsv, folder = data
    ours = list(CriteoBinary(folder, W, batch_size))
    theirs = list(CriteoTSV(tsv, W, batch_size))
    assert len(ours) == len(theirs) == -(-1033 // batch_size)
    for a, b in zip(ours, theirs):
        _same(a, b)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_slices_are_local_batches_disjoint_and_covering(data, world):
    _, folder = data
    whole = list(CriteoBinary(folder, W, 100))
    ranks = [list(CriteoBinary(folder, W, 100, rank=r, world_size=world)) for r in range(world)]
    for i, batch in enumerate(whole):  # 10 full batches and one of 33 across both files
        for r in range(world):
            _same(ranks[r][i], local_batch(batch, r, world))
        got = torch.cat([ranks[r][i].dense for r in range(world)])
        assert torch.equal(got, batch.dense)  # slices in rank order cover the batch once


def test_shuffle_is_a_permutation_per_window_deterministic_by_seed(tmp_path):
    lines = [f"{i % 2}\t{i}" + "\t" * 38 + "\n" for i in range(1000)]  # I1 = line number
    (tmp_path / "d").write_text("".join(lines))
    convert_criteo([tmp_path / "d"], tmp_path / "bin")

    def order(seed: int, rank: int = 0, world: int = 1, epoch: int = 0) -> list[int]:
        r = CriteoBinary(
            tmp_path / "bin", W, 64, rank=rank, world_size=world, shuffle=True, seed=seed,
            shuffle_window=256,
        )  # fmt: skip
        dense = [b.dense[:, 0].double().expm1() for b in r.batches(epoch=epoch)]
        return [round(v) for v in torch.cat(dense).tolist()]

    a = order(1)
    assert sorted(a) == list(range(1000)) and a != list(range(1000))
    assert a == order(1) and a != order(2) and a != order(1, epoch=1)
    assert all(w * 256 <= v < (w + 1) * 256 for w in range(4) for v in a[w * 256 : (w + 1) * 256])
    per_rank = [order(1, r, 3) for r in range(3)]
    assert sorted(sum(per_rank, [])) == list(range(1000))


def test_multi_hot_expansion(data):
    _, folder = data
    one = next(iter(CriteoBinary(folder, W, 256)))
    many = next(iter(CriteoBinary(folder, W, 256, multi_hot=True, seed=5)))
    again = next(iter(CriteoBinary(folder, W, 256, multi_hot=True, seed=5)))
    _same(many, again)
    for t in W.tables:
        bags = many.sparse.values_for(t.name).view(256, t.hotness)
        assert torch.equal(
            many.sparse.lengths_for(t.name), torch.full((256,), t.hotness, dtype=torch.int32)
        )
        assert torch.equal(bags[:, 0], one.sparse.values_for(t.name))
        assert int(bags.min()) >= 0 and int(bags.max()) < t.num_rows
    rows = np.array([3, 9, 3], dtype=np.int64)
    bag = expand_multi_hot(rows, 1000, 4, seed=7, table=2)
    assert bag.shape == (3, 4) and bag[:, 0].tolist() == [3, 9, 3]
    assert bag[0].tolist() == bag[2].tolist() and bag[0].tolist() != bag[1].tolist()
    assert bag.tolist() != expand_multi_hot(rows, 1000, 4, seed=8, table=2).tolist()


def test_errors_name_the_bad_value(data, tmp_path):
    _, folder = data
    with pytest.raises(FileNotFoundError, match="nowhere"):
        CriteoBinary(tmp_path / "nowhere", W, 8)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        CriteoBinary(folder, W, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        CriteoBinary(folder, W, 0)
    tiny = get_workload("tiny")
    with pytest.raises(
        ValueError,
        match=r"day_0_sparse.npy: expected shape \(700, 8\) of int64/int32, got \(700, 26\)",
    ):
        CriteoBinary(folder, tiny, 8)
    with pytest.raises(IndexError, match=r"batch 11 is outside \[0, 11\)"):
        CriteoBinary(folder, W, 100).batch(11)


class _LocalFiles:
    """iopath's ``PathManager`` for local files (TorchRec opens dataset files through iopath,
    its optional ``datasets`` extra, which this environment does not install)."""

    def open(self, path: str, mode: str = "r", **kwargs: object):  # noqa: ANN201
        return open(path, mode)

    def set_strict_kwargs_checking(self, flag: bool) -> None:
        pass


class _LocalFilesFactory:
    def get(self, key: str) -> _LocalFiles:
        return _LocalFiles()


def _iopath(monkeypatch) -> None:
    try:
        import iopath.common.file_io  # noqa: F401
    except ImportError:
        for name in ("iopath", "iopath.common"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        file_io = types.ModuleType("iopath.common.file_io")
        file_io.PathManagerFactory = _LocalFilesFactory  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "iopath.common.file_io", file_io)


def test_torchrec_reads_ours_and_we_read_torchrecs(data, tmp_path, monkeypatch):
    from torchrec.datasets import criteo

    _iopath(monkeypatch)
    tsv, folder = data
    # TorchRec's converter on the same input: same labels and raw ids; its own dense transform
    criteo.BinaryCriteoUtils.tsv_to_npys(
        str(tsv[0]), *(str(tmp_path / f"day_0_{k}.npy") for k in ("dense", "sparse", "labels"))
    )
    for kind in ("sparse", "labels"):
        assert np.array_equal(
            np.load(tmp_path / f"day_0_{kind}.npy"), np.load(folder / f"day_0_{kind}.npy")
        )
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}' holds no criteo_binary.json"):
        CriteoBinary(tmp_path, W, 700)  # no manifest: passed as prefixes, with their transform
    theirs = CriteoBinary([tmp_path / "day_0"], W, 700, dense_transform=DenseTransform.TORCHREC)
    assert theirs.dense_transform == "torchrec"
    ours = next(iter(CriteoBinary(folder, W, 700)))
    got = next(iter(theirs))
    assert torch.equal(got.labels, ours.labels) and got.sparse.equals(ours.sparse)
    # TorchRec's datapipe on our files, hashing as we do: same labels and ids
    pipe = criteo.InMemoryBinaryCriteoIterDataPipe(
        "train",
        [str(folder / f"day_{d}_dense.npy") for d in (0, 1)],
        [str(folder / f"day_{d}_sparse.npy") for d in (0, 1)],
        [str(folder / f"day_{d}_labels.npy") for d in (0, 1)],
        batch_size=128, rank=0, world_size=1, hashes=[t.num_rows for t in W.tables],
    )  # fmt: skip
    for tr, mine in zip(pipe, CriteoBinary(folder, W, 128), strict=True):
        assert torch.equal(tr.labels.float(), mine.labels)
        assert torch.equal(tr.sparse_features.values(), mine.sparse.values)
        assert torch.equal(tr.dense_features, mine.dense)


_BOUNDED = """
import resource, sys, numpy as np
from embark.data.binary import CriteoBinary
from embark.models.workloads import get_workload
w = get_workload("dlrm_dcnv2").scaled(100_000)
reader = CriteoBinary([sys.argv[1] + "/big"], w, 65536)
def vm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
budget = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (vm() + budget, resource.RLIM_INFINITY))
try:
    np.load(sys.argv[1] + "/big_sparse.npy")
    print("loaded whole")
except MemoryError:
    print("whole file refused")
n = sum(int(b.labels.numel()) for b in reader)
hwm = next(int(s.split()[1]) for s in open("/proc/self/status") if s.startswith("VmHWM:"))
print(n, hwm // 1024, "MiB peak RSS")
"""


def test_reading_is_bounded_in_memory_under_an_address_space_limit(tmp_path):
    rows, budget = 800_000, 128 << 20  # 166 MB of ids: larger than the whole budget
    for kind, dtype, shape in (("dense", np.float32, (rows, 13)), ("sparse", np.int64, (rows, 26)),
                               ("labels", np.int32, (rows, 1))):  # fmt: skip
        arr = np.lib.format.open_memmap(tmp_path / f"big_{kind}.npy", "w+", dtype, shape)
        arr[-1] = 1  # the rest stays a hole in the file
        del arr
    assert (tmp_path / "big_sparse.npy").stat().st_size > budget
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_BOUNDED), str(tmp_path), str(budget)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    refused, counted = run.stdout.split("\n")[:2]
    assert refused == "whole file refused"
    assert int(counted.split()[0]) == rows


def test_tsv_gz_matches_plain_in_binary(data, tmp_path):
    tsv, _ = data
    plain = tmp_path / "day_1"
    plain.write_bytes(gzip.decompress(tsv[1].read_bytes()))
    convert_criteo([plain], tmp_path / "bin")
    _same(next(iter(CriteoBinary(tmp_path / "bin", W, 400))), next(iter(CriteoTSV(tsv[1], W, 400))))
