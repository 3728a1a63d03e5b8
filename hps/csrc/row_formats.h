// Row formats of hps (hps.rowformat.RowDtype) read from a cache's storage bytes, dequantized
// to float32: per row (dequant_row, used by the fused pass) and as a gather by slot
// (gather_rows). Included by hps/csrc/fused_lookup.cpp.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"

namespace hps_cpu {

// Row formats (hps.rowformat.RowDtype), read from a cache's storage bytes and dequantized to
// float32. Codes (hps.fused.FORMAT_CODES):
// 0 fp32, 1 fp16, 2 bf16, 3 int8, 4 int4, 5 int2. A quantized row is [scale f16, bias f16,
// q...], value j = scale * q_j + bias with q_j at bits (j % k) * bits of byte 4 + j / k. The
// product of a float16 scale and an integer of <= 8 bits is exact in float32, so this equals
// hps.rowformat.dequantize_rows bit for bit whether or not the compiler fuses the multiply-add.

constexpr int64_t kFp32 = 0, kFp16 = 1, kBf16 = 2, kInt8 = 3, kInt4 = 4, kInt2 = 5;

inline int64_t format_row_bytes(int64_t format, int64_t dim) {
  switch (format) {
    case kFp32: return 4 * dim;
    case kFp16: case kBf16: return 2 * dim;
    case kInt8: return dim + 4;
    case kInt4: return dim % 2 ? -1 : dim / 2 + 4;
    case kInt2: return dim % 4 ? -1 : dim / 4 + 4;
    default: return -1;
  }
}

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// How dequant_row writes dst: kSet dst[d] = row[d]; kAdd dst[d] += row[d]; kZeroAdd
// dst[d] = 0.0f + row[d] (a bag's first row: the float a zeroed dst plus the row gives, -0.0
// turned to +0.0, without first writing and re-reading zeros).
constexpr int kSet = 0, kAdd = 1, kZeroAdd = 2;

// One stored row into dst (see kSet / kAdd / kZeroAdd).
template <int64_t kFormat, int kMode>
inline void dequant_row(const uint8_t* src, int64_t dim, float* dst) {
  if constexpr (kFormat == kFp32) {
    const float* f = reinterpret_cast<const float*>(src);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d)
      dst[d] = kMode == kAdd ? dst[d] + f[d] : kMode == kZeroAdd ? 0.0f + f[d] : f[d];
  } else if constexpr (kFormat == kFp16 || kFormat == kBf16) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
    int64_t d = 0;
#if defined(__F16C__) && defined(__AVX__)
    if constexpr (kFormat == kFp16) {  // 8 at a time (the conversion is exact either way)
      for (; d + 8 <= dim; d += 8) {
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d)));
        if (kMode == kAdd) v = _mm256_add_ps(_mm256_loadu_ps(dst + d), v);
        if (kMode == kZeroAdd) v = _mm256_add_ps(_mm256_setzero_ps(), v);
        _mm256_storeu_ps(dst + d, v);
      }
    }
#endif
    for (; d < dim; ++d) {
      const float v = kFormat == kFp16 ? half_to_float(h[d]) : bf16_to_float(h[d]);
      dst[d] = kMode == kAdd ? dst[d] + v : kMode == kZeroAdd ? 0.0f + v : v;
    }
  } else {
    constexpr int64_t bits = kFormat == kInt8 ? 8 : kFormat == kInt4 ? 4 : 2;
    constexpr int64_t per = 8 / bits;
    constexpr uint32_t mask = (1u << bits) - 1;
    uint16_t sb[2];
    std::memcpy(sb, src, 4);
    const float scale = half_to_float(sb[0]), bias = half_to_float(sb[1]);
    const uint8_t* q = src + 4;
    int64_t d = 0;
#if defined(__AVX2__)
    if constexpr (kFormat == kInt4 || kFormat == kInt2) {
      // 16 values at a time (8 bytes of INT4, 4 of INT2), their fields widened in order to
      // bytes: the loop below computes the same floats, but the compiler does not vectorize
      // its shifts (a 1M × 128 table's INT4 rows read slower than its INT8 rows through it)
      const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(bias);
      for (; d + 16 <= dim; d += 16) {
        __m128i v16;
        if constexpr (kFormat == kInt4) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + d / 2));
          const __m128i m = _mm_set1_epi8(0x0F);
          // value 2k: byte k's low nibble, 2k + 1 its high one
          v16 = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
        } else {
          int32_t word;
          std::memcpy(&word, q + d / 4, 4);
          const __m128i b = _mm_cvtsi32_si128(word);
          const __m128i m = _mm_set1_epi8(0x03);
          const __m128i f0 = _mm_and_si128(b, m), f1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
          const __m128i f2 = _mm_and_si128(_mm_srli_epi16(b, 4), m);
          const __m128i f3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
          // value 4k + m: bits 2m of byte k
          v16 = _mm_unpacklo_epi16(_mm_unpacklo_epi8(f0, f1), _mm_unpacklo_epi8(f2, f3));
        }
        const __m128i halves[2] = {v16, _mm_srli_si128(v16, 8)};
        for (int r = 0; r < 2; ++r) {
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[r]));
          // scale × v is exact in float32 (see above): fused or not, the same float
          __m256 x = _mm256_add_ps(_mm256_mul_ps(vs, v), vb);
          float* o = dst + d + 8 * r;
          if (kMode == kAdd) x = _mm256_add_ps(_mm256_loadu_ps(o), x);
          if (kMode == kZeroAdd) x = _mm256_add_ps(_mm256_setzero_ps(), x);
          _mm256_storeu_ps(o, x);
        }
      }
    }
#endif
#pragma omp simd
    for (int64_t j = d; j < dim; ++j) {
      const uint32_t v = (static_cast<uint32_t>(q[j / per]) >> ((j % per) * bits)) & mask;
      const float x = scale * static_cast<float>(v) + bias;
      dst[j] = kMode == kAdd ? dst[j] + x : kMode == kZeroAdd ? 0.0f + x : x;
    }
  }
}

// Runtime dispatch of dequant_row (for paths off the per-key loop).
inline void dequant_any(int64_t format, const uint8_t* src, int64_t dim, float* dst) {
  switch (format) {
    case kFp32: dequant_row<kFp32, kSet>(src, dim, dst); break;
    case kFp16: dequant_row<kFp16, kSet>(src, dim, dst); break;
    case kBf16: dequant_row<kBf16, kSet>(src, dim, dst); break;
    case kInt8: dequant_row<kInt8, kSet>(src, dim, dst); break;
    case kInt4: dequant_row<kInt4, kSet>(src, dim, dst); break;
    default: dequant_row<kInt2, kSet>(src, dim, dst); break;
  }
}

// Rows a gather_rows thread prefetches ahead of the one it reads (26 pooled tables of
// dlrm_dcnv2 ÷ 300 by slot: 16 ran 5 % faster than 4).
constexpr int64_t kRowsAhead = 16;

// The AVX registers an FP32 bag of dim `dim` is summed in by pool_bag (dims 16, 32, 64, 128),
// 0: row by row through dequant_row (other formats and dims, or no AVX).
template <int64_t kFormat>
inline int bag_vecs(int64_t dim) {
#if defined(__AVX__)
  if (kFormat != kFp32) return 0;
  return dim == 128 || dim == 64 || dim == 32 || dim == 16 ? static_cast<int>(dim / 8) : 0;
#else
  (void)dim;
  return 0;
#endif
}

#if defined(__AVX__)
// One bag of FP32 rows of dim 8 × kVecs summed in kVecs AVX registers from +0.0, key by key in
// order (so the sum equals ((0.0f + r0) + r1) + ..., as dequant_row's kAdd into a zeroed row
// gives), stored once; the output row is never re-read per key.
template <int kVecs>
inline int64_t pool_bag_avx(const uint8_t* storage, int64_t row_bytes, const int64_t* slots,
                            int64_t i0, int64_t h, int64_t end, float* dst) {
  __m256 acc[kVecs];
  for (int r = 0; r < kVecs; ++r) acc[r] = _mm256_setzero_ps();
  int64_t n_valid = 0;
  for (int64_t i = i0; i < i0 + h; ++i) {
    if (i + kRowsAhead < end && slots[i + kRowsAhead] >= 0)
      prefetch_bytes(storage + slots[i + kRowsAhead] * row_bytes, row_bytes);
    const int64_t s = slots[i];
    if (s < 0) continue;
    ++n_valid;
    const float* f = reinterpret_cast<const float*>(storage + s * row_bytes);
    for (int r = 0; r < kVecs; ++r) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(f + 8 * r));
  }
  for (int r = 0; r < kVecs; ++r) _mm256_storeu_ps(dst + 8 * r, acc[r]);
  return n_valid;
}
#endif

// One bag: the rows of slots[i0 .. i0 + h) (slots < 0 skipped) summed in order into dst[0, dim)
// from +0.0, in registers where bag_vecs gives `vecs` > 0, else row by row; rows up to `end`
// (the caller's last key) prefetched kRowsAhead keys ahead. Returns the rows summed.
template <int64_t kFormat>
inline int64_t pool_bag(const uint8_t* storage, int64_t row_bytes, const int64_t* slots,
                        int64_t i0, int64_t h, int64_t end, int64_t dim, int vecs, float* dst) {
#if defined(__AVX__)
  if constexpr (kFormat == kFp32) {
    switch (vecs) {
      case 16: return pool_bag_avx<16>(storage, row_bytes, slots, i0, h, end, dst);
      case 8: return pool_bag_avx<8>(storage, row_bytes, slots, i0, h, end, dst);
      case 4: return pool_bag_avx<4>(storage, row_bytes, slots, i0, h, end, dst);
      case 2: return pool_bag_avx<2>(storage, row_bytes, slots, i0, h, end, dst);
      default: break;
    }
  }
#endif
  (void)vecs;
  std::fill(dst, dst + dim, 0.0f);
  int64_t n_valid = 0;
  for (int64_t i = i0; i < i0 + h; ++i) {
    if (i + kRowsAhead < end && slots[i + kRowsAhead] >= 0)
      prefetch_bytes(storage + slots[i + kRowsAhead] * row_bytes, row_bytes);
    if (slots[i] < 0) continue;
    ++n_valid;
    dequant_row<kFormat, kAdd>(storage + slots[i] * row_bytes, dim, dst);
  }
  return n_valid;
}

// gather_rows: rows of any hps.rowformat.RowDtype read from a cache's storage by slot (see
// dequant_row), rows or bags summed in order (pool_bag).
template <int64_t kFormat>
void gather_rows_of(const uint8_t* storage, int64_t row_bytes, const int64_t* slots, int64_t n,
                    int64_t dim, int64_t hotness, float* out, int64_t out_stride) {
  if (hotness == 0) {
    at::parallel_for(0, n, 2048, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        if (i + kRowsAhead < b && slots[i + kRowsAhead] >= 0)
          prefetch_bytes(storage + slots[i + kRowsAhead] * row_bytes, row_bytes);
        float* dst = out + i * out_stride;
        if (slots[i] < 0)
          std::fill(dst, dst + dim, 0.0f);
        else
          dequant_row<kFormat, kSet>(storage + slots[i] * row_bytes, dim, dst);
      }
    });
    return;
  }
  const int vecs = bag_vecs<kFormat>(dim);
  at::parallel_for(0, n / hotness, std::max<int64_t>(1, 2048 / hotness), [&](int64_t a, int64_t b) {
    for (int64_t bag = a; bag < b; ++bag)
      pool_bag<kFormat>(storage, row_bytes, slots, bag * hotness, hotness, b * hotness, dim, vecs,
                        out + bag * out_stride);
  });
}

// Rows (hotness 0: out row i = row of slots[i], zeros where slots[i] < 0) or bags (hotness h:
// out row b = the rows of slots[b*h .. b*h+h) summed in order, slots < 0 skipped) of storage
// (capacity, row_bytes) uint8 in row format ``format``; out (n or n/h, >= dim) float32 with a
// unit last stride (its rows may be a column block of a wider buffer).
inline void gather_rows(const at::Tensor& storage, const at::Tensor& slots, int64_t format, int64_t dim,
                 at::Tensor out, int64_t hotness) {
  check(storage.scalar_type() == at::kByte && storage.dim() == 2 && storage.is_contiguous(),
        "storage must be (capacity, row_bytes) contiguous uint8");
  const int64_t rb = format_row_bytes(format, dim);
  check(rb > 0, [&] {
    return "row format code " + std::to_string(format) + " with dim " + std::to_string(dim) +
           " is not a row format (codes 0..5; int4 needs an even dim, int2 a multiple of 4)";
  });
  check(storage.size(1) >= rb, [&] {
    return "rows of format " + std::to_string(format) + " and dim " + std::to_string(dim) +
           " need " + std::to_string(rb) + " bytes, storage rows hold " +
           std::to_string(storage.size(1));
  });
  check(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
        "slots must be (n,) contiguous int64");
  const int64_t n = slots.numel();
  check(hotness >= 0 && (hotness == 0 || n % hotness == 0), "slots must be (bags × hotness)");
  const int64_t rows = hotness > 0 ? n / hotness : n;
  check(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == rows &&
            out.size(1) >= dim && out.stride(1) == 1 && out.device().is_cpu(),
        [&] {
          return "out must be a CPU float32 (" + std::to_string(rows) + ", >= " +
                 std::to_string(dim) + ") tensor with unit last stride";
        });
  const int64_t cap = storage.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (sp[i] >= cap || sp[i] < -1)
      throw std::invalid_argument("hps gather_rows: slot " + std::to_string(sp[i]) +
                                  " at position " + std::to_string(i) + " is outside [-1, " +
                                  std::to_string(cap) + ")");
  const uint8_t* st = storage.data_ptr<uint8_t>();
  const int64_t row_bytes = storage.size(1);
  float* o = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  switch (format) {
    case kFp32: gather_rows_of<kFp32>(st, row_bytes, sp, n, dim, hotness, o, os); break;
    case kFp16: gather_rows_of<kFp16>(st, row_bytes, sp, n, dim, hotness, o, os); break;
    case kBf16: gather_rows_of<kBf16>(st, row_bytes, sp, n, dim, hotness, o, os); break;
    case kInt8: gather_rows_of<kInt8>(st, row_bytes, sp, n, dim, hotness, o, os); break;
    case kInt4: gather_rows_of<kInt4>(st, row_bytes, sp, n, dim, hotness, o, os); break;
    default: gather_rows_of<kInt2>(st, row_bytes, sp, n, dim, hotness, o, os); break;
  }
}

}  // namespace hps_cpu
