// Shared pieces of the tilesparse CPU kernels (tw_linear_cpu.cpp: fp32, tw_linear_lowp.cpp:
// bf16/fp16/fp64, tw_linear_amx.cpp / tw_linear_bf16.cpp: bf16 on AMX / AVX512-BF16):
// argument checks, scratch and output memory, the per-call plan of a layout, transposes.
#pragma once

// ATen and the pybind11 casters of at::Tensor are all the kernels use; torch/extension.h
// (the whole C++ frontend) would double the time every compile spends parsing headers.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <sys/mman.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tilesparse_cpu {

// Whether the CPU executes native 16-bit dot products (CPUID, not the compiler's target):
// CPUID.(EAX=7, ECX=0).EDX[23] = AVX512-FP16; CPUID.(EAX=7, ECX=1).EAX[5] = AVX512-BF16.
inline bool cpu_has_native(at::ScalarType t) {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (t == at::kHalf) return (d >> 23) & 1u;
  if (a < 1) return false;  // no sub-leaf 1
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) return false;
  return (a1 >> 5) & 1u;
#else
  (void)t;
  return false;
#endif
}

// Transpose src (rows × cols, row stride lds) into dst (cols × rows, row stride ldd),
// in cache blocks, parallel over column blocks.
template <typename T>
void transpose(const T* src, int64_t rows, int64_t cols, T* dst) {
  constexpr int64_t B = 32;
  const int64_t nb = (cols + B - 1) / B;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int64_t c0 = cb * B, c1 = std::min(cols, c0 + B);
      for (int64_t r0 = 0; r0 < rows; r0 += B) {
        const int64_t r1 = std::min(rows, r0 + B);
        for (int64_t c = c0; c < c1; ++c) {
          T* d = dst + c * rows;
          for (int64_t r = r0; r < r1; ++r) d[r] = src[r * cols + c];
        }
      }
    }
  });
}


// Scratch memory on 2 MiB-aligned pages advised for transparent huge pages: the per-tile
// gathers jump across megabytes of it, and with 4 KiB pages they miss the TLB. (Measured here:
// 90% sparsity 4096³ runs 5.6× over dense with huge pages, 4.6× without.)
//
// The buffers are kept per calling thread and only grow: a fresh allocation per call costs a
// page fault and a kernel page-clear per 2 MiB, which perf showed as 23% of the call at 75%
// (and the faults serialise the two threads on the mm lock). release_scratch() frees them.
class HugeBuffer {
 public:
  HugeBuffer() = default;
  // A pointer to at least n floats, valid until the next reserve() on this buffer.
  float* reserve(int64_t n) {
    const size_t need = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
    if (need > bytes_) {
      constexpr size_t kAlign = size_t(2) << 20;
      const size_t bytes = ((need + kAlign - 1) / kAlign) * kAlign;
      ptr_.reset();
      bytes_ = 0;
      ptr_.reset(static_cast<float*>(std::aligned_alloc(kAlign, bytes)));
      TORCH_CHECK(ptr_ != nullptr, "tw_linear_cpu: out of memory allocating ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
      madvise(ptr_.get(), bytes, MADV_HUGEPAGE);  // advisory; failure only costs speed
#endif
      bytes_ = bytes;
    }
    return ptr_.get();
  }
  void release() {
    ptr_.reset();
    bytes_ = 0;
  }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> ptr_;
  size_t bytes_ = 0;
};

// A thread's scratch: `xt` the per-block buffers of the bf16 kernels (transposed block of X,
// packed pairs, staging), `wpack` packed weights (the calling thread's, shared by all), and on
// the fp32 path `xblk` one M block of X transposed.
struct Scratch {
  HugeBuffer xt, wpack, xblk;
};
inline Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// Ask for transparent huge pages on the 2 MiB-aligned part of a fresh output: a large
// at::empty is a new mmap whose first touch faults once per 4 KiB page otherwise.
inline void advise_huge_pages(void* ptr, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kAlign = uintptr_t(2) << 20;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(ptr) + kAlign - 1) & ~(kAlign - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(kAlign - 1);
  if (e > b + kAlign) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
#endif
}

// Large fp32 outputs come from a pool of huge-page buffers that a tensor's deleter returns
// to: a fresh multi-MiB at::empty is a new mmap, and the kernel clears every page on first
// touch (perf: clear_page 6% of a 4096² call at 50%; dense matmul pays it too). Free buffers
// are kept up to TILESPARSE_OUTPUT_POOL_MB (default 1024; 0 turns the pool off), matched by
// size rounded to 2 MiB; release_scratch() empties the pool.
class OutputPool {
 public:
  static OutputPool& get() {
    static OutputPool* pool = new OutputPool();  // never destroyed: tensors may outlive main
    return *pool;
  }
  static constexpr size_t kMinBytes = size_t(8) << 20;
  static constexpr size_t kAlign = size_t(2) << 20;

  // An (M, N) tensor of options.dtype(); from the pool when it is large and the pool is on.
  at::Tensor empty(int64_t M, int64_t N, const at::TensorOptions& options) {
    const size_t need = static_cast<size_t>(M * N) * options.dtype().itemsize();
    if (need < kMinBytes || cap_ == 0) return at::empty({M, N}, options);
    const size_t bytes = (need + kAlign - 1) / kAlign * kAlign;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        ptr = it->second;
        free_.erase(it);
        free_bytes_ -= bytes;
      }
    }
    if (ptr == nullptr) {
      ptr = std::aligned_alloc(kAlign, bytes);
      if (ptr == nullptr) return at::empty({M, N}, options);
#ifdef MADV_HUGEPAGE
      madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
    }
    return at::from_blob(ptr, {M, N}, [bytes](void* q) { OutputPool::get().put(q, bytes); },
                         options);
  }

  void put(void* ptr, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (free_bytes_ + bytes <= cap_) {
        free_.emplace(bytes, ptr);
        free_bytes_ += bytes;
        return;
      }
    }
    std::free(ptr);
  }

  size_t clear() {
    std::multimap<size_t, void*> gone;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gone.swap(free_);
      n = free_bytes_;
      free_bytes_ = 0;
    }
    for (auto& kv : gone) std::free(kv.second);
    return n;
  }

 private:
  OutputPool() {
    const char* env = std::getenv("TILESPARSE_OUTPUT_POOL_MB");
    const long long mb = env ? std::atoll(env) : 1024;
    cap_ = mb > 0 ? static_cast<size_t>(mb) << 20 : 0;
  }
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  size_t free_bytes_ = 0;
  size_t cap_ = 0;
};

// The argument checks every entry point runs (tilesparse.ops.check_op_inputs validates the
// layout itself, once per index set, before any kernel sees it).
inline void check_cpu_inputs(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                             const at::Tensor& row_idx, const at::Tensor& row_ptr,
                             const at::Tensor& values, const at::Tensor& val_ptr,
                             const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "tw_linear_cpu: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(values.is_contiguous(), "tw_linear_cpu: values must be contiguous");
  for (const at::Tensor* t : {&col_idx, &tile_ptr, &row_idx, &row_ptr, &val_ptr})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tw_linear_cpu: index tensors must be contiguous int64");
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "tw_linear_cpu: bias must have out_features = ", N,
              " entries, got ", bias.has_value() ? bias->numel() : 0);
}

struct Plan {
  int64_t M, K, N, T;
  const int64_t* col_idx;
  const int64_t* tile_ptr;
  const int64_t* row_idx;
  const int64_t* row_ptr;
  const int64_t* val_ptr;
  int64_t max_width;
  bool all_cols_kept;
};

inline Plan make_plan(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
               const at::Tensor& row_idx, const at::Tensor& row_ptr, const at::Tensor& val_ptr,
               int64_t N) {
  Plan p;
  p.M = x.size(0);
  p.K = x.size(1);
  p.N = N;
  p.T = tile_ptr.numel() - 1;
  p.col_idx = col_idx.data_ptr<int64_t>();
  p.tile_ptr = tile_ptr.data_ptr<int64_t>();
  p.row_idx = row_idx.data_ptr<int64_t>();
  p.row_ptr = row_ptr.data_ptr<int64_t>();
  p.val_ptr = val_ptr.data_ptr<int64_t>();
  p.max_width = 0;
  for (int64_t t = 0; t < p.T; ++t)
    p.max_width = std::max(p.max_width, p.tile_ptr[t + 1] - p.tile_ptr[t]);
  p.all_cols_kept = col_idx.numel() == N;
  return p;
}

// Output (advised for huge pages) with pruned columns already holding the bias (or zero);
// kept columns are overwritten.
inline at::Tensor init_output(const Plan& p, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       bool bias_fused) {
  at::Tensor y = at::empty({p.M, p.N}, x.options());
  advise_huge_pages(y.data_ptr(), static_cast<size_t>(p.M * p.N) * y.element_size());
  if (p.all_cols_kept) return y;
  if (bias.has_value() && bias_fused) return y.copy_(bias->reshape({1, p.N}).expand({p.M, p.N}));
  return y.zero_();
}

// fp32 micro-kernels (tw_linear_cpu.cpp, tw_microkernel_avx2.h): where a micro-tile's
// finished C goes: rows 0..rows of Y (row stride ldy, starting at y), columns cols[0..NR) of
// that row (ascending kept columns; lanes past the tile's width are masked off, and the valid
// lanes are a prefix), plus the bias of those columns (zero padded) when there is one.
struct Epilogue {
  float* y;
  int64_t ldy;
  const int32_t* cols;  // NR entries
  const float* bias;    // NR entries or nullptr
  int64_t rows;         // valid rows, 1..MR
  uint32_t lanes;       // valid columns as a bit mask (bit c = column c of the strip)
  bool contiguous;      // cols[c] == cols[0] + c for every valid c
};

#if defined(__AVX512F__)
// dst[j * ldd + i] = src[i * lds + j] for a full 16 × 16 block, in registers.
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4g + c], lane l = column 4l + c of rows 4g .. 4g+3
  for (int g = 0; g < 4; ++g) {
    r[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    r[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    r[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    r[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 vlo = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    const __m512 vhi = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    const __m512 wlo = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 whi = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_ps(dst + (0 + c) * ldd, _mm512_shuffle_f32x4(vlo, wlo, 0x88));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(vlo, wlo, 0xDD));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(vhi, whi, 0x88));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(vhi, whi, 0xDD));
  }
}
#endif

at::Tensor tw_linear_f32(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                         const at::Tensor& row_idx, const at::Tensor& row_ptr,
                         const at::Tensor& values, const at::Tensor& val_ptr,
                         const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor tw_linear_mm(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                        const at::Tensor& row_idx, const at::Tensor& row_ptr,
                        const at::Tensor& values, const at::Tensor& val_ptr,
                        const c10::optional<at::Tensor>& bias, int64_t N);
// bf16 / fp16 through the fp32 kernel where the CPU has no native 16-bit GEMM
// (tw_linear_lowp.cpp; TILESPARSE_LOWP_FP32=1/0 forces it on/off).
bool lowp_via_fp32(at::ScalarType t);

// bf16 on AMX (tw_linear_amx.cpp); amx_available(): built with AMX and the OS grants it
// (TILESPARSE_DISABLE_AMX=1 turns it off).
bool amx_available();
at::Tensor tw_linear_amx(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                         const at::Tensor& row_idx, const at::Tensor& row_ptr,
                         const at::Tensor& values, const at::Tensor& val_ptr,
                         const c10::optional<at::Tensor>& bias, int64_t N);

// bf16 on AVX512-BF16 without AMX (tw_linear_bf16.cpp); bf16_dot_available(): built with
// AVX512-BF16, the CPU has it, and TILESPARSE_DISABLE_AVX512BF16 is unset or 0 (read per call).
bool bf16_dot_available();
at::Tensor tw_linear_bf16(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                          const at::Tensor& row_idx, const at::Tensor& row_ptr,
                          const at::Tensor& values, const at::Tensor& val_ptr,
                          const c10::optional<at::Tensor>& bias, int64_t N);

}  // namespace tilesparse_cpu
