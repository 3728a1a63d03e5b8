"""The small types of the embedding cache (:mod:`hps.storage.cache`): the tier it can be
exclusive with, its statistics, and what one insertion did."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = ["CacheStats", "Placed", "RowHome"]


class RowHome(Protocol):
    """The in-process volatile tier that an attached cache moves rows out of and back into
    (:meth:`EmbeddingCache.attach`; implemented by the hash map's table, see the module
    docstring). Its ``lock`` is held around every move and every read of the tier."""

    lock: threading.Lock

    def take(self, keys: np.ndarray) -> np.ndarray:
        """Drop the rows of ``keys (n,) int64`` the tier stores; ``(n,) bool``: which it did."""
        ...

    def put_back(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Store ``rows (n, row_bytes) uint8`` (the cache's bytes) under ``keys (n,) int64``."""
        ...


@dataclass(frozen=True)
class Placed:
    """What one insertion did inside the cache: ``placed`` new rows (``keys`` into ``slots``)
    and the homed rows it evicted (``evicted_keys (e,)``, ``evicted_rows (e, row_bytes)``)."""

    placed: int
    keys: torch.Tensor
    slots: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_rows: torch.Tensor

    @staticmethod
    def none(storage: torch.Tensor) -> Placed:
        """Nothing placed, in a cache whose rows are ``storage``."""
        e = torch.zeros(0, dtype=torch.int64, device=storage.device)
        return Placed(0, e, e, e, storage[:0])


@dataclass
class CacheStats:
    """Counters of one cache (unique keys as queried)."""

    queries: int = 0
    hits: int = 0
    inserted: int = 0
    evicted: int = 0
    overflowed: int = 0  # new keys not admitted (no colder entry left in their set)
    decays: int = 0  # LFU halvings of every counter

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
