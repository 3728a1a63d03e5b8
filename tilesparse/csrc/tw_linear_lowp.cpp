// The condensed TW format for fp64, and for bf16 / fp16 where none of the AMX kernel
// (tw_linear_amx.cpp), the AVX512-BF16 kernel (tw_linear_bf16.cpp) and the fp32 route below
// applies, on CPU: a per-tile gather into a panel, then at::mm per (1024-row block, tile), so
// the GEMM itself runs in torch's backend. Correct everywhere, fast nowhere: bf16 this way
// measures 0.2-0.8x of dense bf16 (oneDNN/AMX) on an AMX machine and 0.3-0.9x at 50 % on an AMD
// Zen 4 (oneDNN on AVX512-BF16), which is why those CPUs take the AMX / AVX512-BF16 kernels.
//
// lowp_via_fp32(): on a CPU without native 16-bit GEMM instructions (no AVX512-BF16 for bf16,
// no AVX512-FP16 for fp16 — e.g. AVX2 machines such as AMD Zen 3) torch's own bf16/fp16 matmul
// is slow (a 512^3 bf16 matmul took 12x the fp32 time on a Zen 3), and so would be at::mm on
// the panels; there the 16-bit call widens X, the kept values and the bias to fp32, runs the
// fp32 kernel (fp32 accumulation, as every path here) and rounds Y back to the input type.
#include "tw_common.h"

namespace tilesparse_cpu {
namespace {

constexpr int64_t MC_MM = 1024;  // rows per work item on the at::mm path (amortises the call)

}  // namespace

bool lowp_via_fp32(at::ScalarType t) {
  if (t != at::kBFloat16 && t != at::kHalf) return false;
  const char* env = std::getenv("TILESPARSE_LOWP_FP32");  // "1": always, "0": never, unset: auto
  if (env != nullptr && env[0] != '\0') return env[0] != '0';
  static const bool bf16 = !cpu_has_native(at::kBFloat16), fp16 = !cpu_has_native(at::kHalf);
  return t == at::kBFloat16 ? bf16 : fp16;
}

at::Tensor tw_linear_mm(const at::Tensor& x, const at::Tensor& col_idx, const at::Tensor& tile_ptr,
                        const at::Tensor& row_idx, const at::Tensor& row_ptr,
                        const at::Tensor& values, const at::Tensor& val_ptr,
                        const c10::optional<at::Tensor>& bias, int64_t N) {
  const Plan p = make_plan(x, col_idx, tile_ptr, row_idx, row_ptr, val_ptr, N);
  // The bias goes into the GEMM (addmm): one rounding of product + bias, as every other route
  // (mm, then + bias in bf16, rounded twice: 257 + 1 gave 256 instead of 258). Pruned columns
  // hold the bias from init_output, unless every column is kept.
  at::Tensor y = init_output(p, x, bias, /*bias_fused=*/true);
  if (p.M == 0 || p.T == 0) return y;
  at::Tensor vals = values.to(x.scalar_type()).contiguous();
  const at::Tensor bx = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
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
      if (R == 0) {  // every row of the tile pruned: its columns are the bias (or 0)
        if (bx.defined())
          ysub.index_copy_(1, cols, bx.index_select(0, cols).unsqueeze(0).expand({mcur, width}).contiguous());
        else
          ysub.index_fill_(1, cols, 0);
        continue;
      }
      const int64_t* rows = pp->row_idx + pp->row_ptr[t];
      at::Tensor a = at::empty({R, mcur}, x.options());
      char* ad = static_cast<char*>(a.data_ptr());
      for (int64_t k = 0; k < R; ++k)
        std::memcpy(ad + k * mcur * esz, XT + (rows[k] * pp->M + m0) * esz, esz * mcur);
      at::Tensor bt = vals.narrow(0, pp->val_ptr[t], R * width).view({R, width});
      at::Tensor c = bx.defined() ? at::addmm(bx.index_select(0, cols), a.t(), bt) : at::mm(a.t(), bt);
      const int64_t* cp = pp->col_idx + c0;
      if (cp[width - 1] - cp[0] == width - 1)
        ysub.narrow(1, cp[0], width).copy_(c);
      else
        ysub.index_copy_(1, cols, c);
    }
  });
  return y;
}

}  // namespace tilesparse_cpu
