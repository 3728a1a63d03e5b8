"""ps.json values the config check refuses, each naming the field, the value and what was
expected: values that otherwise fail later (a traceback, a machine out of memory) or that
would let the server guess rows (a Redis-only config with asynchronous insertion)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hps.config import MAX_BATCH_SIZE, MAX_PARTITIONS, load_config, parse_config
from hps.server import main


def _doc(vdb: dict[str, Any] | None = None, pdb: dict[str, Any] | None = None, **model: Any):
    m = {
        "model": "dlrm",
        "max_batch_size": 64,
        "sparse_files": ["s/t0"],
        "embedding_table_names": ["t0"],
        "embedding_vecsize_per_table": [8],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        **model,
    }
    return {
        "volatile_db": vdb or {"type": "parallel_hash_map"},
        "persistent_db": pdb or {"type": "rocks_db", "path": "pdb"},
        "models": [m],
    }


def test_a_persistent_db_path_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("not a database")
    with pytest.raises(ValueError) as e:
        parse_config(_doc(pdb={"type": "rocks_db", "path": "afile"}), tmp_path)
    assert str(e.value) == (
        f"persistent_db.path: {str(tmp_path / 'afile')!r} is impossible; expected a folder "
        "for the rocks_db (it is a file)"
    )
    with pytest.raises(ValueError, match=r"persistent_db\.path: .* \(it lies under the file .*"):
        parse_config(_doc(pdb={"type": "rocks_db", "path": "afile/db"}), tmp_path)
    # the server reports it as it reports the other config errors: exit 2, no traceback
    cfg = tmp_path / "ps.json"
    cfg.write_text(json.dumps(_doc(pdb={"type": "rocks_db", "path": "afile"})))
    with pytest.raises(SystemExit) as ex:
        main(["--config", str(cfg)])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "persistent_db.path" in err and "(it is a file)" in err
    assert "Traceback" not in err
    # a folder, or a path not there yet, is fine
    (tmp_path / "db").mkdir()
    for path in ("db", "new/db"):
        cfg_ok = parse_config(_doc(pdb={"type": "rocks_db", "path": path}), tmp_path)
        assert cfg_ok.persistent_db.path == str(tmp_path / path)


def test_a_cuda_device_this_machine_lacks_is_refused() -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:{n}"  # one past the last device: cuda:0 on a machine without a GPU
    with pytest.raises(ValueError) as e:
        parse_config(_doc(device=device))
    msg = str(e.value)
    assert msg.startswith(f"models[0].device: {device!r} is impossible; expected ")
    if n == 0:
        assert "CUDA is not available on this machine" in msg
    for bad in ("gpu", "cuda:x", "cuda:-1", "CUDA"):
        with pytest.raises(ValueError, match=re.escape(f"models[0].device: {bad!r} is impossible")):
            parse_config(_doc(device=bad))
    assert parse_config(_doc(device="cpu")).models[0].device == "cpu"


@pytest.mark.parametrize(
    "doc, field, value",
    [
        (_doc(vdb={"type": "parallel_hash_map", "num_partitions": 10**8}), "volatile_db.num_partitions", 10**8),
        (_doc(vdb={"type": "parallel_hash_map", "num_partitions": MAX_PARTITIONS + 1}), "volatile_db.num_partitions", MAX_PARTITIONS + 1),
        (_doc(max_batch_size=2**70), "models[0].max_batch_size", 2**70),
        (_doc(max_batch_size=MAX_BATCH_SIZE + 1), "models[0].max_batch_size", MAX_BATCH_SIZE + 1),
        (_doc(vdb={"type": "hash_map", "max_batch_size": 2**70}), "volatile_db.max_batch_size", 2**70),
        (_doc(pdb={"type": "rocks_db", "path": "p", "max_batch_size": 2**70}), "persistent_db.max_batch_size", 2**70),
    ],
)  # fmt: skip
def test_sizes_past_their_documented_limit_are_refused(doc: dict, field: str, value: int) -> None:
    limit = "MAX_PARTITIONS" if "partitions" in field else "MAX_BATCH_SIZE"
    with pytest.raises(ValueError) as e:
        parse_config(doc)
    bound = MAX_PARTITIONS if "partitions" in field else MAX_BATCH_SIZE
    assert str(e.value) == (
        f"{field}: {value!r} is impossible; expected an integer in [1, {bound}] (hps.config.{limit})"
    )


def test_sizes_at_their_limit_are_accepted() -> None:
    cfg = parse_config(
        _doc(
            vdb={"type": "hash_map", "num_partitions": MAX_PARTITIONS, "max_batch_size": MAX_BATCH_SIZE},
            pdb={"type": "rocks_db", "path": "p", "max_batch_size": MAX_BATCH_SIZE},
            max_batch_size=MAX_BATCH_SIZE,
        )
    )  # fmt: skip
    assert cfg.volatile_db.num_partitions == MAX_PARTITIONS
    assert cfg.models[0].max_batch_size == MAX_BATCH_SIZE


_REDIS = {"type": "redis_cluster", "address": "127.0.0.1:7000"}


def test_redis_as_the_only_tier_refuses_asynchronous_insertion(tmp_path: Path) -> None:
    """With a Redis cluster as the only database, a cache miss answered with the default vector
    without reading Redis (HugeCTR's asynchronous insertion) would keep answering a down node's
    keys so for the whole outage: refused, naming the field and the ways out."""
    p = tmp_path / "ps.json"
    p.write_text(json.dumps(_doc(vdb=_REDIS, pdb={"type": "none"})))  # gpucache on by default
    with pytest.raises(ValueError) as e:
        load_config(p)
    msg = str(e.value)
    assert msg.startswith("models[0].cache_exact: False is impossible; expected true (or ")
    assert "hit_rate_threshold 1.0, or gpucache false, or a persistent_db" in msg
    ok = [
        _doc(vdb=_REDIS, pdb={"type": "none"}, cache_exact=True),
        _doc(vdb=_REDIS, pdb={"type": "none"}, hit_rate_threshold=1.0),
        _doc(vdb=_REDIS, pdb={"type": "none"}, gpucache=False),
        _doc(vdb=_REDIS),  # a persistent db holds every row: a failed key falls through to it
        _doc(pdb={"type": "none"}),  # an in-process hash map does not fail
    ]
    for d in ok:
        assert parse_config(d, tmp_path).models[0].model == "dlrm"
