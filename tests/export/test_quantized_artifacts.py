"""Serving artifacts of quantized tables: ``row_formats`` writes each table's rows in its
format (``key`` + ``emb_rows``) and records the formats in ``ps.json``; the parameter server
serves exactly the dequantized rows; damaged row files are refused naming the table and file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from export.artifacts import write_serving_artifacts
from hps.config import load_config
from hps.parameter_server import HierarchicalParameterServer
from hps.rowformat import RowDtype, RowFormatError, dequantize_rows, quantize_rows, row_bytes

pytestmark = pytest.mark.slow  # one export of the tiny model (ONNX included) for the module


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """The tiny model exported once with its first table INT8 and its second INT4."""
    model = build_model(get_workload("tiny"), seed=3).eval()
    names = [t.name for t in model.workload.tables]
    formats = {names[0]: RowDtype.INT8, names[1]: RowDtype.INT4}
    out = tmp_path_factory.mktemp("quantized") / "art"
    write_serving_artifacts(model, out, model_name="tiny", row_formats=formats)
    return model, out


def test_quantized_tables_are_exported_and_served_exactly(exported, tmp_path: Path) -> None:
    model, art = exported
    names = [t.name for t in model.workload.tables]
    formats = {names[0]: RowDtype.INT8, names[1]: RowDtype.INT4}
    shutil.copytree(art, tmp_path / "art")
    doc = json.loads((tmp_path / "art" / "ps.json").read_text())["models"][0]
    assert doc["tilerec_row_format_version"] == 1
    assert doc["tilerec_row_format_per_table"][:3] == ["int8", "int4", "fp32"]
    assert "embedding_vecsize_per_table" in doc and "sparse_files" in doc  # HugeCTR's kept
    t0 = model.workload.tables[0]
    assert (
        tmp_path / "art" / "sparse" / names[0] / "emb_rows"
    ).stat().st_size == t0.num_rows * row_bytes(RowDtype.INT8, t0.dim)
    ps = HierarchicalParameterServer(load_config(tmp_path / "art" / "ps.json"))
    try:
        s = ps.session("tiny")
        for t in model.workload.tables[:3]:
            fmt = formats.get(t.name, RowDtype.FP32)
            w = model.embeddings[t.name].weight.detach()
            expect = (
                dequantize_rows(quantize_rows(w, fmt), fmt, t.dim)
                if fmt is not RowDtype.FP32
                else w
            )
            ids = torch.arange(t.num_rows)
            assert torch.equal(s.lookup(t.name, ids), expect)
    finally:
        ps.close()


@pytest.mark.parametrize("damage", ["truncated", "nan_scale"])
def test_a_damaged_row_file_is_refused_naming_table_and_file(tmp_path: Path, damage: str) -> None:
    model = build_model(get_workload("tiny"), seed=3).eval()
    name = model.workload.tables[0].name
    write_serving_artifacts(
        model, tmp_path / "art", model_name="tiny", row_formats={name: RowDtype.INT8}
    )
    rows_file = tmp_path / "art" / "sparse" / name / "emb_rows"
    raw = np.fromfile(rows_file, np.uint8)
    if damage == "truncated":
        raw[:-3].tofile(rows_file)
        match = (
            rf"table '{name}' \(.*emb_rows\): \d+ bytes is not a whole number of \d+-byte int8 rows"
        )
    else:
        raw[0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # row 0's scale
        raw.tofile(rows_file)
        match = rf"table '{name}' \(.*emb_rows\): row 0 has scale nan"
    with pytest.raises(RowFormatError, match=match):
        HierarchicalParameterServer(load_config(tmp_path / "art" / "ps.json"))
