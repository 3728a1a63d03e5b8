"""embark.models: DLRM with dot interaction and DLRM-DCNv2 (:class:`DLRM`, built by
:func:`build_model`) and the workloads they are built for (:class:`Workload`: tables, MLP
widths, interaction; presets by :func:`get_workload`)."""

from embark.models.dlrm import DLRM, CrossNetV2, DotInteraction, build_model, init_weights_
from embark.models.workloads import PRESETS, Interaction, Workload, get_workload

__all__ = [
    "DLRM",
    "PRESETS",
    "CrossNetV2",
    "DotInteraction",
    "Interaction",
    "Workload",
    "build_model",
    "get_workload",
    "init_weights_",
]
