// The fused cache-hit lookup of hps (hps/fused.py is the caller, hps/fused_reference.py the
// pure-torch path it is tested against) and the key counter of a session's key statistics.
//
// cache_gather: every table of one call in one pass. Per key: the splitmix64 hash gives the
// set and an 8-bit tag; the set's tag line (ways bytes, one 64-byte cache line for 64 ways)
// is compared with the tag, and only a matching way's key is read (so a probe reads the tag
// line, about one key line and the row). A hit copies (rows) or accumulates (bags) its row
// into the output, counts a use (LFU: +1 per occurrence; LRU: the query's clock) and marks
// the slot for this query's unique-hit count; a miss records its position for the caller.
// Rows are opaque bytes (row_bytes per table); the row format decides how a row is read.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>  // KeyCounter
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;  // splitmix64 (Steele et al., 2014)
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;
constexpr int64_t kFormatFp32 = 0;  // hps.fused.RowCodec.FP32

inline uint64_t mix64(int64_t key) {
  uint64_t z = static_cast<uint64_t>(key) + kGolden;
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// One table of a cache_gather call.
struct TableView {
  const int64_t* keys;
  int64_t n;  // keys (rows: m; bags: B * hotness)
  const int64_t* ckeys;
  const uint8_t* tags;
  int64_t* counters;
  uint8_t* marks;
  const uint8_t* storage;
  int64_t num_sets, ways, dim, row_bytes, format, stamp, mark;
  int64_t hotness;  // 0: rows; > 0: bags of this many keys (-1 pads)
  bool mean;
  float* out;       // rows: this table's (n, dim) block; bags: column 0 of this table
  int64_t out_stride;  // bags: floats between two bags' rows
};

// The set of a hash: the high 32 bits scaled to [0, num_sets) (a multiply, no division);
// its tag: 1 + (low 16 bits % 255), so 0 marks an empty slot. hps.storage.cache.set_of/tag_of.
inline int64_t set_of(uint64_t h, int64_t num_sets) {
  return static_cast<int64_t>(((h >> 32) * static_cast<uint64_t>(num_sets)) >> 32);
}

inline uint8_t tag_of(uint64_t h) { return static_cast<uint8_t>(1 + (h & 0xFFFF) % 255); }

// Bit w set where tg[w] == tag, for the n <= 64 ways at tg.
inline uint64_t match_tags(const uint8_t* tg, int64_t n, uint8_t tag) {
#if defined(__AVX512BW__)
  const __mmask64 lanes = n >= 64 ? ~0ULL : ((1ULL << n) - 1);
  const __m512i v = _mm512_maskz_loadu_epi8(lanes, tg);
  return _mm512_mask_cmpeq_epi8_mask(lanes, v, _mm512_set1_epi8(static_cast<char>(tag)));
#else
  uint64_t m = 0;
  for (int64_t w = 0; w < n; ++w) m |= static_cast<uint64_t>(tg[w] == tag) << w;
  return m;
#endif
}

inline int64_t probe(const TableView& t, int64_t key) {
  const uint64_t h = mix64(key);
  const int64_t base = set_of(h, t.num_sets) * t.ways;
  const uint8_t tag = tag_of(h);
  for (int64_t w0 = 0; w0 < t.ways; w0 += 64) {
    uint64_t m = match_tags(t.tags + base + w0, std::min<int64_t>(64, t.ways - w0), tag);
    while (m) {
      const int64_t w = w0 + __builtin_ctzll(m);
      if (t.ckeys[base + w] == key) return base + w;
      m &= m - 1;
    }
  }
  return -1;
}

inline void copy_row(const TableView& t, int64_t slot, float* dst) {
  // a vector loop: glibc's memcpy of a few hundred bytes is a call and, on some CPUs, a
  // slow ``rep movsb``
  const float* src = reinterpret_cast<const float*>(t.storage + slot * t.row_bytes);
#pragma omp simd
  for (int64_t d = 0; d < t.dim; ++d) dst[d] = src[d];
}

inline void add_row(const TableView& t, int64_t slot, float* dst) {
  const float* src = reinterpret_cast<const float*>(t.storage + slot * t.row_bytes);
#pragma omp simd
  for (int64_t d = 0; d < t.dim; ++d) dst[d] += src[d];
}

// A run of keys (rows) or bags of one table: the unit of parallel work.
struct Piece {
  int64_t table, begin, end;
};

// The gather of one piece (reads only the cache): rows copied or bags summed (MEAN bags
// without a miss divided), each key's slot in sl (-1 miss, -2 padding).
void gather_piece(const TableView& t, int64_t b0, int64_t b1, int64_t* sl) {
  if (t.hotness == 0) {
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t slot = probe(t, t.keys[i]);
      sl[i] = slot;
      if (slot >= 0) copy_row(t, slot, t.out + i * t.dim);
    }
    return;
  }
  for (int64_t b = b0; b < b1; ++b) {
    float* dst = t.out + b * t.out_stride;
    std::fill(dst, dst + t.dim, 0.0f);
    int64_t n = 0;
    bool missed = false;
    for (int64_t j = 0; j < t.hotness; ++j) {
      const int64_t i = b * t.hotness + j;
      const int64_t key = t.keys[i];
      if (key < 0) {  // -1 pads a short bag
        sl[i] = -2;
        continue;
      }
      ++n;
      const int64_t slot = probe(t, key);
      sl[i] = slot;
      if (slot < 0) {
        missed = true;
        continue;
      }
      add_row(t, slot, dst);
    }
    if (t.mean && !missed && n > 0) {
      const float cnt = static_cast<float>(n);
      for (int64_t d = 0; d < t.dim; ++d) dst[d] /= cnt;
    }
  }
}

// Every table in two parallel regions (each region costs a thread wake-up and a barrier, so
// not two per table): the gathers of all pieces, then the uses (counters, marks), whose
// threads each own the slots ``slot % owners`` of every table, so no two threads write one
// counter (no atomics; counts independent of the thread count). Per table: {hits_all,
// hits_unique, looked_up}; misses (positions into keys) ascending, table after table.
std::vector<std::vector<int64_t>> gather_tables(const std::vector<TableView>& ts,
                                                std::vector<int64_t>& misses,
                                                std::vector<int64_t>& miss_counts) {
  const int64_t T = static_cast<int64_t>(ts.size());
  std::vector<std::vector<int64_t>> slots(T);
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (int64_t i = 0; i < T; ++i) {
    const TableView& t = ts[i];
    slots[i].resize(t.n);
    total += t.n;
    const int64_t units = t.hotness > 0 ? t.n / t.hotness : t.n;
    const int64_t grain = t.hotness > 0 ? std::max<int64_t>(1, 1024 / t.hotness) : 1024;
    for (int64_t u = 0; u < units; u += grain) pieces.push_back({i, u, std::min(units, u + grain)});
  }
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Piece& pc = pieces[p];
      gather_piece(ts[pc.table], pc.begin, pc.end, slots[pc.table].data());
    }
  });
  const int64_t owners = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / 4096));
  std::vector<int64_t> hits(owners * T, 0), uniq(owners * T, 0);
  at::parallel_for(0, owners, 1, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      for (int64_t i = 0; i < T; ++i) {
        const TableView& t = ts[i];
        const int64_t* sl = slots[i].data();
        const uint8_t mk = static_cast<uint8_t>(t.mark);
        int64_t h = 0, u = 0;
        for (int64_t j = 0; j < t.n; ++j) {
          const int64_t s = sl[j];
          if (s < 0 || s % owners != o) continue;
          ++h;
          if (t.stamp < 0)
            ++t.counters[s];
          else
            t.counters[s] = t.stamp;
          if (t.marks[s] != mk) {
            t.marks[s] = mk;
            ++u;
          }
        }
        hits[o * T + i] = h;
        uniq[o * T + i] = u;
      }
    }
  });
  std::vector<std::vector<int64_t>> out(T, std::vector<int64_t>(3, 0));
  miss_counts.assign(T, 0);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t* sl = slots[i].data();
    int64_t valid = 0;
    for (int64_t j = 0; j < ts[i].n; ++j) {
      if (sl[j] == -1) {
        misses.push_back(j);
        ++miss_counts[i];
      }
      valid += sl[j] != -2;
    }
    for (int64_t o = 0; o < owners; ++o) {
      out[i][0] += hits[o * T + i];
      out[i][1] += uniq[o * T + i];
    }
    out[i][2] = valid;
  }
  return out;
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("hps cache_gather: " + what);
}

// Rows (hotness all 0) or bags (hotness > 0) of every table, see the file comment.
// Returns {misses (k,) int64: positions into each table's keys, table after table;
//          per_table (T, 5) int64: misses, hits_all, hits_unique, looked_up, halvings}.
std::vector<at::Tensor> cache_gather(
    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& cache_keys,
    const std::vector<at::Tensor>& tags, const std::vector<at::Tensor>& counters,
    const std::vector<at::Tensor>& marks, const std::vector<at::Tensor>& storage,
    const std::vector<int64_t>& ways, const std::vector<int64_t>& dims,
    const std::vector<int64_t>& formats, const std::vector<int64_t>& stamps,
    const std::vector<int64_t>& mark_values, const std::vector<int64_t>& looked_up,
    const std::vector<int64_t>& intervals,
    at::Tensor out, const std::vector<int64_t>& out_offsets, int64_t out_stride,
    const std::vector<int64_t>& hotness, const std::vector<int64_t>& mean) {
  const size_t T = keys.size();
  for (const auto* v : {&cache_keys, &tags, &counters, &marks, &storage})
    check(v->size() == T, "one tensor per table expected");
  for (const auto* v : {&ways, &dims, &formats, &stamps, &mark_values, &looked_up, &intervals,
                        &out_offsets, &hotness, &mean})
    check(v->size() == T, "one value per table expected");
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
        "out must be a contiguous CPU float32 tensor");
  std::vector<int64_t> valid(T, 0);
  for (size_t i = 0; i < T; ++i) {  // refuse bad keys before any counter moves
    const auto& k = keys[i];
    check(k.scalar_type() == at::kLong && k.is_contiguous(), "keys must be contiguous int64");
    const int64_t* kp = k.data_ptr<int64_t>();
    const int64_t lo = hotness[i] > 0 ? -1 : INT64_MIN + 1;
    int64_t v = 0;
    for (int64_t j = 0; j < k.numel(); ++j) {
      v += kp[j] >= 0 || hotness[i] == 0;
      if (kp[j] < lo)
        throw std::invalid_argument("table " + std::to_string(i) + ": key " +
                                    std::to_string(kp[j]) + " at position " + std::to_string(j) +
                                    (hotness[i] > 0 ? " (keys are >= 0; -1 pads a short bag)"
                                                    : " is reserved (the empty-slot sentinel)"));
    }
    valid[i] = v;
  }
  at::Tensor misses_all;
  std::vector<int64_t> misses;
  auto per_table = at::zeros({static_cast<int64_t>(T), 5}, at::kLong);
  auto* pt = per_table.data_ptr<int64_t>();
  float* out_base = out.data_ptr<float>();
  std::vector<TableView> views;
  for (size_t i = 0; i < T; ++i) {
    const auto& k = keys[i];
    check(formats[i] == kFormatFp32, "row format " + std::to_string(formats[i]) +
                                         " has no fused kernel (FP32 = 0 only)");
    const int64_t capacity = cache_keys[i].numel();
    check(storage[i].scalar_type() == at::kByte && storage[i].dim() == 2 &&
              storage[i].size(0) == capacity && storage[i].is_contiguous(),
          "storage must be (capacity, row_bytes) contiguous uint8");
    const int64_t row_bytes = storage[i].size(1);
    check(row_bytes >= dims[i] * 4, "FP32 rows need 4 * dim bytes");
    // LFU aging before this query's uses: one halving per multiple of the interval crossed
    const int64_t w = intervals[i];
    const int64_t crossed = w > 0 ? (looked_up[i] + valid[i]) / w - looked_up[i] / w : 0;
    if (crossed > 0) {  // -1, an empty slot, stays -1
      int64_t* c = counters[i].data_ptr<int64_t>();
      const int s = static_cast<int>(std::min<int64_t>(crossed, 63));
      for (int64_t j = 0; j < capacity; ++j) c[j] >>= s;  // once per aging period
    }
    TableView t{k.data_ptr<int64_t>(),
                k.numel(),
                cache_keys[i].data_ptr<int64_t>(),
                tags[i].data_ptr<uint8_t>(),
                counters[i].data_ptr<int64_t>(),
                marks[i].data_ptr<uint8_t>(),
                storage[i].data_ptr<uint8_t>(),
                capacity / ways[i],
                ways[i],
                dims[i],
                row_bytes,
                formats[i],
                stamps[i],
                mark_values[i],
                hotness[i],
                mean[i] != 0,
                out_base + out_offsets[i],
                out_stride};
    if (t.hotness > 0) check(t.n % t.hotness == 0, "bag keys must be (B, hotness)");
    views.push_back(t);
    pt[i * 5 + 4] = crossed;
  }
  std::vector<int64_t> miss_counts;
  const auto r = gather_tables(views, misses, miss_counts);
  for (size_t i = 0; i < T; ++i) {
    int64_t* row = pt + i * 5;
    row[0] = miss_counts[i];
    row[1] = r[i][0];
    row[2] = r[i][1];
    row[3] = r[i][2];
  }
  misses_all = at::empty({static_cast<int64_t>(misses.size())}, at::kLong);
  if (!misses.empty())
    std::memcpy(misses_all.data_ptr<int64_t>(), misses.data(), misses.size() * sizeof(int64_t));
  return {misses_all, per_table};
}

// Exact running counts of keys: an open-addressing hash map (linear probing, load ≤ 1/2), so
// an update is O(its keys) whatever the number of keys counted so far.
class KeyCounter {
 public:
  KeyCounter() { rehash(1 << 10); }

  // Adds counts[i] (1 when counts is empty) for keys[i]; keys < 0 are padding, skipped
  // when skip_negative.
  void update(const at::Tensor& keys, const at::Tensor& counts, bool skip_negative) {
    std::lock_guard<std::mutex> g(mu_);
    const auto k = keys.contiguous();
    const int64_t* kp = k.data_ptr<int64_t>();
    const int64_t n = k.numel();
    at::Tensor c;
    const int64_t* cp = nullptr;
    if (counts.defined() && counts.numel()) {
      c = counts.contiguous();
      cp = c.data_ptr<int64_t>();
    }
    reserve(size_ + n);
    for (int64_t i = 0; i < n; ++i) {
      if (skip_negative && kp[i] < 0) continue;
      add(kp[i], cp ? cp[i] : 1);
    }
  }

  at::Tensor count_of(const at::Tensor& keys) {
    std::lock_guard<std::mutex> g(mu_);
    const auto k = keys.contiguous();
    auto out = at::empty({k.numel()}, at::kLong);
    const int64_t* kp = k.data_ptr<int64_t>();
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t i = 0; i < k.numel(); ++i) {
      const int64_t s = find(kp[i]);
      op[i] = s < 0 ? 0 : counts_[s];
    }
    return out;
  }

  // c >> times for every key; keys whose count reaches 0 are dropped.
  void halve(int64_t times) {
    std::lock_guard<std::mutex> g(mu_);
    const int s = static_cast<int>(std::min<int64_t>(times, 63));
    std::vector<std::pair<int64_t, int64_t>> kept;
    kept.reserve(size_);
    for (size_t i = 0; i < used_.size(); ++i)
      if (used_[i] && (counts_[i] >> s) > 0) kept.emplace_back(keys_[i], counts_[i] >> s);
    reset(kept);
  }

  // {keys (k,) ascending, counts (k,)}.
  std::vector<at::Tensor> items() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::pair<int64_t, int64_t>> all;
    all.reserve(size_);
    for (size_t i = 0; i < used_.size(); ++i)
      if (used_[i]) all.emplace_back(keys_[i], counts_[i]);
    std::sort(all.begin(), all.end());
    auto k = at::empty({static_cast<int64_t>(all.size())}, at::kLong);
    auto c = at::empty({static_cast<int64_t>(all.size())}, at::kLong);
    for (size_t i = 0; i < all.size(); ++i) {
      k.data_ptr<int64_t>()[i] = all[i].first;
      c.data_ptr<int64_t>()[i] = all[i].second;
    }
    return {k, c};
  }

  // Replace the contents by keys/counts (the caller's trim).
  void assign(const at::Tensor& keys, const at::Tensor& counts) {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::pair<int64_t, int64_t>> kv(keys.numel());
    for (int64_t i = 0; i < keys.numel(); ++i)
      kv[i] = {keys.data_ptr<int64_t>()[i], counts.data_ptr<int64_t>()[i]};
    reset(kv);
  }

  int64_t size() {
    std::lock_guard<std::mutex> g(mu_);
    return size_;
  }

 private:
  size_t slot_of(int64_t key) const { return mix64(key) & mask_; }

  int64_t find(int64_t key) const {
    for (size_t s = slot_of(key);; s = (s + 1) & mask_) {
      if (!used_[s]) return -1;
      if (keys_[s] == key) return static_cast<int64_t>(s);
    }
  }

  void add(int64_t key, int64_t c) {
    for (size_t s = slot_of(key);; s = (s + 1) & mask_) {
      if (!used_[s]) {
        used_[s] = 1;
        keys_[s] = key;
        counts_[s] = c;
        ++size_;
        return;
      }
      if (keys_[s] == key) {
        counts_[s] += c;
        return;
      }
    }
  }

  void reserve(int64_t want) {
    if (static_cast<size_t>(want) * 2 <= used_.size()) return;
    size_t cap = used_.size();
    while (static_cast<size_t>(want) * 2 > cap) cap *= 2;
    std::vector<std::pair<int64_t, int64_t>> all;
    all.reserve(size_);
    for (size_t i = 0; i < used_.size(); ++i)
      if (used_[i]) all.emplace_back(keys_[i], counts_[i]);
    rehash(cap);
    for (const auto& kv : all) add(kv.first, kv.second);
  }

  void reset(const std::vector<std::pair<int64_t, int64_t>>& kv) {
    size_t cap = 1 << 10;
    while (kv.size() * 2 > cap) cap *= 2;
    rehash(cap);
    for (const auto& p : kv) add(p.first, p.second);
  }

  void rehash(size_t cap) {
    keys_.assign(cap, 0);
    counts_.assign(cap, 0);
    used_.assign(cap, 0);
    mask_ = cap - 1;
    size_ = 0;
  }

  std::mutex mu_;
  std::vector<int64_t> keys_, counts_;
  std::vector<uint8_t> used_;
  size_t mask_ = 0;
  int64_t size_ = 0;
};

// Counts every table's keys into its counter (keys < 0 skipped), tables in parallel.
void count_keys(const std::vector<KeyCounter*>& counters, const std::vector<at::Tensor>& keys) {
  check(counters.size() == keys.size(), "one counter per table expected");
  at::parallel_for(0, static_cast<int64_t>(keys.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) counters[i]->update(keys[i], at::Tensor(), true);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cache_gather", &cache_gather, "fused cache-hit lookup of every table (rows or bags)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("count_keys", &count_keys, "count every table's keys into its KeyCounter",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<KeyCounter>(m, "KeyCounter")
      .def(pybind11::init<>())
      .def("update", &KeyCounter::update, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("count_of", &KeyCounter::count_of)
      .def("halve", &KeyCounter::halve)
      .def("items", &KeyCounter::items)
      .def("assign", &KeyCounter::assign)
      .def("size", &KeyCounter::size);
}
