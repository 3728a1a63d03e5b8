// tilerec: the TW GEMM's fused epilogue, shared by both main loops (cutlass_kernels/epilogue.py
// states the arithmetic and runs it op for op in the CPU emulation):
//
//     no bias:   D = act(alpha * acc + beta * C)      (one fma; C read only when beta != 0)
//     bias:      D = act(acc + bias[n])               (alpha = 1, beta = 0; n = the scattered row)
//
// in fp32, rounded once to the output type. Activations use only round-to-nearest multiplies,
// adds and divides (__fmul_rn/__fadd_rn/__fdiv_rn: never contracted into an fma) with the same
// fp32 constants as epilogue.py (hex literals), so the emulation reproduces them bit for bit.
//
// For the CUTLASS 2.x epilogue (tw_gemm.h): TwOutputOp is the output functor, and
// TwOutputTileIterator is the output tile iterator whose source load returns, for a launch with
// a bias, bias[col_idx[row]] broadcast along the row instead of reading C (D' is row-major, the
// bias is one value per row, which CUTLASS's broadcast epilogues — one value per column — cannot
// express).
#pragma once

#include <cuda_runtime.h>

#include "tw_activation.h"
#include "tw_args.h"

#include "cutlass/cutlass.h"
#include "cutlass/array.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "cutlass/epilogue/thread/scale_type.h"

namespace tilerec {

// The CUTLASS 2.x output functor: D = act(alpha * acc + beta * source), source = C or the
// broadcast bias (beta = 1 then).
template <typename ElementOutput_, int Count, typename ElementAccumulator_ = float,
          typename ElementCompute_ = float>
class TwOutputOp {
 public:
  using ElementOutput = ElementOutput_;
  using ElementSource = ElementOutput_;
  using ElementAccumulator = ElementAccumulator_;
  using ElementCompute = ElementCompute_;
  using ElementScalar = ElementCompute_;
  using ElementC = ElementOutput_;
  using ElementD = ElementOutput_;
  static int const kCount = Count;
  static bool const kIsHeavy = true;  // GELU: CUTLASS then does not unroll the epilogue loop
  static const cutlass::epilogue::thread::ScaleType::Kind kScale =
      cutlass::epilogue::thread::ScaleType::Default;
  using FragmentOutput = cutlass::Array<ElementOutput, kCount>;
  using FragmentSource = cutlass::Array<ElementOutput, kCount>;
  using FragmentAccumulator = cutlass::Array<ElementAccumulator, kCount>;
  using FragmentCompute = cutlass::Array<ElementCompute, kCount>;
  static cutlass::FloatRoundStyle const kRound = cutlass::FloatRoundStyle::round_to_nearest;

  struct Params {
    float alpha = 1.f;
    float beta = 0.f;
    bool source = false;  // read the source (C, or the bias)
    int activation = kTwActNone;
  };

  CUTLASS_HOST_DEVICE explicit TwOutputOp(Params const &params) : params_(params) {}

  CUTLASS_HOST_DEVICE bool is_source_needed() const { return params_.source; }

  CUTLASS_HOST_DEVICE void set_k_partition(int, int) {}

  CUTLASS_HOST_DEVICE FragmentOutput operator()(FragmentAccumulator const &accum,
                                                FragmentSource const &source) const {
    cutlass::NumericArrayConverter<ElementCompute, ElementOutput, kCount> to_compute;
    cutlass::NumericArrayConverter<ElementOutput, ElementCompute, kCount, kRound> to_out;
    FragmentCompute c = to_compute(source);
    FragmentCompute d;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kCount; ++i) {
      d[i] = tw_epilogue_value(float(accum[i]), c[i], params_.alpha, params_.beta, true,
                               params_.activation);
    }
    return to_out(d);
  }

  CUTLASS_HOST_DEVICE FragmentOutput operator()(FragmentAccumulator const &accum) const {
    cutlass::NumericArrayConverter<ElementOutput, ElementCompute, kCount, kRound> to_out;
    FragmentCompute d;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kCount; ++i) {
      d[i] = tw_epilogue_value(float(accum[i]), 0.f, params_.alpha, params_.beta, false,
                               params_.activation);
    }
    return to_out(d);
  }

 private:
  Params params_;
};

// The CUTLASS 2.x output tile iterator (PredicatedTileIterator with ScatterD) whose load, for a
// launch with a bias, fills each accessed row's elements with bias[indices[row]]; the rows it
// visits are exactly those of PredicatedTileIterator::load_with_byte_offset (same loop, same
// row offsets, same row guard), so the source fragment lines up with the accumulators.
template <typename Base>
class TwOutputTileIterator : public Base {
 public:
  using ThreadMap = typename Base::ThreadMap;
  using Element = typename Base::Element;
  using Fragment = typename Base::Fragment;
  using TensorCoord = typename Base::TensorCoord;
  static int const kElementsPerAccess = Base::kElementsPerAccess;

  CUTLASS_DEVICE
  TwOutputTileIterator(typename Base::Params const &params, Element *pointer, TensorCoord extent,
                       int thread_idx, TensorCoord threadblock_offset, int const *indices,
                       Element const *bias = nullptr)
      : Base(params, pointer, extent, thread_idx, threadblock_offset, indices),
        bias_(bias),
        indices_(indices),
        extent_row_(extent.row()) {}

  CUTLASS_DEVICE
  void load(Fragment &frag) const {
    if (bias_ == nullptr) {
      Base::load(frag);
      return;
    }
    int const start_row = this->thread_start_row();
    CUTLASS_PRAGMA_UNROLL
    for (int cluster = 0; cluster < ThreadMap::Iterations::kCluster; ++cluster) {
      CUTLASS_PRAGMA_UNROLL
      for (int group = 0; group < ThreadMap::Iterations::kGroup; ++group) {
        CUTLASS_PRAGMA_UNROLL
        for (int row = 0; row < ThreadMap::Iterations::kRow; ++row) {
          int const frag_row_idx =
              row + ThreadMap::Iterations::kRow * (group + ThreadMap::Iterations::kGroup * cluster);
          int const row_offset = row * ThreadMap::Delta::kRow + group * ThreadMap::Delta::kGroup +
                                 cluster * ThreadMap::Delta::kCluster;
          int const r = row_offset + start_row;
          Element const b = r < extent_row_ ? bias_[indices_[r]] : Element(0);
          CUTLASS_PRAGMA_UNROLL
          for (int column = 0; column < ThreadMap::Iterations::kColumn; ++column) {
            int const base = (frag_row_idx * ThreadMap::Iterations::kColumn + column) *
                             kElementsPerAccess;
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < kElementsPerAccess; ++e) {
              frag[base + e] = b;
            }
          }
        }
      }
    }
  }

 private:
  Element const *bias_;
  int const *indices_;
  int extent_row_;
};

}  // namespace tilerec
