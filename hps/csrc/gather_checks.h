// The argument checks of cache_gather (fused_lookup.cpp) and of the cache arrays it reads
// (cache_tables.h): every tensor's dtype, shape and layout, and every key, refused with a
// message naming the bad value before any counter moves.
#pragma once

#include <torch/extension.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "row_formats.h"

namespace hps_cpu {

// A slot counter's largest level (7 bits), hps/storage/cache/slot_counter.py.
constexpr uint8_t kMaxLevel = 127;

// One value per table of T; out a contiguous CPU float32 tensor.
inline void check_gather_args(size_t T, std::initializer_list<const std::vector<int64_t>*> values,
                              const at::Tensor& out) {
  for (const auto* v : values) check(v->size() == T, "one value per table expected");
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
        "out must be a contiguous CPU float32 tensor");
}

// Whether n keys of hotness h (bags: n / h bags), dim dim, fit out (out_n values) at offset
// off: rows at off + r * dim, bags at off + b * stride with off + dim <= stride (a bag's
// values never reach the next bag's, nor another table's). Overflow-safe: no sum or product
// below can exceed out_n.
inline bool out_placed(int64_t n, int64_t h, int64_t dim, int64_t off, int64_t stride,
                       int64_t out_n) {
  if (dim <= 0 || off < 0) return false;
  if (h > 0 && (stride < 0 || off > stride || dim > stride - off)) return false;
  if (n == 0) return true;  // nothing written
  if (off > out_n) return false;
  const int64_t room = out_n - off;
  if (h == 0) return n <= room / dim;
  return dim <= room && n / h - 1 <= (room - dim) / stride;  // stride >= dim > 0
}

// One table's n keys (bags of h when h > 0) and their place in out (out_placed), refused in
// words that start with prefix() (e.g. "table 3: "): "n keys are not bags of hotness h", or
// "its output (offset ..., n keys of dim ...[, hotness h, stride s]) does not fit out of out_n
// values[ (each bag's offset + dim must be <= stride)]".
template <class Prefix>
inline void check_output(const Prefix& prefix, int64_t n, int64_t h, int64_t dim, int64_t off,
                         int64_t stride, int64_t out_n) {
  check(h >= 0 && (h == 0 || n % h == 0), [&] {
    return prefix() + std::to_string(n) + " keys are not bags of hotness " + std::to_string(h);
  });
  check(out_placed(n, h, dim, off, stride, out_n), [&] {
    return prefix() + "its output (offset " + std::to_string(off) + ", " + std::to_string(n) +
           " keys of dim " + std::to_string(dim) +
           (h == 0 ? std::string()
                   : ", hotness " + std::to_string(h) + ", stride " + std::to_string(stride)) +
           ") does not fit out of " + std::to_string(out_n) + " values" +
           (h == 0 ? "" : " (each bag's offset + dim must be <= stride)");
  });
}

// Per table, the keys that count as looked up (bags: not the -1 pads); throws naming the first
// reserved key (rows: INT64_MIN, the empty-slot sentinel; bags: any key < -1). One branchless
// pass per table (the count and the smallest key, which the compiler vectorizes); only a table
// holding a reserved key is read again, for its first position.
inline std::vector<int64_t> valid_keys(const std::vector<at::Tensor>& keys,
                                       const std::vector<int64_t>& hotness) {
  std::vector<int64_t> valid(keys.size(), 0);
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& k = keys[i];
    check(k.scalar_type() == at::kLong && k.is_contiguous(), "keys must be contiguous int64");
    const int64_t* kp = k.data_ptr<int64_t>();
    const int64_t n = k.numel();
    const bool bags = hotness[i] > 0;
    const int64_t lo = bags ? -1 : INT64_MIN + 1;
    int64_t below = 0, lowest = INT64_MAX;
    for (int64_t j = 0; j < n; ++j) {
      below += kp[j] < 0;
      lowest = kp[j] < lowest ? kp[j] : lowest;
    }
    if (lowest < lo) {
      int64_t j = 0;
      while (kp[j] >= lo) ++j;
      throw std::invalid_argument("table " + std::to_string(i) + ": key " +
                                  std::to_string(kp[j]) + " at position " + std::to_string(j) +
                                  (bags ? " (keys are >= 0; -1 pads a short bag)"
                                        : " is reserved (the empty-slot sentinel)"));
    }
    valid[i] = bags ? n - below : n;
  }
  return valid;
}

// One table's cache tensors: int32 low words or int64 keys, counters and tags a byte per slot,
// <= 16 high words with a nibble per slot (none only while at most one high word), storage
// (capacity, row_bytes) of rows wide enough for the format. Returns row_bytes.
inline int64_t check_table(size_t i, const at::Tensor& cache_keys, const at::Tensor& hw,
                           const at::Tensor& ho, const at::Tensor& tags,
                           const at::Tensor& counters, const at::Tensor& storage, int64_t format,
                           int64_t dim) {
  const int64_t need = format_row_bytes(format, dim);
  check(need > 0, [&] {
    return "row format code " + std::to_string(format) + " with dim " + std::to_string(dim) +
           " is not a row format (codes 0..5)";
  });
  const int64_t capacity = cache_keys.numel();
  const auto kt = cache_keys.scalar_type();
  check((kt == at::kInt || kt == at::kLong) && cache_keys.is_contiguous() &&
            counters.scalar_type() == at::kByte && counters.numel() == capacity &&
            counters.is_contiguous() && tags.scalar_type() == at::kByte &&
            tags.numel() == capacity,
        "cache keys must be contiguous int32 or int64, counters and tags uint8, one per slot");
  check(hw.scalar_type() == at::kLong && hw.is_contiguous() && hw.numel() <= 16 &&
            ho.scalar_type() == at::kByte && ho.is_contiguous() &&
            (ho.numel() == 0 || ho.numel() == (capacity + 1) / 2),
        "high words must be (<= 16,) int64 and their nibbles (ceil(capacity / 2),) uint8");
  check(ho.numel() > 0 || hw.numel() <= 1, [&] {
    return "table " + std::to_string(i) + ": " + std::to_string(hw.numel()) +
           " high words but no nibbles: a nibble per slot (ceil(capacity / 2),) uint8 is "
           "needed with more than one high word";
  });
  check(storage.scalar_type() == at::kByte && storage.dim() == 2 &&
            storage.size(0) == capacity && storage.is_contiguous(),
        "storage must be (capacity, row_bytes) contiguous uint8");
  const int64_t row_bytes = storage.size(1);
  check(row_bytes >= need, [&] {
    return "rows of format " + std::to_string(format) + " and dim " + std::to_string(dim) +
           " need " + std::to_string(need) + " bytes, storage rows hold " +
           std::to_string(row_bytes);
  });
  return row_bytes;
}

// One table's dense key index: empty (none), or (bound,) contiguous int32 slots (-1: no slot;
// the pass reads any value outside [0, capacity) as a miss, never follows it).
inline void check_dense(size_t i, const at::Tensor& dense) {
  check(dense.numel() == 0 || (dense.scalar_type() == at::kInt && dense.dim() == 1 &&
                               dense.is_contiguous() && dense.device().is_cpu()),
        [&] {
          return "table " + std::to_string(i) +
                 ": a dense key index must be (bound,) contiguous CPU int32";
        });
}

}  // namespace hps_cpu
