"""The serving-artifact format: what ``export.write_serving_artifacts`` writes and hps serves::

    out/
      ps.json              tilerec_artifact_version: ARTIFACT_VERSION (hps.config describes it)
      dense.onnx           the dense graph, its metadata_props "tilerec.serving" below
      sparse/<table>/      HugeCTR's sparse files (hps.storage.sparse_files)

The serving metadata of the dense graph says what its ops do not, as JSON under the ONNX
``metadata_props`` key ``tilerec.serving`` (written by ``export.onnx.export_onnx``, read by the
servable to pool each table and by ``export.onnx.run_onnx`` to check ids)::

    {"version": 1,
     "tables": [{"name": "t0", "rows": 1000, "combiner": "sum", "hotness": 1},
                {"name": "t1", "rows": 5000, "combiner": "mean", "hotness": 3}],
     "dense_features": 13}

``version`` is the serving-artifact format version (:data:`ARTIFACT_VERSION`, the one
``ps.json``'s ``tilerec_artifact_version`` carries): metadata of another version, or without
one, is refused with :class:`~hps.types.FormatVersionError`; so is a ``ps.json`` whose
``tilerec_artifact_version`` is another (a ``ps.json`` without it, written by hand or for
HugeCTR, describes no artifacts of ours and is read as HugeCTR's).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from hps.types import FormatVersionError

__all__ = [
    "ARTIFACT_VERSION",
    "ARTIFACT_VERSION_FIELD",
    "COMBINERS",
    "SERVING_METADATA_KEY",
    "ServingMetadata",
    "TableMetadata",
]

#: The serving-artifact format version this hps reads and ``export`` writes.
ARTIFACT_VERSION = 1
ARTIFACT_VERSION_FIELD = "tilerec_artifact_version"  # its field at the top of ps.json
SERVING_METADATA_KEY = "tilerec.serving"  # the ONNX metadata_props key
COMBINERS = ("sum", "mean")  # how a bag of rows is pooled


@dataclass(frozen=True)
class TableMetadata:
    """One embedding table as the graph sees it."""

    name: str
    rows: int  # ids of the full graph lie in [0, rows); -1 pads a short bag
    combiner: str  # one of COMBINERS
    hotness: int  # ids per sample (the bag's width)


@dataclass(frozen=True)
class ServingMetadata:
    """The ``tilerec.serving`` document of a dense graph (see the module docstring)."""

    tables: tuple[TableMetadata, ...]
    dense_features: int
    version: int = ARTIFACT_VERSION

    def to_json(self) -> str:
        doc = asdict(self)
        return json.dumps({"version": doc.pop("version"), **doc})

    @classmethod
    def from_json(cls, text: str, where: str) -> ServingMetadata:
        """Parse the metadata of the graph ``where`` (a path, for messages).

        Raises:
            FormatVersionError: another ``version``, or none.
            ValueError: text that is not this document, or an unknown combiner.
        """
        what = f"{where} (ONNX metadata {SERVING_METADATA_KEY!r})"
        try:
            doc: Any = json.loads(text)
            version = doc.get("version")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{what} is malformed: {e}") from None
        if version != ARTIFACT_VERSION or isinstance(version, bool):
            raise FormatVersionError(
                what, version, ARTIFACT_VERSION, "export the dense graph again with this version"
            )
        try:
            tables = tuple(
                TableMetadata(str(t["name"]), int(t["rows"]), str(t["combiner"]), int(t["hotness"]))
                for t in doc["tables"]
            )
            meta = cls(tables, int(doc["dense_features"]), version)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{what} is malformed: {type(e).__name__}: {e}") from None
        bad = {t.name: t.combiner for t in tables if t.combiner not in COMBINERS}
        if bad:
            raise ValueError(f"{what}: unknown combiner(s) {bad}; expected one of {COMBINERS}")
        return meta
