"""The keys of a set-associative cache's slots (:class:`SlotKeys`): int32 low words, a 4-bit
index per slot into at most ``MAX_HIGH_WORDS`` high words held per cache, or whole int64 keys
once more are in use (the layout is drawn in :mod:`hps.storage.cache`).

The cache owns one :class:`SlotKeys` and calls it with its lock held; which slots hold a key
(the cache's tags) comes in as an argument where a method needs it. With a key bound it keeps
the cache's :class:`~hps.storage.cache.dense_index.DenseKeyIndex` exact: every key written or
cleared here is pointed at its slot or forgotten there.
"""

from __future__ import annotations

import logging

import torch

from hps.storage.cache.dense_index import DenseKeyIndex
from hps.storage.cache.index import (
    EMPTY_KEY,
    MAX_HIGH_WORDS,
    high_word,
    join_words,
    low_word,
    nibble_at,
    set_nibbles,
)
from hps.storage.cache.layout import LayoutField
from hps.storage.host_memory import huge_zeros

__all__ = ["SlotKeys"]

log = logging.getLogger(__name__)


class SlotKeys:
    """The key of each slot of a ``(num_sets, ways)`` cache.

    Args:
        shape: ``(num_sets, ways)``, the cache's sets.
        device: where the keys live.
        compact: hold each key as its low 32 bits and a nibble naming its high 32 bits until
            more than ``MAX_HIGH_WORDS`` high words are in use, then as int64; ``False``:
            int64 from the start.
        key_bound: keep a dense index of the keys in ``[0, key_bound)``; ``None``: none.

    Attributes:
        keys: ``(num_sets, ways)`` int32 low words (-1 in an empty slot) or int64 keys
            (``EMPTY_KEY`` in an empty slot); huge pages, the probe reads it at random.
        high_words: ``(h,) int64``, ``h <= MAX_HIGH_WORDS``: the held keys' distinct high
            words (compact keys; empty with int64 keys).
        high_of: ``(ceil(capacity / 2),) uint8``, each slot's index into ``high_words`` (a
            nibble), once there are two high words; ``None`` before and with int64 keys.
        dense: the dense key index, or ``None``.

    Assigning ``keys``, ``high_words``, ``high_of`` or ``dense`` moves the layout clock
    (:mod:`hps.storage.cache.layout`).
    """

    keys = LayoutField[torch.Tensor]()
    high_words = LayoutField[torch.Tensor]()
    high_of = LayoutField["torch.Tensor | None"]()
    dense = LayoutField["DenseKeyIndex | None"]()

    def __init__(
        self,
        shape: tuple[int, int],
        device: torch.device,
        compact: bool,
        key_bound: int | None = None,
    ) -> None:
        self.capacity = shape[0] * shape[1]
        self.device = device
        # first: a bound this cache cannot take is refused before any large allocation
        self.dense = (
            DenseKeyIndex(key_bound, device, self.capacity) if key_bound is not None else None
        )
        dtype = torch.int32 if compact else torch.int64
        self.keys = huge_zeros(shape, dtype, device).fill_(-1 if compact else EMPTY_KEY)
        self.high_words = torch.zeros(0, dtype=torch.int64, device=device)
        self.high_of = None

    @property
    def wide(self) -> bool:
        """Whether whole int64 keys are held (no low words and high words)."""
        return self.keys.dtype == torch.int64

    @property
    def empty_key(self) -> int:
        """The key of an empty slot: -1 with int32 keys, ``EMPTY_KEY`` with int64 keys."""
        return EMPTY_KEY if self.wide else -1

    def nbytes(self) -> int:
        """Bytes of ``keys``, ``high_words``, ``high_of`` and the dense index."""
        arrays = [self.keys, self.high_words]
        arrays += [self.high_of] if self.high_of is not None else []
        dense = self.dense.nbytes() if self.dense is not None else 0
        return sum(t.numel() * t.element_size() for t in arrays) + dense

    def word_index(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(known (n,) bool, index (n,) int64)``: where each of ``keys (n,) int64``'s high
        word is in ``high_words`` (compact keys)."""
        if self.high_words.numel() == 0:
            z = torch.zeros(keys.numel(), dtype=torch.int64, device=self.device)
            return z.to(torch.bool), z
        eq = high_word(keys)[:, None] == self.high_words[None, :]
        known, index = eq.view(torch.uint8).max(1)
        return known.view(torch.bool), index.to(torch.int64)

    def keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """``(n,) int64``: the keys held in ``slots (n,) int64`` (held slots only)."""
        k = self.keys.view(-1)[slots]
        if self.wide:
            return k
        if self.high_of is None:
            high = self.high_words[:1].expand(slots.numel())
        else:
            high = self.high_words[nibble_at(self.high_of, slots)]
        return join_words(high, k)

    def clear(self, slots: torch.Tensor) -> None:
        """Mark ``slots (n,) int64`` (held) empty (their nibbles are left: no held key reads
        them); their keys leave the dense index."""
        if self.dense is not None:
            self.dense.forget(self.keys_of(slots))
        self.keys.view(-1)[slots] = self.empty_key

    def write(self, slots: torch.Tensor, keys: torch.Tensor, tags: torch.Tensor) -> None:
        """Store ``keys (n,) int64`` in ``slots (n,) int64`` (unique): low word and nibble,
        high words added (or widened to int64 keys) as needed. ``tags (capacity,) uint8``:
        the cache's tags, 0 where a slot holds no key. The keys these slots held leave the
        dense index, and ``keys`` enter it."""
        if self.dense is not None and slots.numel():  # before admit reuses any high word
            self.dense.forget(self.keys_of(slots[tags[slots] != 0]))
        if not self.wide and keys.numel():
            self.admit(torch.unique(high_word(keys)), slots, tags)
        flat = self.keys.view(-1)
        if self.wide:
            flat[slots] = keys
        else:
            flat[slots] = low_word(keys)
            if self.high_of is not None:
                set_nibbles(self.high_of, slots, self.word_index(keys)[1])
        if self.dense is not None:
            self.dense.point(keys, slots)

    def _nibbles(self) -> torch.Tensor:
        return huge_zeros((-(-self.capacity // 2),), torch.uint8, self.device)

    def admit(self, words: torch.Tensor, slots: torch.Tensor, tags: torch.Tensor) -> None:
        """Make ``high_words`` hold ``words (k,) int64`` (unique), which keys are about to be
        written into ``slots``: add them, reusing words no other slot's key has, or widen the
        keys to int64 when more than ``MAX_HIGH_WORDS`` would be in use. ``tags
        (capacity,) uint8``: 0 where a slot holds no key."""
        have = self.high_words
        new = words[~(words[:, None] == have[None, :]).any(1)] if have.numel() else words
        if new.numel() == 0:
            return
        if have.numel() + new.numel() <= MAX_HIGH_WORDS:
            if self.high_of is None and have.numel() + new.numel() > 1:
                self.high_of = self._nibbles()
            self.high_words = torch.cat([have, new])
            return
        held = tags != 0
        held[slots] = False  # these slots are being overwritten
        held_slots = torch.nonzero(held).squeeze(1)
        used = torch.zeros(have.numel(), dtype=torch.bool, device=self.device)
        if self.high_of is None:
            used[:] = held_slots.numel() > 0
        else:
            used[nibble_at(self.high_of, held_slots)] = True
        used |= (have[:, None] == words[None, :]).any(1)  # the batch's own keys need these
        free = torch.nonzero(~used).squeeze(1)
        if used.sum() + new.numel() <= MAX_HIGH_WORDS:
            if self.high_of is None:  # one word in use (or none): slots name word 0
                self.high_of = self._nibbles()
            reuse = free[: new.numel()]
            words_now = have.clone()
            words_now[reuse] = new[: reuse.numel()]
            self.high_words = torch.cat([words_now, new[reuse.numel() :]])
            return
        self.widen(tags)

    def widen(self, tags: torch.Tensor) -> None:
        """Hold whole int64 keys from now on (more than ``MAX_HIGH_WORDS`` high words).
        ``tags (capacity,) uint8``: 0 where a slot holds no key."""
        held = torch.nonzero(tags != 0).squeeze(1)
        full = self.keys_of(held)
        wide = huge_zeros(tuple(self.keys.shape), torch.int64, self.device).fill_(EMPTY_KEY)
        wide.view(-1)[held] = full
        self.keys = wide
        self.high_words = self.high_words[:0]
        self.high_of = None
        log.info(
            "cache of %d slots: keys with more than %d distinct high 32-bit words; keys "
            "widened to int64",
            self.capacity,
            MAX_HIGH_WORDS,
        )
