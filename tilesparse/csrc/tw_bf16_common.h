// Shared pieces of the two bf16 TW kernels that compute Yᵀ per block of batch rows with fp32
// accumulation: tw_linear_amx.cpp (AMX tiles) and tw_linear_bf16.cpp (AVX512-BF16 VDPBF16PS).
//
// Both work on one block of BM = 64 rows of Y at a time (one thread per block, except the
// AVX512-BF16 kernel's small-batch split of a block's columns between threads):
//   1. transpose_block_bf16: rows m0..m0+mcur of X (M × K bf16) → xblk (K × BM, K-major), so a
//      kept row of a tile is BM contiguous bf16 values;
//   2. the tile products land as fp32 columns of Y in an n-major staging block
//      ystage[N][BM] (columns no tile writes hold zeros);
//   3. store_block_bf16: bias added, rounded to bf16 (nearest even; a subnormal result is
//      flushed to zero by VCVTNE2PS2BF16), transposed back into the rows of Y.
// Only compiled where the compiler targets AVX512-BF16 (and so AVX512-BW).
#pragma once

#include "tw_common.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TILESPARSE_BF16_BLOCK 1

namespace tilesparse_cpu {

constexpr int64_t BM = 64;  // rows of Y per bf16 work item (4 vectors of 16 fp32 lanes)

// Rows m0..m0+mcur of X (M × K bf16, row-major) → dst (K × BM, K-major), zero past mcur.
//
// Per half block of 32 batch rows: rows 2i and 2i+1 are read whole, side by side, and
// interleaved into 32-bit words w[i][k] = (x[2i][k], x[2i+1][k]) (one unpack pair and two lane
// permutes per 64 values); the 16 × K word matrix w, transposed in 16 × 16 register blocks, is
// then exactly the K-major block: row k holds w[0][k] … w[15][k] = batch rows 0 … 31 in
// order. Reading two rows at a time keeps the loads in streams the hardware prefetcher
// follows (column blocks of all 64 rows at once left the loads waiting on memory: half the
// time of the tile products at 4096 × 512 → 256, 75 %), and the shuffles are a third of
// widening to fp32 and transposing floats. `words` is scratch of transpose_words(K) words.
//
// The row stride of w is padded by one cache line: with K a power of two the 16 rows a 16 × 16
// transpose reads would sit in one L1 set.
inline int64_t transpose_ldw(int64_t K) { return (K + 15) / 16 * 16 + 16; }
inline int64_t transpose_words(int64_t K) { return 16 * transpose_ldw(K); }

inline void transpose_block_bf16(const uint16_t* X, int64_t K, int64_t m0, int64_t mcur, uint16_t* dst,
                                 uint32_t* words) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const int64_t kpad = (K + 15) / 16 * 16, ldw = transpose_ldw(K);
  alignas(64) uint32_t tail[16 * 16];  // result rows of a partial k block
  for (int64_t r0 = 0; r0 < BM; r0 += 32) {
    if (r0 >= mcur) {  // a half block past the batch: zeros
      for (int64_t k = 0; k < K; ++k) std::memset(dst + k * BM + r0, 0, 32 * sizeof(uint16_t));
      continue;
    }
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t ra = r0 + 2 * i, rb = ra + 1;
      const uint16_t* xa = ra < mcur ? X + (m0 + ra) * K : nullptr;
      const uint16_t* xb = rb < mcur ? X + (m0 + rb) * K : nullptr;
      uint32_t* w = words + i * ldw;
      for (int64_t k0 = 0; k0 < kpad; k0 += 32) {
        const int64_t kn = std::min<int64_t>(32, K - k0);
        const __mmask32 km = kn >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << kn) - 1u);
        const __m512i a = xa ? _mm512_maskz_loadu_epi16(km, xa + k0) : zero;
        const __m512i b = xb ? _mm512_maskz_loadu_epi16(km, xb + k0) : zero;
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        _mm512_storeu_si512(w + k0, _mm512_permutex2var_epi64(lo, first, hi));
        if (k0 + 16 < kpad) _mm512_storeu_si512(w + k0 + 16, _mm512_permutex2var_epi64(lo, second, hi));
      }
    }
    // result row k (16 words = batch rows r0 .. r0+31) goes to dst + k * BM + r0
    const float* wf = reinterpret_cast<const float*>(words);
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      if (k0 + 16 <= K) {
        transpose16(wf + k0, ldw, reinterpret_cast<float*>(dst + k0 * BM + r0), BM / 2);
      } else {
        transpose16(wf + k0, ldw, reinterpret_cast<float*>(tail), 16);
        for (int64_t k = k0; k < K; ++k)
          std::memcpy(dst + k * BM + r0, tail + (k - k0) * 16, 16 * sizeof(uint32_t));
      }
    }
  }
}

// The output columns no tile with kept rows writes (their staging rows must be zeroed per block).
inline std::vector<int64_t> unwritten_columns(const Plan& p) {
  std::vector<uint8_t> written(static_cast<size_t>(p.N), 0);
  for (int64_t t = 0; t < p.T; ++t)
    if (p.row_ptr[t + 1] > p.row_ptr[t])
      for (int64_t j = p.tile_ptr[t]; j < p.tile_ptr[t + 1]; ++j) written[p.col_idx[j]] = 1;
  std::vector<int64_t> out;
  for (int64_t n = 0; n < p.N; ++n)
    if (!written[n]) out.push_back(n);
  return out;
}

// ystage (n-major fp32, rows padded to a multiple of 32 columns, row stride BM) → rows
// 0..mcur of Y (bf16, row stride N, starting at y), bias (N floats) added. Columns go in pairs:
// (n, n+1) rounded to bf16 and interleaved into one 32-bit word per batch row, so one 16 × 16
// word transpose moves 16 rows × 32 columns (half the shuffles of an fp32 one).
// Columns n_begin .. n_end only (n_begin a multiple of 32), when given.
inline void store_block_bf16(const float* ystage, int64_t N, const float* bias, int64_t mcur, uint16_t* y,
                             int64_t n_begin = 0, int64_t n_end = INT64_MAX) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>((i & 1) ? 16 + i / 2 : i / 2);
  const __m512i pair_interleave = _mm512_load_si512(idx);
  alignas(64) float words[16 * 16];
  alignas(64) float tr[16 * 16];
  for (int64_t n0 = n_begin; n0 < std::min(N, n_end); n0 += 32) {
    const int64_t nn = std::min<int64_t>(32, N - n0);
    const __mmask32 nm = nn >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << nn) - 1u);
    for (int64_t r0 = 0; r0 < mcur; r0 += 16) {
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t n = n0 + 2 * j;
        const __m512 a = _mm512_add_ps(_mm512_loadu_ps(ystage + n * BM + r0),
                                       _mm512_set1_ps(n < N ? bias[n] : 0.f));
        const __m512 b = _mm512_add_ps(_mm512_loadu_ps(ystage + (n + 1) * BM + r0),
                                       _mm512_set1_ps(n + 1 < N ? bias[n + 1] : 0.f));
        const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in lanes 0-15, b in 16-31
        _mm512_store_si512(words + j * 16, _mm512_permutexvar_epi16(pair_interleave, ab));
      }
      transpose16(words, 16, tr, 16);  // tr[m][j] = columns n0 + 2j, n0 + 2j + 1 of row m
      const int64_t rn = std::min<int64_t>(16, mcur - r0);
      for (int64_t r = 0; r < rn; ++r)
        _mm512_mask_storeu_epi16(y + (r0 + r) * N + n0, nm, _mm512_load_si512(tr + r * 16));
    }
  }
}

}  // namespace tilesparse_cpu

#endif  // __AVX512BF16__ && __AVX512BW__
