"""embark.models: DLRM with dot interaction and DLRM-DCNv2 (:class:`DLRM`, built by
:func:`build_model`) and the workloads they are built for (:class:`Workload`: tables, MLP
widths, interaction; presets by :func:`get_workload`)."""

from typing import TYPE_CHECKING

from embark.lazy import lazy_attributes

if TYPE_CHECKING:
    from embark.models.dlrm import (
        DLRM,
        CrossNetV2,
        DotInteraction,
        build_dense_part,
        build_model,
        init_weights_,
        uniform_block_,
    )
    from embark.models.tables import EmbeddingTables, TableModel, TableStore
    from embark.models.workloads import PRESETS, Interaction, Workload, get_workload

# Names are imported on first use, so that a command which needs no torch (the data
# converter) starts without importing it.
_EXPORTS = {
    "DLRM": "embark.models.dlrm",
    "CrossNetV2": "embark.models.dlrm",
    "DotInteraction": "embark.models.dlrm",
    "build_dense_part": "embark.models.dlrm",
    "build_model": "embark.models.dlrm",
    "init_weights_": "embark.models.dlrm",
    "uniform_block_": "embark.models.dlrm",
    "EmbeddingTables": "embark.models.tables",
    "TableModel": "embark.models.tables",
    "TableStore": "embark.models.tables",
    "PRESETS": "embark.models.workloads",
    "Interaction": "embark.models.workloads",
    "Workload": "embark.models.workloads",
    "get_workload": "embark.models.workloads",
}

__all__ = [
    "DLRM",
    "PRESETS",
    "CrossNetV2",
    "DotInteraction",
    "EmbeddingTables",
    "Interaction",
    "TableModel",
    "TableStore",
    "Workload",
    "build_dense_part",
    "build_model",
    "get_workload",
    "init_weights_",
    "uniform_block_",
]


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
