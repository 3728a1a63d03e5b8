"""The key words of :class:`~hps.storage.cache.EmbeddingCache`'s slots: int32 low words,
a 4-bit index per slot into at most ``MAX_HIGH_WORDS`` high words held per cache, or whole
int64 keys once more are in use (the layout is drawn in :mod:`hps.storage.cache`).

A mixin of the cache: the methods read and write the cache's ``keys``, ``high_words``,
``high_of`` and ``tags``; callers hold the cache's lock.
"""

from __future__ import annotations

import logging

import torch

from hps.storage.cache_index import (
    EMPTY_KEY,
    MAX_HIGH_WORDS,
    high_word,
    join_words,
    low_word,
    nibble_at,
    set_nibbles,
)
from hps.storage.host_memory import huge_zeros

__all__ = ["CacheKeyWords"]

log = logging.getLogger(__name__)


class CacheKeyWords:
    """The key-word methods of a set-associative cache (the module docstring)."""

    capacity: int
    device: torch.device
    keys: torch.Tensor  # (num_sets, ways) int32 low words, or int64 keys
    high_words: torch.Tensor  # (h,) int64, h <= MAX_HIGH_WORDS
    high_of: torch.Tensor | None  # (capacity / 2,) uint8 nibbles, None while h <= 1
    tags: torch.Tensor  # (num_sets, ways) uint8, 0 = empty

    def _word_index(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(known (n,) bool, index (n,) int64)``: where each key's high word is in
        ``high_words`` (compact keys)."""
        if self.high_words.numel() == 0:
            z = torch.zeros(keys.numel(), dtype=torch.int64, device=self.device)
            return z.to(torch.bool), z
        eq = high_word(keys)[:, None] == self.high_words[None, :]
        known, index = eq.view(torch.uint8).max(1)
        return known.view(torch.bool), index.to(torch.int64)

    def keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """``(n,) int64``: the keys held in ``slots (n,) int64`` (held slots only)."""
        k = self.keys.view(-1)[slots]
        if self.keys.dtype == torch.int64:
            return k
        if self.high_of is None:
            high = self.high_words[:1].expand(slots.numel())
        else:
            high = self.high_words[nibble_at(self.high_of, slots)]
        return join_words(high, k)

    @property
    def empty_key(self) -> int:
        """The key of an empty slot: -1 with int32 keys, ``EMPTY_KEY`` with int64 keys."""
        return -1 if self.keys.dtype == torch.int32 else EMPTY_KEY

    def _write_keys(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store ``keys (n,) int64`` in ``slots (n,) int64`` (unique): low word and nibble,
        high words added (or widened to int64 keys) as needed. Call with the lock held."""
        if self.keys.dtype == torch.int32 and keys.numel():
            self._admit_words(torch.unique(high_word(keys)), slots)
        flat = self.keys.view(-1)
        if self.keys.dtype == torch.int64:
            flat[slots] = keys
            return
        flat[slots] = low_word(keys)
        if self.high_of is not None:
            set_nibbles(self.high_of, slots, self._word_index(keys)[1])

    def _admit_words(self, words: torch.Tensor, slots: torch.Tensor) -> None:
        """Make ``high_words`` hold ``words (k,) int64`` (unique), which keys are about to be
        written into ``slots``: add them, reusing words no other slot's key has, or widen the
        keys to int64 when more than ``MAX_HIGH_WORDS`` would be in use."""
        have = self.high_words
        new = words[~(words[:, None] == have[None, :]).any(1)] if have.numel() else words
        if new.numel() == 0:
            return
        if have.numel() + new.numel() <= MAX_HIGH_WORDS:
            if self.high_of is None and have.numel() + new.numel() > 1:
                self.high_of = huge_zeros((-(-self.capacity // 2),), torch.uint8, self.device)
            self.high_words = torch.cat([have, new])
            return
        held = self.tags.view(-1) != 0
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
                self.high_of = huge_zeros((-(-self.capacity // 2),), torch.uint8, self.device)
            reuse = free[: new.numel()]
            words_now = have.clone()
            words_now[reuse] = new[: reuse.numel()]
            self.high_words = torch.cat([words_now, new[reuse.numel() :]])
            return
        self._widen()

    def _widen(self) -> None:
        """Hold whole int64 keys from now on (more than ``MAX_HIGH_WORDS`` high words)."""
        held = torch.nonzero(self.tags.view(-1) != 0).squeeze(1)
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
