"""A model built from a TorchRec ``EmbeddingBagCollection`` and a dense module, in the shape
tilerec's export and serving take (``tables``, ``embeddings``, ``dense_forward``).

Data flow for ``B`` samples and ``T`` tables (one feature each)::

    features (KJT, keyed by feature) ──ebc──▶ KeyedTensor ──per table──▶ pooled: T × (B, dim_t)
    dense (B, D) ───────────────────────────────────────────┐                 │
                                                            ▼                 ▼
                                     dense_module(dense, pooled) ──▶ logits (B,) (or (B, 1))

The EBC pools (sum or mean, weighted when the EBC is); everything after pooling is the dense
module's. :func:`from_torchrec_dlrm` builds one from TorchRec's own ``DLRM`` / ``DLRM_DCN``,
whose dense module is its ``dense_arch`` → ``inter_arch`` → ``over_arch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from embark.interop.torchrec_tables import feature_of_table, tables_from_ebc_configs
from embark.types import TableConfig

__all__ = ["EBCModel", "TorchRecDLRMDense", "from_torchrec_dlrm"]


class EBCModel(nn.Module):
    """A TorchRec ``EmbeddingBagCollection`` (the tables) and a dense module (the rest).

    Args:
        ebc: the ``torchrec.EmbeddingBagCollection``; held, not copied (its weights are this model's).
        dense_module: ``dense_module(dense (B, D) float32, pooled: list of T (B, dim_t)
            float32 in table order) -> (B,) or (B, 1) float32`` logits.
        dense_features: ``D``, the width of the dense input.
        hotness: ids per sample of each table (TorchRec does not record it; the exported
            graph and ``ps.json`` need it): one int for all, or ``{table: int}``.

    Attributes:
        tables: one :class:`TableConfig` per EBC table, in the EBC's order.
        dense_features: ``D``.

    Raises:
        ValueError: as :func:`~embark.interop.tables_from_ebc_configs` (a shared table, pooling
            NONE, FP16 data, a bad name), or a ``dense_features`` that is not a positive int.
    """

    def __init__(
        self,
        ebc: Any,
        dense_module: nn.Module,
        dense_features: int,
        hotness: int | Mapping[str, int] = 1,
    ) -> None:
        super().__init__()
        if isinstance(dense_features, bool) or not isinstance(dense_features, int):
            raise ValueError(f"dense_features must be a positive int, got {dense_features!r}")
        if dense_features <= 0:
            raise ValueError(f"dense_features must be a positive int, got {dense_features!r}")
        configs = ebc.embedding_bag_configs()
        self.ebc: Any = ebc  # a torchrec EmbeddingBagCollection (torchrec is optional)
        self.dense_module = dense_module
        self.dense_features = dense_features
        self.tables: tuple[TableConfig, ...] = tables_from_ebc_configs(configs, hotness)
        self.features = [feature_of_table(c) for c in configs]

    @property
    def embeddings(self) -> nn.ModuleDict:
        """``{table: nn.EmbeddingBag}``, the EBC's bags (weights ``(num_rows, dim)``)."""
        bags = self.ebc.embedding_bags
        if not isinstance(bags, nn.ModuleDict):
            raise TypeError(f"the EBC's embedding_bags is a {type(bags).__name__}")
        return bags

    @property
    def is_weighted(self) -> bool:
        """Whether the EBC pools with per-id weights (the KJT's ``weights()``)."""
        return bool(self.ebc.is_weighted())

    def pool(self, features: Any) -> list[torch.Tensor]:
        """The EBC's pooled vectors, one ``(B, dim_t) float32`` per table in table order.

        Args:
            features: a ``KeyedJaggedTensor`` keyed by feature (weighted when the EBC is).
        """
        pooled = self.ebc(features).to_dict()
        return [pooled[f] for f in self.features]

    def dense_forward(
        self, dense: torch.Tensor, pooled: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The dense module on pooled vectors.

        Args:
            dense: ``(B, D) float32``.
            pooled: ``(B, T, dim) float32`` (tables of one dim), or ``T`` tensors ``(B, dim_t)``.

        Returns:
            ``(B,) float32`` logits.
        """
        parts = list(pooled.unbind(1)) if isinstance(pooled, torch.Tensor) else list(pooled)
        if len(parts) != len(self.tables):
            raise ValueError(f"expected {len(self.tables)} pooled tensors, got {len(parts)}")
        logits = self.dense_module(dense, parts)
        return logits.squeeze(-1) if logits.dim() == 2 else logits

    def forward(self, dense: torch.Tensor, features: Any) -> torch.Tensor:
        """``dense: (B, D) float32``, ``features``: a ``KeyedJaggedTensor`` → ``(B,)`` logits."""
        if dense.dim() != 2 or dense.shape[1] != self.dense_features:
            raise ValueError(f"dense must be (B, {self.dense_features}), got {tuple(dense.shape)}")
        return self.dense_forward(dense, self.pool(features))


class TorchRecDLRMDense(nn.Module):
    """The dense part of TorchRec's ``DLRM`` (and ``DLRM_DCN``, ``DLRM_Projection``): its
    ``dense_arch``, ``inter_arch`` and ``over_arch``, shared with the model.

    ``forward(dense (B, D), pooled: F × (B, dim)) -> (B, 1)``, as the model's forward after
    its ``sparse_arch`` (which stacks the pooled features into ``(B, F, dim)``).
    """

    def __init__(self, dlrm: Any) -> None:
        super().__init__()
        self.dense_arch = dlrm.dense_arch
        self.inter_arch = dlrm.inter_arch
        self.over_arch = dlrm.over_arch

    def forward(self, dense: torch.Tensor, pooled: Sequence[torch.Tensor]) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense)
        embedded_sparse = torch.stack(list(pooled), dim=1)  # (B, F, dim)
        z = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        out: torch.Tensor = self.over_arch(z)
        return out


def from_torchrec_dlrm(dlrm: Any, hotness: int | Mapping[str, int]) -> EBCModel:
    """An :class:`EBCModel` sharing the modules of TorchRec's ``DLRM`` / ``DLRM_DCN`` (its
    ``sparse_arch.embedding_bag_collection`` and :class:`TorchRecDLRMDense`): the same
    weights, the same logits (squeezed to ``(B,)``).

    ``hotness`` is each table's maximum bag size, which TorchRec does not record: one for
    every table, ``{table: n}`` (an error names every table missing), or inferred from data
    with :func:`embark.data.max_bag_sizes` over batches keyed by table.

    Raises:
        TypeError: for a module without TorchRec DLRM's ``sparse_arch``, ``dense_arch``,
            ``inter_arch`` and ``over_arch``.
        ValueError: as :class:`EBCModel`.
    """
    missing = [
        a for a in ("sparse_arch", "dense_arch", "inter_arch", "over_arch") if not hasattr(dlrm, a)
    ]
    if missing:
        raise TypeError(
            f"from_torchrec_dlrm: a {type(dlrm).__name__} has no {missing}; expected TorchRec's "
            f"DLRM (torchrec.models.dlrm); build an EBCModel(ebc, dense_module, ...) instead"
        )
    ebc = dlrm.sparse_arch.embedding_bag_collection
    first = dlrm.dense_arch.model
    linear = next((m for m in first.modules() if isinstance(m, nn.Linear)), None)
    if linear is None:
        raise TypeError("from_torchrec_dlrm: the DLRM's dense_arch has no Linear layer")
    return EBCModel(ebc, TorchRecDLRMDense(dlrm), linear.in_features, hotness)
