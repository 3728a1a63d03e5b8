// Fused gather-GEMM for the condensed tile-wise (TW) format on CPU.
//
// Y[:, cols_t] = X[:, rows_t] · B_t for every tile t (see tilesparse/format.py).
//
// Why this shape: gathering a tile's K columns out of row-major activations re-reads X once
// per tile with a strided access, which costs more than the multiply. Work items are
// (M block, tile) pairs, M-block major, run with at::parallel_for (torch's thread count).
//
// fp32: a thread transposes its M block of X (mc = 96 rows) into a K-major buffer it keeps
// (K × 96 floats, L2-resident), so a kept row of a tile is 96 contiguous floats. A
// register-blocked AVX-512 micro-kernel (MR × NR = 12 × 32, 24 zmm accumulators) broadcasts
// A straight from those rows through the tile's row list (no gather copy; both cache lines
// of a row's MR floats are prefetched 16 rows ahead) and reads B from the tile's block,
// re-packed per call into contiguous zero-padded 32-wide strips. The last k-block adds the
// bias and writes into Y directly: masked stores where a strip's columns are contiguous,
// AVX-512 scatters where column pruning left gaps. A tile's kept rows are split into k-blocks
// of equal size (≤ KC); pruned output columns are filled with one masked store per 16-column
// group.
//
// Without AVX-512 (AVX2 + FMA, e.g. AMD Zen 3) the same design runs a 6 × 16 micro-kernel
// (12 ymm accumulators; tw_microkernel_avx2.h) on 16-wide strips; the epilogue has no
// scatter, so strips with pruned gaps are stored through a 16-float buffer with scalar
// stores. Measured on an AMD EPYC (Zen 3, 2 threads, 4096³, G=128): 1.51× / 3.08× / 7.69× over
// dense at 50 / 75 / 90 % (the scalar loop of the same shape: 0.65× / 1.48× / 2.75×); perf at
// 50 %: ~90 % of the kernel's samples in the micro-kernel's k loop; ~65 GF/s per core over the
// call (dense torch.matmul: ~80).
// Without AVX2 a scalar C loop of the AVX-512 shape runs (correct, slow). simd() says which.
//
// Memory: scratch buffers are kept per thread and reused, and large outputs come from a pool
// of huge-page buffers (OutputPool): a fresh 64 MiB buffer per call is a new mmap whose every
// page faults and is cleared on first touch: fresh scratch buffers cost 23% of the call at 75%,
// and the output pool is worth 1.5x on the DLRM cross layer 512 → 3456 at batch 4096 (56 MiB
// output).
//
// Measured on the AVX-512 machine (perf, 4096³, 50%, 2 threads): ~83% of cycles in the micro-kernel, ~2% in the
// block transposes, ~1% re-packing B. A hot-loop micro-benchmark put the micro-kernel at
// ~180 GF/s per core with A read through the row list, ~210 GF/s with A packed contiguously;
// packing A costs more than that here because the block's rows come back from L2 per tile.
// Prefetching both lines of every A row, for every strip, gained 4%.
//
// Other dtypes: bf16 on the AMX kernel where the CPU and OS allow it (tw_linear_amx.cpp), else
// on the AVX512-BF16 kernel where the CPU has VDPBF16PS (tw_linear_bf16.cpp); bf16 / fp16
// through this fp32 kernel (widened, then rounded back) where the CPU has no native 16-bit
// GEMM; otherwise, and for fp64, gather per tile and call at::mm (tw_linear_lowp.cpp).
#include "tw_common.h"
#include "tw_microkernel_avx2.h"

namespace tilesparse_cpu {
namespace {


#if defined(TILESPARSE_AVX2)
// AVX2 + FMA without AVX-512: the 6 × 16 micro-kernel and helpers of tw_microkernel_avx2.h.
using avx2::MR;
using avx2::NR;
using avx2::KC;
using avx2::PFD;
using avx2::MC;
using avx2::copy_strip;
using avx2::micro_kernel;
#else
constexpr int64_t MR = 12;   // rows of Y per micro-kernel (broadcast operand)
constexpr int64_t NR = 32;   // columns of Y per micro-kernel: two 16-float vectors
constexpr int64_t KC = 256;  // kept rows per k-block: a B strip of 256 × 32 floats = 32 KiB
constexpr int64_t PFD = 16;  // kept rows ahead that the micro-kernel prefetches A from
constexpr int64_t MC = 96;   // rows of Y per work item (8 micro-panels of MR)

// B strip: dst[k][0:NR] = B[k * ldb + 0 : ncols], columns beyond ncols zero.
void copy_strip(const float* B, int64_t ldb, int64_t kc, int64_t ncols, float* dst) {
#if defined(__AVX512F__)
  const __mmask16 m0 = ncols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32   ? __mmask16(0xFFFF)
                       : ncols <= 16 ? __mmask16(0)
                                     : __mmask16((1u << (ncols - 16)) - 1);
  for (int64_t k = 0; k < kc; ++k) {
    _mm512_storeu_ps(dst + k * NR, _mm512_maskz_loadu_ps(m0, B + k * ldb));
    _mm512_storeu_ps(dst + k * NR + 16, _mm512_maskz_loadu_ps(m1, B + k * ldb + 16));
  }
#else
  for (int64_t k = 0; k < kc; ++k)
    for (int64_t j = 0; j < NR; ++j) dst[k * NR + j] = j < ncols ? B[k * ldb + j] : 0.f;
#endif
}

// C[MR × NR] (+)= A[k][0:MR] · B[k][0:NR] with A[k] = A + arows[k] * lda (a kept row of the
// transposed X block) and B packed contiguous; C row stride ldc, padded. A is prefetched PFD
// rows ahead, both lines its MR floats may span (arows must have kc + PFD entries). With `out`, the result goes into Y
// (bias added, scattered to the kept columns) instead of C.
void micro_kernel(int64_t kc, const float* A, const int64_t* arows, int64_t lda, const float* B,
                  float* C, int64_t ldc, bool accumulate, const Epilogue* out) {
#if defined(__AVX512F__)
  __m512 c[MR][2];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      c[r][0] = _mm512_loadu_ps(C + r * ldc);
      c[r][1] = _mm512_loadu_ps(C + r * ldc + 16);
    } else {
      c[r][0] = _mm512_setzero_ps();
      c[r][1] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    // B streams from L2; fetch it a few k-steps ahead (two lines per step).
    _mm_prefetch(reinterpret_cast<const char*>(B + (k + 24) * NR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(B + (k + 24) * NR + 16), _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(B + k * NR);
    const __m512 b1 = _mm512_loadu_ps(B + k * NR + 16);
    const float* a = A + arows[k] * lda;
    {
      const float* an = A + arows[k + PFD] * lda;
      _mm_prefetch(reinterpret_cast<const char*>(an), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(an + MR - 1), _MM_HINT_T0);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
      c[r][0] = _mm512_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(ar, b1, c[r][1]);
    }
  }
  if (out == nullptr) {
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(C + r * ldc, c[r][0]);
      _mm512_storeu_ps(C + r * ldc + 16, c[r][1]);
    }
    return;
  }
  const __mmask16 m0 = __mmask16(out->lanes & 0xFFFF), m1 = __mmask16(out->lanes >> 16);
  const __m512 bias0 = out->bias ? _mm512_loadu_ps(out->bias) : _mm512_setzero_ps();
  const __m512 bias1 = out->bias ? _mm512_loadu_ps(out->bias + 16) : _mm512_setzero_ps();
  if (out->contiguous) {
    float* y = out->y + out->cols[0];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      if (r >= out->rows) break;
      _mm512_mask_storeu_ps(y + r * out->ldy, m0, _mm512_add_ps(c[r][0], bias0));
      _mm512_mask_storeu_ps(y + r * out->ldy + 16, m1, _mm512_add_ps(c[r][1], bias1));
    }
  } else {
    const __m512i i0 = _mm512_loadu_si512(out->cols), i1 = _mm512_loadu_si512(out->cols + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      if (r >= out->rows) break;
      float* y = out->y + r * out->ldy;
      _mm512_mask_i32scatter_ps(y, m0, i0, _mm512_add_ps(c[r][0], bias0), 4);
      if (m1) _mm512_mask_i32scatter_ps(y, m1, i1, _mm512_add_ps(c[r][1], bias1), 4);
    }
  }
#else
  float c[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r][j] = accumulate ? C[r * ldc + j] : 0.f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) c[r][j] += A[arows[k] * lda + r] * B[k * NR + j];
  if (out == nullptr) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) C[r * ldc + j] = c[r][j];
    return;
  }
  for (int r = 0; r < out->rows; ++r)
    for (int j = 0; j < NR; ++j)
      if (out->lanes >> j & 1u)
        out->y[r * out->ldy + out->cols[j]] = c[r][j] + (out->bias ? out->bias[j] : 0.f);
#endif
}

#endif  // TILESPARSE_AVX2

// Rows m0..m0+mcur of X (M × K row-major) → dst (K × mc, K-major), zero padded past mcur.
// One block is contiguous (mc·K floats), so the gathers of every tile of that block stay in
// L2 without the set conflicts a power-of-two row stride would cause.
void transpose_block(const float* X, int64_t K, int64_t m0, int64_t mcur, int64_t mc, float* dst) {
  // Register-transposed panels of RB rows, each across all of K: RB sequential streams, which
  // the hardware prefetcher follows (k-outer order touched a line of every one of the 96 rows
  // at once and waited on memory: the transposes took 37 % of the micro-kernel's time on
  // 4096 × 512 → 256 at 75 % on a Zen 4).
#if defined(__AVX512F__)
  constexpr int64_t RB = 16;
#elif defined(TILESPARSE_AVX2)
  constexpr int64_t RB = 8;
#else
  constexpr int64_t RB = 0;
#endif
  const int64_t kfull = K / 16 * 16;
  int64_t r = 0;
  if (RB > 0)
    for (; r + RB <= mcur; r += RB)
      for (int64_t k0 = 0; k0 < kfull; k0 += 16) {
#if defined(__AVX512F__)
        transpose16(X + (m0 + r) * K + k0, K, dst + k0 * mc + r, mc);
#elif defined(TILESPARSE_AVX2)
        avx2::transpose8(X + (m0 + r) * K + k0, K, dst + k0 * mc + r, mc);
        avx2::transpose8(X + (m0 + r) * K + k0 + 8, K, dst + (k0 + 8) * mc + r, mc);
#endif
      }
  // rows past the last full panel (all of K), and the K tail of the panels' rows
  for (int64_t rr = 0; rr < mcur; ++rr) {
    const float* src = X + (m0 + rr) * K;
    for (int64_t k = rr < r ? kfull : 0; k < K; ++k) dst[k * mc + rr] = src[k];
  }
  if (mcur < mc)
    for (int64_t k = 0; k < K; ++k) std::memset(dst + k * mc + mcur, 0, sizeof(float) * (mc - mcur));
}

// Per-call tables of the fp32 path: for every NR-wide strip of every tile, its output
// columns (int32, padded with the strip's first column), its bias (zero padded) and lane
// mask; plus the columns no tile keeps.
struct StripTables {
  std::vector<int64_t> first;  // (T+1,): strips of tile t are first[t] .. first[t+1]
  std::vector<int32_t> cols;   // (S·NR,)
  std::vector<float> bias;     // (S·NR,) or empty
  std::vector<uint32_t> lanes; // (S,)
  std::vector<uint8_t> contiguous;  // (S,)
  std::vector<int64_t> pruned; // output columns no tile writes
  // the same columns as 16-column groups: group start and a lane mask of its pruned columns
  std::vector<int64_t> group_start;
  std::vector<uint16_t> group_mask;
};

StripTables make_strips(const Plan& p, const float* bptr) {
  StripTables st;
  st.first.assign(static_cast<size_t>(p.T + 1), 0);
  for (int64_t t = 0; t < p.T; ++t)
    st.first[t + 1] = st.first[t] + (p.tile_ptr[t + 1] - p.tile_ptr[t] + NR - 1) / NR;
  const int64_t S = st.first[p.T];
  st.cols.assign(static_cast<size_t>(S * NR), 0);
  if (bptr) st.bias.assign(static_cast<size_t>(S * NR), 0.f);
  st.lanes.assign(static_cast<size_t>(S), 0);
  st.contiguous.assign(static_cast<size_t>(S), 0);
  std::vector<uint8_t> kept(static_cast<size_t>(p.N), 0);
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t c0 = p.tile_ptr[t], width = p.tile_ptr[t + 1] - c0;
    for (int64_t j = 0; j < width; j += NR) {
      const int64_t s = st.first[t] + j / NR, n = std::min(NR, width - j);
      const int64_t* cols = p.col_idx + c0 + j;
      for (int64_t c = 0; c < NR; ++c) {
        const int64_t col = c < n ? cols[c] : cols[0];
        st.cols[s * NR + c] = static_cast<int32_t>(col);
        if (bptr && c < n) st.bias[s * NR + c] = bptr[col];
      }
      for (int64_t c = 0; c < n; ++c) kept[cols[c]] = 1;
      st.lanes[s] = n >= 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
      st.contiguous[s] = cols[n - 1] - cols[0] == n - 1;
    }
  }
  for (int64_t n = 0; n < p.N; ++n)
    if (!kept[n]) st.pruned.push_back(n);
  for (int64_t g = 0; g < p.N; g += 16) {
    uint32_t m = 0;
    for (int64_t c = g; c < std::min(p.N, g + 16); ++c)
      if (!kept[c]) m |= 1u << (c - g);
    if (m) {
      st.group_start.push_back(g);
      st.group_mask.push_back(static_cast<uint16_t>(m));
    }
  }
  return st;
}

}  // namespace

at::Tensor tw_linear_f32(const at::Tensor& x, const at::Tensor& col_idx,
                         const at::Tensor& tile_ptr, const at::Tensor& row_idx,
                         const at::Tensor& row_ptr, const at::Tensor& values,
                         const at::Tensor& val_ptr, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  TORCH_CHECK(N < (int64_t(1) << 31), "tw_linear_cpu: out_features must be < 2^31, got ", N);
  const Plan p = make_plan(x, col_idx, tile_ptr, row_idx, row_ptr, val_ptr, N);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bptr = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  // Every entry of Y is written exactly once below: kept columns by their tile's epilogue,
  // the rest (pruned columns, tiles without rows) with the bias or zero.
  at::Tensor y = OutputPool::get().empty(p.M, p.N, x.options());
  if (p.M == 0) return y;
  if (p.T == 0) return bptr ? y.copy_(bias_f.reshape({1, p.N}).expand({p.M, p.N})) : y.zero_();
  const StripTables st = make_strips(p, bptr);

  const int64_t mc = std::min(MC, ((p.M + MR - 1) / MR) * MR);
  const int64_t nmb = (p.M + mc - 1) / mc;

  // Every tile's block re-packed once per call as NR-wide strips [strip][k][NR] (zero padded),
  // so a strip is contiguous and stays in L1 while the 8 panels of a work item use it.
  std::vector<int64_t> wp_off(static_cast<size_t>(p.T + 1), 0);
  for (int64_t t = 0; t < p.T; ++t)
    wp_off[t + 1] = wp_off[t] + (p.row_ptr[t + 1] - p.row_ptr[t]) * (st.first[t + 1] - st.first[t]) * NR;
  float* WP = thread_scratch().wpack.reserve(wp_off[p.T]);
  const float* V = values.data_ptr<float>();
  const Plan* pp = &p;
  at::parallel_for(0, p.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t width = pp->tile_ptr[t + 1] - pp->tile_ptr[t];
      const int64_t R = pp->row_ptr[t + 1] - pp->row_ptr[t];
      for (int64_t j = 0; j < width; j += NR)
        copy_strip(V + pp->val_ptr[t] + j, width, R, std::min(NR, width - j),
                   WP + wp_off[t] + (j / NR) * R * NR);
    }
  });
  // Every tile's row list followed by PFD copies of its last row, so the micro-kernel's
  // prefetch PFD rows ahead never reads past the list (and only re-touches a row it needs).
  std::vector<int64_t> prow_off(static_cast<size_t>(p.T + 1), 0);
  for (int64_t t = 0; t < p.T; ++t) prow_off[t + 1] = prow_off[t] + (p.row_ptr[t + 1] - p.row_ptr[t]) + PFD;
  std::vector<int64_t> prow(static_cast<size_t>(prow_off[p.T]), 0);
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t R = p.row_ptr[t + 1] - p.row_ptr[t];
    int64_t* dst = prow.data() + prow_off[t];
    std::copy(p.row_idx + p.row_ptr[t], p.row_idx + p.row_ptr[t + 1], dst);
    std::fill(dst + R, dst + R + PFD, R > 0 ? dst[R - 1] : 0);
  }
  float* Y = y.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  const int64_t ldc = ((p.max_width + NR - 1) / NR) * NR;

  // Work items (M block, tile), M-block major: a thread transposes an M block of X into its
  // own L2-resident buffer when it reaches it (no separate pass over X, no M×K copy in
  // memory), then runs that block's tiles against it.
  at::parallel_for(0, nmb * p.T, 1, [&](int64_t i0, int64_t i1) {
    float* Xblk = thread_scratch().xblk.reserve(pp->K * mc);
    std::vector<float> cbuf(static_cast<size_t>(mc * ldc));
    int64_t have_mb = -1;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t mb = item / pp->T, t = item % pp->T;
      const int64_t m0 = mb * mc, mcur = std::min(mc, pp->M - m0);
      if (mb != have_mb) {
        transpose_block(X, pp->K, m0, mcur, mc, Xblk);
        have_mb = mb;
      }
      if (t == 0 && !st.pruned.empty()) {
        // the columns no tile keeps (exactly one item per M block has t == 0)
#if defined(__AVX512F__)
        // one masked store per 16-column group that holds pruned columns
        const size_t ng = st.group_start.size();
        for (int64_t r = 0; r < mcur; ++r) {
          float* yr = Y + (m0 + r) * pp->N;
          for (size_t q = 0; q < ng; ++q) {
            const int64_t g = st.group_start[q];
            const __mmask16 m = st.group_mask[q];
            const __m512 v = bptr ? _mm512_maskz_loadu_ps(m, bptr + g) : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(yr + g, m, v);
          }
        }
#elif defined(TILESPARSE_AVX2)
        for (int64_t r = 0; r < mcur; ++r)
          avx2::fill_pruned(Y + (m0 + r) * pp->N, st.group_start.data(), st.group_mask.data(),
                            st.group_start.size(), bptr);
#else
        for (int64_t r = 0; r < mcur; ++r) {
          float* yr = Y + (m0 + r) * pp->N;
          for (const int64_t n : st.pruned) yr[n] = bptr ? bptr[n] : 0.f;
        }
#endif
      }
      const int64_t c0 = pp->tile_ptr[t], width = pp->tile_ptr[t + 1] - c0;
      const int64_t* rows = prow.data() + prow_off[t];
      const int64_t R = pp->row_ptr[t + 1] - pp->row_ptr[t];
      if (R == 0) {
        // A tile that kept no rows contributes only its bias.
        const int64_t* cols = pp->col_idx + c0;
        for (int64_t r = 0; r < mcur; ++r) {
          float* yr = Y + (m0 + r) * pp->N;
          for (int64_t j = 0; j < width; ++j) yr[cols[j]] = bptr ? bptr[cols[j]] : 0.f;
        }
        continue;
      }
      const int64_t mpad = ((mcur + MR - 1) / MR) * MR;
      const float* Wt = WP + wp_off[t];
      const int64_t kstep = (R + (R + KC - 1) / KC - 1) / ((R + KC - 1) / KC);
      for (int64_t kb = 0; kb < R; kb += kstep) {
        const int64_t kc = std::min(kstep, R - kb);
        const bool last = kb + kstep >= R;
        for (int64_t i = 0; i < mpad; i += MR) {
          for (int64_t j = 0; j < width; j += NR) {
            const float* Bj = Wt + (j / NR) * R * NR + kb * NR;
            float* C = cbuf.data() + i * ldc + j;
            if (!last) {
              micro_kernel(kc, Xblk + i, rows + kb, mc, Bj, C, ldc, kb > 0, nullptr);
              continue;
            }
            const int64_t s = st.first[t] + j / NR;
            const Epilogue out{Y + (m0 + i) * pp->N, pp->N, st.cols.data() + s * NR,
                               bptr ? st.bias.data() + s * NR : nullptr, std::min(MR, mcur - i),
                               st.lanes[s], st.contiguous[s] != 0};
            micro_kernel(kc, Xblk + i, rows + kb, mc, Bj, C, ldc, kb > 0, &out);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace tilesparse_cpu

using namespace tilesparse_cpu;

at::Tensor tw_linear_cpu(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                         const at::Tensor& row_idx, const at::Tensor& row_ptr,
                         const at::Tensor& values, const at::Tensor& val_ptr,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_cpu_inputs(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
  if (x.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat)
    return tw_linear_f32(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
  if (x.scalar_type() == at::kBFloat16 && amx_available())
    return tw_linear_amx(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
  if (x.scalar_type() == at::kBFloat16 && bf16_dot_available())
    return tw_linear_bf16(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
  if (lowp_via_fp32(x.scalar_type())) {
    c10::optional<at::Tensor> bias32;
    if (bias.has_value()) bias32 = bias->to(at::kFloat);
    return tw_linear_f32(x.to(at::kFloat), col_idx, tile_ptr, row_idx, row_ptr,
                         values.to(at::kFloat).contiguous(), val_ptr, bias32, out_features)
        .to(x.scalar_type());
  }
  return tw_linear_mm(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
}

// Frees the calling thread's scratch buffers; returns the bytes released.
int64_t release_scratch() {
  Scratch& s = thread_scratch();
  const int64_t n = static_cast<int64_t>(s.xt.bytes() + s.wpack.bytes() + s.xblk.bytes());
  s.xt.release();
  s.wpack.release();
  s.xblk.release();
  return n + static_cast<int64_t>(OutputPool::get().clear());
}

bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// The instruction set the fp32 micro-kernel was compiled for.
std::string simd() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(TILESPARSE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tw_linear_cpu", &tw_linear_cpu, "Fused gather-GEMM for the condensed TW format (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("release_scratch", &release_scratch,
        "Free the calling thread's scratch buffers (they grow to the largest call) and the pooled "
        "free output buffers; returns bytes");
  m.def("has_avx512", &has_avx512, "Whether the fp32 micro-kernel was compiled for AVX-512");
  m.def("simd", &simd,
        "The fp32 micro-kernel's instruction set: 'avx512' (12x32), 'avx2' (AVX2+FMA, 6x16) or "
        "'scalar'");
  m.def("lowp_via_fp32", [](const std::string& dtype) {
          TORCH_CHECK(dtype == "bfloat16" || dtype == "float16", "lowp_via_fp32: 'bfloat16' or 'float16', got '", dtype, "'");
          return lowp_via_fp32(dtype == "bfloat16" ? at::kBFloat16 : at::kHalf);
        },
        "Whether that dtype runs through the fp32 kernel (no native 16-bit GEMM on this CPU, or "
        "TILESPARSE_LOWP_FP32=1; bf16 on AMX takes the AMX kernel first)");
  m.def("has_amx", &amx_available,
        "Whether bf16 runs on the AMX kernel (built with AMX, granted by the OS, not disabled)");
  m.def("has_avx512_bf16", &bf16_dot_available,
        "Whether the AVX512-BF16 kernel can run (built with it, the CPU has it, "
        "TILESPARSE_DISABLE_AVX512BF16 unset or 0); bf16 takes it where AMX is off");
  m.def("bf16_kernel", [] {
          return std::string(amx_available() ? "amx"
                             : bf16_dot_available() ? "avx512_bf16"
                             : lowp_via_fp32(at::kBFloat16) ? "fp32"
                                                            : "mm");
        },
        "The kernel a bf16 call takes now: 'amx', 'avx512_bf16', 'fp32' (widened to the fp32 "
        "kernel) or 'mm' (at::mm on gathered panels)");
  m.def("tw_linear_avx512_bf16", &tw_linear_bf16,
        "The AVX512-BF16 kernel itself, whatever the dispatch would pick (tests; x bf16)",
        py::call_guard<py::gil_scoped_release>());
}
