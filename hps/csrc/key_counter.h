// The key counter of a session's key statistics (hps.key_counts.KeyCounts). Included by
// hps/csrc/fused_lookup.cpp.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "common.h"

namespace hps_cpu {

// Exact running counts of keys: an open-addressing hash map (linear probing, load ≤ 1/2) of
// 16-byte entries (key, count; count -1 marks a free entry), so an update is O(its keys)
// whatever the number of keys counted so far, a key's probe reads about one cache line, and
// the lines of the keys a few places ahead are prefetched. The map doubles when a new key
// would take its load past 1/2, so it is sized by the distinct keys held, not by the keys of
// one update (a call of 30,000 occurrences of 9,000 distinct keys keeps a 512 KiB map, which
// stays in a core's L2, where room for every occurrence took 2 MiB).
//
// An occurrence (a key of an update without counts, or of a fused pass) adds weight()
// (set_weight; 1 unless set): a caller that counts about one call in w (sampled statistics,
// hps.key_counts.KeyCounts) counts each call it takes as w. Pre-counted updates add their
// counts as given.
class KeyCounter {
 public:
  KeyCounter() { rehash(1 << 10); }

  // Set before the counter is shared (KeyCounts sets it when it makes the counter): a pass
  // reads weight() without the lock.
  void set_weight(int64_t w) {
    check(w >= 1, "set_weight: the weight must be >= 1");
    std::lock_guard<std::mutex> g(mu_);
    weight_ = w;
  }
  int64_t weight() const { return weight_; }

  // Adds counts[i] (weight() when counts is empty) for keys[i]; keys < 0 are padding,
  // skipped when skip_negative.
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
    // each key hashed once: its hash waits in a ring of `ahead` between its entry's prefetch
    // and its add
    constexpr int64_t ahead = 8;
    uint64_t ring[ahead];
    for (int64_t i = 0; i < std::min(ahead, n); ++i) {
      ring[i] = mix64(kp[i]);
      __builtin_prefetch(&slots_[ring[i] & mask_], 1, 3);
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t h = ring[i % ahead];
      if (i + ahead < n) {
        const uint64_t ha = mix64(kp[i + ahead]);
        ring[i % ahead] = ha;
        __builtin_prefetch(&slots_[ha & mask_], 1, 3);
      }
      if (skip_negative && kp[i] < 0) continue;
      add_hashed(kp[i], h, cp ? cp[i] : weight_);
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
      op[i] = s < 0 ? 0 : slots_[s].count;
    }
    return out;
  }

  // c >> times for every key; keys whose count reaches 0 are dropped.
  void halve(int64_t times) {
    std::lock_guard<std::mutex> g(mu_);
    halve_held(times);
  }

  // halve() by a caller that holds the counter (a fused pass halving before it counts). In
  // place, O(slots), no allocation: the slots are walked once from a free one; an entry that
  // reaches 0 is freed, and a later entry of the same run of occupied slots is taken out and
  // put back from its home slot (landing at or before its old slot, within the slots already
  // walked), so no freed slot cuts a probe path short. Entries of runs with nothing freed
  // before them only have their count shifted.
  void halve_held(int64_t times) {
    const int s = static_cast<int>(std::min<int64_t>(times, 63));
    if (s == 0) return;
    size_t start = 0;
    while (slots_[start].count >= 0) ++start;  // load <= 1/2: a free slot exists
    bool freed = false;                         // a slot of the current run was freed
    for (size_t n = 1; n <= mask_; ++n) {
      Entry& e = slots_[(start + n) & mask_];
      if (e.count < 0) {  // free before the walk: the run ends
        freed = false;
        continue;
      }
      const int64_t c = e.count >> s;
      if (c > 0 && !freed) {
        e.count = c;
        continue;
      }
      e.count = -1;
      --size_;
      freed = true;
      if (c > 0) add(e.key, c);
    }
  }

  // Keeps the max_keys hottest keys (ties: the smaller key) once more than 2 × max_keys are
  // held, in one hold of the counter (keys counted meanwhile by other callers wait, not
  // lost); returns the keys held after.
  int64_t trim(int64_t max_keys) {
    std::lock_guard<std::mutex> g(mu_);
    if (size_ <= 2 * max_keys) return size_;
    std::vector<std::pair<int64_t, int64_t>> all = entries();
    const auto hotter = [](const std::pair<int64_t, int64_t>& a,
                           const std::pair<int64_t, int64_t>& b) {
      return a.second != b.second ? a.second > b.second : a.first < b.first;
    };
    std::nth_element(all.begin(), all.begin() + max_keys, all.end(), hotter);
    all.resize(max_keys);
    reset(all);
    return size_;
  }

  // {keys (k,) ascending, counts (k,)}.
  std::vector<at::Tensor> items() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::pair<int64_t, int64_t>> all = entries();
    std::sort(all.begin(), all.end());
    auto k = at::empty({static_cast<int64_t>(all.size())}, at::kLong);
    auto c = at::empty({static_cast<int64_t>(all.size())}, at::kLong);
    for (size_t i = 0; i < all.size(); ++i) {
      k.data_ptr<int64_t>()[i] = all[i].first;
      c.data_ptr<int64_t>()[i] = all[i].second;
    }
    return {k, c};
  }

  int64_t size() {
    std::lock_guard<std::mutex> g(mu_);
    return size_;
  }

  // Entries the map has room for (its memory: 16 bytes each).
  int64_t capacity() {
    std::lock_guard<std::mutex> g(mu_);
    return static_cast<int64_t>(slots_.size());
  }

  // For a caller that counts keys inside its own pass (cache_gather): hold() the counter for
  // the pass (halve_held() first where an aging falls in it), then per key
  // prefetch_entry(mix64(key)) a few keys ahead of add_hashed(key, mix64(key), weight()) (a
  // prefetch is a hint: a growth in between only makes it miss).
  std::unique_lock<std::mutex> hold() { return std::unique_lock<std::mutex>(mu_); }
  void prefetch_entry(uint64_t h) const { __builtin_prefetch(&slots_[h & mask_], 1, 3); }

  // add with the key's mix64 already computed; a new key that would take the load past 1/2
  // doubles the map first
  void add_hashed(int64_t key, uint64_t h, int64_t c) {
    for (size_t s = h & mask_;; s = (s + 1) & mask_) {
      Entry& e = slots_[s];
      if (e.count < 0) {
        if (static_cast<size_t>(size_ + 1) * 2 > slots_.size()) {
          reserve(size_ + 1);
          add_hashed(key, h, c);
          return;
        }
        e.key = key;
        e.count = c;
        ++size_;
        return;
      }
      if (e.key == key) {
        e.count += c;
        return;
      }
    }
  }

 private:
  struct Entry {
    int64_t key;
    int64_t count;  // -1: free
  };

  size_t slot_of(int64_t key) const { return mix64(key) & mask_; }

  int64_t find(int64_t key) const {
    for (size_t s = slot_of(key);; s = (s + 1) & mask_) {
      if (slots_[s].count < 0) return -1;
      if (slots_[s].key == key) return static_cast<int64_t>(s);
    }
  }

  void add(int64_t key, int64_t c) { add_hashed(key, mix64(key), c); }

  std::vector<std::pair<int64_t, int64_t>> entries() const {
    std::vector<std::pair<int64_t, int64_t>> all;
    all.reserve(size_);
    for (const Entry& e : slots_)
      if (e.count >= 0) all.emplace_back(e.key, e.count);
    return all;
  }

  void reserve(int64_t want) {
    if (static_cast<size_t>(want) * 2 <= slots_.size()) return;
    size_t cap = slots_.size();
    while (static_cast<size_t>(want) * 2 > cap) cap *= 2;
    const auto all = entries();
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
    slots_.assign(cap, Entry{0, -1});
    mask_ = cap - 1;
    size_ = 0;
  }

  std::mutex mu_;
  std::vector<Entry> slots_;
  size_t mask_ = 0;
  int64_t size_ = 0;
  int64_t weight_ = 1;  // what an occurrence adds
};

// Counts every table's keys into its counter (keys < 0 skipped), tables in parallel.
inline void count_keys(const std::vector<KeyCounter*>& counters, const std::vector<at::Tensor>& keys) {
  check(counters.size() == keys.size(), "one counter per table expected");
  at::parallel_for(0, static_cast<int64_t>(keys.size()), 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) counters[i]->update(keys[i], at::Tensor(), true);
  });
}

}  // namespace hps_cpu
