"""What :func:`~embark.quant.quantize_embeddings_` does: a frozen, validated config that
round-trips through JSON (torchao's config style)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from embark.training.config import EmbeddingKernel
from hps.rowformat import RowDtype

__all__ = ["EmbeddingQuantConfig"]


def _dtype(value: object, where: str) -> RowDtype:
    try:
        return RowDtype(value)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"{where} must be one of {[d.value for d in RowDtype]}, got {value!r}"
        ) from None


@dataclass(frozen=True)
class EmbeddingQuantConfig:
    """How each embedding table is stored after quantization.

    Args:
        dtype: the row format of every table not in ``per_table`` (``fp32`` keeps a table as
            it is: a trainable ``nn.EmbeddingBag``).
        per_table: ``{table name: dtype}`` overrides (e.g. a compression plan's choice).
        kernel: the lookup of quantized tables: ``auto`` (FBGEMM's fused lookup-and-dequantize
            where it imports and reads the dtype, else pure torch), ``fbgemm``, ``reference``.

    Strings are accepted for the enums and turned into them; a bad one is a ``ValueError``
    naming the field and the allowed values.

    >>> EmbeddingQuantConfig("int8", {"t0": "fp16"}).to_dict()
    {'dtype': 'int8', 'per_table': {'t0': 'fp16'}, 'kernel': 'auto'}
    """

    dtype: RowDtype = RowDtype.INT8
    per_table: Mapping[str, RowDtype] = field(default_factory=dict)
    kernel: EmbeddingKernel = EmbeddingKernel.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype(self.dtype, "dtype"))
        if not isinstance(self.per_table, Mapping):
            raise ValueError(
                f"per_table must map table names to dtypes, got {type(self.per_table).__name__}"
            )
        table: dict[str, RowDtype] = {}
        for name, value in self.per_table.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"per_table keys must be table names, got {name!r}")
            table[name] = _dtype(value, f"per_table[{name!r}]")
        object.__setattr__(self, "per_table", MappingProxyType(table))
        try:
            object.__setattr__(self, "kernel", EmbeddingKernel(self.kernel))
        except ValueError:
            raise ValueError(
                f"kernel must be one of {[k.value for k in EmbeddingKernel]}, got {self.kernel!r}"
            ) from None

    def dtype_of(self, table: str) -> RowDtype:
        """The row format of ``table``."""
        return self.per_table.get(table, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (:meth:`from_dict` inverts it)."""
        return {
            "dtype": self.dtype.value,
            "per_table": {k: v.value for k, v in self.per_table.items()},
            "kernel": self.kernel.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingQuantConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: naming unknown fields, or a bad value.
        """
        unknown = set(data) - {"dtype", "per_table", "kernel"}
        if unknown:
            raise ValueError(
                f"EmbeddingQuantConfig: unknown fields {sorted(unknown)} "
                "(expected dtype, per_table, kernel)"
            )
        return cls(**dict(data))
