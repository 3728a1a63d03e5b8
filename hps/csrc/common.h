// Helpers shared by the compiled kernels of hps (hps/csrc/fused_lookup.cpp includes them).
#pragma once

#include <ATen/EmptyTensor.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

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
// waits for one to free). kWrite: for writing, as an output row of a bag a few bags ahead,
// whose lines are then held when its sum is stored (bags of a table are written a whole
// sample's row apart, in a buffer larger than the caches, so no hardware prefetcher sees them
// coming; each store would wait for its line).
constexpr int kRead = 0, kWrite = 1;

template <int kRw = kRead>
inline void prefetch_bytes(const void* p, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a & ~uintptr_t{63}; l < a + static_cast<uintptr_t>(n); l += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(l), kRw, 3);
}

// How many bags ahead the static all-hit pass prefetches its output row (prefetch_bytes<kWrite>):
// 26 pooled FP32 tables of dlrm_dcnv2 ÷ 300 over full static caches, the CPU's caches evicted
// before each call, 2 to 4 bags ran 0.03–0.58 ms faster than none (0.33 ms of about 2.3 on
// average, six alternated pairs). (The set-associative pass pools after its probe, and ran no
// faster with it.)
constexpr int64_t kOutAhead = 3;

// Refuse bad arguments (pybind11 raises std::invalid_argument as ValueError). The message is
// a literal or a callable that builds it, so it is built only when the check fails: the checks
// run per table on every call, and building their strings each time would cost 26 tables
// about 20 µs a call, more than the gather of a small batch.
template <class Message>
inline void check(bool ok, const Message& what) {
  if (__builtin_expect(ok, 1)) return;
  if constexpr (std::is_invocable_v<Message>)
    throw std::invalid_argument("hps: " + std::string(what()));
  else
    throw std::invalid_argument("hps: " + std::string(what));
}

// A CPU tensor of `size` and `dtype`, its bytes zeroed where `zero`, allocated without the
// operator dispatcher (at::empty and at::zeros go through it): a call's small result tensors.
// at::zeros of a (26, 5) table took 65 µs of a 26-table call whose code the CPU no longer
// held in its caches, most of it the dispatcher's and the fill's code read back in.
inline at::Tensor cpu_tensor(at::IntArrayRef size, at::ScalarType dtype, bool zero) {
  at::Tensor t = at::detail::empty_cpu(size, dtype, /*pin_memory=*/false, std::nullopt);
  if (zero && t.nbytes() > 0) std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

}  // namespace hps_cpu
