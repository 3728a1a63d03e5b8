// The compiled CPU kernels of hps (hps/kernels.py builds them): the fused cache-hit lookup
// (here; hps/fused.py is the caller and holds the pure-torch reference it is tested against),
// the probe's building blocks (cache_probe.h), the row formats and dequantizing gather
// (row_formats.h), the all-hit pass over full static caches (static_gather.h) and the key
// counter of a session's key statistics (key_counter.h).
//
// cache_gather: every table of one call in one pass. Per key: the splitmix64 hash gives the
// set and an 8-bit tag; the set's tag line (ways bytes, one 64-byte cache line for 64 ways)
// is compared with the tag, and only a matching way's key is read (a compact cache's int32 low
// word, and the nibble naming its high word once the cache holds several: the key's high word
// is looked up among the cache's <= 16 first; or int64 keys; so a probe reads the tag line,
// about one key line, the row and the slot's counter byte). The probe
// is pipelined over the keys (the tag line, key line and row of the keys a few places ahead are
// prefetched while a row is copied), so several keys' memory reads are in flight at once. A hit
// copies (rows) or accumulates (bags, key by key in request order) its row into the output,
// counts its table's use weight in the slot's counter byte (hps/storage/cache/slot_counter.py:
// LFU a Morris step of the 7-bit level with the draw of the key's position, or a weighted
// step; LRU the query's 7-bit stamp; weight 0: the counter is not touched), writing the byte
// only when it changes, and sets the slot's bit in this thread's slot bitmap on its first hit,
// for this query's unique-hit count (first_hits.h; the bits are clear again before the call
// returns). A miss records
// its position for the caller, and a bag with a miss hands its rows back (pending_rows) so that
// the caller sums it in request order once the missed rows are known. A cache with a dense key
// index (hps/storage/cache/dense_index.py) answers its keys in [0, bound) from their 4-byte
// entries instead: no hash, tag line or key line (the hash is still computed for a key counter);
// a piece of FP32 bags whose keys all lie in the index's range is pooled in the index's own pass
// (pool_bags_dense), a piece of FP32 rows copied in another (rows_dense), and a table whose
// keys all do counts its unique hits by key (dense_distinct), not in the slot bitmap.
// Rows are opaque bytes (row_bytes per table); the row format decides how a row is read.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cache_probe.h"
#include "cache_tables.h"
#include "common.h"
#include "dense_rows.h"
#include "first_hits.h"
#include "gather_checks.h"
#include "key_counter.h"
#include "pooled_bags.h"
#include "probe_pass.h"
#include "row_formats.h"
#include "slot_uses.h"
#include "static_gather.h"

namespace hps_cpu {

// The owner of a slot: a multiplicative hash of the slot scaled to [0, owners) (a multiply,
// no division per key).
inline int64_t owner_of(int64_t slot, int64_t owners) {
  const uint64_t h = (static_cast<uint64_t>(slot) * kGolden) >> 32;
  return static_cast<int64_t>(((h & 0xFFFFFFFFULL) * static_cast<uint64_t>(owners)) >> 32);
}

// The uses (counters, unique hits) of the hits of tables `split` after a parallel gather cut
// them into pieces across the threads: each thread owns the slots ``owner_of(slot) ==
// thread`` of every such table, so no two threads write one counter (no atomics; counts
// independent of the thread count).
void use_slots(const std::vector<TableView>& ts, const std::vector<int64_t*>& slots,
               const std::vector<int64_t>& split, int64_t owners, std::vector<int64_t>& hits,
               std::vector<int64_t>& uniq) {
  const int64_t T = static_cast<int64_t>(ts.size());
  at::parallel_for(0, owners, 1, [&](int64_t o0, int64_t o1) {
    FirstHits firsts;
    for (int64_t o = o0; o < o1; ++o) {
      for (const int64_t i : split) {
        const TableView& t = ts[i];
        firsts.make_room(t.n, slot_bits(t.num_sets * t.ways).data());
        const int64_t* sl = slots[i];
        int64_t h = 0;
        for (int64_t j = 0; j < t.n; ++j) {
          if (t.weight && j + 16 < t.n && sl[j + 16] >= 0)
            __builtin_prefetch(t.counters + sl[j + 16], 1, 3);
          const int64_t s = sl[j];
          if (s < 0 || owner_of(s, owners) != o) continue;
          use_slot(t, s, j, h, firsts);
        }
        hits[o * T + i] = h;
        uniq[o * T + i] = firsts.clear();  // this owner's slots: no other thread's
      }
    }
  });
}

// What a fused call needs per key and per table beyond its arguments, kept by the calling
// thread from call to call and grown, never shrunk: each key's slot and each table's first
// hits. Allocated afresh, a 65,000-key call zero-filled 0.5 MiB of slots and made 26
// allocations before its pass, then freed them: the step before its pass took 61 µs and its
// return 50 µs of a cold 3.6 ms call (2-vCPU VM), 5 and 37 µs with the scratch kept.
// Per calling thread, so concurrent calls never share it; the pass's worker threads write
// into the caller's.
struct CallScratch {
  std::unique_ptr<int64_t[]> slot_of_key;
  int64_t slot_room = 0;
  std::vector<FirstHits> first_hits;
  int64_t* slots(int64_t keys) {
    if (keys > slot_room) {
      slot_of_key.reset(new int64_t[keys]);
      slot_room = keys;
    }
    return slot_of_key.get();
  }
  // T tables' first hits, each empty (clear() after every table, also when a pass throws)
  std::vector<FirstHits>& firsts(int64_t T) {
    if (static_cast<int64_t>(first_hits.size()) < T) first_hits.resize(T);
    return first_hits;
  }
};

inline CallScratch& call_scratch() {
  thread_local CallScratch scratch;
  return scratch;
}

// A thread's share of a parallel gather: a whole table (every piece of it, its slots used
// and its keys counted in the same pass) or one piece of a table split across the threads.
struct Unit {
  int64_t table, first, last;  // pieces [first, last)
  bool whole;
  int64_t keys;
};

// The units in the order the threads take them: the largest first. Each thread takes the next
// unit when it is done with its last (one shared counter), so a thread that woke late, or drew
// the tables whose rows were furthest away, takes fewer: a plan made from key counts before
// the region (each unit to the thread with the fewest keys so far) left the two threads of a
// 2-vCPU host ending 0.1-0.4 ms apart in a 1.6-2.3 ms region.
std::vector<int64_t> largest_first(const std::vector<Unit>& units) {
  std::vector<int64_t> order(units.size());
  for (size_t u = 0; u < units.size(); ++u) order[u] = static_cast<int64_t>(u);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return units[a].keys > units[b].keys; });
  return order;
}

// Every table: the gathers of all pieces in one parallel region, then (when more than one
// thread gathered and a table was split across them) the uses of the split tables in a second
// (each region costs a thread wake-up and a barrier, so not two per table). A table of at most
// total / threads keys is gathered whole by one thread, which also uses its slots and counts
// its hits into key_counters[i] in the same pass, as a single thread does every table; only a
// larger table is cut into pieces across the threads. Per table: {hits_all, hits_unique,
// looked_up}; misses (positions into keys) ascending, table after table; pending: per table,
// the bags with a miss (ascending).
// The hits of each table whose key_counters[i] is set and that one thread gathered are
// counted into it (counted[i] = 1), the counter first halved halvings[i] times (the LFU
// agings of the table's cache this query crosses); a split table's are not. Misses are never
// counted here (the caller counts them one for one).
// distinct[i]: set for each table with a dense key index (dense_distinct, which also decides
// ts[i].by_key) before the table's pass reads a row: by the thread that gathers a whole
// table, at the start of its unit (a serial pass over every key of the call before the
// parallel region took 0.23-0.34 ms of a 3.5 ms call over the 26 tables of dlrm_dcnv2 ÷ 300),
// and before the region for the tables one thread does alone or that are split.
std::vector<std::vector<int64_t>> gather_tables(std::vector<TableView>& ts,
                                                const std::vector<KeyCounter*>& key_counters,
                                                const std::vector<int64_t>& halvings,
                                                std::vector<uint8_t>& counted,
                                                const std::vector<int64_t>& valid,
                                                std::vector<int64_t>& misses,
                                                std::vector<int64_t>& miss_counts,
                                                std::vector<int64_t*>& slots,
                                                std::vector<int64_t>& distinct) {
  const int64_t T = static_cast<int64_t>(ts.size());
  // unique hits by key where the table has a dense index and every key is in its range
  auto count_distinct = [&](int64_t i) {
    if (ts[i].dense == nullptr) return;
    distinct[i] = dense_distinct(ts[i], nullptr, ts[i].n);
    ts[i].by_key = distinct[i] >= 0;
  };
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (int64_t i = 0; i < T; ++i) total += ts[i].n;
  // each key's slot, in this thread's scratch (every entry is written by the pass before it is
  // read: no clearing); per table a pointer into it
  int64_t* scratch = call_scratch().slots(total);
  slots.assign(T, nullptr);
  for (int64_t i = 0, at = 0; i < T; at += ts[i].n, ++i) slots[i] = scratch + at;
  for (int64_t i = 0; i < T; ++i) {
    const TableView& t = ts[i];
    const int64_t units = t.hotness > 0 ? t.n / t.hotness : t.n;
    const int64_t grain = t.hotness > 0 ? std::max<int64_t>(1, 2048 / t.hotness) : 2048;
    for (int64_t u = 0; u < units; u += grain) pieces.push_back({i, u, std::min(units, u + grain)});
  }
  const int64_t P = static_cast<int64_t>(pieces.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), P);
  // small calls run on the calling thread: a thread wake-up costs more than their gather
  const bool alone = threads <= 1 || total < 8192 || at::in_parallel_region();
  std::vector<int64_t> hits(T, 0), uniq(T, 0);
  // each table's first hits, where one thread does it all
  std::vector<FirstHits>& firsts = call_scratch().firsts(T);
  std::vector<int64_t> piece_misses(P, 0);
  auto run = [&](int64_t p, bool uses) {
    const Piece& pc = pieces[p];
    const TableView& t = ts[pc.table];
    const int64_t h = std::max<int64_t>(1, t.hotness);
    int64_t* sl = slots[pc.table];
    const int64_t i0 = pc.begin * h, i1 = pc.end * h;
    int64_t unused_h = 0;
    FirstHits unused_f;
    int64_t& ht = uses ? hits[pc.table] : unused_h;
    FirstHits& ft = uses ? firsts[pc.table] : unused_f;
#if defined(__AVX__)
    if (const int vecs = pooled_vecs(t)) {
      if (t.dense != nullptr && all_dense(t, i0, i1, false)) {
#define HPS_DENSE(V)                                                            \
  piece_misses[p] = uses ? pool_bags_dense<V, true>(t, i0, i1, sl, ht, ft)     \
                         : pool_bags_dense<V, false>(t, i0, i1, sl, ht, ft); \
  break;
        switch (vecs) {
          case 16: HPS_DENSE(16)
          case 8: HPS_DENSE(8)
          case 4: HPS_DENSE(4)
          default: HPS_DENSE(2)
        }
#undef HPS_DENSE
        return;
      }
      piece_misses[p] = uses ? gather_piece<true, kFp32, true>(t, i0, i1, sl, ht, ft)
                             : gather_piece<false, kFp32, true>(t, i0, i1, sl, ht, ft);
      switch (vecs) {
        case 16: pool_bags<16>(t, i0, i1, sl); break;
        case 8: pool_bags<8>(t, i0, i1, sl); break;
        case 4: pool_bags<4>(t, i0, i1, sl); break;
        default: pool_bags<2>(t, i0, i1, sl); break;
      }
      return;
    }
#endif
    if (t.hotness == 0 && t.format == kFp32 && t.dense != nullptr && all_dense(t, i0, i1, true)) {
      piece_misses[p] = uses ? rows_dense<true>(t, i0, i1, sl, ht, ft)
                             : rows_dense<false>(t, i0, i1, sl, ht, ft);
      return;
    }
#define HPS_GATHER(F)                                                         \
  piece_misses[p] = uses ? gather_piece<true, F>(t, i0, i1, sl, ht, ft)   \
                         : gather_piece<false, F>(t, i0, i1, sl, ht, ft); \
  break;
    switch (t.format) {
      case kFp32: HPS_GATHER(kFp32)
      case kFp16: HPS_GATHER(kFp16)
      case kBf16: HPS_GATHER(kBf16)
      case kInt8: HPS_GATHER(kInt8)
      case kInt4: HPS_GATHER(kInt4)
      default: HPS_GATHER(kInt2)
    }
#undef HPS_GATHER
  };
  counted.assign(T, 0);
  // table i's key counter (where it has one) held for the pass that counts into it, halved
  // for the agings the query crosses, and handed to the pass
  auto take_counter = [&](int64_t i) {
    std::unique_lock<std::mutex> held;
    if (key_counters[i] == nullptr) return held;
    held = key_counters[i]->hold();
    if (halvings[i] > 0) key_counters[i]->halve_held(halvings[i]);
    ts[i].counter = key_counters[i];
    counted[i] = 1;
    return held;
  };
  if (alone) {
    // before the slot bits below are sized: dense_distinct may grow them
    for (int64_t i = 0; i < T; ++i) count_distinct(i);
    std::vector<std::unique_lock<std::mutex>> held;  // each counter held for the pass
    for (int64_t i = 0; i < T; ++i) held.push_back(take_counter(i));
    // one table after another over this thread's slot bits (sized for the widest cache
    // first, so no table's pointer into them moves), each table's bits cleared after it
    int64_t widest = 0;
    for (int64_t i = 0; i < T; ++i) widest = std::max(widest, ts[i].num_sets * ts[i].ways);
    uint64_t* bits = slot_bits(widest).data();
    for (int64_t i = 0; i < T; ++i) firsts[i].make_room(ts[i].n, bits);
    try {
      for (int64_t p = 0; p < P; ++p) {
        run(p, true);
        const int64_t i = pieces[p].table;
        if (p + 1 == P || pieces[p + 1].table != i) uniq[i] = firsts[i].clear();
      }
    } catch (...) {  // a key counter that could not grow: no slot bit outlives the call
      for (int64_t i = 0; i < T; ++i) firsts[i].clear();
      throw;
    }
  } else {
    std::vector<Unit> units;
    std::vector<int64_t> split;  // tables cut into pieces across the threads
    for (int64_t p = 0; p < P;) {
      const int64_t i = pieces[p].table;
      int64_t q = p;
      while (q < P && pieces[q].table == i) ++q;
      if (ts[i].n * threads <= total) {
        units.push_back({i, p, q, true, ts[i].n});
      } else {
        split.push_back(i);
        const int64_t h = std::max<int64_t>(1, ts[i].hotness);
        for (int64_t r = p; r < q; ++r)
          units.push_back({i, r, r + 1, false, (pieces[r].end - pieces[r].begin) * h});
      }
      p = q;
    }
    for (const int64_t i : split) count_distinct(i);
    const std::vector<int64_t> order = largest_first(units);
    const int64_t U = static_cast<int64_t>(order.size());
    std::atomic<int64_t> next{0};
    std::vector<std::exception_ptr> errors(T);
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < U;
           k = next.fetch_add(1, std::memory_order_relaxed)) {
        const Unit& w = units[order[k]];
        if (!w.whole) {
          run(w.first, false);
          continue;
        }
        const int64_t i = w.table;
        const std::unique_lock<std::mutex> held = take_counter(i);  // for the table's pass
        try {
          count_distinct(i);  // this thread's slot bits, clear again before make_room
          firsts[i].make_room(ts[i].n, slot_bits(ts[i].num_sets * ts[i].ways).data());
          for (int64_t p = w.first; p < w.last; ++p) run(p, true);
        } catch (...) {  // a key counter that could not grow: no slot bit outlives the call
          errors[i] = std::current_exception();
        }
        uniq[i] = firsts[i].clear();
      }
    });
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
    if (!split.empty()) {
      int64_t split_keys = 0;
      for (const int64_t i : split) split_keys += ts[i].n;
      const int64_t owners = std::max<int64_t>(1, std::min<int64_t>(threads, split_keys / 4096));
      std::vector<int64_t> oh(owners * T, 0), ou(owners * T, 0);
      use_slots(ts, slots, split, owners, oh, ou);
      for (int64_t o = 0; o < owners; ++o)
        for (const int64_t i : split) {
          hits[i] += oh[o * T + i];
          uniq[i] += ou[o * T + i];
        }
    }
  }
  std::vector<std::vector<int64_t>> out(T, std::vector<int64_t>(3, 0));
  miss_counts.assign(T, 0);
  for (int64_t p = 0; p < P; ++p) miss_counts[pieces[p].table] += piece_misses[p];
  for (int64_t i = 0; i < T; ++i) {
    if (miss_counts[i] > 0) {  // their positions (only tables with a miss are scanned)
      const int64_t* sl = slots[i];
      for (int64_t j = 0; j < ts[i].n; ++j)
        if (sl[j] == -1) misses.push_back(j);
    }
    out[i] = {hits[i], uniq[i], valid[i]};
  }
  return out;
}

// The rows of the bags of table t that had a miss: ``(bags × hotness, dim)`` float32, hits
// copied, misses and padding zero, so that the caller can sum each such bag in request order
// once its missed rows are known.
at::Tensor pending_rows(const TableView& t, const int64_t* sl,
                        const int64_t* misses, int64_t n_misses) {
  std::vector<int64_t> bags;
  for (int64_t k = 0; k < n_misses; ++k) {
    const int64_t b = misses[k] / t.hotness;
    if (bags.empty() || bags.back() != b) bags.push_back(b);
  }
  auto rows = at::zeros({static_cast<int64_t>(bags.size()) * t.hotness, t.dim}, at::kFloat);
  float* r = rows.data_ptr<float>();
  for (size_t q = 0; q < bags.size(); ++q)
    for (int64_t j = 0; j < t.hotness; ++j) {
      const int64_t s = sl[bags[q] * t.hotness + j];
      if (s >= 0)
        dequant_any(t.format, row_of(t, s), t.dim, r + (static_cast<int64_t>(q) * t.hotness + j) * t.dim);
    }
  return rows;
}

// Rows (hotness all 0) or bags (hotness > 0) of every table, see the file comment.
// key_counters: empty, or per table a KeyCounter (or None) that the pass counts the table's
// hits of keys >= 0 into when one thread does every key of the table (gather_tables), first
// halving it once per LFU halving of the table's cache that falls in this query (the caller
// ages the rest of its statistics, e.g. their mass, to match). c: the caches' arrays
// (cache_tables.h), one table per key tensor; a table's dense key index (int32, the slot of
// each key in [0, numel), -1 where none) answers those keys in place of the hash probe (a
// slot outside the cache reads as a miss).
// weights: empty (every table 1), or per table the uses each hit counts (>= 0; see use_slot).
// Returns {misses (k,) int64: positions into each table's keys, table after table;
//          per_table (T, 5) int64: misses, hits_all, hits_unique, looked_up, halvings;
//          counted (T,) uint8: 1 where the table's hits were counted into its KeyCounter;
//          then per table its pending rows (bags with a miss, see pending_rows; else empty)}.
std::vector<at::Tensor> cache_gather(
    const std::vector<at::Tensor>& keys, const CacheTables& c, const std::vector<int64_t>& stamps,
    const std::vector<int64_t>& streams, const std::vector<int64_t>& looked_up,
    const std::vector<int64_t>& intervals, at::Tensor out,
    const std::vector<int64_t>& out_offsets, int64_t out_stride,
    const std::vector<int64_t>& hotness, const std::vector<int64_t>& mean,
    const std::vector<KeyCounter*>& key_counters, const std::vector<int64_t>& weights) {
  const size_t T = keys.size();
  check(weights.empty() || weights.size() == T, "weights: none, or one per table");
  for (size_t i = 0; i < weights.size(); ++i)
    check(weights[i] >= 0, [&] {
      return "table " + std::to_string(i) + ": use weight " + std::to_string(weights[i]) +
             " is negative";
    });
  check(key_counters.empty() || key_counters.size() == T,
        "key_counters: none, or one KeyCounter (or None) per table");
  check(c.size() == T, [&] {
    return std::to_string(T) + " key tensors but " + std::to_string(c.size()) + " tables";
  });
  check_gather_args(T, {&stamps, &streams, &looked_up, &intervals, &out_offsets, &hotness, &mean},
                    out);
  const std::vector<int64_t>& ways = c.ways;
  const int64_t* gp = c.gaps_p;
  int64_t level_counts[kMaxLevel + 1];  // LEVEL_COUNTS: the sums of the gaps below each level
  level_counts[0] = 0;
  for (int v = 0; v < kMaxLevel; ++v) level_counts[v + 1] = level_counts[v] + gp[v];
  const uint8_t* hv = c.halve_p;
  const std::vector<int64_t> valid = valid_keys(keys, hotness);  // refuses bad keys first
  at::Tensor misses_all;
  std::vector<int64_t> misses;
  auto per_table = cpu_tensor({static_cast<int64_t>(T), 5}, at::kLong, true);
  auto* pt = per_table.data_ptr<int64_t>();
  float* out_base = out.data_ptr<float>();
  std::vector<TableView> views;
  std::vector<KeyCounter*> kcs(T, nullptr);
  std::vector<int64_t> halvings(T, 0), distinct(T, -1);
  const int64_t out_n = out.numel();
  for (size_t i = 0; i < T; ++i) {  // every table's output inside out before anything is written
    const auto tab = [i] { return "table " + std::to_string(i) + ": "; };
    check_output(tab, keys[i].numel(), hotness[i], c.dims[i], out_offsets[i], out_stride, out_n);
  }
  for (size_t i = 0; i < T; ++i) {
    const auto& k = keys[i];
    const CacheTables::Arrays& a = c.arrays[i];
    const int64_t capacity = a.capacity;
    // LFU aging before this query's uses: one halving per multiple of the interval crossed
    const int64_t w = intervals[i];
    const int64_t crossed = w > 0 ? (looked_up[i] + valid[i]) / w - looked_up[i] / w : 0;
    if (crossed > 0) {  // the level of half the count, crossed times
      uint8_t lut[kMaxLevel + 1];
      for (int v = 0; v <= kMaxLevel; ++v) lut[v] = static_cast<uint8_t>(v);
      for (int64_t r = 0; r < std::min<int64_t>(crossed, kMaxLevel + 1); ++r)
        for (int v = 0; v <= kMaxLevel; ++v) lut[v] = hv[lut[v]];
      uint8_t* lv = a.counters;
      for (int64_t j = 0; j < capacity; ++j) lv[j] = lut[lv[j] & kMaxLevel];  // once per period
    }
    TableView t{k.data_ptr<int64_t>(),
                k.numel(),
                a.keys,
                a.key32,
                a.high_words,
                a.n_high_words,
                a.high_of,
                a.tags,
                a.counters,
                a.storage,
                capacity / ways[i],
                ways[i],
                c.dims[i],
                c.row_bytes[i],
                c.formats[i],
                stamps[i],
                streams[i],
                gp,
                level_counts,
                weights.empty() ? 1 : weights[i],
                hotness[i],
                mean[i] != 0,
                out_base + out_offsets[i],
                out_stride};
    if (a.dense != nullptr) {
      t.dense = a.dense;
      t.n_dense = a.n_dense;
    }
    views.push_back(t);
    pt[i * 5 + 4] = crossed;
    halvings[i] = crossed;  // a key counter is halved as its cache ages, before the query counts
    kcs[i] = key_counters.empty() ? nullptr : key_counters[i];
  }
  std::vector<int64_t> miss_counts;
  std::vector<int64_t*> slots;
  std::vector<uint8_t> counted;
  const auto r =
      gather_tables(views, kcs, halvings, counted, valid, misses, miss_counts, slots, distinct);
  std::vector<at::Tensor> result;
  result.reserve(2 + T);
  // the (0, dim) pending rows of the tables without a bag to complete, one per dim (a tensor
  // per table would cost more than a small call's gather)
  std::vector<std::pair<int64_t, at::Tensor>> none;
  const auto no_rows = [&none](int64_t dim) {
    for (const auto& [d, t] : none)
      if (d == dim) return t;
    none.emplace_back(dim, cpu_tensor({0, dim}, at::kFloat, false));
    return none.back().second;
  };
  int64_t first = 0;
  for (size_t i = 0; i < T; ++i) {
    int64_t* row = pt + i * 5;
    row[0] = miss_counts[i];
    row[1] = r[i][0];
    row[2] = views[i].by_key
                 ? distinct[i] - dense_distinct(views[i], misses.data() + first, miss_counts[i])
                 : r[i][1];
    row[3] = r[i][2];
    result.push_back(views[i].hotness > 0 && miss_counts[i] > 0
                         ? pending_rows(views[i], slots[i], misses.data() + first, miss_counts[i])
                         : no_rows(views[i].dim));
    first += miss_counts[i];
  }
  misses_all = cpu_tensor({static_cast<int64_t>(misses.size())}, at::kLong, false);
  if (!misses.empty())
    std::memcpy(misses_all.data_ptr<int64_t>(), misses.data(), misses.size() * sizeof(int64_t));
  auto counted_t = cpu_tensor({static_cast<int64_t>(T)}, at::kByte, false);
  if (T) std::memcpy(counted_t.data_ptr<uint8_t>(), counted.data(), T);
  result.insert(result.begin(), {misses_all, per_table, counted_t});
  return result;
}

// A fused call's keys as hps.session.fused._check takes them without a word, checked in one
// call: each a contiguous CPU int64 tensor of at most max_keys[i] keys and, for bags, (B, w)
// with one B for all. Returns each table's w (bags) or an empty list (rows), or None for any
// other keys: the caller then checks them one by one, and words the error. (Checking 26
// tables in Python takes 20-38 µs a call.)
pybind11::object plain_keys(const std::vector<at::Tensor>& keys,
                            const std::vector<int64_t>& max_keys, bool bags) {
  if (keys.size() != max_keys.size()) return pybind11::none();
  std::vector<int64_t> hot;
  int64_t batch = -1;
  for (size_t i = 0; i < keys.size(); ++i) {
    const at::Tensor& k = keys[i];
    if (k.scalar_type() != at::kLong || !k.is_contiguous() || !k.device().is_cpu() ||
        k.numel() > max_keys[i])
      return pybind11::none();
    if (!bags) continue;
    if (k.dim() != 2 || (batch >= 0 && k.size(0) != batch)) return pybind11::none();
    batch = k.size(0);
    hot.push_back(k.size(1));
  }
  return pybind11::cast(hot);
}

// Each table's rows in a fused call's flat output `out` (float32, 1-D): table i's block of
// keys[i].numel() rows of dims[i] values at offsets[i], viewed in its keys' shape plus its dim.
// One call for every table, each a view of out (as_strided: out's storage, version counter and
// view base): 26 views made in Python (a slice and a view each) took 285 µs of a call whose
// code and objects the CPU no longer held in its caches (70 µs warm), these 163 µs (17 µs).
std::vector<at::Tensor> row_views(const at::Tensor& out, const std::vector<at::Tensor>& keys,
                                  const std::vector<int64_t>& offsets,
                                  const std::vector<int64_t>& dims) {
  const size_t T = keys.size();
  check(offsets.size() == T && dims.size() == T, "row_views: one offset and one dim per table");
  check(out.dim() == 1 && out.is_contiguous(), "row_views: out must be 1-D and contiguous");
  std::vector<at::Tensor> views;
  views.reserve(T);
  const int64_t base = out.storage_offset(), n = out.numel();
  for (size_t i = 0; i < T; ++i) {
    const at::Tensor& k = keys[i];
    std::vector<int64_t> size(k.sizes().begin(), k.sizes().end());
    size.push_back(dims[i]);
    std::vector<int64_t> stride(size.size());
    int64_t step = 1;
    for (size_t d = size.size(); d-- > 0;) {
      stride[d] = step;
      step *= size[d];
    }
    check(offsets[i] >= 0 && offsets[i] + step <= n, [&] {
      return "row_views: table " + std::to_string(i) + "'s " + std::to_string(step) +
             " values at " + std::to_string(offsets[i]) + " do not fit in " + std::to_string(n);
    });
    views.push_back(out.as_strided(size, stride, base + offsets[i]));
  }
  return views;
}

// The LFU draw stream of each query: mix64(seed · 2**32 + clock) of each table's cache
// (seeds and clocks: their low 32 bits), as hps.storage.cache.slot_counter.stream_of.
std::vector<int64_t> lfu_streams(const std::vector<int64_t>& seeds,
                                 const std::vector<int64_t>& clocks) {
  check(seeds.size() == clocks.size(), "one seed per clock");
  std::vector<int64_t> out(seeds.size());
  for (size_t i = 0; i < seeds.size(); ++i) {
    const uint64_t x = (static_cast<uint64_t>(seeds[i]) & 0xFFFFFFFFULL) << 32 |
                       (static_cast<uint64_t>(clocks[i]) & 0xFFFFFFFFULL);
    out[i] = static_cast<int64_t>(mix64(static_cast<int64_t>(x)));
  }
  return out;
}

}  // namespace hps_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace hps_cpu;
  pybind11::class_<CacheTables>(m, "CacheTables")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<int64_t>, at::Tensor, at::Tensor>())
      .def("__len__", &CacheTables::size);
  m.def("row_views", &row_views,
        "each table's rows of a fused call's flat output, in its keys' shape");
  m.def("lfu_streams", &lfu_streams, "each query's LFU draw stream from its cache's seed and clock");
  m.def("plain_keys", &plain_keys,
        "each table's bag width when every table's keys pass the fused call's checks, else None");
  m.def("cache_gather", &cache_gather, "fused cache-hit lookup of every table (rows or bags)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gather_rows", &gather_rows,
        "rows or in-order bag sums of stored rows of any row format, dequantized to float32",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("static_gather", &static_gather,
        "all-hit rows or bags of full IDENTITY static caches (per-table statistics, or none), "
        "their keys counted into the given key counters",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("count_keys", &count_keys, "count every table's keys into its KeyCounter",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // every KeyCounter call takes the counter's mutex, which a fused pass holds for the pass:
  // waiting for it must not hold the GIL
  using Release = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<KeyCounter>(m, "KeyCounter")
      .def(pybind11::init<>())
      .def("update", &KeyCounter::update, Release())
      .def("count_of", &KeyCounter::count_of, Release())
      .def("halve", &KeyCounter::halve, Release())
      .def("items", &KeyCounter::items, Release())
      .def("trim", &KeyCounter::trim, Release())
      .def("size", &KeyCounter::size, Release())
      .def("capacity", &KeyCounter::capacity, Release())
      .def("set_weight", &KeyCounter::set_weight, Release());
}
