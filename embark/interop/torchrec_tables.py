"""TorchRec tables, state dicts and batches in tilerec's terms (torchrec stays optional).

TorchRec describes tables with ``EmbeddingBagConfig`` (``name``, ``num_embeddings``,
``embedding_dim``, ``feature_names``, ``pooling``) and keeps their weights in an
``EmbeddingBagCollection`` under ``embedding_bags.<table>.weight``; tilerec has
:class:`~embark.types.TableConfig` and ``embeddings.<table>.weight``. Both hold one
``(num_rows, dim) float32`` matrix per table, row ``i`` the vector of id ``i``, so the mapping
is a rename of the state-dict keys (the tensors are the same objects)::

    TorchRec EmbeddingBagCollection          tilerec DLRM
    embedding_bags.t0.weight  (1000, 16)  ⇄  embeddings.t0.weight  (1000, 16)
    embedding_bags.t1.weight  (  50, 16)  ⇄  embeddings.t1.weight  (  50, 16)

A TorchRec batch (``KeyedJaggedTensor``) is keyed by *feature*; a tilerec batch by *table*.
Each tilerec table serves one feature, so a table whose config lists several features
(a shared table) is refused by name.

Nothing here imports torchrec at module level: the functions read the configs' attributes
(``ebc_configs_from_tables`` alone builds TorchRec objects, importing it then).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embark.data.jagged import JaggedBatch
from embark.models.workloads import Interaction, Workload
from embark.types import Combiner, TableConfig

__all__ = [
    "EBC_PREFIX",
    "EMBARK_PREFIX",
    "batch_from_kjt",
    "ebc_configs_from_tables",
    "ebc_to_embark_state_dict",
    "embark_to_ebc_state_dict",
    "feature_of_table",
    "tables_from_ebc_configs",
    "workload_from_ebc_configs",
]

EBC_PREFIX = "embedding_bags."  # TorchRec EmbeddingBagCollection: embedding_bags.<table>.weight
EMBARK_PREFIX = "embeddings."  # embark DLRM: embeddings.<table>.weight

_POOLING_TO_COMBINER = {"SUM": Combiner.SUM, "MEAN": Combiner.MEAN}


def _enum_name(value: Any) -> str:
    """``PoolingType.SUM`` / ``DataType.FP32`` → ``"SUM"`` / ``"FP32"`` (the enums' names)."""
    return str(getattr(value, "name", value))


def feature_of_table(config: Any) -> str:
    """The one feature name of a TorchRec ``EmbeddingBagConfig`` (its table name when it lists
    none, as TorchRec's ``EmbeddingBagCollection`` does).

    Raises:
        ValueError: naming the table and its features when it lists more than one.
    """
    names = list(config.feature_names) or [config.name]
    if len(names) != 1:
        raise ValueError(
            f"table {config.name!r} serves features {names}; a tilerec table serves one feature "
            f"(give each feature its own table, or look the shared table up once)"
        )
    return names[0]


def _hotness_of(hotness: int | Mapping[str, int], name: str) -> int:
    return hotness[name] if isinstance(hotness, Mapping) else hotness


def tables_from_ebc_configs(
    configs: Sequence[Any], hotness: int | Mapping[str, int] = 1
) -> tuple[TableConfig, ...]:
    """tilerec tables for TorchRec ``EmbeddingBagConfig`` s, in the same order.

    Args:
        configs: ``EmbeddingBagConfig`` s (``ebc.embedding_bag_configs()``).
        hotness: ids per sample of each table (TorchRec's configs do not say; the exported
            graph and ``ps.json`` need it): one int for all, or ``{table: int}``.

    Returns:
        one :class:`TableConfig` per config: ``name``, ``num_rows = num_embeddings``,
        ``dim = embedding_dim``, ``combiner`` from ``pooling`` (SUM / MEAN).

    Raises:
        ValueError: naming the table for pooling ``NONE`` (unpooled sequence embeddings), a
            data type other than FP32, several features on one table, a table name outside
            tilerec's name rule, or a missing ``hotness`` entry; for no configs or duplicate
            feature names.
    """
    if not configs:
        raise ValueError("tables_from_ebc_configs: no EmbeddingBagConfig given")
    tables = []
    features: dict[str, str] = {}
    if isinstance(hotness, Mapping):
        missing = [c.name for c in configs if c.name not in hotness]
        if missing:
            raise ValueError(
                f"hotness: no entry for table(s) {missing} (given for {list(hotness)}); "
                "TorchRec does not record a table's maximum bag size: give every table's, or "
                "infer them from data with embark.data.max_bag_sizes(batches)"
            )
    for cfg in configs:
        pooling = _enum_name(cfg.pooling)
        if pooling not in _POOLING_TO_COMBINER:
            raise ValueError(
                f"table {cfg.name!r}: pooling {pooling} has no tilerec combiner "
                f"(expected one of {sorted(_POOLING_TO_COMBINER)})"
            )
        dtype = _enum_name(cfg.data_type)
        if dtype != "FP32":
            raise ValueError(f"table {cfg.name!r}: data_type {dtype}; tilerec tables are FP32")
        feature = feature_of_table(cfg)
        if feature in features:
            raise ValueError(
                f"feature {feature!r} is served by tables {features[feature]!r} and {cfg.name!r}"
            )
        features[feature] = cfg.name
        tables.append(
            TableConfig(
                name=cfg.name,
                num_rows=cfg.num_embeddings,
                dim=cfg.embedding_dim,
                hotness=_hotness_of(hotness, cfg.name),
                combiner=_POOLING_TO_COMBINER[pooling],
            )
        )
    return tuple(tables)


def workload_from_ebc_configs(
    configs: Sequence[Any],
    dense_features: int,
    bottom_mlp: Sequence[int],
    top_mlp: Sequence[int],
    interaction: Interaction | None = None,
    hotness: int | Mapping[str, int] = 1,
    name: str = "torchrec",
) -> Workload:
    """A :class:`Workload` (the tables of :func:`tables_from_ebc_configs` and the given dense
    part) to train or plan a TorchRec model's tables with embark.

    Raises:
        ValueError: as :func:`tables_from_ebc_configs` and :class:`Workload` do.
    """
    return Workload(
        name=name,
        tables=tables_from_ebc_configs(configs, hotness),
        dense_features=dense_features,
        bottom_mlp=tuple(bottom_mlp),
        top_mlp=tuple(top_mlp),
        interaction=interaction if interaction is not None else Interaction(),
        source="torchrec EmbeddingBagConfig",
    )


def ebc_configs_from_tables(tables: Sequence[TableConfig]) -> list[Any]:
    """TorchRec ``EmbeddingBagConfig`` s for tilerec tables (one feature per table, named like
    the table; FP32; pooling from the combiner). Needs torchrec.

    Raises:
        ImportError: when torchrec is not importable.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    pooling = {Combiner.SUM: PoolingType.SUM, Combiner.MEAN: PoolingType.MEAN}
    return [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_rows,
            embedding_dim=t.dim,
            feature_names=[t.name],
            pooling=pooling[t.combiner],
        )
        for t in tables
    ]


def _rename(
    state: Mapping[str, torch.Tensor], src: str, dst: str, keep_others: bool
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    others = []
    for key, value in state.items():
        if key.startswith(src) and key.endswith(".weight") and key.count(".") == 2:
            out[dst + key[len(src) :]] = value
        else:
            others.append(key)
    if others and not keep_others:
        raise ValueError(
            f"state dict keys {others[:5]}{' …' if len(others) > 5 else ''} are not "
            f"'{src}<table>.weight'"
        )
    return out


def ebc_to_embark_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An ``EmbeddingBagCollection`` state dict as embark's: ``embedding_bags.<t>.weight`` →
    ``embeddings.<t>.weight``, each ``(num_rows, dim)`` tensor unchanged (the same object).

    Load it with ``model.load_state_dict(..., strict=False)`` (it holds the tables only).

    Raises:
        ValueError: naming the keys that are not ``embedding_bags.<table>.weight``.
    """
    return _rename(state, EBC_PREFIX, EMBARK_PREFIX, keep_others=False)


def embark_to_ebc_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tables of an embark model's state dict as an ``EmbeddingBagCollection``'s:
    ``embeddings.<t>.weight`` → ``embedding_bags.<t>.weight``, tensors unchanged; the dense
    part's keys (``bottom_mlp.…``) are not an EBC's and are left out, so
    ``ebc.load_state_dict(embark_to_ebc_state_dict(model.state_dict()))`` loads strictly.

    Raises:
        ValueError: when ``state`` holds no ``embeddings.<table>.weight``.
    """
    out = _rename(state, EMBARK_PREFIX, EBC_PREFIX, keep_others=True)
    if not out:
        raise ValueError(
            f"embark_to_ebc_state_dict: no 'embeddings.<table>.weight' among {list(state)[:5]}"
        )
    return out


def batch_from_kjt(kjt: Any, configs: Sequence[Any]) -> JaggedBatch:
    """A TorchRec batch keyed by feature as a :class:`JaggedBatch` keyed by table, in the
    configs' table order (what an embark model built from those tables takes).

    Conversion as :meth:`JaggedBatch.from_kjt` (exact, or refused: weighted and
    variable-batch KJTs without inverse indices).

    Raises:
        ValueError: as :meth:`JaggedBatch.from_kjt`; a table whose feature is missing from
            the KJT (naming both); a table with several features.
    """
    batch = JaggedBatch.from_kjt(kjt)
    per_key = batch.per_key()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for cfg in configs:
        feature = feature_of_table(cfg)
        if feature not in per_key:
            raise ValueError(
                f"table {cfg.name!r}: its feature {feature!r} is not among the batch's keys "
                f"{batch.keys}"
            )
        out[cfg.name] = per_key[feature]
    return JaggedBatch.from_per_key(out)
