"""A set-associative cache's dense key index (:class:`DenseKeyIndex`): the slot of every key
in ``[0, bound)``, or -1, so that the compiled cache-hit pass finds a key's slot with one
4-byte read instead of hashing it and reading its set's tag line and key line (and the cache's
torch operations with one gather instead of comparing it with its set's keys).

Embedding tables are indexed by dense row ids (a Criteo feature's ids are its value's index
modulo the table's rows), so a table's keys usually fill ``[0, rows)``; the index then costs
4 bytes per possible key, under 1 % of an FP32 row of dim 128, and the keys of a Zipf-hot
table's hottest rows share its cache lines. Keys outside ``[0, bound)`` (negative keys, keys
added by online updates past the bound) are probed by hash as before, so any bound is correct;
:func:`dense_key_bound` picks one that pays for its memory.

The index is exact under the cache's lock: :class:`~hps.storage.cache.slot_keys.SlotKeys`
points a key at its slot whenever it writes the key and forgets it whenever it clears or
overwrites the slot, the only two ways a slot's key changes (``tests/hps/test_dense_index.py``
checks it against the slots' keys after every kind of change). The compiled pass reads any
entry outside ``[0, capacity)`` as a miss and never follows it; the cache's torch operations
also check that the slot an entry names holds its key, and hash the key where it does not
(:meth:`~hps.storage.cache.EmbeddingCache._slots`).
"""

from __future__ import annotations

import torch

from hps.storage.cache.layout import LayoutField
from hps.storage.host_memory import huge_zeros

__all__ = ["MAX_INDEXED_SLOTS", "MAX_INDEX_SHARE", "DenseKeyIndex", "dense_key_bound"]

#: the most a dense index may take, as a share of its cache's row storage (4 bytes per key of
#: ``[0, bound)`` against ``row_bytes`` per slot)
MAX_INDEX_SHARE = 1 / 8

#: the most slots a cache with a dense index may have: its int32 entries name every slot
MAX_INDEXED_SLOTS = 2**31 - 1


def dense_key_bound(key_end: int, capacity: int, row_bytes: int) -> int | None:
    """The bound of a dense index for a cache of ``capacity`` slots of ``row_bytes`` whose
    table's keys lie in ``[0, key_end)``: ``key_end`` when its 4 bytes per key take at most
    :data:`MAX_INDEX_SHARE` of the row storage, else ``None`` (hash probes only; also for a
    cache of more than :data:`MAX_INDEXED_SLOTS` slots)."""
    if key_end <= 0 or key_end >= 2**31 or capacity > MAX_INDEXED_SLOTS:
        return None
    return key_end if 4 * key_end <= MAX_INDEX_SHARE * capacity * row_bytes else None


class DenseKeyIndex:
    """The slot (int32) of each key in ``[0, bound)``; -1 where the cache holds none.

    Args:
        bound: keys ``0 .. bound - 1`` are indexed; ``1 <= bound < 2**31``.
        device: where the index lives (the cache's device).
        capacity: the cache's slots, at most :data:`MAX_INDEXED_SLOTS` (an int32 names each).

    Raises:
        ValueError: naming a bound that is not an int in ``[1, 2**31)``, or a capacity over
            :data:`MAX_INDEXED_SLOTS`.

    Attributes:
        slots: ``(bound,)`` int32, huge pages (the pass reads it at random).
    """

    #: the slot of each key (assigning it moves the layout clock, :mod:`hps.storage.cache.layout`)
    slots = LayoutField[torch.Tensor]()

    def __init__(self, bound: int, device: torch.device, capacity: int) -> None:
        if isinstance(bound, bool) or not isinstance(bound, int) or not 1 <= bound < 2**31:
            raise ValueError(f"cache key_bound must be an int in [1, 2**31), got {bound!r}")
        if capacity > MAX_INDEXED_SLOTS:
            raise ValueError(
                f"cache key_bound {bound}: a dense key index names slots as int32, and this "
                f"cache has {capacity} slots (at most {MAX_INDEXED_SLOTS}); use key_bound=None"
            )
        self.bound = bound
        self.slots = huge_zeros((bound,), torch.int32, device).fill_(-1)

    def nbytes(self) -> int:
        """Bytes of ``slots``."""
        return self.slots.numel() * 4

    def point(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Record that ``keys (n,) int64`` (distinct) are held in ``slots (n,) int64``; keys
        outside ``[0, bound)`` are not indexed."""
        inside = (keys >= 0) & (keys < self.bound)
        self.slots[keys[inside]] = slots[inside].to(torch.int32)

    def forget(self, keys: torch.Tensor) -> None:
        """Record that ``keys (n,) int64`` are no longer held."""
        inside = (keys >= 0) & (keys < self.bound)
        self.slots[keys[inside]] = -1

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, slots)``, both ``(k,) int64``: every indexed key and its slot."""
        keys = torch.nonzero(self.slots >= 0).squeeze(1)
        return keys, self.slots[keys].to(torch.int64)
