// The arrays of the caches one fused call reads (cache_gather, fused_lookup.cpp), held and
// checked once: hps.fused.CompiledTables builds one per list of caches and keeps it while no
// cache replaces an array (hps.storage.cache.layout), so that a call converts and checks only
// its keys and its per-query values. Per call, converting seven lists of 26 tensors from
// Python and checking every table takes a 26-table call about 15 µs, and building those lists
// in Python 25-50 µs more (2-core VM).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "gather_checks.h"

namespace hps_cpu {

// Per table: the cache's keys (int32 low words or int64), high words and their nibbles (an
// empty uint8 tensor: none), tags, counters, storage (capacity, row_bytes), dense key index
// (an empty int32 tensor: none); ways, dim and row format code; then the LFU tables gaps
// (128,) int64 and halve (128,) uint8 (hps.storage.cache.slot_counter). The tensors are held
// (a reference each), so they live as long as this object, whatever the caches do.
struct CacheTables {
  // Where one table's arrays lie, read once here: a call builds its tables' views from these
  // records, side by side, rather than following a tensor and its storage object for each of
  // the seven arrays of every table (objects a call finds out of the CPU's caches).
  struct Arrays {
    const void* keys;
    bool key32;
    const int64_t* high_words;
    int64_t n_high_words;
    const uint8_t* high_of;  // null: no nibbles
    const uint8_t* tags;
    uint8_t* counters;
    const uint8_t* storage;
    int64_t capacity;
    const int32_t* dense;  // null: no dense key index
    int64_t n_dense;
  };

  std::vector<at::Tensor> cache_keys, high_words, high_of, tags, counters, storage, dense;
  std::vector<int64_t> ways, dims, formats, row_bytes;
  at::Tensor gaps, halve;
  std::vector<Arrays> arrays;  // per table, of the tensors above (held: the pointers stay valid)
  const int64_t* gaps_p = nullptr;
  const uint8_t* halve_p = nullptr;

  CacheTables(std::vector<at::Tensor> cache_keys_, std::vector<at::Tensor> high_words_,
              std::vector<at::Tensor> high_of_, std::vector<at::Tensor> tags_,
              std::vector<at::Tensor> counters_, std::vector<at::Tensor> storage_,
              std::vector<at::Tensor> dense_, std::vector<int64_t> ways_,
              std::vector<int64_t> dims_, std::vector<int64_t> formats_, at::Tensor gaps_,
              at::Tensor halve_)
      : cache_keys(std::move(cache_keys_)),
        high_words(std::move(high_words_)),
        high_of(std::move(high_of_)),
        tags(std::move(tags_)),
        counters(std::move(counters_)),
        storage(std::move(storage_)),
        dense(std::move(dense_)),
        ways(std::move(ways_)),
        dims(std::move(dims_)),
        formats(std::move(formats_)),
        gaps(std::move(gaps_)),
        halve(std::move(halve_)) {
    const size_t T = cache_keys.size();
    for (const auto* v : {&high_words, &high_of, &tags, &counters, &storage, &dense})
      check(v->size() == T, "one tensor per table expected");
    for (const auto* v : {&ways, &dims, &formats})
      check(v->size() == T, "one value per table expected");
    check(gaps.scalar_type() == at::kLong && gaps.numel() == kMaxLevel + 1 &&
              gaps.is_contiguous() && halve.scalar_type() == at::kByte &&
              halve.numel() == kMaxLevel + 1 && halve.is_contiguous(),
          "gaps must be (128,) int64 and halve (128,) uint8 (hps.storage.cache.slot_counter)");
    row_bytes.resize(T);
    for (size_t i = 0; i < T; ++i) {
      check(ways[i] > 0 && cache_keys[i].numel() % ways[i] == 0, [&] {
        return "table " + std::to_string(i) + ": " + std::to_string(cache_keys[i].numel()) +
               " slots are not whole sets of " + std::to_string(ways[i]) + " ways";
      });
      row_bytes[i] = check_table(i, cache_keys[i], high_words[i], high_of[i], tags[i],
                                 counters[i], storage[i], formats[i], dims[i]);
      check_dense(i, dense[i]);
    }
    arrays.resize(T);
    for (size_t i = 0; i < T; ++i) {
      const bool has_dense = dense[i].numel() > 0;
      arrays[i] = {cache_keys[i].data_ptr(),
                   cache_keys[i].scalar_type() == at::kInt,
                   high_words[i].data_ptr<int64_t>(),
                   high_words[i].numel(),
                   high_of[i].numel() ? high_of[i].data_ptr<uint8_t>() : nullptr,
                   tags[i].data_ptr<uint8_t>(),
                   counters[i].data_ptr<uint8_t>(),
                   storage[i].data_ptr<uint8_t>(),
                   cache_keys[i].numel(),
                   has_dense ? dense[i].data_ptr<int32_t>() : nullptr,
                   has_dense ? dense[i].numel() : 0};
    }
    gaps_p = gaps.data_ptr<int64_t>();
    halve_p = halve.data_ptr<uint8_t>();
  }

  size_t size() const { return cache_keys.size(); }
};

}  // namespace hps_cpu
