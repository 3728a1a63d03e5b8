"""No write outside its target folder, by any writer (issue #22, item 3).

Hostile names (``../victim``, an absolute path, ``a/b``) reach the writers through a checkpoint's
``state.json``, a ``ps.json``, a workload or a ``model_name`` argument; symlinks planted inside
an output folder point at a "victim" folder beside it. Each test snapshots the victim (every
entry, file bytes and link targets, links never followed) and checks it is unchanged, whether
the writer refused or went ahead.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import embark.names
import hps.names
from embark.models.dlrm import build_model
from embark.models.workloads import Workload, get_workload
from embark.types import TableConfig
from export.artifacts import write_serving_artifacts
from hps.config import parse_config
from hps.storage.sparse_files import convert_checkpoint, read_table, write_table

Snapshot = dict[str, tuple[str, str | bytes]]


def _snapshot(root: Path) -> Snapshot:
    """Every entry under ``root``: ``{relative path: ("dir", "") | ("file", bytes) |
    ("link", target)}``; links are recorded, never followed."""
    out: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", "")
            else:
                out[rel] = ("file", p.read_bytes())
    return out


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """``tmp_path/victim``: a folder beside the writers' output folders, with a table's files."""
    v = tmp_path / "victim"
    (v / "emb").mkdir(parents=True)
    (v / "keep.txt").write_text("must survive")
    (v / "emb" / "key").write_bytes(b"\x01" * 16)
    return v


def _checkpoint(folder: Path, names: list[str], rows: int = 5, dim: int = 2) -> None:
    """A trainer-layout checkpoint whose ``state.json`` names ``names`` as its tables."""
    folder.mkdir(parents=True)
    save_file(
        {f"embeddings.{n}.weight": torch.ones(rows, dim) for n in names},
        str(folder / "model.safetensors"),
    )
    tables = [
        {"name": n, "num_rows": rows, "dim": dim, "hotness": 1, "combiner": "sum"} for n in names
    ]
    (folder / "state.json").write_text(json.dumps({"workload": {"name": "x", "tables": tables}}))


HOSTILE = ["../victim", "../victim/emb", "a/b", "..", ".", "", "x.y", "t 0"]


# ---------------------------------------------------------------------- convert_checkpoint
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("name", [*HOSTILE, "ABSOLUTE"])
def test_convert_checkpoint_refuses_a_table_name_that_leaves_the_folder(
    tmp_path: Path, victim: Path, name: str, overwrite: bool
) -> None:
    name = str(victim) if name == "ABSOLUTE" else name
    _checkpoint(tmp_path / "ckpt", ["t0", name])
    out = tmp_path / "out"
    out.mkdir()
    before, out_before = _snapshot(victim), _snapshot(out)
    with pytest.raises(
        ValueError, match=r"table name .* is not a valid name; expected 1 to 128 ASCII"
    ):
        convert_checkpoint(tmp_path / "ckpt", out, overwrite=overwrite)
    assert _snapshot(victim) == before
    assert _snapshot(out) == out_before  # checked before anything was written (t0 included)


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("target", ["victim", "victim/emb", "victim/keep.txt", "victim/absent"])
def test_a_symlink_in_the_output_folder_is_never_written_or_deleted_through(
    tmp_path: Path, victim: Path, target: str, overwrite: bool
) -> None:
    """``out/t0`` a symlink to the victim folder, a folder in it, a file in it, or a path that
    does not exist: refused as taken, or (``overwrite``) replaced by a real folder; the
    victim is untouched either way."""
    _checkpoint(tmp_path / "ckpt", ["t0"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "t0").symlink_to(tmp_path / target)
    before = _snapshot(victim)
    if not overwrite:
        with pytest.raises(ValueError, match="exists; pass overwrite=True"):
            convert_checkpoint(tmp_path / "ckpt", out)
        assert (out / "t0").is_symlink()
    else:
        convert_checkpoint(tmp_path / "ckpt", out, overwrite=True)
        assert not (out / "t0").is_symlink() and (out / "t0").is_dir()
        keys, rows = read_table(out / "t0", dim=2)
        assert keys.tolist() == list(range(5)) and np.array_equal(rows, np.ones((5, 2)))
        assert sorted(p.name for p in out.iterdir()) == ["t0"]  # no hidden leftovers
    assert _snapshot(victim) == before


def test_write_table_refuses_a_folder_named_dot_dot(tmp_path: Path, victim: Path) -> None:
    before = _snapshot(victim)
    keys, rows = np.arange(3, dtype=np.int64), np.zeros((3, 2), np.float32)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"'\.\.' does not name an entry inside"):
            write_table(victim / "emb" / "..", keys, rows, overwrite=overwrite)
    assert _snapshot(victim) == before


# ------------------------------------------------------------------- serving artifacts
@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return build_model(get_workload("tiny"), seed=0).eval()


@pytest.mark.parametrize("name", [*HOSTILE, "ABSOLUTE", "dlrm/v2"])
def test_write_serving_artifacts_refuses_a_model_name_that_is_not_a_name(
    tmp_path: Path, victim: Path, tiny_model, name: str
) -> None:
    """A ``/`` in a model name would be accepted and then answer 404 (its URL has one path
    segment per name); ``../victim`` would name no model the server can route to."""
    name = str(victim) if name == "ABSOLUTE" else name
    before = _snapshot(victim)
    with pytest.raises(ValueError, match=r"model_name .* is not a valid name"):
        write_serving_artifacts(tiny_model, tmp_path / "art", model_name=name)
    assert not (tmp_path / "art").exists() and _snapshot(victim) == before


@pytest.mark.parametrize("entry", ["ps.json", "dense.onnx", "sparse/t0"])
def test_write_serving_artifacts_replaces_a_planted_link_without_following_it(
    tmp_path: Path, victim: Path, tiny_model, entry: str
) -> None:
    art = tmp_path / "art"
    write_serving_artifacts(tiny_model, art)
    planted = art / entry
    target = victim / "emb" if entry == "sparse/t0" else victim / "keep.txt"
    if planted.is_dir():
        shutil.rmtree(planted)
    else:
        planted.unlink()
    planted.symlink_to(target)
    before = _snapshot(victim)
    write_serving_artifacts(tiny_model, art, overwrite=True)
    assert not planted.is_symlink() and planted.exists()
    assert _snapshot(victim) == before
    assert not [p for p in art.rglob(".*")]  # no staging or backup left behind


# ----------------------------------------------------------- names refused where they enter
@pytest.mark.parametrize("name", [*HOSTILE, "/abs/t", "é", "-t0", "t" * 129])
def test_table_config_refuses_a_name_that_breaks_the_rule(name: str) -> None:
    with pytest.raises(ValueError, match=r"TableConfig.name .* is not a valid name"):
        TableConfig(name, 10, 4)


def test_a_workload_file_with_a_hostile_table_name_is_refused() -> None:
    doc = get_workload("tiny").to_dict()
    doc["tables"][0]["name"] = "../victim"
    with pytest.raises(ValueError, match=r"TableConfig.name '\.\./victim' is not a valid name"):
        Workload.from_dict(doc)


def _ps_doc(model: str = "m", tables: tuple[str, ...] = ("t0",)) -> dict:
    return {
        "volatile_db": {"type": "hash_map"},
        "models": [
            {
                "model": model,
                "max_batch_size": 4,
                "sparse_files": [f"sparse/{t}" for t in tables],
                "embedding_table_names": list(tables),
                "embedding_vecsize_per_table": [4] * len(tables),
                "maxnum_catfeature_query_per_table_per_sample": [1] * len(tables),
            }
        ],
    }


@pytest.mark.parametrize("name", [*HOSTILE, "/abs/m", "dlrm/v2"])
def test_ps_json_refuses_model_and_table_names_that_are_not_names(name: str) -> None:
    with pytest.raises(ValueError, match=r"models\[0\]\.model: .* expected 1 to 128 ASCII letters"):
        parse_config(_ps_doc(model=name))
    with pytest.raises(
        ValueError,
        match=r"models\[0\]\.embedding_table_names\[1\]: .* expected 1 to 128 ASCII letters",
    ):
        parse_config(_ps_doc(tables=("t0", name)))


@pytest.mark.parametrize("name", ["t0", "_x", "T_1", "user_id", "dlrm-v2", "3d-x", "a" * 128])
def test_valid_names_are_accepted_everywhere(name: str) -> None:
    assert TableConfig(name, 10, 4).name == name
    assert parse_config(_ps_doc(model=name, tables=(name,))).models[0].model == name


# ------------------------------------------------------------------- one rule, two packages
@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9_.-][A-Za-z0-9_./-]{0,130}")))
def test_embark_and_hps_apply_the_same_name_rule(name: str) -> None:
    """embark and hps import nothing of each other, so each states the rule; they agree."""
    assert embark.names.is_name(name) == hps.names.is_name(name)


def test_the_two_rules_are_described_alike() -> None:
    assert embark.names.NAME_RULE == hps.names.NAME_RULE
