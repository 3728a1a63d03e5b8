"""Bytes of a DLRM as stored: its tables (in their row formats) and its dense part (training
state such as a fused update's optimizer rows is not the model and is not counted)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from embark.models.dlrm import DLRM
from embark.quant.quantize import table_bytes

__all__ = ["ModelSize", "model_size"]


@dataclass(frozen=True)
class ModelSize:
    """Bytes of one model: ``tables`` (every table's stored rows), ``dense`` (every other
    state-dict tensor: MLPs, interaction, projections, in whatever form a pruner left them)."""

    tables: int
    dense: int

    @property
    def total(self) -> int:
        return self.tables + self.dense

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def model_size(model: DLRM) -> ModelSize:
    """:class:`ModelSize` of ``model`` (tables per :func:`~embark.quant.table_bytes`; the dense
    part as the bytes of its children's state-dict tensors, shared storage counted once)."""
    seen: set[tuple[int, int]] = set()
    dense = 0
    for child in model.children():
        if child is model.embeddings:  # the tables (with their fused updates' state)
            continue
        for tensor in child.state_dict().values():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if key not in seen:
                seen.add(key)
                dense += tensor.numel() * tensor.element_size()
    return ModelSize(tables=sum(table_bytes(model).values()), dense=dense)
