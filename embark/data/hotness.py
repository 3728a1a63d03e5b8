"""One meaning of ``hotness``: the maximum bag size of a table, enforced by a declared policy.

``TableConfig.hotness`` is the largest number of ids one sample may hold in that table's bag
(HugeCTR's ``maxnum_catfeature_query_per_table_per_sample``). A longer bag is handled by the
table's :class:`~embark.types.HotnessPolicy` the same way wherever it enters a model:
:func:`enforce_hotness` here (tabular sources, ``DLRM.forward`` in training and evaluation),
and ``hps.vocabulary`` in the v2 server (which reads the policy from the artifacts). With
``hotness = 2`` and ``TRUNCATE``::

    bags      [V0, V1, V2]   [V3]   [ ]
    lengths   3              1      0
    kept      [V0, V1]       [V3]   [ ]        lengths 2 1 0

``REFUSE`` raises :class:`HotnessError` instead, naming the table, the sample, its bag size and
the limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from embark.data.jagged import JaggedBatch
from embark.types import HotnessPolicy, TableConfig

__all__ = ["HotnessError", "enforce_hotness", "max_bag_sizes", "truncate_bags"]


class HotnessError(ValueError):
    """A bag longer than its table's ``hotness`` under :attr:`HotnessPolicy.REFUSE`."""


def truncate_bags(
    values: np.ndarray, lengths: np.ndarray, hotness: int
) -> tuple[np.ndarray, np.ndarray]:
    """Keep the first ``hotness`` ids of every bag.

    Args:
        values: ``(nnz,)`` ids, bag after bag.
        lengths: ``(B,)`` integer bag sizes, summing to ``nnz``.
        hotness: the maximum bag size, ≥ 1.

    Returns:
        ``(values (nnz',), lengths (B,) int32)`` with every length ``min(length, hotness)``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or int(lengths.max()) <= hotness:
        return values, lengths.astype(np.int32)
    starts = np.cumsum(lengths) - lengths
    within = np.arange(values.shape[0], dtype=np.int64) - np.repeat(starts, lengths)
    kept = np.minimum(lengths, hotness)
    return values[within < hotness], kept.astype(np.int32)


def check_or_truncate(
    table: TableConfig, values: np.ndarray, lengths: np.ndarray, where: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """Apply ``table``'s hotness policy to one table's bags (numpy).

    Args:
        table: the table (its ``hotness`` and ``hotness_policy``).
        values: ``(nnz,)`` ids; lengths: ``(B,)`` bag sizes.
        where: what the bags are, for the error (e.g. ``"rows 0..511 of train"``).

    Returns:
        ``(values, lengths int32)``, truncated under ``TRUNCATE``.

    Raises:
        HotnessError: under ``REFUSE``, for the first bag longer than ``hotness``.
    """
    lengths = np.asarray(lengths)
    if lengths.size == 0 or int(lengths.max()) <= table.hotness:
        return values, lengths.astype(np.int32, copy=False)
    if table.hotness_policy is HotnessPolicy.TRUNCATE:
        return truncate_bags(values, lengths, table.hotness)
    sample = int(np.argmax(lengths > table.hotness))
    raise HotnessError(
        f"table {table.name!r}: sample {sample}{' of ' + where if where else ''} has a bag of "
        f"{int(lengths[sample])} ids but hotness (the maximum bag size) is {table.hotness}; "
        f"raise hotness, or declare hotness_policy='truncate' to keep the first "
        f"{table.hotness} ids (the server applies the same policy)"
    )


def enforce_hotness(sparse: JaggedBatch, tables: Sequence[TableConfig]) -> JaggedBatch:
    """``sparse`` with every table's hotness policy applied (the same object when every bag
    fits, which costs one pass over ``lengths``).

    Args:
        sparse: the batch, keyed by table name; keys that are no table pass unchanged.
        tables: the model's tables.

    Raises:
        HotnessError: a bag longer than its table's ``hotness`` under ``REFUSE``.
    """
    lengths = sparse.lengths
    b = sparse.batch_size
    if lengths.numel() == 0:
        return sparse
    limits = {t.name: t for t in tables}
    per_key_max = lengths.view(len(sparse.keys), b).amax(dim=1).tolist() if b else []
    over = [k for k, m in zip(sparse.keys, per_key_max) if k in limits and m > limits[k].hotness]
    if not over:
        return sparse
    per_key = {}
    for k in sparse.keys:
        values, key_lengths = sparse.values_for(k), sparse.lengths_for(k)
        if k in over:
            v, n = check_or_truncate(
                limits[k], values.cpu().numpy(), key_lengths.cpu().numpy(), "this batch"
            )
            values = torch.from_numpy(np.ascontiguousarray(v)).to(values.device)
            key_lengths = torch.from_numpy(np.ascontiguousarray(n)).to(key_lengths.device)
        per_key[k] = (values, key_lengths)
    return JaggedBatch.from_per_key(per_key)


def max_bag_sizes(batches: Iterable[JaggedBatch]) -> dict[str, int]:
    """The largest bag of each key over ``batches``: the ``hotness`` of data (what
    :func:`embark.interop.from_torchrec_dlrm` and ``export`` take per table).

    Returns:
        ``{key: max bag size}`` (at least 1, so a key seen only empty still gets a valid
        hotness), keys in first-seen order.
    """
    out: dict[str, int] = {}
    for sp in batches:
        b = sp.batch_size
        maxima = sp.lengths.view(len(sp.keys), b).amax(dim=1).tolist() if b else []
        for k, m in zip(sp.keys, maxima or [0] * len(sp.keys)):
            out[k] = max(out.get(k, 1), int(m))
    return out


def hotness_for(tables: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
    """``{name: tables[name]}`` for every name, or one error naming every missing table."""
    missing = [n for n in names if n not in tables]
    if missing:
        raise ValueError(
            f"hotness: no entry for table(s) {missing} (given for {list(tables)}); give each "
            f"table's maximum bag size, or infer them with embark.data.max_bag_sizes(batches)"
        )
    return {n: tables[n] for n in names}
