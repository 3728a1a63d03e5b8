"""A table stored in a row format (:mod:`hps.rowformat`) and looked up with its rows
dequantized on the fly: :class:`QuantizedEmbeddingBag`, a drop-in for an evaluating
``nn.EmbeddingBag`` (``forward(ids, offsets) -> (B, dim) float32``).

Two lookups compute the same pooled bags: the reference (pure torch: gather the ids' rows,
dequantize them, pool) and FBGEMM's fused lookup-and-dequantize on CPU
(``IntNBitTableBatchedEmbeddingBagsCodegen``), built over the module's own rows: the kernel's
weight buffer *is* ``rows`` (a flat view, no copy), so a table is held once.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from embark.models.tables import RowFormatTable
from embark.training.config import EmbeddingKernel
from embark.types import Combiner
from hps.rowformat import RowDtype, check_rows, dequantize_rows, quantize_rows, row_bytes

log = logging.getLogger(__name__)

__all__ = [
    "ROW_FORMAT_BYTES",
    "QuantizedEmbeddingBag",
    "fbgemm_inference_available",
    "row_format_tag",
]

#: Length of a table's ``row_format`` buffer: its dtype's name in ASCII, zero-padded.
ROW_FORMAT_BYTES = 8

# Row dtypes FBGEMM's inference kernel reads (its SparseType names).
_FBGEMM_TYPES = {
    RowDtype.FP32: "FP32",
    RowDtype.FP16: "FP16",
    RowDtype.INT8: "INT8",
    RowDtype.INT4: "INT4",
    RowDtype.INT2: "INT2",
}


@functools.cache
def _fbgemm() -> tuple[ModuleType, ModuleType, ModuleType] | None:
    """``(inference ops, common ops, configs)`` of ``fbgemm_gpu``, or ``None`` (logged once)."""
    try:
        return (
            importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_inference"),
            importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_common"),
            importlib.import_module("fbgemm_gpu.split_embedding_configs"),
        )
    except (ImportError, OSError, RuntimeError) as err:
        log.warning(
            "fbgemm_gpu does not import (%s): quantized tables are looked up on the reference "
            "path (pure torch)",
            err,
        )
        return None


def fbgemm_inference_available() -> bool:
    """Whether FBGEMM's inference kernel imports (a failure is logged once)."""
    return _fbgemm() is not None


def row_format_tag(dtype: RowDtype) -> torch.Tensor:
    """``(ROW_FORMAT_BYTES,) uint8``: ``dtype``'s name in ASCII, zero-padded (a table's
    ``row_format`` buffer, saved beside its rows so a load can tell the formats apart)."""
    raw = RowDtype(dtype).value.encode("ascii").ljust(ROW_FORMAT_BYTES, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _tag_name(tag: torch.Tensor) -> str:
    """The dtype name a ``row_format`` tensor holds (its raw bytes where they are no name)."""
    if tag.dtype != torch.uint8 or tag.dim() != 1:
        return f"<row_format {tuple(tag.shape)} {tag.dtype}>"
    raw = bytes(tag.tolist()).rstrip(b"\0")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return repr(raw)


class _FbgemmLookup:
    """FBGEMM's CPU inference TBE over one table's rows (its weight buffer bound to ``rows``)."""

    def __init__(self, rows: torch.Tensor, dtype: RowDtype, dim: int, combiner: Combiner) -> None:
        mods = _fbgemm()
        if mods is None:
            raise RuntimeError(
                "kernel='fbgemm' but fbgemm_gpu does not import; install fbgemm-gpu-cpu or "
                "use kernel='reference'"
            )
        ops, common, configs = mods
        sparse_type = getattr(configs.SparseType, _FBGEMM_TYPES[dtype])
        self.tbe = ops.IntNBitTableBatchedEmbeddingBagsCodegen(
            [("t", rows.shape[0], dim, sparse_type, common.EmbeddingLocation.HOST)],
            device="cpu",
            pooling_mode=common.PoolingMode.MEAN
            if combiner is Combiner.MEAN
            else common.PoolingMode.SUM,
            output_dtype=configs.SparseType.FP32,
            row_alignment=1,  # our rows are unpadded (FBGEMM's CPU default)
            # ids are range-checked (naming the table) by the model before any lookup
            bounds_check_mode=common.BoundsCheckMode.NONE,
        )
        # The kernel allocates its own buffer here (one table's quantized bytes, freed below);
        # with one table it starts at offset 0, so our rows, flattened, are that buffer.
        self.tbe.initialize_weights()
        if int(self.tbe.weights_physical_offsets[0]) != 0 or self.tbe.host_size < rows.numel():
            raise RuntimeError(
                f"FBGEMM laid out the table at offset {self.tbe.weights_physical_offsets[0]} "
                f"in {self.tbe.host_size} bytes; expected offset 0 and {rows.numel()} bytes"
            )
        self.tbe.weights_host = rows.view(-1)
        # The kernel's op, called with the module's own arguments: this table has no cache, no
        # index remapping and no bounds check, so the module's forward would only add Python
        # (about half of a small table's lookup time on this CPU).
        tbe = self.tbe
        self._op_args = {
            "dev_weights": tbe.weights_host,
            "uvm_weights": tbe.weights_uvm,
            "weights_placements": tbe.weights_placements,
            "weights_offsets": tbe.weights_offsets,
            "weights_tys": tbe.weights_tys,
            "D_offsets": tbe.D_offsets,
            "total_D": tbe.total_D,
            "max_int2_D": tbe.max_int2_D,
            "max_int4_D": tbe.max_int4_D,
            "max_int8_D": tbe.max_int8_D,
            "max_float16_D": tbe.max_float16_D,
            "max_float32_D": tbe.max_float32_D,
            "pooling_mode": int(tbe.pooling_mode),
            "indice_weights": None,
            "output_dtype": tbe.output_dtype,
            "lxu_cache_weights": tbe.lxu_cache_weights,
            "lxu_cache_locations": torch.empty(0, dtype=torch.int32),
            "row_alignment": tbe.row_alignment,
            "max_float8_D": tbe.max_float8_D,
            "fp8_exponent_bits": tbe.fp8_exponent_bits,
            "fp8_exponent_bias": tbe.fp8_exponent_bias,
        }

    def __call__(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ends = torch.cat([offsets, offsets.new_tensor([ids.numel()])])
        op = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function
        return op(indices=ids, offsets=ends, **self._op_args)


class QuantizedEmbeddingBag(RowFormatTable):
    """One table's rows in a :class:`~hps.rowformat.RowDtype`, pooled into bags on lookup.

    Args:
        name: the table's name (in errors).
        rows: ``(num_rows, row_bytes(dtype, dim)) uint8`` rows in the row format (checked:
            width, finite scales and biases).
        dtype: the rows' format.
        dim: values per row.
        combiner: sum or mean of a bag's rows.
        kernel: ``fbgemm`` (FBGEMM's fused CPU lookup, or an error), ``reference`` (pure
            torch), ``auto`` (FBGEMM where it imports and reads ``dtype``, else the reference).

    Buffers (both persistent, the table's state-dict entries): ``rows`` (the table) and
    ``row_format`` (:func:`row_format_tag` of ``dtype``). A state dict loads only into a table
    of the same dtype: rows of another format (which may have the same width, e.g. ``int8``
    and ``fp16`` rows of ``dim=8``) are refused naming the table and both dtypes, never
    reinterpreted.

    Raises:
        hps.rowformat.RowFormatError: naming the table, for rows that are not ``dtype`` rows.
    """

    rows: torch.Tensor
    row_format: torch.Tensor

    def __init__(
        self,
        name: str,
        rows: torch.Tensor,
        dtype: RowDtype,
        dim: int,
        combiner: Combiner = Combiner.SUM,
        kernel: EmbeddingKernel = EmbeddingKernel.AUTO,
    ) -> None:
        super().__init__()
        self.name = name
        self.dtype = RowDtype(dtype)
        self.dim = dim
        self.combiner = Combiner(combiner)
        self.kernel = EmbeddingKernel(kernel)
        check_rows(rows, self.dtype, dim, f"table {name!r}")
        self.register_buffer("rows", rows.contiguous())
        self.register_buffer("row_format", row_format_tag(self.dtype))
        self._lookup: _FbgemmLookup | None = None

    @classmethod
    def from_float(
        cls,
        name: str,
        weight: torch.Tensor,
        dtype: RowDtype,
        combiner: Combiner = Combiner.SUM,
        kernel: EmbeddingKernel = EmbeddingKernel.AUTO,
    ) -> QuantizedEmbeddingBag:
        """Quantize ``weight`` (``(num_rows, dim) float32``) into a new table.

        Raises:
            hps.rowformat.RowFormatError: naming the table, for values ``dtype`` cannot hold
                (NaN, inf, beyond float16's range) or a ``dim`` it cannot pack.
        """
        rows = quantize_rows(weight, dtype, f"table {name!r}")
        return cls(name, rows, dtype, weight.shape[1], combiner, kernel)

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the stored rows (``num_rows * row_bytes(dtype, dim)``)."""
        return self.num_rows * row_bytes(self.dtype, self.dim)

    @property
    def uses_fbgemm(self) -> bool:
        """Whether lookups go through FBGEMM's kernel."""
        if self.kernel is EmbeddingKernel.REFERENCE:
            return False
        if self.kernel is EmbeddingKernel.FBGEMM:
            return True
        return self.dtype in _FBGEMM_TYPES and fbgemm_inference_available()

    def dequantize(self) -> torch.Tensor:
        """The whole table as ``(num_rows, dim) float32``."""
        return dequantize_rows(self.rows, self.dtype, self.dim, f"table {self.name!r}")

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Pooled bags.

        Args:
            ids: ``(nnz,) int64`` row ids, in range (the model checks them).
            offsets: ``(B,) int64`` start of each bag in ``ids`` (``nn.EmbeddingBag``'s).

        Returns:
            ``(B, dim) float32``.

        Raises:
            RuntimeError: for ``kernel="fbgemm"`` when ``fbgemm_gpu`` does not import.
            ValueError: for ``kernel="fbgemm"`` and a dtype FBGEMM's kernel does not read.
        """
        if self.uses_fbgemm:
            return self._fbgemm_lookup()(ids, offsets)
        return self.reference(ids, offsets)

    def reference(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The pure-torch lookup every fast path is tested against: gather, dequantize, pool."""
        vectors = dequantize_rows(self.rows[ids], self.dtype, self.dim, f"table {self.name!r}")
        mode = "mean" if self.combiner is Combiner.MEAN else "sum"
        positions = torch.arange(ids.numel(), device=ids.device)
        return F.embedding_bag(positions, vectors, offsets, mode=mode)

    def _fbgemm_lookup(self) -> _FbgemmLookup:
        if self.dtype not in _FBGEMM_TYPES:
            raise ValueError(
                f"table {self.name!r}: FBGEMM's inference kernel does not read {self.dtype.value} "
                f"rows (it reads {', '.join(d.value for d in _FBGEMM_TYPES)}); use "
                "kernel='reference' or 'auto'"
            )
        lookup = self._lookup
        if lookup is None or lookup.tbe.weights_host.data_ptr() != self.rows.data_ptr():
            lookup = self._lookup = _FbgemmLookup(self.rows, self.dtype, self.dim, self.combiner)
        return lookup

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        tag = state_dict.get(prefix + "row_format")
        if tag is not None and not torch.equal(tag.cpu(), self.row_format.cpu()):
            raise ValueError(
                f"table {self.name!r}: the state dict holds {_tag_name(tag)} rows, this table "
                f"is {self.dtype.value}; quantize the model with the same "
                "EmbeddingQuantConfig before loading"
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def __getstate__(self) -> dict[str, Any]:
        # the kernel is rebuilt over the copy's rows on its first lookup
        state = self.__dict__.copy()
        state["_lookup"] = None
        return state

    def extra_repr(self) -> str:
        return (
            f"{self.name!r}, {self.num_rows}, {self.dim}, dtype={self.dtype.value}, "
            f"combiner={self.combiner.value}, kernel={self.kernel.value}"
        )
