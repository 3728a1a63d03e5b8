"""Where a key lives in the embedding cache: its set (the high 32 bits of splitmix64 scaled to
the number of sets) and its tag (8 bits the set index does not use, 0 marking an empty slot).
The compiled fused pass (``hps/csrc``) computes the same two functions; the tests compare them.
Also the slots' homed bits: one bit per slot, slot ``s`` at bit ``s % 8`` of byte ``s // 8``,
and a compact cache's key words: a key is its high 32 bits (one of at most
``MAX_HIGH_WORDS`` the cache holds) and its low 32 bits; a slot keeps the low word and, once
the cache holds two high words or more, a nibble naming its high word (slot ``s`` at bits
``4·(s % 2)`` of byte ``s // 2``).
"""

from __future__ import annotations

import torch

__all__ = [
    "EMPTY_KEY",
    "MAX_HIGH_WORDS",
    "high_word",
    "homed_at",
    "join_words",
    "low_word",
    "mix64_int",
    "mix_keys",
    "nibble_at",
    "set_homed",
    "set_nibbles",
    "set_of",
    "tag_of",
]

EMPTY_KEY = -(2**63)  # sentinel of an empty slot; this one int64 key value cannot be cached


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64 constants (Steele et al., 2014)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(keys: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser over ``(n,) int64`` or int32 (the same as :func:`hps.types.mix64`;
    int64 multiplication wraps modulo 2**64)."""
    z = keys.to(torch.int64) + _GOLDEN  # int32 keys (a compact cache's) widen first
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def mix_keys(keys: torch.Tensor) -> torch.Tensor:
    """``(n,) int64`` → ``(n,) int64``: splitmix64 of each value, bits as a signed int64."""
    return _mix(keys)


def mix64_int(x: int) -> int:
    """splitmix64 of one 64-bit value (Python int, any sign), as a signed int64."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return _signed(z ^ (z >> 31))


def set_of(keys: torch.Tensor, num_sets: int) -> torch.Tensor:
    """``(n,) int64`` keys → ``(n,) int64`` set indices: the high 32 bits of ``mix64(key)``
    scaled to ``[0, num_sets)``, ``(hi32 × num_sets) >> 32`` (a multiply where ``%`` would
    divide; exact in int64 for ``num_sets < 2**31``)."""
    return (_srl(_mix(keys), 32) * num_sets) >> 32


def tag_of(keys: torch.Tensor) -> torch.Tensor:
    """``(n,) int64`` keys → ``(n,) uint8`` tags in ``[1, 255]`` (0 marks an empty slot):
    ``1 + (low 16 bits of mix64(key)) % 255``, bits the set index does not use."""
    return (1 + (_mix(keys) & 0xFFFF) % 255).to(torch.uint8)


def homed_at(bits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``bits (ceil(capacity / 8),) uint8``, ``slots (n,) int64`` → ``(n,) bool``: each slot's
    bit."""
    return ((bits[slots >> 3] >> (slots & 7).to(torch.uint8)) & 1).to(torch.bool)


def set_homed(bits: torch.Tensor, slots: torch.Tensor, value: bool) -> None:
    """Set (``value``) or clear the bits of ``slots (n,) int64`` (unique) in ``bits`` in place."""
    if slots.numel() == 0:
        return
    byte, where = torch.unique(slots >> 3, return_inverse=True)
    # distinct bits of distinct slots: their sum in a byte is their OR
    m = torch.zeros(byte.numel(), dtype=torch.int64, device=bits.device)
    m = m.index_add_(0, where, torch.ones_like(slots) << (slots & 7)).to(torch.uint8)
    if value:
        bits[byte] |= m
    else:
        bits[byte] &= ~m


MAX_HIGH_WORDS = 16  # distinct high words a compact cache's keys may have: a nibble per slot


def high_word(keys: torch.Tensor) -> torch.Tensor:
    """``(n,) int64`` keys → ``(n,) int64`` high words, ``key >> 32`` (arithmetic: in
    ``[-2**31, 2**31)``); ``key == (high << 32) | (low 32 bits)``."""
    return keys >> 32


def low_word(keys: torch.Tensor) -> torch.Tensor:
    """``(n,) int64`` keys → ``(n,) int32``: their low 32 bits (as a signed int32)."""
    return keys.to(torch.int32)


def join_words(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``high (n,) int64``, ``low (n,) int32`` → ``(n,) int64`` keys."""
    return (high << 32) | (low.to(torch.int64) & 0xFFFFFFFF)


def nibble_at(nibbles: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``nibbles (ceil(capacity / 2),) uint8``, ``slots`` int64 (any shape) → int64 of the same
    shape: slot ``s``'s 4 bits, bits ``4·(s % 2)`` up of byte ``s // 2``."""
    return ((nibbles[slots >> 1].to(torch.int64) >> ((slots & 1) * 4)) & 0xF).to(torch.int64)


def set_nibbles(nibbles: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values (n,) int64`` in ``[0, 16)`` into the nibbles of ``slots (n,) int64``
    (unique) in place."""
    if slots.numel() == 0:
        return
    byte, where = torch.unique(slots >> 1, return_inverse=True)
    shift = (slots & 1) * 4
    # distinct nibbles of distinct slots: their sum in a byte is their OR
    clear = torch.zeros(byte.numel(), dtype=torch.int64, device=nibbles.device)
    clear.index_add_(0, where, torch.full_like(slots, 0xF) << shift)
    put = torch.zeros_like(clear).index_add_(0, where, values << shift)
    nibbles[byte] = ((nibbles[byte].to(torch.int64) & ~clear) | put).to(torch.uint8)
