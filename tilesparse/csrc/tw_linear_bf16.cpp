// bf16 condensed TW GEMM on AVX512-BF16 (VDPBF16PS, fp32 accumulation), for CPUs that have
// the bf16 dot-product instruction but no AMX: AMD Zen 4 / Zen 5, Intel Cooper Lake.
//
// VDPBF16PS adds, per 32-bit lane, the products of two bf16 pairs: c[i] += a[2i]·b[2i] +
// a[2i+1]·b[2i+1]. TW keeps a different set of K rows per tile, so the gathered operand must be
// the one that is re-packed per block anyway; as in the AMX kernel, per tile t
//
//     Y[:, cols_t]ᵀ (width × m)  =  W_tᵀ (width × R)  ·  X[:, rows_t]ᵀ (R × m)
//
// with the vectors along m (batch rows) and W broadcast:
//
//   wpack[t][s][q][NS]  one 32-bit word per (kept-row pair q, column n of strip s) =
//                       (W[2q][s·NS + n], W[2q+1][s·NS + n]); zero past R and past the tile's
//                       width. Packed once per call, for every tile.
//   xpack[q][BM][2]     the tile's kept rows rows_t[2q], rows_t[2q+1] of the K-major block of X,
//                       interleaved per batch row (zero past R). Packed per (block, tile).
//
//   e.g. R = 3 kept rows (5, 9, 12), BM = 4 batch rows, x_k = row k of the K-major block:
//       xpack[0] = x5[0] x9[0] | x5[1] x9[1] | x5[2] x9[2] | x5[3] x9[3]
//       xpack[1] = x12[0] 0    | x12[1] 0    | x12[2] 0    | x12[3] 0
//
// Micro-kernel: NS = 6 output columns × up to 4 vectors of 16 batch rows = 24 zmm accumulators;
// per pair q it loads ≤ 4 xpack vectors, broadcasts 6 wpack words and issues ≤ 24 VDPBF16PS.
// The finished accumulators are the fp32 columns of Y for this block: they go straight into
// the n-major staging block (16 contiguous floats per store, at the kept column's row, so
// pruned-column gaps need no scatter), which store_block_bf16 rounds (nearest even) and writes
// back into Y's rows with the bias (tw_bf16_common.h, shared with the AMX kernel).
//
// Work item = one block of BM = 64 rows of Y and all tiles (one thread owns every column of
// its rows); the block of X is transposed to K-major once per item. With at least twice as
// many threads as blocks (small batches) a block's strips are split between floor(threads /
// blocks) threads instead, each of which transposes the block for itself (see below).
//
// Subnormals: VDPBF16PS flushes subnormal inputs and products to zero and VCVTNE2PS2BF16
// subnormal results (as oneDNN's bf16 GEMM on these CPUs); the fp32 route keeps them.
#include "tw_bf16_common.h"

namespace tilesparse_cpu {

#if defined(TILESPARSE_BF16_BLOCK)
namespace {

constexpr int64_t NS = 6;  // output columns per micro-kernel (broadcast operand)

// CPUID once per process (in a VM each CPUID is a trap to the hypervisor).
bool cpu_has_bf16_dot() {
  static const bool ok = cpu_has_native(at::kBFloat16);
  return ok;
}

// Every tile's W block as strips of NS columns of bf16 pairs (layout above). W is the tile's
// R × width row-major block; `words` is scratch of round_up(width, 32) words. Per pair of rows,
// the two rows are interleaved into words in column order (one unpack pair and two lane
// permutes per 32 columns), then each strip's words are one masked load and store, the load
// masked to the tile's width so a narrow last strip gets zeros (the scalar loop this replaces
// made a call at batch 64, 3456 → 1024, 75 % take 1.5 ms instead of 1.0).
void pack_w(const uint16_t* W, int64_t R, int64_t width, uint32_t* dst, uint32_t* words) {
  const int64_t np = (R + 1) / 2, ns = (width + NS - 1) / NS;
  const __m512i zero = _mm512_setzero_si512();
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const int64_t wpad = (width + 31) / 32 * 32;
  const __mmask16 six = static_cast<__mmask16>((1u << NS) - 1u);
  for (int64_t q = 0; q < np; ++q) {
    const uint16_t* lo = W + 2 * q * width;
    const uint16_t* hi = 2 * q + 1 < R ? lo + width : nullptr;
    for (int64_t n0 = 0; n0 < wpad; n0 += 32) {
      const int64_t nn = std::min<int64_t>(32, width - n0);
      const __mmask32 m = nn >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << nn) - 1u);
      const __m512i a = _mm512_maskz_loadu_epi16(m, lo + n0);
      const __m512i b = hi ? _mm512_maskz_loadu_epi16(m, hi + n0) : zero;
      const __m512i l = _mm512_unpacklo_epi16(a, b), h = _mm512_unpackhi_epi16(a, b);
      _mm512_storeu_si512(words + n0, _mm512_permutex2var_epi64(l, first, h));
      _mm512_storeu_si512(words + n0 + 16, _mm512_permutex2var_epi64(l, second, h));
    }
    for (int64_t s = 0; s < ns; ++s) {
      const int64_t valid = std::min<int64_t>(NS, width - s * NS);
      const __mmask16 in = static_cast<__mmask16>((1u << valid) - 1u);
      _mm512_mask_storeu_epi32(dst + (s * np + q) * NS, six, _mm512_maskz_loadu_epi32(in, words + s * NS));
    }
  }
}

// The tile's kept rows of the K-major block, interleaved in pairs: dst[q][m][e] =
// xblk[rows[2q + e]][m] (zero past R).
void pack_x(const uint16_t* xblk, const int64_t* rows, int64_t R, uint16_t* dst) {
  const __m512i zero = _mm512_setzero_si512();
  // 64-bit lanes of the (lo, hi) unpacks → batch rows 0..15 and 16..31 in order
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t q = 0; 2 * q < R; ++q) {
    const uint16_t* x0 = xblk + rows[2 * q] * BM;
    const uint16_t* x1 = 2 * q + 1 < R ? xblk + rows[2 * q + 1] * BM : nullptr;
    uint16_t* d = dst + q * BM * 2;
    for (int64_t mo = 0; mo < BM / 32; ++mo) {
      const __m512i a = _mm512_loadu_si512(x0 + mo * 32);
      const __m512i b = x1 ? _mm512_loadu_si512(x1 + mo * 32) : zero;
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      _mm512_storeu_si512(d + mo * 64, _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_storeu_si512(d + mo * 64 + 32, _mm512_permutex2var_epi64(lo, second, hi));
    }
  }
}

// wpack lives in a scratch buffer that also holds the fp32 kernel's floats
typedef uint32_t __attribute__((__may_alias__)) word_alias;

// dst[i][0 : 16·MV] = Σ_q w[q][i] · x[q][0 : 16·MV] for the NS columns of one strip (w: its
// np × NS words, x: np × BM pairs); dst[i] is the column's staging row.

template <int MV>
void strip_kernel(int64_t np, const word_alias* w, const uint16_t* x, float* const* dst) {
  __m512 c[NS][MV];
#pragma GCC unroll 6
  for (int i = 0; i < NS; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) c[i][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < np; ++q) {
    const uint16_t* xq = x + q * BM * 2;
    __m512bh b[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(xq + v * 32);
    const word_alias* wq = w + q * NS;
#pragma GCC unroll 6
    for (int i = 0; i < NS; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(wq[i]));
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) c[i][v] = _mm512_dpbf16_ps(c[i][v], a, b[v]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < NS; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(dst[i] + 16 * v, c[i][v]);
}

void run_strip(int mv, int64_t np, const word_alias* w, const uint16_t* x, float* const* dst) {
  switch (mv) {
    case 1: return strip_kernel<1>(np, w, x, dst);
    case 2: return strip_kernel<2>(np, w, x, dst);
    case 3: return strip_kernel<3>(np, w, x, dst);
    default: return strip_kernel<4>(np, w, x, dst);
  }
}

}  // namespace
#endif  // TILESPARSE_BF16_BLOCK

bool bf16_dot_available() {
#if defined(TILESPARSE_BF16_BLOCK)
  const char* off = std::getenv("TILESPARSE_DISABLE_AVX512BF16");
  if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
  return cpu_has_bf16_dot();  // a build cached from another CPU must not SIGILL
#else
  return false;
#endif
}

at::Tensor tw_linear_bf16(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                          const at::Tensor& row_idx, const at::Tensor& row_ptr,
                          const at::Tensor& values, const at::Tensor& val_ptr,
                          const c10::optional<at::Tensor>& bias, int64_t N) {
#if defined(TILESPARSE_BF16_BLOCK)
  check_cpu_inputs(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, N);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "tw_linear_bf16: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(cpu_has_bf16_dot(), "tw_linear_bf16: this CPU has no AVX512-BF16");
  const Plan p = make_plan(x, col_idx, tile_ptr, row_idx, row_ptr, val_ptr, N);
  at::Tensor y = OutputPool::get().empty(p.M, p.N, x.options());
  if (p.M == 0) return y;
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous()
                                             : at::zeros({p.N}, x.options().dtype(at::kFloat));
  const float* bptr = bias_f.data_ptr<float>();
  const at::Tensor vals = values.to(at::kBFloat16).contiguous();
  const uint16_t* V = reinterpret_cast<const uint16_t*>(vals.data_ptr());
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr());

  // wpack offsets (in words) of every tile; the longest pair list sizes a thread's xpack
  std::vector<int64_t> w_off(static_cast<size_t>(p.T + 1), 0);
  int64_t max_np = 1;
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t np = (p.row_ptr[t + 1] - p.row_ptr[t] + 1) / 2;
    const int64_t ns = (p.tile_ptr[t + 1] - p.tile_ptr[t] + NS - 1) / NS;
    w_off[t + 1] = w_off[t] + ns * np * NS;
    max_np = std::max(max_np, np);
  }
  const std::vector<int64_t> unwritten = unwritten_columns(p);
  uint32_t* wpack = reinterpret_cast<uint32_t*>(thread_scratch().wpack.reserve(w_off[p.T] + 16));
  const Plan* pp = &p;
  at::parallel_for(0, p.T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> words(static_cast<size_t>((pp->max_width + 31) / 32 * 32));
    for (int64_t t = t0; t < t1; ++t)
      pack_w(V + pp->val_ptr[t], pp->row_ptr[t + 1] - pp->row_ptr[t],
             pp->tile_ptr[t + 1] - pp->tile_ptr[t], wpack + w_off[t], words.data());
  });
  const int64_t nmb = (p.M + BM - 1) / BM;
  const int64_t nstage = (p.N + 31) / 32 * 32;  // staging rows, padded for store_block_bf16
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr());

  // The micro-kernel calls of one block, (tile, strip), tiles with rows only; work[i] = pairs
  // before call i (its cost is proportional to its pairs).
  std::vector<std::pair<int64_t, int64_t>> calls;
  std::vector<int64_t> work{0};
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t np = (p.row_ptr[t + 1] - p.row_ptr[t] + 1) / 2;
    if (np == 0) continue;
    for (int64_t st = 0; st * NS < p.tile_ptr[t + 1] - p.tile_ptr[t]; ++st) {
      calls.emplace_back(t, st);
      work.push_back(work.back() + np);
    }
  }
  const int64_t strips = static_cast<int64_t>(calls.size());
  // At least twice as many threads as blocks (a small batch, where one thread per block would
  // leave threads idle: 3 threads on 2 blocks): a block's calls are cut into `nchunk` chunks of
  // about equal work that threads run side by side, each into its columns of one staging block
  // per M block shared by all; the stores into Y follow in a second parallel pass over
  // 32-column groups. Otherwise one thread runs a whole block and stores it at once.
  const int64_t nthreads = at::get_num_threads();
  // (at::parallel_for hands each thread a contiguous run of items: floor keeps the runs equal)
  const int64_t nchunk = strips == 0 ? 1 : std::max<int64_t>(1, std::min(strips, nthreads / nmb));
  std::vector<int64_t> chunk_first(static_cast<size_t>(nchunk + 1), strips);
  for (int64_t c = 0; c < nchunk; ++c)
    chunk_first[c] = std::lower_bound(work.begin(), work.end() - 1, work.back() * c / nchunk) - work.begin();
  at::Tensor shared;
  if (nchunk > 1) {
    shared = at::empty({nmb * nstage * BM}, x.options().dtype(at::kFloat));
    for (int64_t mb = 0; mb < nmb; ++mb)  // the padding rows store_block_bf16 reads
      std::fill(shared.data_ptr<float>() + (mb * nstage + p.N) * BM,
                shared.data_ptr<float>() + (mb + 1) * nstage * BM, 0.f);
  }
  float* const shared_stage = nchunk > 1 ? shared.data_ptr<float>() : nullptr;

  at::parallel_for(0, nmb * nchunk, 1, [&](int64_t i0, int64_t i1) {
    // the per-thread buffers share one allocation (float units): xblk, xpack, ystage, junk,
    // transpose words
    const int64_t xblk_f = (pp->K * BM + 1) / 2, xpack_f = max_np * BM;
    const int64_t words_f = transpose_words(pp->K);
    float* base = thread_scratch().xt.reserve(xblk_f + xpack_f + (nstage + 1) * BM + words_f + 16);
    uint16_t* xblk = reinterpret_cast<uint16_t*>(base);
    uint16_t* xpack = reinterpret_cast<uint16_t*>(base + xblk_f);
    float* const own_stage = base + xblk_f + xpack_f;
    float* junk = own_stage + nstage * BM;  // the staging row of a strip's padded columns
    uint32_t* words = reinterpret_cast<uint32_t*>(junk + BM);
    if (nchunk == 1) std::fill(own_stage + pp->N * BM, own_stage + nstage * BM, 0.f);
    float* dst[NS];
    int64_t have_mb = -1;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t mb = item / nchunk, chunk = item % nchunk;
      const int64_t m0 = mb * BM, mcur = std::min(BM, pp->M - m0);
      const int mv = static_cast<int>((mcur + 15) / 16);
      float* ystage = nchunk == 1 ? own_stage : shared_stage + mb * nstage * BM;
      if (mb != have_mb) transpose_block_bf16(X, pp->K, m0, mcur, xblk, words);
      have_mb = mb;
      if (chunk == 0)
        for (const int64_t n : unwritten) std::fill(ystage + n * BM, ystage + (n + 1) * BM, 0.f);
      // The next block's rows of X (one contiguous range) are prefetched into L2 a few lines
      // after each strip, so its transpose does not wait on memory (with X out of cache the
      // transpose took half the time of the products at 4096 × 512 → 256, 75 %).
      const char* const pf_base = reinterpret_cast<const char*>(X + (m0 + BM) * pp->K);
      int64_t pf = 0, pf_bytes = 0;  // byte offsets into the next block's rows
      if (nchunk == 1 && item + 1 < i1) pf_bytes = (std::min(pp->M, m0 + 2 * BM) - (m0 + BM)) * pp->K * 2;
      const int64_t pf_step = strips > 0 ? (pf_bytes / 64 + strips - 1) / strips * 64 : 0;
      int64_t packed = -1;  // the tile whose pairs are in xpack
      for (int64_t ci = chunk_first[chunk]; ci < chunk_first[chunk + 1]; ++ci) {
        const auto [t, st] = calls[ci];
        const int64_t R = pp->row_ptr[t + 1] - pp->row_ptr[t];
        const int64_t c0 = pp->tile_ptr[t], width = pp->tile_ptr[t + 1] - c0, np = (R + 1) / 2;
        if (t != packed) pack_x(xblk, pp->row_idx + pp->row_ptr[t], R, xpack);
        packed = t;
        for (int64_t i = 0; i < NS; ++i) {
          const int64_t n = st * NS + i;
          dst[i] = n < width ? ystage + pp->col_idx[c0 + n] * BM : junk;
        }
        run_strip(mv, np, wpack + w_off[t] + st * np * NS, xpack, dst);
        for (const int64_t e = std::min(pf + pf_step, pf_bytes); pf < e; pf += 64) _mm_prefetch(pf_base + pf, _MM_HINT_T1);
      }
      if (nchunk == 1) store_block_bf16(ystage, pp->N, bptr, mcur, Y + m0 * pp->N);
    }
  });
  if (nchunk > 1) {
    const int64_t ngroups = nstage / 32;
    at::parallel_for(0, nmb * ngroups, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t mb = item / ngroups, n0 = (item % ngroups) * 32;
        store_block_bf16(shared_stage + mb * nstage * BM, pp->N, bptr, std::min(BM, pp->M - mb * BM),
                         Y + mb * BM * pp->N, n0, n0 + 32);
      }
    });
  }
  return y;
#else
  (void)col_idx, (void)tile_ptr, (void)row_idx, (void)row_ptr, (void)values, (void)val_ptr;
  (void)bias, (void)N;
  TORCH_CHECK(false, "tw_linear_cpu: this build has no AVX512-BF16 kernel (got ", x.scalar_type(), ")");
#endif
}

}  // namespace tilesparse_cpu
