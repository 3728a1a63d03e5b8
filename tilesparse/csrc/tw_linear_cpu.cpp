// Fused gather-GEMM for the condensed tile-wise (TW) format on CPU.
//
// Y[:, cols_t] = X[:, rows_t] · B_t for every tile t (see tilesparse/format.py).
//
// Why this shape: gathering a tile's K columns out of row-major activations re-reads X once
// per tile with a strided access, which costs more than the multiply. Here X is transposed
// ONCE per call into K-major order (XT: K × M), so a kept row of a tile is a contiguous
// M-vector and the per-tile gather becomes a memcpy into a small L1/L2-resident panel. Work
// items are (M block, tile) pairs, run with at::parallel_for (torch's own thread count).
//
// fp32: a register-blocked AVX-512 micro-kernel (MR × NR = 12 × 32, 24 zmm accumulators)
// reads the gathered panel (L1) and the tile's block straight from `values` (L2, row stride
// G_t). Other dtypes (bf16, fp16, fp64): the same gather, then at::mm per work item, so the
// GEMM itself runs in torch's backend (oneDNN/AMX for bf16).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <vector>

#include <sys/mman.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t MR = 12;   // rows of Y per micro-kernel (broadcast operand)
constexpr int64_t NR = 32;   // columns of Y per micro-kernel: two 16-float vectors
constexpr int64_t KC = 256;  // kept rows per panel: A panel 12 × 256 floats = 12 KiB in L1
constexpr int64_t MC = 96;   // rows of Y per work item (8 micro-panels)
constexpr int64_t MC_MM = 256;  // rows per work item on the at::mm path (amortises the call)

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

// Gather kc kept rows of one X block into panels: panel p holds A[k][0:MR] =
// Xblk[rows[k]][p*MR : (p+1)*MR]. A block row (mc floats) is contiguous, so each kept row is
// read once, front to back, and the rows a few steps ahead are prefetched.
void pack_panels(const float* Xblk, int64_t mc, const int64_t* rows, int64_t kc, float* dst) {
  const int64_t np = mc / MR;
  for (int64_t k = 0; k < kc; ++k) {
    const float* src = Xblk + rows[k] * mc;
#if defined(__AVX512F__)
    if (k + 8 < kc) {
      const char* pf = reinterpret_cast<const char*>(Xblk + rows[k + 8] * mc);
      for (int64_t b = 0; b < mc * 4; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
    }
    for (int64_t p = 0; p < np; ++p)
      _mm512_mask_storeu_ps(dst + (p * kc + k) * MR, __mmask16((1u << MR) - 1),
                            _mm512_maskz_loadu_ps(__mmask16((1u << MR) - 1), src + p * MR));
#else
    for (int64_t p = 0; p < np; ++p)
      for (int64_t r = 0; r < MR; ++r) dst[(p * kc + k) * MR + r] = src[p * MR + r];
#endif
  }
}

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

// C[MR × NR] (+)= A[k][MR] · B[k][NR]   (both packed contiguous; C row stride ldc, padded).
void micro_kernel(int64_t kc, const float* A, const float* B, float* C, int64_t ldc,
                  bool accumulate) {
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
    const float* a = A + k * MR;
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
      c[r][0] = _mm512_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(ar, b1, c[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * ldc, c[r][0]);
    _mm512_storeu_ps(C + r * ldc + 16, c[r][1]);
  }
#else
  float c[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r][j] = accumulate ? C[r * ldc + j] : 0.f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) c[r][j] += A[k * MR + r] * B[k * NR + j];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) C[r * ldc + j] = c[r][j];
#endif
}

// A scratch buffer of floats on 2 MiB-aligned memory advised for transparent huge pages: the
// per-tile gathers jump across megabytes of it, and with 4 KiB pages they miss the TLB.
// (Measured here: 90% sparsity 4096³ went from 4.6× to 5.6× over dense with huge pages.)
class HugeBuffer {
 public:
  explicit HugeBuffer(int64_t n) {
    constexpr size_t kAlign = size_t(2) << 20;
    const size_t bytes = ((static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + kAlign - 1) / kAlign) * kAlign;
    ptr_.reset(static_cast<float*>(std::aligned_alloc(kAlign, bytes)));
    TORCH_CHECK(ptr_ != nullptr, "tw_linear_cpu: out of memory allocating ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
    madvise(ptr_.get(), bytes, MADV_HUGEPAGE);  // advisory; failure only costs speed
#endif
  }
  float* data() const { return ptr_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> ptr_;
};

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

Plan make_plan(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
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

// Output with pruned columns already holding bias (or zero); kept columns are overwritten.
at::Tensor init_output(const Plan& p, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       bool bias_fused) {
  if (p.all_cols_kept) return at::empty({p.M, p.N}, x.options());
  if (bias.has_value() && bias_fused)
    // a fresh tensor: for M=1 an expand().contiguous() would alias the caller's bias
    return at::empty({p.M, p.N}, x.options()).copy_(bias->reshape({1, p.N}).expand({p.M, p.N}));
  return at::zeros({p.M, p.N}, x.options());
}

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

// X (M × K row-major) → XTb (nmb × K × mc): block mb holds rows m0..m0+mc of X K-major,
// zero padded past M. A block is contiguous (mc·K floats), so the gathers of every tile of
// that block stay in L2 without the set conflicts a power-of-two row stride would cause.
void block_transpose(const float* X, int64_t M, int64_t K, int64_t mc, float* XTb) {
  const int64_t nmb = (M + mc - 1) / mc;
  at::parallel_for(0, nmb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb) {
      const int64_t m0 = mb * mc, mcur = std::min(mc, M - m0);
      float* dst = XTb + mb * K * mc;
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        const int64_t kn = std::min<int64_t>(16, K - k0);
        int64_t r = 0;
#if defined(__AVX512F__)
        if (kn == 16)
          for (; r + 16 <= mcur; r += 16) transpose16(X + (m0 + r) * K + k0, K, dst + k0 * mc + r, mc);
#endif
        for (; r < mcur; ++r) {
          const float* src = X + (m0 + r) * K + k0;
          for (int64_t j = 0; j < kn; ++j) dst[(k0 + j) * mc + r] = src[j];
        }
        if (mcur < mc)
          for (int64_t j = 0; j < kn; ++j)
            std::memset(dst + (k0 + j) * mc + mcur, 0, sizeof(float) * (mc - mcur));
      }
    }
  });
}

at::Tensor tw_linear_f32(const at::Tensor& x, const at::Tensor& col_idx,
                         const at::Tensor& tile_ptr, const at::Tensor& row_idx,
                         const at::Tensor& row_ptr, const at::Tensor& values,
                         const at::Tensor& val_ptr, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  const Plan p = make_plan(x, col_idx, tile_ptr, row_idx, row_ptr, val_ptr, N);
  at::Tensor y = init_output(p, x, bias, true);
  if (p.M == 0 || p.T == 0) return y;
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bptr = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;

  const int64_t mc = std::min(MC, ((p.M + MR - 1) / MR) * MR);
  const int64_t nmb = (p.M + mc - 1) / mc;
  HugeBuffer xtb(nmb * p.K * mc);
  block_transpose(x.data_ptr<float>(), p.M, p.K, mc, xtb.data());
  const float* XTb = xtb.data();

  // Every tile's block re-packed once per call as NR-wide strips [strip][k][NR] (zero padded),
  // so a strip is contiguous and stays in L1 while all panels of a work item stream past it.
  std::vector<int64_t> wp_off(static_cast<size_t>(p.T + 1), 0);
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t width = p.tile_ptr[t + 1] - p.tile_ptr[t];
    wp_off[t + 1] = wp_off[t] + (p.row_ptr[t + 1] - p.row_ptr[t]) * ((width + NR - 1) / NR) * NR;
  }
  HugeBuffer wpack(wp_off[p.T]);
  float* WP = wpack.data();
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
  float* Y = y.data_ptr<float>();
  const int64_t ldc = ((p.max_width + NR - 1) / NR) * NR;

  at::parallel_for(0, nmb * p.T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> apack(static_cast<size_t>(mc * KC));
    std::vector<float> cbuf(static_cast<size_t>(mc * ldc));
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t mb = item / pp->T, t = item % pp->T;
      const int64_t m0 = mb * mc, mcur = std::min(mc, pp->M - m0);
      const int64_t mpad = ((mcur + MR - 1) / MR) * MR;
      const int64_t c0 = pp->tile_ptr[t], width = pp->tile_ptr[t + 1] - c0;
      const int64_t* rows = pp->row_idx + pp->row_ptr[t];
      const int64_t R = pp->row_ptr[t + 1] - pp->row_ptr[t];
      const int64_t* cols = pp->col_idx + c0;
      if (R == 0) {
        // A tile that kept no rows contributes only its bias.
        for (int64_t r = 0; r < mcur; ++r) {
          float* yr = Y + (m0 + r) * pp->N;
          for (int64_t j = 0; j < width; ++j) yr[cols[j]] = bptr ? bptr[cols[j]] : 0.f;
        }
        continue;
      }
      const float* Xblk = XTb + mb * pp->K * mc;
      const float* Wt = WP + wp_off[t];
      for (int64_t kb = 0; kb < R; kb += KC) {
        const int64_t kc = std::min(KC, R - kb);
        pack_panels(Xblk, mc, rows + kb, kc, apack.data());
        // While this block computes, pull the next one (same tile's next kc rows, or the
        // next tile's first) from L3 into L2, spread over the micro-kernel calls.
        const float* next = nullptr;
        int64_t next_rows = 0, next_R = R;
        if (kb + KC < R) {
          next = Wt + (kb + KC) * NR;
          next_rows = std::min(KC, R - kb - KC);
        } else if (t + 1 < pp->T) {
          next = WP + wp_off[t + 1];
          next_R = pp->row_ptr[t + 2] - pp->row_ptr[t + 1];
          next_rows = std::min(KC, next_R);
        }
        const int64_t npan = mpad / MR;
        for (int64_t i = 0; i < mpad; i += MR) {
          for (int64_t j = 0; j < width; j += NR) {
            const float* Bj = Wt + (j / NR) * R * NR + kb * NR;
            micro_kernel(kc, apack.data() + i * kc, Bj, cbuf.data() + i * ldc + j, ldc, kb > 0);
            if (next != nullptr) {
              // strip j of the next block, part i of npan
              const int64_t part = (next_rows + npan - 1) / npan, r0 = (i / MR) * part;
              const char* pf = reinterpret_cast<const char*>(next + (j / NR) * next_R * NR + r0 * NR);
              const int64_t nb = std::max<int64_t>(0, std::min(part, next_rows - r0)) * NR * 4;
              for (int64_t b = 0; b < nb; b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
            }
          }
        }
      }
      const bool contiguous = cols[width - 1] - cols[0] == width - 1;
      for (int64_t r = 0; r < mcur; ++r) {
        const float* cr = cbuf.data() + r * ldc;
        float* yr = Y + (m0 + r) * pp->N;
        if (contiguous) {
          float* yd = yr + cols[0];
          if (bptr) {
            const float* bd = bptr + cols[0];
            for (int64_t j = 0; j < width; ++j) yd[j] = cr[j] + bd[j];
          } else {
            std::memcpy(yd, cr, sizeof(float) * width);
          }
        } else {
          for (int64_t j = 0; j < width; ++j) yr[cols[j]] = cr[j] + (bptr ? bptr[cols[j]] : 0.f);
        }
      }
    }
  });
  return y;
}

template <typename T>
void gather_rows(const T* XT, int64_t M, const int64_t* rows, int64_t R, int64_t m0,
                 int64_t mcur, T* dst) {
  for (int64_t k = 0; k < R; ++k) std::memcpy(dst + k * mcur, XT + rows[k] * M + m0, sizeof(T) * mcur);
}

at::Tensor tw_linear_mm(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                        const at::Tensor& row_idx, const at::Tensor& row_ptr,
                        const at::Tensor& values, const at::Tensor& val_ptr,
                        const c10::optional<at::Tensor>& bias, int64_t N) {
  const Plan p = make_plan(x, col_idx, tile_ptr, row_idx, row_ptr, val_ptr, N);
  at::Tensor y = init_output(p, x, bias, false);
  if (p.M == 0 || p.T == 0) {
    if (bias.has_value() && p.all_cols_kept == false) y.add_(*bias);
    return y;
  }
  at::Tensor vals = values.to(x.scalar_type()).contiguous();
  at::Tensor xt = x.t().contiguous();
  if (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) {
    xt = at::empty({p.K, p.M}, x.options());
    transpose<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), p.M, p.K,
                        reinterpret_cast<uint16_t*>(xt.data_ptr()));
  }
  const int64_t mc = std::min(MC_MM, p.M);
  const int64_t nmb = (p.M + mc - 1) / mc;
  const Plan* pp = &p;
  const int64_t esz = x.element_size();
  const char* XT = static_cast<const char*>(xt.data_ptr());
  at::parallel_for(0, nmb * p.T, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t mb = item / pp->T, t = item % pp->T;
      const int64_t m0 = mb * mc, mcur = std::min(mc, pp->M - m0);
      const int64_t c0 = pp->tile_ptr[t], width = pp->tile_ptr[t + 1] - c0;
      const int64_t R = pp->row_ptr[t + 1] - pp->row_ptr[t];
      at::Tensor ysub = y.narrow(0, m0, mcur);
      at::Tensor cols = col_idx.narrow(0, c0, width);
      if (R == 0) {
        ysub.index_fill_(1, cols, 0);
        continue;
      }
      const int64_t* rows = pp->row_idx + pp->row_ptr[t];
      at::Tensor a = at::empty({R, mcur}, x.options());
      char* ad = static_cast<char*>(a.data_ptr());
      for (int64_t k = 0; k < R; ++k)
        std::memcpy(ad + k * mcur * esz, XT + (rows[k] * pp->M + m0) * esz, esz * mcur);
      at::Tensor bt = vals.narrow(0, pp->val_ptr[t], R * width).view({R, width});
      at::Tensor c = at::mm(a.t(), bt);
      const int64_t* cp = pp->col_idx + c0;
      if (cp[width - 1] - cp[0] == width - 1)
        ysub.narrow(1, cp[0], width).copy_(c);
      else
        ysub.index_copy_(1, cols, c);
    }
  });
  if (bias.has_value()) y.add_(bias->to(x.scalar_type()));
  return y;
}

}  // namespace

at::Tensor tw_linear_cpu(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                         const at::Tensor& row_idx, const at::Tensor& row_ptr,
                         const at::Tensor& values, const at::Tensor& val_ptr,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "tw_linear_cpu: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(values.is_contiguous(), "tw_linear_cpu: values must be contiguous");
  for (const at::Tensor* t : {&col_idx, &tile_ptr, &row_idx, &row_ptr, &val_ptr})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tw_linear_cpu: index tensors must be contiguous int64");
  if (x.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat)
    return tw_linear_f32(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
  return tw_linear_mm(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features);
}

bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tw_linear_cpu", &tw_linear_cpu, "Fused gather-GEMM for the condensed TW format (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_avx512", &has_avx512, "Whether the fp32 micro-kernel was compiled for AVX-512");
}
