// The pipelined probe pass of the fused lookup over one piece of a table (gather_piece): the
// tag line, key line and row of later keys in flight while a key's row is copied or summed.
// Included by hps/csrc/fused_lookup.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cache_probe.h"
#include "common.h"
#include "first_hits.h"
#include "key_counter.h"
#include "row_formats.h"
#include "slot_uses.h"

namespace hps_cpu {

// Distances of the probe pipeline, in keys: a key's row (and counter) is prefetched kRowAhead
// keys before it is read, its key line kProbeAhead keys before that, its tag line kProbeAhead
// keys earlier still. The row, 8 lines of 64 bytes in FP32 at dim 128, is the longest wait;
// 26 tables of dlrm_dcnv2 ÷ 300, pooled: row distance 8 ran 2 % faster than 4, 12 to 24 no
// faster than 8, probe distance 2 slower than 4; probe distance 8 against 4 differed within
// the noise (docs/benchmarks.md, "pooled bags").
constexpr int64_t kRowAhead = 8, kProbeAhead = 8;
// The per-key state of the keys in the pipeline, a ring indexed by the key's position: 1 KiB
// that stays in L1 (a state per key of a 2,048-key piece, 64 KiB, evicted the tag and key
// lines the pipeline had just prefetched).
constexpr int64_t kRing = 32;
static_assert(kRing > kRowAhead + 2 * kProbeAhead && (kRing & (kRing - 1)) == 0,
              "the ring holds every key in flight");

// The gather of one piece (keys [i0, i1) of one table; bags: whole bags), pipelined so that
// the tag line, key line and row of later keys are in flight while a key's row is copied:
// rows copied or bags summed key by key in request order (MEAN bags without a miss divided),
// each key's slot in sl (-1 miss, -2 padding); returns the misses. A bag's first hit is
// written as 0.0f + row (kZeroAdd), the later ones added, so its output row is written once
// and never zero-filled first (a bag without a hit is zero-filled at its last key). With
// ``uses`` (one thread does every key of the table) the counters are written here too, hits
// counted and first hits recorded, and the hits of keys >= 0 counted into t.counter when it is
// set (the key's hash computed once for both; its counter entry prefetched with the tag line;
// the misses are counted exactly by the caller's miss path, hps/session/fused.py).
// With kProbeOnly (bags pooled afterwards by pool_bags from sl) no row is read here.
template <bool kUses, int64_t kFormat, bool kProbeOnly = false>
int64_t gather_piece(const TableView& t, int64_t i0, int64_t i1, int64_t* sl,
                  int64_t& hits, FirstHits& firsts) {
  ProbeState ring[kRing];
  const auto ps = [&ring](int64_t x) -> ProbeState& { return ring[x & (kRing - 1)]; };
  const int64_t first_ways = std::min<int64_t>(64, t.ways);
  const bool bags = t.hotness > 0;
  // bags: the bag before the first (the loop steps to it), the key's place in its bag (no
  // division per key), its output row
  int64_t bag = bags ? i0 / t.hotness - 1 : 0;
  int64_t j = bags ? t.hotness - 1 : 0;
  float* dst = nullptr;
  int64_t n_valid = 0, n_missed = 0;
  bool missed = false, written = false;
  for (int64_t i = i0 - kRowAhead - 2 * kProbeAhead; i < i1; ++i) {
    const int64_t a = i + kRowAhead + 2 * kProbeAhead;  // stage 1: hash, prefetch the tag line
    if (a >= i0 && a < i1) {
      const int64_t key = t.keys[a];
      if (bags && key < 0) {
        ps(a).base = -1;
      } else if (key >= 0 && key < t.n_dense) {  // the dense index: one 4-byte read, no hash
        ps(a).base = -3;
        __builtin_prefetch(t.dense + key, 0, 3);
        if (kUses && t.counter != nullptr) {
          ps(a).hash = mix64(key);
          t.counter->prefetch_entry(ps(a).hash);
        }
      } else {
        const uint64_t h = mix64(key);
        ps(a).hash = h;
        if (kUses && t.counter != nullptr && key >= 0) t.counter->prefetch_entry(h);
        const int64_t word = t.key32 ? word_index(t, key) : 0;
        if (word < 0) {
          ps(a).base = -2;  // a high word the cache lacks: a miss without a probe
        } else {
          ps(a).base = set_of(h, t.num_sets) * t.ways;
          ps(a).tag = tag_of(h);
          ps(a).word = static_cast<uint8_t>(word);
          __builtin_prefetch(t.tags + ps(a).base, 0, 3);
        }
      }
    }
    const int64_t b = i + kRowAhead + kProbeAhead;  // stage 2: match the tags, prefetch the key line
    if (b >= i0 && b < i1 && ps(b).base == -3) {  // the slot, known: its counter now
      int64_t s = t.dense[t.keys[b]];
      if (static_cast<uint64_t>(s) >= static_cast<uint64_t>(t.num_sets * t.ways))
        s = -1;  // none (-1), or a slot outside the cache: a miss, never followed
      ps(b).match = static_cast<uint64_t>(s);
      if (s >= 0 && kUses && t.weight) __builtin_prefetch(t.counters + s, 1, 3);
    } else if (b >= i0 && b < i1 && ps(b).base >= 0) {
      const uint64_t m = match_tags(t.tags + ps(b).base, first_ways, ps(b).tag);
      ps(b).match = m;
      if (m) {
        const int64_t s = ps(b).base + __builtin_ctzll(m);
        __builtin_prefetch(key_addr(t, s), 0, 3);
        if (t.word_of) __builtin_prefetch(t.word_of + (s >> 1), 0, 3);
      }
    }
    const int64_t c = i + kRowAhead;  // stage 3: the slot; prefetch its row and counter
    if (c >= i0 && c < i1) {
      int64_t slot = ps(c).base == -2 ? -1 : -2;
      if (ps(c).base == -3) {
        slot = static_cast<int64_t>(ps(c).match);
        if (slot >= 0 && !kProbeOnly) prefetch_bytes(row_of(t, slot), t.row_bytes);
      } else if (ps(c).base >= 0) {
        const int64_t key = t.keys[c];
        const int64_t base = ps(c).base;
        slot = -1;
        for (uint64_t m = ps(c).match; m; m &= m - 1) {
          const int64_t w = __builtin_ctzll(m);
          if (holds(t, base + w, key, ps(c).word)) {
            slot = base + w;
            break;
          }
        }
        if (slot < 0 && t.ways > 64) {  // sets wider than one tag line: the rest of the set
          for (int64_t w0 = 64; w0 < t.ways && slot < 0; w0 += 64) {
            uint64_t m = match_tags(t.tags + base + w0, std::min<int64_t>(64, t.ways - w0), ps(c).tag);
            for (; m; m &= m - 1) {
              const int64_t w = w0 + __builtin_ctzll(m);
              if (holds(t, base + w, key, ps(c).word)) {
                slot = base + w;
                break;
              }
            }
          }
        }
        if (slot >= 0) {
          if (!kProbeOnly) prefetch_bytes(row_of(t, slot), t.row_bytes);
          if (kUses && t.weight) __builtin_prefetch(t.counters + slot, 1, 3);
        }
      }
      sl[c] = slot;
      n_missed += slot == -1;
    }
    if (i < i0) continue;
    if (kUses && t.counter != nullptr && t.keys[i] >= 0 && sl[i] >= 0)  // hits: misses later
      t.counter->add_hashed(t.keys[i], ps(i).hash, t.counter->weight());
    const int64_t slot = sl[i];  // stage 4: copy or add the row, use the slot
    if (!bags) {
      if (slot >= 0) {
        dequant_row<kFormat, kSet>(row_of(t, slot), t.dim, t.out + i * t.dim);
        if (kUses) use_slot(t, slot, i, hits, firsts);
      }
      continue;
    }
    if constexpr (kProbeOnly) {
      if (kUses && slot >= 0) use_slot(t, slot, i, hits, firsts);
      continue;
    }
    if (++j == t.hotness) {
      j = 0;
      dst = t.out + (++bag) * t.out_stride;
      n_valid = 0;
      missed = written = false;
    }
    if (slot != -2) ++n_valid;
    if (slot == -1) missed = true;
    if (slot >= 0) {
      if (written) {
        dequant_row<kFormat, kAdd>(row_of(t, slot), t.dim, dst);
      } else {
        dequant_row<kFormat, kZeroAdd>(row_of(t, slot), t.dim, dst);
        written = true;
      }
      if (kUses) use_slot(t, slot, i, hits, firsts);
    }
    if (j != t.hotness - 1) continue;
    if (!written) std::fill(dst, dst + t.dim, 0.0f);
    if (t.mean && !missed && n_valid > 0) {
      const float cnt = static_cast<float>(n_valid);
      for (int64_t d = 0; d < t.dim; ++d) dst[d] /= cnt;
    }
  }
  return n_missed;
}

}  // namespace hps_cpu
