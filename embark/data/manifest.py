"""The manifest of a converted Criteo folder (``criteo_binary.json``): what the folder holds,
written last by :func:`~embark.data.convert.convert_criteo` and required by
:class:`~embark.data.binary.CriteoBinary`, which checks the files against it on open.

A folder of ``n`` rows from one input ``day_0``::

    {"format": "tilerec-criteo-npy", "version": 2, "dense_transform": "log1p_clip0",
     "num_dense": 13, "num_sparse": 26, "workload": "dlrm_dcnv2",
     "files": [{"stem": "day_0", "rows": n,
                "arrays": {"dense":  {"bytes": 128 + n*13*4, "sha256": "…"},
                           "sparse": {"bytes": 128 + n*26*8, "sha256": "…"},
                           "labels": {"bytes": 128 + n*4,    "sha256": "…"}}}],
     "stats": {"lines": …, "good_lines": …, "bad_lines": …, "reasons": {…}, "examples": […]}}

``bytes`` is the whole ``<stem>_<array>.npy`` file; ``sha256`` covers its rows (the bytes
after the ``.npy`` header, whose shape is checked against ``rows`` instead). A stem is one
plain file name (no folder, not hidden), so no entry reads outside the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from embark.data.npy import NpyArray

MANIFEST = "criteo_binary.json"
FORMAT = "tilerec-criteo-npy"
FORMAT_VERSION = 2  # records each array's bytes and the sha256 of its rows
_STEM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HASH_BLOCK = 1 << 22  # bytes read at a time when checking a checksum


class DenseTransform(StrEnum):
    """What a folder's ``<stem>_dense.npy`` holds, from the dense integers ``x``."""

    LOG1P_CLIP0 = "log1p_clip0"  # log(1 + max(x, 0)), float32: MLPerf's and CriteoTSV's
    TORCHREC = "torchrec"  # log(x - min + 2), min over the file: TorchRec's tsv_to_npys


class ArrayKind(StrEnum):
    """The three arrays of one input: ``<stem>_<kind>.npy``."""

    DENSE = "dense"  # (n, D) float32
    SPARSE = "sparse"  # (n, T) int64
    LABELS = "labels"  # (n, 1) int32, 0 or 1


class ManifestError(ValueError):
    """A manifest that cannot be read or does not describe its folder (names the file)."""


def check_stem(stem: object, where: str) -> str:
    """``stem`` if it is one plain, visible file name, else :class:`ManifestError`."""
    if not isinstance(stem, str) or not _STEM.fullmatch(stem):
        raise ManifestError(
            f"{where}: stem {stem!r} is not a plain file name (letters, digits, '._+-', "
            "not starting with '.'); a stem names files inside the folder only"
        )
    return stem


@dataclass(frozen=True)
class ArrayRecord:
    """One ``.npy`` file: its size and the sha256 of its rows."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class FileRecord:
    """One input's three arrays, ``rows`` each."""

    stem: str
    rows: int
    arrays: dict[ArrayKind, ArrayRecord]

    def path(self, folder: Path, kind: ArrayKind) -> Path:
        return folder / f"{self.stem}_{kind.value}.npy"

    def to_dict(self) -> dict[str, Any]:
        return {
            "stem": self.stem,
            "rows": self.rows,
            "arrays": {
                k.value: {"bytes": a.bytes, "sha256": a.sha256} for k, a in self.arrays.items()
            },
        }

    @classmethod
    def from_dict(cls, doc: object, where: str) -> FileRecord:
        """Parse one ``files`` entry; ``where`` names it in errors."""
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: an object expected, got {type(doc).__name__}")
        stem = check_stem(doc.get("stem"), where)
        rows = _int(doc, "rows", where)
        arrays_doc = doc.get("arrays")
        if not isinstance(arrays_doc, dict) or set(arrays_doc) != {k.value for k in ArrayKind}:
            raise ManifestError(
                f"{where}: 'arrays' must map exactly {[k.value for k in ArrayKind]}, "
                f"got {sorted(arrays_doc) if isinstance(arrays_doc, dict) else arrays_doc!r}"
            )
        arrays = {}
        for kind in ArrayKind:
            a, at = arrays_doc[kind.value], f"{where} array {kind.value!r}"
            if not isinstance(a, dict):
                raise ManifestError(f"{at}: an object expected")
            digest = a.get("sha256")
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise ManifestError(f"{at}: 'sha256' must be 64 lowercase hex digits")
            arrays[kind] = ArrayRecord(_int(a, "bytes", at), digest)
        return cls(stem, rows, arrays)


@dataclass(frozen=True)
class Manifest:
    """A parsed ``criteo_binary.json`` (module docstring)."""

    dense_transform: DenseTransform
    num_dense: int
    num_sparse: int
    files: list[FileRecord]
    workload: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dense_transform": self.dense_transform.value,
            "num_dense": self.num_dense,
            "num_sparse": self.num_sparse,
            "workload": self.workload,
            "files": [f.to_dict() for f in self.files],
            "stats": self.stats,
        }
        return json.dumps(doc, indent=1) + "\n"


def _int(doc: dict[str, Any], key: str, where: str) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ManifestError(f"{where}: {key!r} must be an integer >= 0, got {v!r}")
    return v


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    """Read and check the manifest of ``folder`` (its syntax only; :func:`verify_folder`
    checks the files).

    Raises:
        FileNotFoundError: the folder holds no manifest (naming both).
        ManifestError: naming the manifest: not JSON, another format or version, a missing
            or mistyped field, an unsafe or repeated stem.
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} holds no {MANIFEST}: it is not a finished conversion (a "
            "conversion publishes its folder whole, manifest included; an interrupted one "
            "publishes nothing). Files TorchRec's tsv_to_npys wrote are read by passing their "
            "prefixes: CriteoBinary([folder/day_0, ...], ..., dense_transform=DenseTransform.TORCHREC)"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"{path}: not a JSON manifest: {err}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{path}: a JSON object expected, got {type(doc).__name__}")
    if doc.get("format") != FORMAT or doc.get("version") != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format {doc.get('format')!r} version {doc.get('version')!r}, expected "
            f"{FORMAT!r} version {FORMAT_VERSION} (convert the TSV files again)"
        )
    try:
        transform = DenseTransform(str(doc.get("dense_transform")))
    except ValueError:
        raise ManifestError(
            f"{path}: dense_transform {doc.get('dense_transform')!r}, expected one of "
            f"{[t.value for t in DenseTransform]}"
        ) from None
    files_doc = doc.get("files")
    if not isinstance(files_doc, list):
        raise ManifestError(f"{path}: 'files' must be a list, got {files_doc!r}")
    files = [FileRecord.from_dict(f, f"{path} files[{i}]") for i, f in enumerate(files_doc)]
    stems = [f.stem for f in files]
    dup = sorted({s for s in stems if stems.count(s) > 1})
    if dup:
        raise ManifestError(f"{path}: stem(s) {dup} listed more than once")
    workload, stats = doc.get("workload"), doc.get("stats", {})
    if workload is not None and not isinstance(workload, str):
        raise ManifestError(f"{path}: 'workload' must be a string or null, got {workload!r}")
    if not isinstance(stats, dict):
        raise ManifestError(f"{path}: 'stats' must be an object, got {stats!r}")
    return Manifest(
        transform, _int(doc, "num_dense", str(path)), _int(doc, "num_sparse", str(path)),
        files, workload, stats,
    )  # fmt: skip


def rows_sha256(arr: NpyArray) -> str:
    """sha256 of the rows of a ``.npy`` file (the bytes after its header)."""
    h = hashlib.sha256()
    with open(arr.path, "rb") as fh:
        fh.seek(arr.offset)
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def check_labels(labels: np.ndarray, path: Path, first_row: int = 0) -> None:
    """Raise ``ValueError`` naming ``path`` and the row when a label is not 0 or 1."""
    bad = np.flatnonzero((labels != 0) & (labels != 1))
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            f"{path}: row {first_row + k} has label {labels.reshape(-1)[k].item()!r}; labels must be "
            "0 or 1 (a corrupted file?)"
        )


def verify_folder(
    folder: Path, manifest: Manifest, *, checksums: bool = True
) -> dict[tuple[str, ArrayKind], NpyArray]:
    """Check every array the manifest lists: present, its header's rows and its size as
    recorded, and (``checksums``) the sha256 of its rows.

    Returns:
        the opened arrays by ``(stem, kind)``.

    Raises:
        FileNotFoundError: naming a missing file.
        ValueError: naming the file and what differs from the manifest.
    """
    arrays: dict[tuple[str, ArrayKind], NpyArray] = {}
    for rec in manifest.files:
        for kind, want in rec.arrays.items():
            path = rec.path(folder, kind)
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing; {folder / MANIFEST} lists it")
            arr = NpyArray.open(path)
            size = path.stat().st_size
            if arr.num_rows != rec.rows or size != want.bytes:
                raise ValueError(
                    f"{path}: {arr.num_rows} rows in {size} bytes, {folder / MANIFEST} says "
                    f"{rec.rows} rows in {want.bytes} bytes (files of another conversion?)"
                )
            if checksums and rows_sha256(arr) != want.sha256:
                raise ValueError(
                    f"{path}: the sha256 of its rows differs from {folder / MANIFEST}'s "
                    "(the file was changed or corrupted after the conversion)"
                )
            arrays[(rec.stem, kind)] = arr
    return arrays
