// tilerec: launch arguments of the TW GEMM, exactly as cutlass_kernels/reference.py packs
// them (TWLaunch). Plain C++: the torch binding includes this without any CUTLASS header.
#pragma once

#include <cstdint>

namespace tilerec {

struct TwGemmArgs {
  int num_tiles;           // T
  int batch;               // N' = padded batch (multiple of the alignment)
  int lda;                 // row pitch of the packed blocks (>= widest tile, multiple of alignment)
  int ldx;                 // row pitch of X^T (>= batch)
  int ldy;                 // row pitch of Y^T (>= batch)
  int pad_;                // keeps the pointers 8-byte aligned on every ABI
  const int *tile_meta;    // (T, 4): col_off, ncols, row_off, nrows (16-byte aligned)
  const int *col_idx;      // (Nk,) scatter indices (kept output columns)
  const int *row_idx;      // (R,)  gather indices (kept input rows, per tile)
  const void *w;           // (R, lda) packed blocks, element type of the instance
  const void *xt;          // (K, ldx) activations, K-major
  void *yt;                // (N, ldy) output, K-major; rows of pruned columns are not touched
  float alpha;             // D = act(alpha * acc + beta * C), with C = D (in place, same scatter)
  float beta;
  const void *bias;        // (N,) or null: D = act(acc + bias[n]) (then alpha = 1, beta = 0)
  int activation;          // TwActivation, applied in fp32 before the one rounding
  int pad2_;
};

// The epilogue's activation (cutlass_kernels/epilogue.py ACTIVATION_CODE; tw_epilogue.h).
enum TwActivation : int {
  kTwActNone = 0,
  kTwActRelu = 1,
  kTwActGelu = 2,       // x * Phi(x), erf form (nn.GELU())
  kTwActGeluTanh = 3,   // tanh form (nn.GELU(approximate="tanh"))
};

// Launcher status (0 = launched; > 0 is a cudaError_t).
enum TwStatus : int {
  kTwOk = 0,
  kTwBadShape = -1,       // batch/ldx/ldy/lda not multiples of the alignment, or ld < batch
  kTwTooManyBlocks = -2,  // grid.y over 65535 (batch too large for this batch tile)
  kTwBadEpilogue = -3,    // an unknown activation, or a bias with alpha != 1 or beta != 0
};

// The epilogue arguments the kernels compute exactly what cutlass_kernels/epilogue.py states for.
inline bool tw_epilogue_args_ok(TwGemmArgs const &args) {
  if (args.activation < kTwActNone || args.activation > kTwActGeluTanh) return false;
  return args.bias == nullptr || (args.alpha == 1.f && args.beta == 0.f);
}

}  // namespace tilerec
