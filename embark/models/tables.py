"""A model's embedding tables as one typed module: storage dtype, lookups (pooled bags) and the
fused sparse update, the way TorchRec's ``EmbeddingBagCollection`` + fused optimizer hold them.

Every holder of tables is a :class:`TableStore`: :class:`EmbeddingTables` (a single-process
model's whole tables, ``DLRM.embeddings``) and ``embark.sharding.ShardedEmbeddingCollection``
(one rank's shards and replicas). A model that has tables is a :class:`TableModel`
(``DLRM``, ``ShardedDLRM``); the trainer, quantization, export and checkpoints reach the
tables through :meth:`TableModel.embedding_store`, never by attribute probing or by parameter
name::

    store = model.embedding_store()
    store.trainable_weights()    {table: float weight (rows, dim)}   what a trainer updates
    store.replicated()           tables whose replicas are summed over ranks (DP)
    store.storage_dtype(t)       RowDtype: FP32 / FP16 / BF16 weights, INT8 / INT4 ... rows
    store.install_update(t, u)   a trainer's fused lookup-and-update (a FusedLookup)
    store.lookup(t, ids, offsets, mode)   (B, dim) float32 pooled bags, through the update

A table trained in FP16 or BF16 (:meth:`TableStore.set_storage_dtype_`) keeps its weight in
that dtype; every lookup returns float32 bags whatever the storage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from embark.types import Combiner, TableConfig
from hps.rowformat import RowDtype

__all__ = [
    "FLOAT_DTYPES",
    "FusedLookup",
    "RowFormatTable",
    "bag_fp32",
    "TableModel",
    "TableStore",
    "EmbeddingTables",
    "table_weight_key",
    "torch_dtype",
]

#: The dtypes a trainable table's weight can be stored in, and their torch dtypes.
FLOAT_DTYPES: dict[RowDtype, torch.dtype] = {
    RowDtype.FP32: torch.float32,
    RowDtype.FP16: torch.float16,
    RowDtype.BF16: torch.bfloat16,
}

# the child holding a store's fused updates (a table of this name is refused)
_FUSED = "_fused"


def table_weight_key(table: str) -> str:
    """The name of ``table``'s weight in a single-process model's state dict and in every
    checkpoint (``"embeddings.<table>.weight"``; its optimizer state is this name plus
    ``"::<state key>"``)."""
    return f"embeddings.{table}.weight"


def torch_dtype(dtype: RowDtype) -> torch.dtype:
    """The torch dtype of a trainable table stored as ``dtype``.

    Raises:
        ValueError: naming the dtype, for a row format that is not a float (INT8 ...).
    """
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"a trainable table is stored as one of {[d.value for d in FLOAT_DTYPES]}, "
            f"got {RowDtype(dtype).value!r}"
        )
    return FLOAT_DTYPES[dtype]


def row_dtype_of(dtype: torch.dtype) -> RowDtype:
    """The :class:`RowDtype` of a float weight's torch dtype.

    Raises:
        ValueError: naming the dtype, for a dtype a table's weight cannot have.
    """
    for row, t in FLOAT_DTYPES.items():
        if t == dtype:
            return row
    raise ValueError(f"a table's weight must be one of {list(FLOAT_DTYPES.values())}, got {dtype}")


def bag_fp32(
    ids: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, mode: str
) -> torch.Tensor:
    """``(B, dim) float32`` bags of ``ids`` over ``weight`` of any float dtype, summed in
    float32 (an FP16/BF16 table's rows are widened before the sum, as the parameter server
    sums dequantized rows, so a bag neither rounds to 16 bits nor overflows to inf)."""
    if weight.dtype == torch.float32:
        return F.embedding_bag(ids, weight, offsets, mode=mode)
    rows = weight.index_select(0, ids).float()
    positions = torch.arange(ids.numel(), device=ids.device)
    return F.embedding_bag(positions, rows, offsets, mode=mode)


class FusedLookup(nn.Module, ABC):
    """Base of a table's fused lookup-and-update that a trainer installs in a
    :class:`TableStore` (``embark.training.fused.SparseTableUpdate``).

    Attributes:
        frozen: the table is looked up but never updated.
    """

    frozen: bool = False

    @abstractmethod
    def forward(
        self, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mode: str
    ) -> torch.Tensor:
        """Pool ``ids`` (``(nnz,) int64``, bags starting at ``offsets`` ``(B,) int64``) from
        ``weight`` ``(num_rows, dim)`` by ``mode`` (``"sum"``/``"mean"``) → ``(B, dim)
        float32``; with autograd on, its backward updates the touched rows."""


class RowFormatTable(nn.Module, ABC):
    """Base of a table held in a row format (``embark.quant.QuantizedEmbeddingBag``):
    looked up, never trained (it holds no float weight).

    Attributes:
        dtype: the rows' :class:`~hps.rowformat.RowDtype`.
    """

    dtype: RowDtype
    combiner: Combiner

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the stored rows."""

    @abstractmethod
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``(B, dim) float32`` pooled bags of ``ids`` ``(nnz,) int64`` at ``offsets``."""


class TableStore(nn.Module, ABC):
    """What every holder of tables offers the trainer, quantization, export and checkpoints
    (see the module docstring). Subclasses implement :meth:`trainable_weights` and
    :meth:`_set_weight`; a fused update installed for a table is used by :meth:`lookup`."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(_FUSED, nn.ModuleDict())

    @property
    def _updates(self) -> nn.ModuleDict:
        updates = self._modules[_FUSED]
        assert isinstance(updates, nn.ModuleDict)
        return updates

    @abstractmethod
    def trainable_weights(self) -> dict[str, nn.Parameter]:
        """``{table: (rows, dim) weight}`` of the float tables (whole, or this rank's shard or
        replica), in table order; a table in a row format is left out."""

    def replicated(self) -> frozenset[str]:
        """The tables whose replicas are summed over the ranks (data-parallel); none here."""
        return frozenset()

    def storage_dtype(self, table: str) -> RowDtype:
        """How ``table``'s values are stored.

        Raises:
            KeyError: naming the tables, for a table this store does not hold.
        """
        weights = self.trainable_weights()
        if table not in weights:
            raise KeyError(f"no table {table!r}; this store holds {sorted(weights)}")
        return row_dtype_of(weights[table].dtype)

    # ----------------------------------------------------------- fused updates
    def install_update(self, table: str, update: FusedLookup) -> None:
        """Look ``table`` up through ``update`` from now on (replacing one installed before).

        Raises:
            KeyError: for a table without a float weight here.
            TypeError: for an ``update`` that is no :class:`FusedLookup`.
        """
        if table not in self.trainable_weights():
            raise KeyError(
                f"no trainable table {table!r}; this store holds {sorted(self.trainable_weights())}"
            )
        if not isinstance(update, FusedLookup):
            raise TypeError(
                f"table {table!r}: a fused update is a FusedLookup, got {type(update).__name__}"
            )
        self._updates[table] = update

    def remove_update(self, table: str) -> None:
        """Drop ``table``'s fused update (if any): it is looked up plainly again."""
        if table in self._updates:
            del self._updates[table]

    def update_of(self, table: str) -> FusedLookup | None:
        """``table``'s installed fused update, or ``None``."""
        if table not in self._updates:
            return None
        update = self._updates[table]
        assert isinstance(update, FusedLookup)
        return update

    def lookup(
        self, table: str, ids: torch.Tensor, offsets: torch.Tensor, mode: str
    ) -> torch.Tensor:
        """``(B, dim) float32`` bags of ``ids`` (``(nnz,) int64``, ids of this store's piece of
        ``table``) at ``offsets`` ``(B,) int64`` pooled by ``mode``: through the fused update
        when one is installed, else ``F.embedding_bag``."""
        weight = self.trainable_weights()[table]
        update = self.update_of(table)
        if update is not None:
            out: torch.Tensor = update(weight, ids, offsets, mode)
        else:
            out = bag_fp32(ids, weight, offsets, mode)
        return out.float()

    # ---------------------------------------------------------- storage dtype
    @torch.no_grad()
    def set_storage_dtype_(self, dtype: RowDtype) -> None:
        """Store every float table in ``dtype`` (FP32, FP16 or BF16; values rounded to
        nearest), in place: each weight becomes a new parameter of that dtype, keeping its
        ``requires_grad``. A table already in ``dtype`` is left as it is (same parameter).

        Raises:
            ValueError: for a dtype that is not a float (:func:`torch_dtype`), or when a fused
                update is installed (the updates are built over the weights: convert first).
        """
        target = torch_dtype(dtype)
        weights = self.trainable_weights()
        changing = [t for t, w in weights.items() if w.dtype != target]
        busy = [t for t in changing if t in self._updates]
        if busy:
            raise ValueError(
                f"tables {busy} have fused updates installed; set the storage dtype to "
                f"{RowDtype(dtype).value} before a trainer takes them over"
            )
        for t in changing:
            w = weights[t]
            self._set_weight(t, nn.Parameter(w.to(target), requires_grad=w.requires_grad))

    @abstractmethod
    def _set_weight(self, table: str, weight: nn.Parameter) -> None:
        """Replace ``table``'s weight (its storage dtype changed)."""


class EmbeddingTables(TableStore):
    """A single-process model's tables, one ``nn.EmbeddingBag`` (or a
    :class:`RowFormatTable`) per table, registered under the table's name so their weights
    are ``<prefix>.<table>.weight`` in the model's state dict.

    Indexing reads like a ``ModuleDict`` of the tables (``tables["t0"]``, ``keys()``,
    ``items()``, ``in``, ``len``); tables are replaced only through :meth:`replace_table`.

    Args:
        tables: the tables, in order (their ``num_rows``, ``dim`` and combiner).

    Raises:
        ValueError: for duplicate table names or a table named ``"_fused"``.
    """

    def __init__(self, tables: Sequence[TableConfig]) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names) or _FUSED in names:
            raise ValueError(
                f"EmbeddingTables: table names must be distinct and not {_FUSED!r}, got {names}"
            )
        self._names: list[str] = names
        for t in tables:
            mode = "mean" if t.combiner == Combiner.MEAN else "sum"
            self.add_module(t.name, nn.EmbeddingBag(t.num_rows, t.dim, mode=mode))

    # ------------------------------------------------------ mapping of tables
    def __getitem__(self, table: str) -> nn.Module:
        if table not in self._names:
            raise KeyError(f"no table {table!r}; the tables are {self._names}")
        return self._modules[table]  # type: ignore[return-value]

    def __contains__(self, table: object) -> bool:
        return table in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def keys(self) -> list[str]:
        """The table names, in order."""
        return list(self._names)

    def items(self) -> list[tuple[str, nn.Module]]:
        """``(table, its module)`` in order."""
        return [(n, self[n]) for n in self._names]

    def values(self) -> list[nn.Module]:
        """The tables' modules, in order."""
        return [self[n] for n in self._names]

    # -------------------------------------------------------------- TableStore
    def trainable_weights(self) -> dict[str, nn.Parameter]:
        return {
            n: m.get_parameter("weight") for n, m in self.items() if isinstance(m, nn.EmbeddingBag)
        }

    def storage_dtype(self, table: str) -> RowDtype:
        module = self[table]
        if isinstance(module, RowFormatTable):
            return module.dtype
        return row_dtype_of(module.get_parameter("weight").dtype)

    def storage_dtypes(self) -> dict[str, RowDtype]:
        """``{table: storage dtype}`` in order."""
        return {n: self.storage_dtype(n) for n in self._names}

    def mode(self, table: str) -> str:
        """``"sum"`` or ``"mean"``: how ``table``'s bags are pooled."""
        module = self[table]
        if isinstance(module, nn.EmbeddingBag):
            return str(module.mode)
        assert isinstance(module, RowFormatTable)
        return "mean" if module.combiner == Combiner.MEAN else "sum"

    def bag(self, table: str, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``(B, dim) float32`` pooled bags of ``table`` (its row format's lookup, its fused
        update's, or a plain bag), ids range-checked by the caller."""
        module = self[table]
        if isinstance(module, RowFormatTable):
            return module(ids, offsets)
        assert isinstance(module, nn.EmbeddingBag)
        if self.update_of(table) is not None:
            return self.lookup(table, ids, offsets, module.mode)
        if module.weight.dtype == torch.float32:
            return module(ids, offsets)
        return bag_fp32(ids, module.weight, offsets, module.mode)

    def float_weight(self, table: str) -> torch.Tensor:
        """``(num_rows, dim) float32`` values of a float table (its weight itself when FP32,
        else a converted copy), detached.

        Raises:
            ValueError: naming the table and its dtype, for a table in a row format.
        """
        module = self[table]
        if not isinstance(module, nn.EmbeddingBag):
            raise ValueError(
                f"table {table!r} is stored as {self.storage_dtype(table).value} rows and has "
                "no float weight"
            )
        return module.weight.detach().float()

    def replace_table(self, table: str, module: RowFormatTable) -> None:
        """Hold ``table`` as ``module`` (e.g. quantized rows); its fused update is dropped (a
        table in a row format is not trained).

        Raises:
            KeyError: for a table this store does not hold.
        """
        if table not in self._names:
            raise KeyError(f"no table {table!r}; the tables are {self._names}")
        self.remove_update(table)
        self._modules[table] = module

    def _set_weight(self, table: str, weight: nn.Parameter) -> None:
        bag = self[table]
        assert isinstance(bag, nn.EmbeddingBag)
        bag.weight = weight


class TableModel(nn.Module, ABC):
    """Base of a model whose embedding tables are one :class:`TableStore` (``DLRM``,
    ``ShardedDLRM``): what the trainer takes over and quantization and export read."""

    @abstractmethod
    def embedding_store(self) -> TableStore:
        """The model's tables."""
