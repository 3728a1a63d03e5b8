// bf16 condensed TW GEMM on Intel AMX (tile registers, TDPBF16PS, fp32 accumulation).
//
// AMX multiplies C[16 × 16] += A[16 × 32] · B[32 × 16] with B in pairs of K ("VNNI": a tile
// row holds 16 columns × 2 consecutive k). TW gathers K per tile, so the roles are swapped to
// keep the gathered operand contiguous: per tile t,
//
//     Y[:, cols_t]ᵀ (width × m)  =  W_tᵀ (width × R)  ·  X[:, rows_t]ᵀ (R × m)
//
//   A = W_tᵀ, re-packed once per call into 16 × 32 blocks      apack[t][nb][kb][16 n][32 k]
//   B = the tile's kept rows of a K-major M block of X, as pairs bpack[kb][mq][16 pairs][16 m][2]
//       (row p of a B tile interleaves kept rows rows_t[2p], rows_t[2p+1]; past R: zeros)
//   C = Yᵀ blocks (16 output columns × 16 batch rows), 2 × 2 of them per step (4 C + 2 A + 2 B
//       of the 8 tile registers).
//
// Work item = one M block of BM rows and all tiles, so one thread owns every column of its
// rows: C blocks go (as 16 contiguous floats per output column) into an n-major fp32 staging
// block ystage[N][BM], which store_block_bf16 rounds and writes back to Y's rows, bias added
// (block transpose, staging and store are shared with tw_linear_bf16.cpp: tw_bf16_common.h).
//
// Built only when the compiler targets AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on
// such a machine); used only when the kernel grants the process AMX state (arch_prctl).
#include "tw_bf16_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(TILESPARSE_BF16_BLOCK)
#define TILESPARSE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tilesparse_cpu {

#if TILESPARSE_AMX
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 × 16 fp32), 4-5: A (16 × 32 bf16), 6-7: B (16 pairs × 16 × 2 bf16).
void load_tile_config() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// The B operand of one tile for the current block: bpack[kb][mq][p][m][e] =
// xblk[rows[32 kb + 2p + e]][16 mq + m], zero past R. Two kept rows of 32 batch rows each are
// interleaved per step (unpack within 128-bit lanes, then a lane permute into m order).
void pack_b(const uint16_t* xblk, const int64_t* rows, int64_t R, int64_t nkb, uint16_t* bpack) {
  const __m512i zero = _mm512_setzero_si512();
  // 64-bit lanes of (lo, hi) unpacks → m 0..15 and m 16..31 in order
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t k0 = kb * 32 + 2 * p, k1 = k0 + 1;
      const uint16_t* x0 = k0 < R ? xblk + rows[k0] * BM : nullptr;
      const uint16_t* x1 = k1 < R ? xblk + rows[k1] * BM : nullptr;
      for (int64_t mo = 0; mo < BM / 32; ++mo) {
        const __m512i a = x0 ? _mm512_loadu_si512(x0 + mo * 32) : zero;
        const __m512i b = x1 ? _mm512_loadu_si512(x1 + mo * 32) : zero;
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
        uint16_t* dst = bpack + ((kb * (BM / 16) + 2 * mo) * 16 + p) * 32;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi64(lo, first, hi));
        _mm512_storeu_si512(dst + 16 * 32, _mm512_permutex2var_epi64(lo, second, hi));
      }
    }
  }
}

// The A operand of one tile: apack[nb][kb][n][k] = W[32 kb + k][16 nb + n] (W = the tile's
// R × width block), zero past R and width; nb runs over an even number of 16-column blocks.
// Each 16 (k) × 16 (n) block goes through an fp32 register transpose.
void pack_a(const uint16_t* W, int64_t R, int64_t width, int64_t nnb, int64_t nkb, uint16_t* apack) {
  alignas(64) float in[16 * 16];
  alignas(64) float out[16 * 16];
  for (int64_t nb = 0; nb < nnb; ++nb) {
    const int64_t n0 = nb * 16, nn = std::max<int64_t>(0, std::min<int64_t>(16, width - n0));
    const __mmask16 nm = static_cast<__mmask16>((1u << nn) - 1u);
    for (int64_t kh = 0; kh < 2 * nkb; ++kh) {  // 16-row halves of the 32-row k-blocks
      const int64_t k0 = kh * 16;
      for (int64_t r = 0; r < 16; ++r) {
        __m512i v = _mm512_setzero_si512();
        if (k0 + r < R && nn > 0)
          v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(nm, W + (k0 + r) * width + n0)), 16);
        _mm512_store_si512(reinterpret_cast<__m512i*>(in + r * 16), v);
      }
      transpose16(in, 16, out, 16);  // out[n][k]
      uint16_t* blk = apack + (nb * nkb + kh / 2) * 512 + (kh % 2) * 16;
      for (int64_t n = 0; n < 16; ++n)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk + n * 32),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_load_si512(out + n * 16), 16)));
    }
  }
}

bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl(ARCH_REQ_XCOMP_PERM, ...)
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_available() {
  static const bool ok = [] {
    const char* off = std::getenv("TILESPARSE_DISABLE_AMX");
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
    return request_amx();
  }();
  return ok;
}

at::Tensor tw_linear_amx(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                         const at::Tensor& row_idx, const at::Tensor& row_ptr,
                         const at::Tensor& values, const at::Tensor& val_ptr,
                         const c10::optional<at::Tensor>& bias, int64_t N) {
  const Plan p = make_plan(x, col_idx, tile_ptr, row_idx, row_ptr, val_ptr, N);
  at::Tensor y = OutputPool::get().empty(p.M, p.N, x.options());
  if (p.M == 0) return y;
  at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::zeros({p.N}, x.options().dtype(at::kFloat));
  const float* bptr = bias_f.data_ptr<float>();
  const at::Tensor vals = values.to(at::kBFloat16).contiguous();
  const uint16_t* V = reinterpret_cast<const uint16_t*>(vals.data_ptr());
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr());

  // A operands of every tile, and the columns no tile with kept rows writes.
  std::vector<int64_t> nkb(p.T), nnb(p.T), a_off(p.T + 1, 0);
  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t R = p.row_ptr[t + 1] - p.row_ptr[t], width = p.tile_ptr[t + 1] - p.tile_ptr[t];
    nkb[t] = (R + 31) / 32;
    nnb[t] = 2 * ((width + 31) / 32);
    a_off[t + 1] = a_off[t] + nnb[t] * nkb[t] * 512;
  }
  const std::vector<int64_t> unwritten = unwritten_columns(p);
  const int64_t np = (p.N + 31) / 32 * 32;  // staging rows, padded for the 32-column conversion
  uint16_t* apack = reinterpret_cast<uint16_t*>(thread_scratch().wpack.reserve((a_off[p.T] + 1) / 2 + 32));
  const Plan* pp = &p;
  at::parallel_for(0, p.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      pack_a(V + pp->val_ptr[t], pp->row_ptr[t + 1] - pp->row_ptr[t], pp->tile_ptr[t + 1] - pp->tile_ptr[t],
             nnb[t], nkb[t], apack + a_off[t]);
  });
  int64_t max_nkb = 1;
  for (int64_t t = 0; t < p.T; ++t) max_nkb = std::max(max_nkb, nkb[t]);
  const int64_t nmb = (p.M + BM - 1) / BM;
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr());

  at::parallel_for(0, nmb, 1, [&](int64_t b0, int64_t b1) {
    Scratch& s = thread_scratch();
    // the three per-thread buffers share one allocation (float units)
    const int64_t xblk_f = (pp->K * BM + 1) / 2, bpack_f = max_nkb * 32 * BM / 2;
    const int64_t words_f = transpose_words(pp->K);
    float* base = s.xt.reserve(xblk_f + bpack_f + np * BM + 16 * 16 * 4 + 64 + words_f);
    uint16_t* xblk = reinterpret_cast<uint16_t*>(base);
    uint16_t* bpack = reinterpret_cast<uint16_t*>(base + xblk_f);
    float* ystage = base + xblk_f + bpack_f;
    float* cbuf = ystage + np * BM;
    cbuf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cbuf) + 63) & ~uintptr_t(63));
    uint32_t* words = reinterpret_cast<uint32_t*>(cbuf + 16 * 16 * 4);  // transpose scratch
    std::fill(ystage + pp->N * BM, ystage + np * BM, 0.f);
    load_tile_config();
    for (int64_t mb = b0; mb < b1; ++mb) {
      const int64_t m0 = mb * BM, mcur = std::min(BM, pp->M - m0);
      const int64_t npairs_m = (mcur + 31) / 32;
      transpose_block_bf16(X, pp->K, m0, mcur, xblk, words);
      for (const int64_t n : unwritten) std::fill(ystage + n * BM, ystage + (n + 1) * BM, 0.f);
      for (int64_t t = 0; t < pp->T; ++t) {
        const int64_t R = pp->row_ptr[t + 1] - pp->row_ptr[t];
        if (R == 0) continue;
        const int64_t c0 = pp->tile_ptr[t], width = pp->tile_ptr[t + 1] - c0, kbs = nkb[t];
        pack_b(xblk, pp->row_idx + pp->row_ptr[t], R, kbs, bpack);
        const uint16_t* At = apack + a_off[t];
        for (int64_t mq = 0; mq < 2 * npairs_m; mq += 2) {
          for (int64_t nb = 0; nb < nnb[t]; nb += 2) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kbs; ++kb) {
              _tile_loadd(4, At + (nb * kbs + kb) * 512, 64);
              _tile_loadd(5, At + ((nb + 1) * kbs + kb) * 512, 64);
              _tile_loadd(6, bpack + (kb * (BM / 16) + mq) * 512, 64);
              _tile_loadd(7, bpack + (kb * (BM / 16) + mq + 1) * 512, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, cbuf, 64);
            _tile_stored(1, cbuf + 256, 64);
            _tile_stored(2, cbuf + 512, 64);
            _tile_stored(3, cbuf + 768, 64);
            // C block (i, j): output columns 16 (nb + i) + r, batch rows 16 (mq + j) + 0..15
            for (int64_t i = 0; i < 2; ++i) {
              for (int64_t r = 0; r < 16; ++r) {
                const int64_t jn = (nb + i) * 16 + r;
                if (jn >= width) break;
                float* dst = ystage + pp->col_idx[c0 + jn] * BM + mq * 16;
                _mm512_storeu_ps(dst, _mm512_load_ps(cbuf + (2 * i) * 256 + r * 16));
                _mm512_storeu_ps(dst + 16, _mm512_load_ps(cbuf + (2 * i + 1) * 256 + r * 16));
              }
            }
          }
        }
      }
      store_block_bf16(ystage, pp->N, bptr, mcur, Y + m0 * pp->N);
    }
    _tile_release();
  });
  return y;
}

#else  // no AMX in this build

bool amx_available() { return false; }

at::Tensor tw_linear_amx(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const c10::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "tw_linear_cpu: this build has no AMX kernel (got ", x.scalar_type(), ")");
}

#endif

}  // namespace tilesparse_cpu
