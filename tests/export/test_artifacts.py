"""Serving artifacts: sparse files + dense ONNX + ps.json; one request served through the
parameter server and onnxruntime equals the eager model."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import export.artifacts as artifacts
from embark.data.jagged import JaggedBatch
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from export.artifacts import write_serving_artifacts
from export.onnx import onnx_inputs, run_onnx
from hps.artifact_format import ARTIFACT_VERSION, SERVING_METADATA_KEY
from hps.config import load_config
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import build_servables
from hps.storage.sparse_files import read_table, write_table
from hps.types import FormatVersionError
from tests.tolerances import tol


def test_request_served_from_artifacts_equals_eager(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=3).eval()
    cfg = write_serving_artifacts(model, tmp_path / "art", model_name="tiny")
    assert cfg.model("tiny").network_file.endswith("dense.onnx")
    keys, rows = read_table(tmp_path / "art" / "sparse" / "t0", dim=model.workload.tables[0].dim)
    assert torch.equal(torch.from_numpy(rows.copy()), model.embeddings["t0"].weight.detach())
    assert keys.tolist() == list(range(rows.shape[0]))

    server = HierarchicalParameterServer(load_config(tmp_path / "art" / "ps.json"))
    try:
        session = server.session("tiny")
        gen = torch.Generator().manual_seed(0)
        batch = 6
        dense = torch.rand(batch, model.workload.dense_features, generator=gen)
        pooled, values, lengths = [], [], []
        for t in model.workload.tables:
            ids = torch.randint(0, t.num_rows, (batch, t.hotness), generator=gen)
            pooled.append(session.lookup(t.name, ids).sum(dim=1))  # sum combiner
            values.append(ids.flatten())
            lengths += [t.hotness] * batch
        sparse = JaggedBatch(
            [t.name for t in model.workload.tables],
            torch.cat(values),
            torch.tensor(lengths, dtype=torch.int32),
        )
        want = model(dense, sparse).detach()
        got = run_onnx(
            tmp_path / "art" / "dense.onnx", {"dense": dense, "pooled": torch.stack(pooled, dim=1)}
        )
        torch.testing.assert_close(got, want, **tol("onnx"))
    finally:
        server.close()


def test_existing_artifacts_are_not_overwritten(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    write_serving_artifacts(model, tmp_path)
    before = (tmp_path / "ps.json").read_text()
    with pytest.raises(ValueError, match="exists"):
        write_serving_artifacts(model, tmp_path, model_name="other")
    assert (tmp_path / "ps.json").read_text() == before
    assert json.loads(before)["models"][0]["model"] == "dlrm"


def test_bad_settings_fail_before_anything_is_written(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    with pytest.raises(ValueError, match=r"models\[0\].gpucacheper: 1.5 is impossible"):
        write_serving_artifacts(model, tmp_path / "a", cache_fraction=1.5)
    assert not (tmp_path / "a").exists()
    cfg = write_serving_artifacts(model, tmp_path / "a")  # the retry needs no overwrite=True
    assert cfg.model("dlrm").tables[0].name == "t0"


def test_cache_knobs_are_written_and_read_back(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    cfg = write_serving_artifacts(
        model, tmp_path / "lfu", cache_policy="lfu", cache_lfu_decay_keys_per_slot=5
    )
    doc = json.loads((tmp_path / "lfu" / "ps.json").read_text())["models"][0]
    assert (doc["cache_policy"], doc["cache_lfu_decay_keys_per_slot"]) == ("lfu", 5)
    m = cfg.model("dlrm")
    assert (m.cache_policy.value, m.cache_lfu_decay_keys_per_slot) == ("lfu", 5.0)
    write_serving_artifacts(model, tmp_path / "d")
    default = json.loads((tmp_path / "d" / "ps.json").read_text())["models"][0]
    assert (default["cache_policy"], default["cache_lfu_decay_keys_per_slot"]) == ("lru", 20.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"cache_policy": "mru"},
            r"models\[0\].cache_policy: 'mru' is not one of \['lru', 'lfu'\]",
        ),
        (
            {"cache_lfu_decay_keys_per_slot": -1.0},
            r"models\[0\].cache_lfu_decay_keys_per_slot: -1.0",
        ),
    ],
)
def test_bad_cache_knobs_fail_before_anything_is_written(tmp_path, kwargs, match) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    with pytest.raises(ValueError, match=match):
        write_serving_artifacts(model, tmp_path / "a", **kwargs)
    assert not (tmp_path / "a").exists()


def _snapshot(root: Path) -> dict[str, bytes | None] | None:
    """Every path under ``root`` with its bytes (``None`` for a folder); ``None`` if no ``root``."""
    if not root.exists():
        return None
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def _mixed_dim_tiny():
    w = get_workload("tiny")
    tables = (dataclasses.replace(w.tables[0], dim=8), *w.tables[1:])
    return build_model(dataclasses.replace(w, tables=tables), seed=0).eval()


def _assert_written(out: Path, model) -> None:
    assert sorted(p.name for p in out.iterdir()) == [
        "dense.onnx",
        "ps.json",
        "sparse",
        "vocabulary.json",
    ]
    for t in model.workload.tables:
        keys, rows = read_table(out / "sparse" / t.name, dim=t.dim)
        assert torch.equal(torch.from_numpy(rows.copy()), model.embeddings[t.name].weight.detach())
        assert keys.tolist() == list(range(t.num_rows))


@pytest.mark.parametrize("case", ["float16", "bfloat16", "mixed_dims"])
def test_unexportable_model_fails_before_anything_is_written(tmp_path, case) -> None:
    """A model the served dense graph cannot take (not float32, or tables of different dims) is
    refused with a ValueError naming the problem before anything is written (not onnx's
    TypeError, not after the sparse folders), so the corrected export into the same folder needs
    no overwrite=True."""
    if case == "mixed_dims":
        model = _mixed_dim_tiny()
        match = (
            r"write_serving_artifacts: .*needs one dim for every table, but the tables' dims "
            r"differ \(dim 8: 't0'; dim 16: 't1', 't2'.*give every table the same dim"
        )
        fixed = build_model(get_workload("tiny"), seed=0).eval()
    else:
        dtype = getattr(torch, case)
        model = build_model(get_workload("tiny"), seed=0).eval().to(dtype)
        match = (
            rf"write_serving_artifacts needs a float32 model, but 'embeddings\.t0\.weight' "
            rf"is {dtype}.*model\.float\(\)"
        )
        fixed = copy.deepcopy(model).float()
    out = tmp_path / "art"
    with pytest.raises(ValueError) as err:
        write_serving_artifacts(model, out)
    assert not out.exists()
    assert re.search(match, str(err.value)), str(err.value)
    out.mkdir()
    with pytest.raises(ValueError, match=match):
        write_serving_artifacts(model, out)
    assert list(out.iterdir()) == []
    cfg = write_serving_artifacts(fixed, out)  # no overwrite=True needed
    assert [t.name for t in cfg.model("dlrm").tables] == [t.name for t in fixed.workload.tables]
    _assert_written(out, fixed)


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch) -> None:
    """A failure midway (here: the second table's write) removes what was written, the folders
    this call created included, so the retry needs no overwrite=True."""
    model = build_model(get_workload("tiny"), seed=0).eval()
    calls = []

    def failing_write_table(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError("disk full")
        return write_table(*args, **kwargs)

    monkeypatch.setattr(artifacts, "write_table", failing_write_table)
    with pytest.raises(OSError, match="disk full"):
        write_serving_artifacts(model, tmp_path / "a" / "art")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    write_serving_artifacts(model, tmp_path / "a" / "art")
    _assert_written(tmp_path / "a" / "art", model)


@pytest.mark.parametrize("stage", ["export", "move"])
def test_failed_overwrite_restores_the_old_artifacts(tmp_path, monkeypatch, stage) -> None:
    """overwrite=True failing midway leaves the folder byte for byte what it was, never old and
    new files mixed: failing in the ONNX export (after the sparse folders were staged) or while the new files are moved in (here: ps.json, the last one; every replaced file is
    put back)."""
    out = tmp_path / "art"
    old = build_model(get_workload("tiny"), seed=0).eval()
    write_serving_artifacts(old, out)
    (out / "notes.txt").write_text("kept")
    before = _snapshot(out)
    new = build_model(get_workload("tiny"), seed=1).eval()
    if stage == "export":

        def failing_export(*_args, **_kwargs):
            raise OSError("export failed")

        monkeypatch.setattr(artifacts, "export_onnx", failing_export)
    else:
        move_in = artifacts._move_in

        def failing_move(src, dst):
            if Path(src).name == "ps.json" and Path(src).parent.name.startswith(".staging-"):
                raise OSError("move failed")
            return move_in(src, dst)

        monkeypatch.setattr(artifacts, "_move_in", failing_move)
    with pytest.raises(OSError, match=f"{stage} failed"):
        write_serving_artifacts(new, out, model_name="new", overwrite=True)
    monkeypatch.undo()
    assert _snapshot(out) == before
    write_serving_artifacts(new, out, model_name="new", overwrite=True)
    assert json.loads((out / "ps.json").read_text())["models"][0]["model"] == "new"
    assert (out / "notes.txt").read_text() == "kept"
    for t in new.workload.tables:
        _, rows = read_table(out / "sparse" / t.name, dim=t.dim)
        assert torch.equal(torch.from_numpy(rows.copy()), new.embeddings[t.name].weight.detach())


def _exported_with_sparse_elsewhere(tmp_path: Path) -> tuple[Path, Path, object]:
    """``tmp_path/art`` exported from a tiny model, its ``sparse`` folder a symlink to
    ``tmp_path/other_disk``: ``(out, other_disk, model)``."""
    out, elsewhere = tmp_path / "art", tmp_path / "other_disk"
    elsewhere.mkdir()
    out.mkdir()
    (out / "sparse").symlink_to(elsewhere, target_is_directory=True)
    old = build_model(get_workload("tiny"), seed=0).eval()
    write_serving_artifacts(old, out)
    return out, elsewhere, old


def test_overwrite_through_a_link_to_another_filesystem(tmp_path, monkeypatch) -> None:
    """``out/sparse`` a symlink to another disk: a rename between the staging folder and it
    fails with EXDEV, and the move falls back to copying."""
    import errno
    import os

    out, elsewhere, old = _exported_with_sparse_elsewhere(tmp_path)
    rename = os.rename

    def cross_device(src, dst, *args, **kwargs):
        a, b = os.path.realpath(src), os.path.realpath(os.path.dirname(os.fspath(dst)))
        if (a.startswith(str(elsewhere)) or b.startswith(str(elsewhere))) and ".staging-" in a + b:
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", cross_device)
    new = build_model(get_workload("tiny"), seed=1).eval()
    write_serving_artifacts(new, out, model_name="new", overwrite=True)
    monkeypatch.undo()
    assert (out / "sparse").is_symlink() and not list(out.glob(".staging-*"))
    assert json.loads((out / "ps.json").read_text())["models"][0]["model"] == "new"
    for t in new.workload.tables:
        _, rows = read_table(elsewhere / t.name, dim=t.dim)
        assert torch.equal(torch.from_numpy(rows.copy()), new.embeddings[t.name].weight.detach())


def test_a_copy_across_filesystems_failing_half_way_restores_the_old_table(
    tmp_path, monkeypatch
) -> None:
    """``out/sparse`` on another disk and the copy of a table failing after its first file (disk
    full): the destination never holds a partial copy, the old tables are restored whole and
    nothing hidden is left beside them."""
    import errno
    import os

    out, elsewhere, old = _exported_with_sparse_elsewhere(tmp_path)
    before = _snapshot(out)
    rename, copy2 = os.rename, shutil.copy2
    copied = []

    def cross_device(src, dst, *args, **kwargs):
        if ".staging-" in os.fspath(src) and os.path.realpath(
            os.path.dirname(os.fspath(dst))
        ).startswith(str(elsewhere)):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        return rename(src, dst, *args, **kwargs)

    def disk_full(src, dst, *args, **kwargs):
        copied.append(dst)
        if len(copied) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        return copy2(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", cross_device)
    monkeypatch.setattr(shutil, "copy2", disk_full)
    new = build_model(get_workload("tiny"), seed=1).eval()
    with pytest.raises(OSError, match="No space left"):
        write_serving_artifacts(new, out, model_name="new", overwrite=True)
    monkeypatch.undo()
    assert _snapshot(out) == before
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(
        t.name for t in old.workload.tables
    )
    for t in old.workload.tables:
        _, rows = read_table(elsewhere / t.name, dim=t.dim)
        assert torch.equal(torch.from_numpy(rows.copy()), old.embeddings[t.name].weight.detach())


def _set_serving_metadata(path: Path, text: str | None) -> None:
    """Replace (``None``: remove) the graph's ``tilerec.serving`` metadata."""
    import onnx

    proto = onnx.load(str(path))
    kept = [(m.key, m.value) for m in proto.metadata_props if m.key != SERVING_METADATA_KEY]
    del proto.metadata_props[:]
    for k, v in kept + ([] if text is None else [(SERVING_METADATA_KEY, text)]):
        e = proto.metadata_props.add()
        e.key, e.value = k, v
    onnx.save(proto, str(path))


def test_artifacts_carry_their_format_version_and_another_is_refused(tmp_path) -> None:
    """ps.json and the dense graph's serving metadata both carry the artifact format version;
    the server refuses a graph whose metadata has another version or none, naming the file."""
    model = build_model(get_workload("tiny"), seed=0)
    art = tmp_path / "art"
    cfg = write_serving_artifacts(model, art)
    doc = json.loads((art / "ps.json").read_text())
    assert doc["tilerec_artifact_version"] == ARTIFACT_VERSION == cfg.artifact_version
    dense = art / "dense.onnx"
    meta = json.loads(_serving_metadata(dense))
    assert meta["version"] == ARTIFACT_VERSION
    inputs = onnx_inputs(model, 2, include_embeddings=False)
    for text, found in (
        (json.dumps({**meta, "version": 2}), 2),
        (json.dumps(meta | {"version": None}), None),
    ):
        _set_serving_metadata(dense, text)
        ps = HierarchicalParameterServer(load_config(art / "ps.json"))
        try:
            with pytest.raises(FormatVersionError, match=re.escape(str(dense))) as ei:
                build_servables(ps)
            assert (ei.value.found, ei.value.expected) == (found, ARTIFACT_VERSION)
        finally:
            ps.close()
        with pytest.raises(FormatVersionError, match=re.escape(str(dense))):
            run_onnx(dense, inputs)
    _set_serving_metadata(dense, None)  # a graph without serving metadata
    ps = HierarchicalParameterServer(load_config(art / "ps.json"))
    try:
        with pytest.raises(FormatVersionError, match="has no format version") as ei:
            build_servables(ps)
        assert str(dense) in str(ei.value) and "no serving metadata" in str(ei.value)
    finally:
        ps.close()


def _serving_metadata(path: Path) -> str:
    import onnx

    return {m.key: m.value for m in onnx.load(str(path)).metadata_props}[SERVING_METADATA_KEY]


@pytest.mark.parametrize("name", ["a/b", "../x", "", "dlrm.v2"])
def test_a_model_name_that_is_not_a_name_is_refused_before_writing(tmp_path, name) -> None:
    """A ``/`` would be accepted and then answer 404: the URL holds one segment per name."""
    model = build_model(get_workload("tiny"), seed=0).eval()
    with pytest.raises(ValueError, match=r"model_name .* is not a valid name; expected 1 to 128"):
        write_serving_artifacts(model, tmp_path / "art", model_name=name)
    assert not (tmp_path / "art").exists()
    cfg = write_serving_artifacts(model, tmp_path / "art", model_name="dlrm-v2")
    assert cfg.models[0].model == "dlrm-v2"


def test_a_dangling_link_where_a_table_goes_is_taken(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0).eval()
    (tmp_path / "art" / "sparse").mkdir(parents=True)
    (tmp_path / "art" / "sparse" / "t0").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"sparse folders exist: \[.*sparse/t0'\]"):
        write_serving_artifacts(model, tmp_path / "art")
    assert not (tmp_path / "nowhere").exists()
    write_serving_artifacts(model, tmp_path / "art", overwrite=True)
    assert not (tmp_path / "art" / "sparse" / "t0").is_symlink()
    assert not (tmp_path / "nowhere").exists()
