"""The set-associative embedding cache (:class:`EmbeddingCache`); its layout, probe, counters
and exclusive tiers are drawn in :mod:`hps.storage.cache`."""

from __future__ import annotations

import logging
import math
import numbers
import threading

import torch

from hps.rowformat import RowDtype
from hps.storage.cache.index import (
    homed_at,
    low_word,
    nibble_at,
    set_homed,
    set_of,
    tag_of,
)
from hps.storage.cache.layout import LayoutField
from hps.storage.cache.records import CacheStats, Placed, RowHome
from hps.storage.cache.slot_counter import (
    LRU_PERIOD,
    LRU_RENORM,
    add_weighted,
    aging_lut,
    count_of,
    draws,
    level_of,
    lru_renormalised,
    stream_of,
)
from hps.storage.cache.slot_keys import SlotKeys
from hps.storage.host_memory import huge_zeros
from hps.storage.row_codec import RowCodec
from hps.types import DEFAULT_LFU_DECAY_KEYS_PER_SLOT, CachePolicy

log = logging.getLogger(__name__)

DEFAULT_WAYS = 64  # HugeCTR: slabs of 32 keys, 2 slabs per set
_MAX_SHIFT = 63  # a priority (int64) is 0 after 63 halvings


class EmbeddingCache:
    """Set-associative row cache.

    Args:
        capacity: rows the cache can hold (rounded up to a whole number of sets).
        dim: row width.
        policy: ``lru`` or ``lfu``.
        ways: slots per set.
        device: where keys, counters and rows live.
        lfu_decay_keys_per_slot: LFU aging period, in looked-up keys per slot: every counter
            is halved after each ``lfu_decay_interval = max(1, round(lfu_decay_keys_per_slot ×
            capacity))`` looked-up keys (see :mod:`hps.storage.cache`); 0 never ages. Ignored
            by LRU.
        row_format: how ``storage`` holds a row (the table's dtype).
        compact_keys: hold each key as its low 32 bits and a nibble naming its high 32 bits
            (4 or 3.5 bytes less per slot, :mod:`hps.storage.cache`) until more than 16 high words
            are cached, then as int64; ``False``: int64 from the start.
        seed: seeds the LFU counters' draws (:mod:`hps.storage.cache.slot_counter`).
        key_bound: keep a dense key index of the keys in ``[0, key_bound)``
            (:mod:`hps.storage.cache.dense_index`: 4 bytes per key; the compiled cache-hit
            pass and this cache's operations then find their slots without a set probe);
            ``None``: every key is hashed.
            Any bound is correct (other keys are hashed); see
            :func:`~hps.storage.cache.dense_index.dense_key_bound`.
        lfu_sampling: LFU counts the uses of one query in ``lfu_sampling`` (those whose
            query clock is a multiple of it), each hit as ``lfu_sampling`` uses (a weighted
            step, :func:`~hps.storage.cache.slot_counter.add_weighted`: the same expected
            count), so the other queries' hits read no counter and write none; 1 (the
            default) counts every query. Ignored by LRU, whose stamps every hit writes.

    Raises:
        ValueError: naming a non-positive capacity, dim or ways, or a negative,
            non-finite or non-numeric ``lfu_decay_keys_per_slot``, an ``lfu_sampling`` that is
            not an integer >= 1, or a ``key_bound`` that
            is not an int in ``[1, 2**31)`` or given to a cache of more than ``2**31 - 1``
            slots.

    All methods take ``keys: (n,) int64`` without duplicates on ``device`` and are
    thread-safe (one lock; each call is a few vectorised tensor ops).
    """

    # the arrays the compiled fused pass reads: assigning one moves the layout clock
    # (hps.storage.cache.layout), so that a pass holding them takes them again
    slot_keys = LayoutField[SlotKeys]()
    counters = LayoutField[torch.Tensor]()
    tags = LayoutField[torch.Tensor]()
    row_format = LayoutField[RowDtype]()
    row_bytes = LayoutField[int]()
    storage = LayoutField[torch.Tensor]()

    def __init__(
        self,
        capacity: int,
        dim: int,
        policy: CachePolicy | str = CachePolicy.LRU,
        ways: int = DEFAULT_WAYS,
        device: torch.device | str = "cpu",
        lfu_decay_keys_per_slot: float = DEFAULT_LFU_DECAY_KEYS_PER_SLOT,
        row_format: RowDtype | str = RowDtype.FP32,
        compact_keys: bool = True,
        seed: int = 0,
        key_bound: int | None = None,
        lfu_sampling: int = 1,
    ) -> None:
        if isinstance(lfu_sampling, bool) or not isinstance(lfu_sampling, int) or lfu_sampling < 1:
            raise ValueError(
                f"cache lfu_sampling must be an integer >= 1 (one query in it counts its LFU "
                f"uses, each as that many), got {lfu_sampling!r}"
            )
        if capacity <= 0:
            raise ValueError(f"cache capacity must be > 0 rows, got {capacity}")
        if dim <= 0:
            raise ValueError(f"cache dim must be > 0, got {dim}")
        if ways <= 0:
            raise ValueError(f"cache ways must be > 0, got {ways}")
        per_slot: object = lfu_decay_keys_per_slot  # checked: any real number, not a bool
        if (
            isinstance(per_slot, bool)
            or not isinstance(per_slot, numbers.Real)
            or not math.isfinite(per_slot)
            or per_slot < 0
        ):
            raise ValueError(
                f"cache lfu_decay_keys_per_slot must be a finite number >= 0 (looked-up keys "
                f"per slot between halvings; 0: never), got {per_slot!r}"
            )
        self.policy = CachePolicy(policy)
        self.dim = dim
        self.device = torch.device(device)
        self.ways = min(ways, capacity)
        self.num_sets = -(-capacity // self.ways)
        if self.num_sets >= 2**31:
            raise ValueError(
                f"cache of {capacity} rows in sets of {self.ways} ways has {self.num_sets} sets, "
                f"at most {2**31 - 1} (raise ways)"
            )
        self.capacity = self.num_sets * self.ways
        sets = (self.num_sets, self.ways)
        #: the key of each slot (int32 low words and high words, or int64 keys)
        self.slot_keys = SlotKeys(sets, self.device, compact_keys, key_bound)
        # huge pages: the probe reads these at random (a TLB miss per read with 4 KiB pages)
        #: one byte per slot (:mod:`hps.storage.cache.slot_counter`): LFU level / LRU stamp
        self.counters = huge_zeros(sets, torch.uint8, self.device)
        self.tags = huge_zeros(sets, torch.uint8, self.device)
        self.seed = int(seed)
        #: how a row is stored (:mod:`hps.rowformat`)
        self.codec = RowCodec(dim, RowDtype(row_format), "cache")
        self.row_format = self.codec.dtype
        #: bytes of one stored row (FP32: 4 × dim); rows are opaque bytes to the probe
        self.row_bytes = self.codec.row_bytes
        self.storage = huge_zeros((self.capacity, self.row_bytes), torch.uint8, self.device)
        self._fp32 = self.storage.view(torch.float32) if self.row_format is RowDtype.FP32 else None
        #: one bit per slot (slot s: bit s % 8 of byte s // 8): its row is the attached
        #: :class:`RowHome`'s only copy (:mod:`hps.storage.cache`)
        self.homed_bits = torch.zeros(-(-self.capacity // 8), dtype=torch.uint8, device=self.device)
        #: the in-process tier this cache is exclusive with (:meth:`attach`), or ``None``
        self.home: RowHome | None = None
        self._clock = 1  # LRU: bumped by every query; entries inserted since then carry it
        self.lfu_decay_keys_per_slot = float(per_slot)
        #: looked-up keys between two LFU halvings (0: never; always 0 for LRU)
        interval = float(per_slot) * self.capacity
        aging = (
            self.lfu_decay_keys_per_slot > 0 and self.policy is CachePolicy.LFU
        )  # LRU ignores the knob
        if aging and (not math.isfinite(interval) or interval >= 2**62):
            raise ValueError(
                f"cache lfu_decay_keys_per_slot {per_slot!r} × {self.capacity} slots is no "
                f"usable aging period (over 2**62 keys); use 0 for never"
            )
        self.lfu_decay_interval = max(1, round(interval)) if aging else 0
        #: one query in this many counts its LFU uses (each hit as this many); LRU: 1
        self.lfu_sampling = lfu_sampling if self.policy is CachePolicy.LFU else 1
        self._looked_up = 0  # the aging clock: keys (occurrences) looked up so far
        #: halvings applied so far; a priority counted at epoch e is worth ``p >> (decay_epoch - e)``
        self.decay_epoch = 0
        self._lock = threading.Lock()
        self._refresh_cursor = 0
        self.stats = CacheStats()

    @property
    def values(self) -> torch.Tensor:
        """``(capacity, dim) float32``, the view of ``storage`` of an FP32 cache.

        Raises:
            ValueError: the rows are stored in another format (read them with
                :meth:`query`, which dequantizes).
        """
        if self._fp32 is None:
            raise ValueError(
                f"a cache of {self.row_format.value} rows has no float32 view of its storage; "
                "its rows are dequantized on lookup (EmbeddingCache.query)"
            )
        return self._fp32

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``values (n, dim)`` float → ``(n, row_bytes) uint8`` on ``device`` (quantized)."""
        if self._fp32 is not None:
            v = values.to(device=self.device, dtype=torch.float32).contiguous()
            return v.view(torch.uint8).view(-1, self.row_bytes)
        rows = self.codec.encode(values.detach().to("cpu", torch.float32).numpy())
        return torch.from_numpy(rows).to(self.device)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows (n, row_bytes) uint8`` → ``(n, dim) float32`` on ``device``."""
        if self._fp32 is not None:
            return rows.contiguous().view(torch.float32)
        return torch.from_numpy(self.codec.decode(rows.cpu().numpy())).to(self.device)

    def _tick(self) -> int:
        """Advance the query clock (one per query or fused call) and return it; LRU: every
        ``LRU_RENORM`` ticks the stamps' ages are capped (:func:`lru_renormalised`), so 7-bit
        stamps never wrap. Call with the cache's lock held."""
        self._clock += 1
        if self.policy is CachePolicy.LRU and self._clock % LRU_RENORM == 0:
            self.counters.copy_(lru_renormalised(self.counters, self._clock))
        return self._clock

    def use_weight(self) -> int:
        """The uses each hit of the current query counts: ``lfu_sampling`` on a query whose
        clock is a multiple of it, 0 on the others; 1 where ``lfu_sampling`` is 1 (every LFU
        query counted, and always for LRU). Call after :meth:`_tick`, with the cache's lock
        held."""
        k = self.lfu_sampling
        if k == 1:
            return 1
        return k if self._clock % k == 0 else 0

    def lfu_stream(self) -> int:
        """The draw stream of the LFU uses of the current query (:func:`stream_of` of the seed
        and the clock)."""
        return stream_of(self.seed, self._clock)

    def _advance_age(self, looked_up: int) -> int:
        """The halvings ``looked_up`` more keys cross (LFU aging clock), with the clock, the
        epoch and the statistics moved; the counters are NOT shifted (the caller does)."""
        w = self.lfu_decay_interval
        if not w:
            return 0
        before = self._looked_up // w
        self._looked_up += looked_up
        crossed = self._looked_up // w - before
        self.decay_epoch += crossed
        self.stats.decays += crossed
        return crossed

    # ------------------------------------------------------------------ queries
    def _slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit (n,) bool, slot (n,) int64)``; ``slot`` is meaningful where ``hit`` (a slot
        of the cache elsewhere). Keys of the dense key index are one gather from it (exact
        under the lock, as :meth:`_hashed_slots` finds them), each slot it names checked to
        hold its key (one more gather); the others are hashed, as is a key whose entry names
        no slot of the cache or a slot holding another key (never written so). An entry of
        -1 is trusted: the index is what says a key of its range is not cached."""
        dense = self.slot_keys.dense
        if dense is None or keys.numel() == 0:
            return self._hashed_slots(keys)
        found = dense.slots.index_select(0, keys.clamp(0, dense.bound - 1)).to(torch.int64)
        inside = (keys >= 0) & (keys < dense.bound) & (found >= -1) & (found < self.capacity)
        hit = inside & (found >= 0)
        slot = torch.where(hit, found, 0)
        named = torch.nonzero(hit).squeeze(1)
        tagged = self.tags.view(-1).index_select(0, slot.index_select(0, named)) != 0
        kept = named[tagged]  # keys are read only from slots that hold one
        held = tagged.clone()
        held[tagged] = self.slot_keys.keys_of(slot.index_select(0, kept)) == keys[kept]
        if not bool(held.all()):  # a slot that does not hold its key: hash the key
            wrong = named[~held]
            inside[wrong], hit[wrong], slot[wrong] = False, False, 0
        if not bool(inside.all()):
            out = torch.nonzero(~inside).squeeze(1)
            h, s = self._hashed_slots(keys.index_select(0, out))
            hit[out], slot[out] = h, s
        return hit, slot

    def _hashed_slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_slots` by the set probe alone (every key hashed; the dense key index is
        not read): what the torch reference pass reads (:func:`hps.fused.gather_reference`)."""
        s = set_of(keys, self.num_sets)
        sk = self.slot_keys
        if sk.wide:
            match = sk.keys.index_select(0, s) == keys[:, None]  # (n, ways)
        else:  # the low word, the high word's nibble (where kept), and a held slot
            known, word = sk.word_index(keys)
            match = sk.keys.index_select(0, s) == low_word(keys)[:, None]
            match &= self.tags.index_select(0, s) != 0
            match &= known[:, None]
            if sk.high_of is not None:
                ways = torch.arange(self.ways, device=self.device)
                match &= nibble_at(sk.high_of, s[:, None] * self.ways + ways) == word[:, None]
        hit, way = match.view(torch.uint8).max(1)  # one pass: any match, and where
        return hit.view(torch.bool), s * self.ways + way

    def _touch(
        self, slots: torch.Tensor, counts: torch.Tensor | None, positions: torch.Tensor
    ) -> None:
        """Count a use of each of ``slots (n,) int64`` (unique): LRU stamps the clock; LFU adds
        ``counts`` (default 1) times :meth:`use_weight` to the levels with the draws of
        ``positions (n,) int64`` (nothing on a query whose uses are not sampled)."""
        flat = self.counters.view(-1)
        if self.policy is CachePolicy.LRU:
            flat[slots] = self._clock % LRU_PERIOD
            return
        k = self.use_weight()
        if k == 0:  # a query whose LFU uses are not sampled
            return
        w = torch.ones_like(slots) if counts is None else counts
        flat[slots] = add_weighted(flat[slots], w * k, draws(self.lfu_stream(), positions))

    def _homed_at(self, slots: torch.Tensor) -> torch.Tensor:
        """``(n,) bool``: the homed bit of each of ``slots (n,) int64``."""
        return homed_at(self.homed_bits, slots)

    def _set_homed(self, slots: torch.Tensor, value: bool) -> None:
        """Set (or clear) the homed bit of ``slots (n,) int64`` (unique)."""
        set_homed(self.homed_bits, slots, value)

    def _age(self, looked_up: int) -> None:
        """Advance the aging clock by ``looked_up`` keys; halve every counter once per multiple
        of ``lfu_decay_interval`` crossed."""
        crossed = self._advance_age(looked_up)
        if crossed:
            lut = aging_lut(crossed).to(self.device)
            self.counters.copy_(lut[self.counters.long()])

    def query(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor | None = None,
        inverse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Look up rows.

        Args:
            keys: ``(n,) int64`` unique, on ``device``.
            counts: ``(n,) int64`` occurrences of each key in the request (LFU weights; the
                aging clock advances by their sum, else by ``n``).
            inverse: ``(m,) int64`` indices into ``keys``: when given, the rows come back
                expanded to the request, ``values[inverse]``, in one gather.

        Returns:
            ``(values (n or m, dim) float32, hit (n,) bool)``, dequantized from
            ``row_format``; rows of misses are zeros.
        """
        with self._lock:
            hit, slot = self._slots(keys)
            self._tick()
            hs = slot[hit]
            if self.lfu_decay_interval:  # age first: this query's own uses count in full (as
                # TinyLFU, whose uses after a reset are not halved); a query longer than the
                # period would otherwise shift its own hits away and lose to every cold miss
                self._age(int(keys.numel()) if counts is None else int(counts.sum()))
            self._touch(hs, None if counts is None else counts[hit], torch.nonzero(hit).squeeze(1))
            self.stats.queries += int(keys.numel())
            self.stats.hits += int(hs.numel())
            if inverse is None:
                picked = self.storage.index_select(0, slot)
                miss_rows = torch.nonzero(~hit).squeeze(1)
            else:
                picked = self.storage.index_select(0, slot.index_select(0, inverse))
                miss_rows = torch.nonzero(~hit.index_select(0, inverse)).squeeze(1)
        out = self.decode(picked)
        if miss_rows.numel():
            out.index_fill_(0, miss_rows, 0.0)
        return out, hit

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """``(n,) bool``: which keys are cached (no counter update)."""
        with self._lock:
            return self._slots(keys)[0]

    # ------------------------------------------------------------------ writes
    def insert(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        priority: torch.Tensor | None = None,
        epoch: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> int:
        """Insert rows; cached copies of the same keys are overwritten. Returns rows newly placed.

        Admission: within a set, new keys are placed in order of ``priority`` (highest first)
        into the victims (empty slots first, then the lowest counters), and a new key only
        replaces a *colder* entry — LRU: one not used since the last query (so one batch's
        misses never evict that batch's hits); LFU: one used fewer times than ``priority``.

        Args:
            keys: ``(n,) int64`` unique, on ``device``; must not contain ``EMPTY_KEY``.
            values: ``(n, dim) float32``.
            priority: ``(n,) int64`` occurrences of each key in the request (default 1).
            epoch: the ``decay_epoch`` at which ``priority`` was counted (LFU): halved once per
                aging since, so a priority counted before a halving (an asynchronous insertion,
                or a concurrent query that aged the cache) weighs what a resident count would.
                Default: counted now.
            rows: ``(n, row_bytes) uint8``, the same rows as a tier stores them: stored as they
                are (``values`` is then not read), so a quantized row keeps its bytes.
        """
        if keys.numel() == 0:
            return 0
        if rows is None:
            rows = self.encode(values)
        elif rows.dtype != torch.uint8 or tuple(rows.shape) != (keys.numel(), self.row_bytes):
            raise ValueError(
                f"cache of {self.row_format.value} rows: rows must be ({keys.numel()}, "
                f"{self.row_bytes}) uint8, got {rows.dtype} {tuple(rows.shape)}"
            )
        rows = rows.to(self.device)
        home = self.home
        if home is None:
            return self._insert(keys, rows, priority, epoch).placed
        with home.lock:  # a move: no reader of the home sees a row in neither tier
            moved = self._insert(keys, rows, priority, epoch)
            held = torch.from_numpy(home.take(moved.keys.cpu().numpy()))
            with self._lock:
                self._set_homed(moved.slots[held.to(self.device)], True)
            if moved.evicted_keys.numel():
                home.put_back(moved.evicted_keys.cpu().numpy(), moved.evicted_rows.cpu().numpy())
            return moved.placed

    def _insert(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        priority: torch.Tensor | None,
        epoch: int | None,
    ) -> Placed:
        """:meth:`insert` of encoded ``values (n, row_bytes) uint8`` within this cache: the
        rows placed, and the homed rows evicted."""
        if priority is None:
            priority = torch.ones(keys.numel(), dtype=torch.int64, device=self.device)
        with self._lock:
            if epoch is not None and self.decay_epoch > epoch and self.policy is CachePolicy.LFU:
                priority = priority >> min(self.decay_epoch - epoch, _MAX_SHIFT)
            hit, slot = self._slots(keys)
            if hit.any():
                self.storage[slot[hit]] = values[hit]
                if self.slot_keys.dense is not None:  # an entry that had to be hashed: mended
                    self.slot_keys.dense.point(keys[hit], slot[hit])
            new = ~hit
            if not new.any():
                return Placed.none(self.storage)
            keys, values, priority = keys[new], values[new], priority[new].clamp(1, 2**31 - 1)
            s = set_of(keys, self.num_sets)
            # sort by set, then by priority (descending) inside a set
            order = torch.argsort(s * 2**31 + (2**31 - 1 - priority), stable=True)
            s_sorted = s[order]
            sets, inv, counts = torch.unique_consecutive(
                s_sorted, return_inverse=True, return_counts=True
            )
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(s_sorted.numel(), device=self.device) - starts[inv]
            fits = rank < self.ways
            level = self.counters.index_select(0, sets).long()  # (S, ways)
            empty = self.tags.index_select(0, sets) == 0
            lru = self.policy is CachePolicy.LRU
            # coldness, lowest first: empty slots, then LRU the oldest use, LFU the fewest uses
            age = (self._clock - level) % LRU_PERIOD if lru else level
            cold = torch.where(empty, -1, LRU_PERIOD - 1 - age if lru else level)
            victim_order = torch.argsort(cold, dim=1, stable=True)
            inv_f, rank_f, src = inv[fits], rank[fits], order[fits]
            way = victim_order[inv_f, rank_f]
            was_empty = empty[inv_f, way]
            if lru:  # a colder entry: one not used since the last query
                ok = was_empty | (age[inv_f, way] >= 1)
                incoming = torch.full_like(src, self._clock % LRU_PERIOD).to(torch.uint8)
            else:  # one used fewer times than the new key's priority
                ok = was_empty | (count_of(level[inv_f, way].to(torch.uint8)) < priority[src])
                incoming = level_of(priority[src])
            self.stats.overflowed += int(keys.numel() - int(ok.sum()))
            tgt = (sets[inv_f] * self.ways + way)[ok]
            src = src[ok]
            self.stats.evicted += int((~was_empty[ok]).sum())
            back = self._homed_at(tgt)  # homed rows evicted: they go back to the home
            evicted_keys = self.slot_keys.keys_of(tgt[back])
            evicted_rows = self.storage[tgt[back]]  # copies
            self.slot_keys.write(tgt, keys[src], self.tags.view(-1))
            self.tags.view(-1)[tgt] = tag_of(keys[src])
            self.storage[tgt] = values[src]
            self.counters.view(-1)[tgt] = incoming[ok]
            self._set_homed(tgt, False)
            n = int(tgt.numel())
            self.stats.inserted += n
            return Placed(n, keys[src], tgt, evicted_keys, evicted_rows)

    def update_if_present(
        self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None = None
    ) -> int:
        """Overwrite the cached copies of ``keys`` that are cached (``values (n, dim)``
        float32, or ``rows (n, row_bytes) uint8`` stored as they are); returns how many were."""
        if keys.numel() == 0:
            return 0
        rows = self.encode(values) if rows is None else rows.to(self.device)
        with self._lock:
            hit, slot = self._slots(keys)
            self.storage[slot[hit]] = rows[hit]
            return int(hit.sum())

    def invalidate(self, keys: torch.Tensor) -> int:
        """Drop ``keys`` from the cache; returns how many were cached."""
        if keys.numel() == 0:
            return 0
        home = self.home
        if home is None:
            return self._invalidate(keys)[0]
        with home.lock:
            n, back_keys, back_rows = self._invalidate(keys)
            if back_keys.numel():
                home.put_back(back_keys.cpu().numpy(), back_rows.cpu().numpy())
            return n

    def _invalidate(self, keys: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Drop ``keys``; ``(how many were cached, homed keys dropped, their rows)``."""
        with self._lock:
            return self._drop_locked(keys)

    def _drop_locked(self, keys: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """:meth:`_invalidate`'s work; the caller holds ``_lock``. A key given twice is
        dropped (and counted) once."""
        keys = torch.unique(keys)
        hit, slot = self._slots(keys)
        hs = slot[hit]
        back = self._homed_at(hs)
        back_keys, back_rows = keys[hit][back], self.storage[hs[back]]
        self.slot_keys.clear(hs)
        self.tags.view(-1)[hs] = 0
        self.counters.view(-1)[hs] = 0
        self._set_homed(hs, False)
        return int(hs.numel()), back_keys, back_rows

    # ------------------------------------------------------------------ exclusive tiers
    def attach(self, home: RowHome) -> None:
        """Make this cache exclusive with the in-process tier ``home`` (:mod:`hps.storage.cache`):
        from now on an insertion moves rows out of it and an eviction moves them back.

        Raises:
            ValueError: the cache is not on the CPU (``home`` is host memory: a device cache
                does not share its memory), already attached, or not empty (its rows may
                also be held by ``home``).
        """
        if self.device.type != "cpu":
            raise ValueError(
                f"only a CPU cache can be exclusive with the in-process hash map, "
                f"this one is on {self.device}"
            )
        with self._lock:
            if self.home is not None:
                raise ValueError("this cache is already attached to an in-process tier")
            held = int((self.tags != 0).sum())
            if held:
                raise ValueError(
                    f"a cache must be empty to be attached to an in-process tier (holds {held} rows)"
                )
            self.home = home

    def peek_homed(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``keys (n,) int64`` this cache holds for its home: ``(rows (n,
        row_bytes) uint8, hit (n,) bool)`` (rows of the others are garbage). No counter,
        clock or statistic moves: the home answers for these rows (call with its lock held)."""
        with self._lock:
            hit, slot = self._slots(keys)
            hit &= self._homed_at(slot)
            return self.storage.index_select(0, slot), hit

    def update_homed(self, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Write rows that the home is given (``rows (n, row_bytes) uint8``, stored bytes) into
        the slots caching ``keys (n,) int64`` and mark them homed; ``(n,) bool``: which were
        cached (the home stores the others itself). Call with the home's lock held."""
        rows = rows.to(self.device)
        with self._lock:
            hit, slot = self._slots(keys)
            hs = slot[hit]
            self.storage[hs] = rows[hit]
            self._set_homed(hs, True)
            return hit

    def unhome(self, keys: torch.Tensor) -> None:
        """The home dropped ``keys (n,) int64``: their cached rows (if any) stay cached, as
        copies the home no longer holds. Call with the home's lock held."""
        with self._lock:
            hit, slot = self._slots(keys)
            self._set_homed(slot[hit], False)

    def homed_rows(self) -> int:
        """Rows this cache holds for its home."""
        with self._lock:
            return int(self.homed.sum())

    @property
    def homed(self) -> torch.Tensor:
        """``(capacity,) bool``: which slots hold their home's only copy (a new tensor)."""
        return self._homed_at(torch.arange(self.capacity, device=self.device))

    # ------------------------------------------------------------------ refresh / inspection
    def cached_keys(self) -> torch.Tensor:
        """Every cached key, ``(k,) int64``."""
        with self._lock:
            return self.slot_keys.keys_of(torch.nonzero(self.tags.view(-1) != 0).squeeze(1))

    def next_refresh_keys(self, fraction: float) -> torch.Tensor:
        """The cached keys of the next ``fraction`` of slots (round robin over calls)."""
        n = max(1, int(round(fraction * self.capacity)))
        with self._lock:
            start = self._refresh_cursor
            idx = torch.arange(start, start + n, device=self.device) % self.capacity
            self._refresh_cursor = (start + n) % self.capacity
            return self.slot_keys.keys_of(idx[self.tags.view(-1)[idx] != 0])

    def nbytes(self) -> int:
        """Host or device bytes this cache holds: rows, keys, counters, tags, homed bits,
        high words and the dense key index (per slot: the row + 6.125 with one high word, +
        6.625 with up to 16, + 10.125 with int64 keys; plus 8 B per high word and 4 B per key
        of the dense index's range)."""
        arrays = [self.storage, self.counters, self.tags, self.homed_bits]
        return sum(t.numel() * t.element_size() for t in arrays) + self.slot_keys.nbytes()

    def __len__(self) -> int:
        with self._lock:
            return int((self.tags != 0).sum())
