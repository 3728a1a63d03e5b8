// tilerec: the tile-wise (TW) sparse GEMM kernel template, built from CUTLASS 2.x components.
//
// The layer computes Y = X . W (X: M x K, W: K x N). It runs transposed, in the K-major
// ("column-major activations") world of Guo et al. (SC20):
//
//     Y^T[cols_t, :] = B_t^T . X^T[rows_t, :]        for every tile t (one launch, all tiles)
//
// As a CUTLASS GEMM per tile:  M' = G_t (kept output columns), N' = batch, K' = R_t (kept rows)
//   A' = B_t^T : ColumnMajor, lda = G (packed blocks, see cutlass_kernels/reference.py)
//   B' = X^T   : RowMajor (K x ldx), rows GATHERED by row_idx inside the main-loop load
//                (a kept row of X^T is a contiguous M-vector, so loads stay 128-bit wide)
//   D' = Y^T   : RowMajor (N x ldy), rows SCATTERED by col_idx in the epilogue, which applies
//                the bias and the activation (tw_epilogue.h): D' = act(alpha*acc + beta*C) or
//                act(acc + bias[col_idx[m]]), in fp32, rounded once
// Grid: blockIdx.x = tile t (consecutive CTAs share one batch block of X^T in L2),
//       blockIdx.y = batch block of Shape::kN columns. One CTA covers a whole tile (G_t <= kM).
//
// tile_meta (T x 4 int32), one int4 per tile:  {col_off, ncols, row_off, nrows}
//   scatter indices of tile t = col_idx[col_off : col_off + ncols]
//   gather  indices of tile t = row_idx[row_off : row_off + nrows]
//   block of tile t           = w + row_off * lda   (nrows x lda, row-major = A' column-major)
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "tw_args.h"
#include "tw_epilogue.h"

#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/default_gemm.h"
#include "cutlass/epilogue/threadblock/epilogue.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace tilerec {

template <
    typename Element_,             // cutlass::half_t | cutlass::bfloat16_t (A', B', C', D')
    typename ElementAccumulator_,  // float
    typename OperatorClass_,       // cutlass::arch::OpClassTensorOp
    typename ArchTag_,             // main-loop feature level (Sm80: cp.async + mma.sync)
    typename ThreadblockShape_,    // GemmShape<G, batch tile, k tile>
    typename WarpShape_,
    typename InstructionShape_,
    int Stages_,
    int Alignment_,
    typename MathOperator_>        // cutlass::arch::OpMultiplyAdd
struct TwGemmTraits {
  using Element = Element_;
  using ElementAccumulator = ElementAccumulator_;
  using ThreadblockShape = ThreadblockShape_;
  static int const kAlignment = Alignment_;

  using OutputOp = TwOutputOp<Element, Alignment_, ElementAccumulator, ElementAccumulator>;

  // DefaultGemm only assembles the main loop and epilogue; the kernel below is ours.
  using Default = cutlass::gemm::kernel::DefaultGemm<
      Element, cutlass::layout::ColumnMajor, Alignment_,   // A' = packed W^T blocks
      Element, cutlass::layout::RowMajor, Alignment_,      // B' = X^T, gathered rows
      Element, cutlass::layout::RowMajor,                  // D' = Y^T, scattered rows
      ElementAccumulator, OperatorClass_, ArchTag_,
      ThreadblockShape_, WarpShape_, InstructionShape_, OutputOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, Stages_,
      /*SplitKSerial=*/false, MathOperator_,
      cutlass::gemm::SharedMemoryClearOption::kZfill,
      /*GatherA=*/false, /*GatherB=*/true, /*ScatterD=*/true>;

  using Mma = typename Default::Mma;
  // DefaultGemm's epilogue with the output tile iterator swapped for one whose source load can
  // broadcast the bias (tw_epilogue.h); every other part is CUTLASS's.
  using DefaultEpilogue = typename Default::Epilogue;
  using Epilogue = cutlass::epilogue::threadblock::Epilogue<
      typename DefaultEpilogue::Shape, typename DefaultEpilogue::WarpMmaOperator,
      DefaultEpilogue::kPartitionsK,
      TwOutputTileIterator<typename DefaultEpilogue::OutputTileIterator>,
      typename DefaultEpilogue::AccumulatorFragmentIterator,
      typename DefaultEpilogue::WarpTileIterator, typename DefaultEpilogue::SharedLoadIterator,
      OutputOp, typename DefaultEpilogue::Padding, DefaultEpilogue::Base::kFragmentsPerIteration>;
};

template <typename Traits>
struct TwGemmKernel {
  using Mma = typename Traits::Mma;
  using Epilogue = typename Traits::Epilogue;
  using OutputOp = typename Traits::OutputOp;
  using Element = typename Traits::Element;
  using WarpCount = typename Mma::WarpCount;
  static int const kThreadCount = 32 * WarpCount::kCount;
  static int const kTileM = Mma::Shape::kM;   // G: widest tile one CTA covers
  static int const kTileN = Mma::Shape::kN;   // batch columns per CTA
  static int const kTileK = Mma::Shape::kK;

  union SharedStorage {
    typename Mma::SharedStorage main_loop;
    typename Epilogue::SharedStorage epilogue;
  };

  CUTLASS_DEVICE
  void operator()(TwGemmArgs const &args, SharedStorage &shared_storage) const {
    int const tile = blockIdx.x;
    int const n_offset = blockIdx.y * kTileN;
    if (tile >= args.num_tiles || n_offset >= args.batch) {
      return;
    }
    int4 const meta = reinterpret_cast<int4 const *>(args.tile_meta)[tile];
    int const col_off = meta.x, ncols = meta.y, row_off = meta.z, nrows = meta.w;

    // CUTLASS iterators take non-const pointers; A' and B' are only ever read.
    Element *ptr_w = const_cast<Element *>(static_cast<Element const *>(args.w)) +
                     int64_t(row_off) * int64_t(args.lda);
    Element *ptr_x = const_cast<Element *>(static_cast<Element const *>(args.xt));
    Element *ptr_y = static_cast<Element *>(args.yt);

    int const thread_idx = threadIdx.x;
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const lane_idx = threadIdx.x % 32;

    typename Mma::IteratorA::Params params_a(cutlass::layout::ColumnMajor(args.lda));
    typename Mma::IteratorB::Params params_b(cutlass::layout::RowMajor(args.ldx));
    typename Mma::IteratorA iterator_a(params_a, ptr_w, {ncols, nrows}, thread_idx,
                                       cutlass::MatrixCoord{0, 0});
    typename Mma::IteratorB iterator_b(params_b, ptr_x, {nrows, args.batch}, thread_idx,
                                       cutlass::MatrixCoord{0, n_offset},
                                       args.row_idx + row_off);

    Mma mma(shared_storage.main_loop, thread_idx, warp_idx, lane_idx);
    typename Mma::FragmentC accumulators;
    accumulators.clear();
    int const k_iterations = (nrows + kTileK - 1) / kTileK;
    mma(k_iterations, accumulators, iterator_a, iterator_b, accumulators);

    Element const *bias = static_cast<Element const *>(args.bias);
    typename OutputOp::Params op_params;
    op_params.alpha = bias ? 1.f : args.alpha;
    op_params.beta = bias ? 1.f : args.beta;  // the bias is the source, added once
    op_params.source = bias != nullptr || args.beta != 0.f;
    op_params.activation = args.activation;
    OutputOp output_op(op_params);
    typename Epilogue::OutputTileIterator::Params params_y(cutlass::layout::RowMajor(args.ldy));
    cutlass::MatrixCoord const extent_y{ncols, args.batch};
    cutlass::MatrixCoord const offset_y{0, n_offset};
    typename Epilogue::OutputTileIterator iterator_c(params_y, ptr_y, extent_y, thread_idx,
                                                     offset_y, args.col_idx + col_off, bias);
    typename Epilogue::OutputTileIterator iterator_d(params_y, ptr_y, extent_y, thread_idx,
                                                     offset_y, args.col_idx + col_off);
    Epilogue epilogue(shared_storage.epilogue, thread_idx, warp_idx, lane_idx);
    epilogue(output_op, iterator_d, accumulators, iterator_c);
  }
};

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreadCount)
tw_gemm_device(TwGemmArgs args) {
  extern __shared__ int4 tw_smem[];
  Kernel kernel;
  kernel(args, *reinterpret_cast<typename Kernel::SharedStorage *>(tw_smem));
}

template <typename Traits>
int tw_gemm_launch(TwGemmArgs const &args, cudaStream_t stream) {
  using Kernel = TwGemmKernel<Traits>;
  int const align = Traits::kAlignment;
  if (args.num_tiles <= 0 || args.batch <= 0) {
    return kTwOk;  // nothing to compute: every column pruned, or an empty batch
  }
  if (args.batch % align || args.ldx % align || args.ldy % align || args.lda % align ||
      args.ldx < args.batch || args.ldy < args.batch || args.lda < 1) {
    return kTwBadShape;
  }
  if (!tw_epilogue_args_ok(args)) {
    return kTwBadEpilogue;
  }
  long long const blocks_n = (args.batch + Kernel::kTileN - 1) / Kernel::kTileN;
  if (blocks_n > 65535) {
    return kTwTooManyBlocks;
  }
  int const smem = int(sizeof(typename Kernel::SharedStorage));
  if (smem >= (48 << 10)) {
    cudaError_t err = cudaFuncSetAttribute(tw_gemm_device<Kernel>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) {
      return int(err);
    }
  }
  dim3 grid(unsigned(args.num_tiles), unsigned(blocks_n), 1);
  dim3 block(Kernel::kThreadCount, 1, 1);
  tw_gemm_device<Kernel><<<grid, block, smem, stream>>>(args);
  return int(cudaGetLastError());
}

}  // namespace tilerec
