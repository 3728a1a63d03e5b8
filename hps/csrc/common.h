// Helpers shared by the compiled kernels of hps (hps/csrc/fused_lookup.cpp includes them).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace hps_cpu {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;  // splitmix64 (Steele et al., 2014)
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;

inline uint64_t mix64(int64_t key) {
  uint64_t z = static_cast<uint64_t>(key) + kGolden;
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// Prefetch the n bytes at p: each 64-byte line they touch once (a 512-byte row on a line
// boundary is 8 prefetches, not 9: with the core's miss buffers full, every prefetch issued
// waits for one to free).
inline void prefetch_bytes(const void* p, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a & ~uintptr_t{63}; l < a + static_cast<uintptr_t>(n); l += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(l), 0, 3);
}

// Prefetch the lines of the n floats at p for writing: an output row of a bag a few bags ahead,
// whose lines are then held when its sum is stored (bags of a table are written a whole
// sample's row apart, in a buffer larger than the caches, so no hardware prefetcher sees them
// coming; each store would wait for its line).
inline void prefetch_for_write(const float* p, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = a + static_cast<uintptr_t>(n) * sizeof(float);
  for (uintptr_t l = a & ~uintptr_t{63}; l < end; l += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(l), 1, 3);
}

// How many bags ahead the static all-hit pass prefetches its output row (prefetch_for_write):
// 26 pooled FP32 tables of dlrm_dcnv2 ÷ 300 over full static caches, the CPU's caches evicted
// before each call, 2 to 4 ran 0.2–0.4 ms (10–15 %) faster than none. (The set-associative
// pass pools after its probe, and ran no faster with it.)
constexpr int64_t kOutAhead = 3;

// Refuse bad arguments (pybind11 raises std::invalid_argument as ValueError).
inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("hps: " + what);
}

}  // namespace hps_cpu
