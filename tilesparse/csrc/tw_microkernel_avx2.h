// AVX2 + FMA pieces of the fp32 TW kernel (tw_linear_cpu.cpp), for CPUs without AVX-512:
// a 6 × 16 micro-kernel (12 ymm accumulators, 2 for B, 1 broadcast: the shape of BLIS's
// Haswell sgemm), the B-strip copy, an 8 × 8 register transpose and the pruned-column fill.
// AVX2 has no scatter and no mask registers: contiguous strips end in _mm256_maskstore_ps,
// strips with pruned gaps go through a 16-float buffer and scalar stores.
#pragma once

#include "tw_common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TILESPARSE_AVX2 1
#include <immintrin.h>

namespace tilesparse_cpu {
namespace avx2 {

// Blocking, measured on an AMD EPYC (Zen 3: 32 KiB L1d, 512 KiB L2 per core), 4096³, G=128,
// 2 threads, variants interleaved: KC=128 beat 256 by 3-4 % at 50 % and 75 % (the B strip,
// 8 KiB, and the lines of a panel's A rows, ~11 KiB, both stay in L1) and 64 / 192 / 384 / 512
// were no better; MC 48 / 144, PFD 8 / 32, a software prefetch of B and strip-outer loop order
// were no better or slower. The vector transpose and pruned-column fill below measured within
// noise (±3 %) of the scalar loops on the square at 75 / 90 %; they are kept for the short-N
// layers (DLRM 512 → 256), where the per-call transpose of X weighs more.
constexpr int64_t MR = 6;    // rows of Y per micro-kernel (broadcast operand)
constexpr int64_t NR = 16;   // columns of Y per micro-kernel: two 8-float vectors, one line of B
constexpr int64_t KC = 128;  // kept rows per k-block: a B strip of 128 × 16 floats = 8 KiB
constexpr int64_t PFD = 16;  // kept rows ahead that the micro-kernel prefetches A from
constexpr int64_t MC = 96;   // rows of Y per work item (16 micro-panels of MR)

// Lanes 0..n-1 of an 8-float vector set (for maskstore / maskload), n clamped to 0..8.
inline __m256i lane_mask(int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(8, n)))), iota);
}

// B strip: dst[k][0:NR] = B[k * ldb + 0 : ncols], columns beyond ncols zero.
inline void copy_strip(const float* B, int64_t ldb, int64_t kc, int64_t ncols, float* dst) {
  if (ncols >= NR) {
    for (int64_t k = 0; k < kc; ++k) {
      _mm256_storeu_ps(dst + k * NR, _mm256_loadu_ps(B + k * ldb));
      _mm256_storeu_ps(dst + k * NR + 8, _mm256_loadu_ps(B + k * ldb + 8));
    }
    return;
  }
  const __m256i m0 = lane_mask(ncols), m1 = lane_mask(ncols - 8);
  for (int64_t k = 0; k < kc; ++k) {
    _mm256_storeu_ps(dst + k * NR, _mm256_maskload_ps(B + k * ldb, m0));
    _mm256_storeu_ps(dst + k * NR + 8, _mm256_maskload_ps(B + k * ldb + 8, m1));
  }
}

// C[MR × NR] (+)= A[k][0:MR] · B[k][0:NR] with A[k] = A + arows[k] * lda and B packed
// contiguous (NR floats per k); C row stride ldc. A is prefetched PFD rows ahead (arows must
// have kc + PFD entries). With `out`, the result goes into Y (bias added) instead of C.
inline void micro_kernel(int64_t kc, const float* A, const int64_t* arows, int64_t lda,
                         const float* B, float* C, int64_t ldc, bool accumulate,
                         const Epilogue* out) {
  __m256 c[MR][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      c[r][0] = _mm256_loadu_ps(C + r * ldc);
      c[r][1] = _mm256_loadu_ps(C + r * ldc + 8);
    } else {
      c[r][0] = _mm256_setzero_ps();
      c[r][1] = _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * NR);
    const __m256 b1 = _mm256_loadu_ps(B + k * NR + 8);
    const float* a = A + arows[k] * lda;
    {
      const float* an = A + arows[k + PFD] * lda;
      _mm_prefetch(reinterpret_cast<const char*>(an), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(an + MR - 1), _MM_HINT_T0);
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r);
      c[r][0] = _mm256_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(ar, b1, c[r][1]);
    }
  }
  if (out == nullptr) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(C + r * ldc, c[r][0]);
      _mm256_storeu_ps(C + r * ldc + 8, c[r][1]);
    }
    return;
  }
  const __m256 bias0 = out->bias ? _mm256_loadu_ps(out->bias) : _mm256_setzero_ps();
  const __m256 bias1 = out->bias ? _mm256_loadu_ps(out->bias + 8) : _mm256_setzero_ps();
  // valid lanes are a prefix of the strip (make_strips)
  const int64_t n = __builtin_popcount(out->lanes);
  if (out->contiguous) {
    float* y = out->y + out->cols[0];
    if (n == NR) {
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        if (r >= out->rows) break;
        _mm256_storeu_ps(y + r * out->ldy, _mm256_add_ps(c[r][0], bias0));
        _mm256_storeu_ps(y + r * out->ldy + 8, _mm256_add_ps(c[r][1], bias1));
      }
    } else {
      const __m256i m0 = lane_mask(n), m1 = lane_mask(n - 8);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        if (r >= out->rows) break;
        _mm256_maskstore_ps(y + r * out->ldy, m0, _mm256_add_ps(c[r][0], bias0));
        _mm256_maskstore_ps(y + r * out->ldy + 8, m1, _mm256_add_ps(c[r][1], bias1));
      }
    }
    return;
  }
  // Column pruning left gaps: no scatter on AVX2, so a row goes out through a buffer.
  alignas(32) float row[NR];
  const int32_t* cols = out->cols;
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (r >= out->rows) break;
    _mm256_store_ps(row, _mm256_add_ps(c[r][0], bias0));
    _mm256_store_ps(row + 8, _mm256_add_ps(c[r][1], bias1));
    float* y = out->y + r * out->ldy;
    for (int64_t j = 0; j < n; ++j) y[cols[j]] = row[j];
  }
}

// dst[j * ldd + i] = src[i * lds + j] for a full 8 × 8 block, in registers.
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4g + c], 128-bit lane l = column 4l + c of rows 4g .. 4g+3
  for (int g = 0; g < 2; ++g) {
    r[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    r[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    r[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    r[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(dst + (4 + c) * ldd, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}

// One row of Y: the pruned columns of every 16-column group (group start g, lane mask m of
// its pruned columns) set to the bias, or zero; two masked stores per group.
inline void fill_pruned(float* yr, const int64_t* group_start, const uint16_t* group_mask,
                        size_t ng, const float* bias) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (size_t q = 0; q < ng; ++q) {
    const int64_t g = group_start[q];
    for (int h = 0; h < 2; ++h) {
      const int m = (group_mask[q] >> (8 * h)) & 0xFF;
      if (m == 0) continue;
      const __m256i mv = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(m), bit), bit);
      const __m256 v = bias ? _mm256_maskload_ps(bias + g + 8 * h, mv) : _mm256_setzero_ps();
      _mm256_maskstore_ps(yr + g + 8 * h, mv, v);
    }
  }
}

}  // namespace avx2
}  // namespace tilesparse_cpu
#endif
