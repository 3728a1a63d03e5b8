"""Serving artifacts of a trained (and pruned) DLRM: one folder that the parameter server
(``hps``) and onnxruntime serve unchanged.

Layout written by :func:`write_serving_artifacts` (format version
:data:`hps.artifact_format.ARTIFACT_VERSION`, which ``ps.json`` carries as ``tilerec_artifact_version``
and the graph's metadata as ``version``; hps refuses artifacts of another version)::

    out/
      ps.json               the parameter-server config (HugeCTR field names), validated by hps
      dense.onnx            the dense part (inputs dense (B, D), pooled (B, T, dim)); its
                            metadata ``tilerec.serving`` (hps.artifact_format) names each
                            table's combiner
      sparse/<table>/key         int64 little-endian, one per row
      sparse/<table>/emb_vector  float32 rows (num_rows × dim)
      vocabulary.json       per table: its maximum bag size (hotness), what a longer bag gets
                            (hotness_policy) and its vocabulary, raw id → row, if it has one
                            (embark.data.vocabulary's format; hps.vocabulary applies it)

The model is checked first (float32, one dim for every table) and everything is written into a
staging folder inside ``out/`` and then moved in place, ``ps.json`` last: a failure leaves ``out/``
as it was (no partial tables, a folder this call created is removed again).

The model name and the table names follow the name rule of :mod:`hps.names` (a name with ``/``
would be written and then answer 404). Every path is joined one component at a time
(:func:`hps.names.entry`), and an entry being replaced is renamed aside, never followed: a
symlink at ``out/ps.json`` or ``out/sparse/<table>`` is replaced, its target untouched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embark.data.vocabulary import FILE_NAME as VOCABULARY_FILE
from embark.data.vocabulary import Vocabulary, vocabulary_document
from embark.models.dlrm import DLRM
from embark.types import TableConfig
from export.onnx import ExportableModel, as_exportable, check_exportable, export_onnx, model_tables
from hps.artifact_format import ARTIFACT_VERSION, ARTIFACT_VERSION_FIELD
from hps.config import (
    ROW_FORMAT_FIELD,
    ROW_FORMAT_VERSION,
    ROW_FORMAT_VERSION_FIELD,
    PSConfig,
    parse_config,
)
from hps.names import check_name, entry, entry_exists, hidden_sibling, remove_entry
from hps.rowformat import RowDtype, quantize_rows
from hps.storage.sparse_files import write_table, write_table_rows
from hps.types import DEFAULT_LFU_DECAY_KEYS_PER_SLOT, CachePolicy

__all__ = ["write_serving_artifacts"]


def write_serving_artifacts(
    model: torch.nn.Module,
    out_dir: str | Path,
    model_name: str = "dlrm",
    max_batch_size: int = 1024,
    cache_fraction: float = 0.2,
    overwrite: bool = False,
    cache_exact: bool = True,
    cache_policy: CachePolicy | str = CachePolicy.LRU,
    cache_lfu_decay_keys_per_slot: float = DEFAULT_LFU_DECAY_KEYS_PER_SLOT,
    vocabularies: Mapping[str, Vocabulary] | None = None,
    hotness: int | Mapping[str, int] | None = None,
    row_formats: Mapping[str, RowDtype] | None = None,
) -> PSConfig:
    """Write the sparse files, the dense ONNX graph and ``ps.json`` for ``model``.

    Args:
        model: embark's DLRM (TileSparseLinear layers are exported as condensed standard ops),
            an :class:`embark.interop.EBCModel` (a TorchRec ``EmbeddingBagCollection`` and a
            dense module) or TorchRec's own ``DLRM`` (:func:`export.onnx.as_exportable`).
        out_dir: the artifact folder (created).
        model_name: ``models[0].model`` in ``ps.json``, the model's name in the server's URLs
            (``/v2/models/<model_name>/infer``): letters, digits, ``_``, ``-`` (:mod:`hps.names`).
        max_batch_size: the largest request the server accepts.
        cache_fraction: ``gpucacheper``, fraction of each table the embedding cache holds.
        overwrite: replace existing table folders / files.
        cache_exact: ``cache_exact`` in ``ps.json``: a cache miss is always fetched from the
            databases, so the served model scores exactly like the eager one. ``False`` is
            HugeCTR's behaviour: above ``hit_rate_threshold`` (0.9) a miss gets the default
            vector while its row is inserted in the background (lower latency, approximate).
        cache_policy: ``cache_policy`` in ``ps.json``, ``"lru"`` or ``"lfu"``.
        cache_lfu_decay_keys_per_slot: ``cache_lfu_decay_keys_per_slot`` in ``ps.json``: the
            LFU aging period in looked-up keys per cache slot (0: never age; ignored by LRU).
            Both cache fields are written out even at their defaults, so the knobs are in the file.
        vocabularies: ``{table: Vocabulary}`` (``Preprocessor.vocabularies`` of
            :mod:`embark.data.tabular`): the server then takes raw ids for those tables and maps
            them as training did, an unknown id to its out-of-vocabulary row. Written with every
            table's hotness and hotness policy into ``vocabulary.json``.
        hotness: each table's maximum bag size for a TorchRec DLRM, which does not record it
            (``{table: n}`` or one int; :func:`embark.data.max_bag_sizes` infers it from data);
            embark's models carry theirs.
        row_formats: ``{table: RowDtype}``, how the server stores a table's rows in every
            tier (FP32 for a table not named). A table in another format is written as its
            quantized rows (``key`` + ``emb_rows``, :func:`hps.storage.sparse_files.write_table_rows`:
            FBGEMM's layout, :mod:`hps.rowformat`) and ``ps.json`` records the formats
            (``tilerec_row_format_per_table`` with ``tilerec_row_format_version``).

    Returns:
        the validated :class:`hps.config.PSConfig` read back from the written ``ps.json``.

    Raises:
        ValueError: when ``out_dir/ps.json`` or a table's sparse folder exists and ``overwrite``
            is false, ``model_name`` or a table name is not a valid name (``a/b``, ``../x``),
            the config does not validate, the model is not float32 (convert it with
            ``model.float()``), or its tables differ in dim (the served dense graph takes one
            ``pooled (B, T, dim)``). Nothing is written then, and a failure while writing
            leaves ``out_dir`` as it was (replaced files are restored); also a weighted
            TorchRec EBC (the server takes ids, not per-id weights).
        TypeError: for a model :func:`export.onnx.as_exportable` does not take.
    """
    out = Path(out_dir)
    check_name(model_name, "model_name")
    ps_path = out / "ps.json"
    if ps_path.exists() and not overwrite:
        raise ValueError(f"{ps_path} exists; pass overwrite=True to replace the artifacts")
    model = as_exportable(model, "write_serving_artifacts", hotness)
    check_exportable(model, include_embeddings=False, caller="write_serving_artifacts")
    tables = model_tables(model)
    vocab_doc = vocabulary_document(tables, vocabularies or {})
    doc = _ps_json(
        model,
        model_name,
        max_batch_size,
        cache_fraction,
        cache_exact,
        str(cache_policy),  # checked by parse_config, which names the field
        cache_lfu_decay_keys_per_slot,
    )
    _add_row_formats(doc, [t.name for t in tables], row_formats or {})
    cfg = parse_config(doc, base_dir=out)  # validate before anything is written
    if not overwrite:
        taken = [str(p) for p in _table_entries(out, tables) if entry_exists(p)]
        if taken:
            raise ValueError(f"sparse folders exist: {taken}; pass overwrite=True to replace them")
    _write_atomically(out, model, doc, vocab_doc, [t.name for t in tables])
    return cfg


def _write_atomically(
    out: Path,
    model: ExportableModel,
    doc: dict[str, Any],
    vocab_doc: dict[str, Any],
    table_names: list[str],
) -> None:
    """Write everything into a staging folder inside ``out``, then move it in place
    (``ps.json`` last); on failure ``out`` is left as it was."""
    created = _make_dirs(out)
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
        _write_into(staging, model, doc)
        (staging / VOCABULARY_FILE).write_text(json.dumps(vocab_doc))
        rels = [
            *(("sparse", name) for name in table_names),
            ("dense.onnx",),
            (VOCABULARY_FILE,),
            ("ps.json",),
        ]
        _commit(staging, out, rels)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for d in reversed(created):  # innermost first; only if still empty
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    shutil.rmtree(staging, ignore_errors=True)  # holds the replaced files, if any


def _ps_json(
    model: ExportableModel,
    model_name: str,
    max_batch_size: int,
    cache_fraction: float,
    cache_exact: bool,
    cache_policy: str,
    cache_lfu_decay_keys_per_slot: float,
) -> dict[str, Any]:
    """The ``ps.json`` document of the artifacts (HugeCTR's per-table lists, paths relative to
    the artifact folder, the artifact format version at the top).

    HugeCTR's parser reads it too: every field it requires is written (``supportlonglong``,
    ``sparse_files``, ``deployed_device_list``, ``maxnum_catfeature_query_per_table_per_sample``,
    ``embedding_vecsize_per_table``, ``default_value_for_each_table``) with the JSON type it
    takes, and our own fields are ones it does not look up (``tests/export/test_psjson_for_hugectr.py``
    checks this against its source). HugeCTR resolves the relative paths against its working
    directory: run it from the artifact folder.
    """
    tables = model_tables(model)
    return {
        ARTIFACT_VERSION_FIELD: ARTIFACT_VERSION,
        "supportlonglong": True,
        "volatile_db": {"type": "parallel_hash_map"},
        "persistent_db": {"type": "none"},
        "models": [
            {
                "model": model_name,
                "max_batch_size": max_batch_size,
                "sparse_files": [f"sparse/{t.name}" for t in tables],
                "embedding_table_names": [t.name for t in tables],
                "embedding_vecsize_per_table": [t.dim for t in tables],
                "maxnum_catfeature_query_per_table_per_sample": [t.hotness for t in tables],
                "default_value_for_each_table": [0.0] * len(tables),
                "gpucache": True,
                "gpucacheper": cache_fraction,
                "hit_rate_threshold": 0.9,
                "cache_exact": cache_exact,
                "cache_policy": cache_policy,
                "cache_lfu_decay_keys_per_slot": cache_lfu_decay_keys_per_slot,
                "deployed_device_list": [0],  # HugeCTR requires it (its GPU; ours is "device")
                "network_file": "dense.onnx",
            }
        ],
    }


def _add_row_formats(
    doc: dict[str, Any], names: list[str], formats: Mapping[str, RowDtype]
) -> None:
    """Record ``formats`` in the model's entry of ``doc`` (nothing when every table is FP32).

    Raises:
        ValueError: a table name the model does not have, or a value that is no ``RowDtype``.
    """
    unknown = sorted(set(formats) - set(names))
    if unknown:
        raise ValueError(f"row_formats names tables {unknown} the model lacks; tables: {names}")
    dtypes = [RowDtype(formats.get(n, RowDtype.FP32)) for n in names]
    if all(d is RowDtype.FP32 for d in dtypes):
        return
    m = doc["models"][0]
    m[ROW_FORMAT_VERSION_FIELD] = ROW_FORMAT_VERSION
    m[ROW_FORMAT_FIELD] = [d.value for d in dtypes]


def _write_into(folder: Path, model: ExportableModel, doc: dict[str, Any]) -> None:
    """Write every artifact into ``folder``: the dense graph (stamped with its serving
    metadata), one sparse folder per table (keys ``0..rows-1``) and ``ps.json``."""
    export_onnx(model, folder / "dense.onnx", include_embeddings=False)
    m = doc["models"][0]
    formats = dict(
        zip(m["embedding_table_names"], map(RowDtype, m.get(ROW_FORMAT_FIELD, [])), strict=False)
    )
    for t in model_tables(model):
        w = _table_values(model, t.name).cpu().numpy().astype(np.float32, copy=False)
        keys = np.arange(w.shape[0], dtype=np.int64)
        fmt = formats.get(t.name, RowDtype.FP32)
        if fmt is RowDtype.FP32:
            write_table(_inside(folder, ("sparse", t.name)), keys, w)
        else:  # the rows every tier will store, quantized once here
            q = quantize_rows(torch.from_numpy(w), fmt, f"table {t.name!r}").numpy()
            write_table_rows(_inside(folder, ("sparse", t.name)), keys, q)
    (folder / "ps.json").write_text(json.dumps(doc, indent=2))


def _table_values(model: ExportableModel, table: str) -> torch.Tensor:
    """``(num_rows, dim) float32`` values of ``table``: a DLRM's through its typed tables
    (:meth:`embark.models.tables.EmbeddingTables.float_weight`), a TorchRec EBC's bag weight."""
    if isinstance(model, DLRM):
        return model.embeddings.float_weight(table)
    weight = model.embeddings[table].weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"table {table!r}: its weight is a {type(weight).__name__}")
    return weight.detach()


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the folders it created, outermost first."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _inside(root: Path, rel: Sequence[str]) -> Path:
    """``root/rel[0]/rel[1]/...``, each component an entry of the folder before it
    (:func:`hps.names.entry`: never ``..``, absolute or holding a separator)."""
    path = root
    for part in rel:
        path = entry(path, part, "artifact path component")
    return path


def _table_entries(out: Path, tables: Sequence[TableConfig]) -> list[Path]:
    """``out/sparse/<table>`` of each table."""
    return [_inside(out, ("sparse", t.name)) for t in tables]


def _move_in(src: Path, dest: Path) -> None:
    """Put ``src`` at ``dest`` (which does not exist): a rename, or, when ``dest``'s folder is
    on another filesystem (``out/sparse`` a symlink to another disk), a copy into a hidden
    sibling of ``dest`` renamed into place, so ``dest`` never holds a partial copy."""
    try:
        os.rename(src, dest)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    tmp = hidden_sibling(dest, "incoming")
    try:
        if src.is_dir():
            shutil.copytree(src, tmp, symlinks=True, copy_function=shutil.copy2)
        else:
            shutil.copy2(src, tmp)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise


def _commit(staging: Path, out: Path, rels: Sequence[Sequence[str]]) -> None:
    """Move ``staging/<rel>`` to ``out/<rel>`` for each ``rel`` (path components) in order,
    each joined by :func:`_inside`. An existing one is first
    renamed to a hidden sibling (same folder, so never a copy; deleted once all are in place).
    A per-table symlink ``out/sparse/<t>`` is replaced by the new folder, not written through;
    a symlinked ``out/sparse`` is written through. On failure every step is undone (the
    replaced files are put back) and the error re-raised."""
    token = uuid.uuid4().hex[:8]
    done: list[tuple[Path, Path | None, bool]] = []  # (dest, its backup, moved in)
    created: list[Path] = []
    try:
        for rel in rels:
            src, dest = _inside(staging, rel), _inside(out, rel)
            backup = None
            if entry_exists(dest):
                backup = dest.with_name(f".{dest.name}.replaced-{token}")
                done.append(
                    (dest, None, False)
                )  # recorded first: restored if the rename half-fails
                os.rename(dest, backup)
                done[-1] = (dest, backup, False)
            else:
                created += _make_dirs(dest.parent)
                done.append((dest, None, False))
            _move_in(src, dest)
            done[-1] = (dest, backup, True)
    except BaseException:
        for dest, backup, moved in reversed(done):
            if moved:
                remove_entry(dest)
            if backup is not None:
                remove_entry(dest)
                os.rename(backup, dest)
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    for _, backup, _ in done:
        if backup is not None:
            remove_entry(backup)
