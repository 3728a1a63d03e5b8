// tilerec: the TW sparse GEMM for Hopper (sm_90a): cp.async gather producers + wgmma consumer.
//
// Same problem and arguments as tw_gemm.h (Y^T[cols_t,:] = B_t^T . X^T[rows_t,:], TwGemmArgs),
// with CUTLASS 3.x pieces: the CollectiveBuilder's KernelCpAsyncWarpSpecialized main loop (two
// producer warp groups issue 16-byte cp.async loads, one consumer warp group runs wgmma from
// shared memory). TMA cannot gather arbitrary rows, so the gathered operand B' = X^T is a CuTe
// tensor whose K-mode stride looks the row up in row_idx (a "gather stride"): every cp.async of
// a kept row stays a contiguous 16-byte batch vector. The epilogue is ours: accumulators get the
// bias and the activation of tw_epilogue.h (tw_epilogue_value, the same arithmetic as the
// multistage kernel's), rows are scattered through col_idx and written straight from registers.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "tw_args.h"
#include "tw_epilogue.h"

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "cute/tensor.hpp"

namespace tilerec {
namespace sm90 {

// The stride of a gathered mode: coordinate i maps to offset index[i] * stride.
template <class Stride>
struct GatherStride {
  int const *index;
  Stride stride;

  template <class I>
  CUTE_HOST_DEVICE friend constexpr auto operator*(I i, GatherStride const &s) {
    return int64_t(s.index[i]) * s.stride;
  }
  template <class I>
  CUTE_HOST_DEVICE friend constexpr auto operator*(GatherStride const &s, I i) {
    return int64_t(s.index[i]) * s.stride;
  }
  // CuTe divides strides when it tiles a layout; the index lookup stays in front.
  template <class Div>
  CUTE_HOST_DEVICE friend constexpr auto safe_div(GatherStride const &s, Div const &d) {
    return GatherStride<decltype(cute::safe_div(s.stride, d))>{s.index, cute::safe_div(s.stride, d)};
  }
  // make_layout requires integral strides; a gathered one is built directly.
  template <class Shape>
  CUTE_HOST_DEVICE friend constexpr auto make_layout(Shape const &shape, GatherStride const &s) {
    return cute::Layout<Shape, GatherStride>(shape, s);
  }
};

}  // namespace sm90
}  // namespace tilerec

namespace cute {

// Recasting a gathered tensor to wider elements (the 16-byte cp.async does) must rescale only
// the unit-stride mode: of the outer (gather) layout, of the running offset, and of the inner
// coordinate layout. CuTe has no upcast for such a ComposedLayout; these two supply it.
template <int N, int Mode, class Shape, class Stride>
CUTE_HOST_DEVICE constexpr auto tw_upcast_coords(Shape const &shape, Stride const &stride) {
  if constexpr (is_tuple<Shape>::value) {
    return transform_layout(shape, stride,
                            [](auto const &s, auto const &d) { return tw_upcast_coords<N, Mode>(s, d); });
  } else if constexpr (is_scaled_basis<Stride>::value) {
    if constexpr (Stride::mode() == Mode) {
      return make_layout(ceil_div(shape, Int<N>{}), ceil_div(stride, Int<N>{}));
    } else {
      return make_layout(shape, stride);
    }
  } else {
    return upcast<N>(shape, stride);
  }
  CUTE_GCC_UNREACHABLE;
}

template <int N, class OuterShape, class GatherT, class Offset, class Shape, class Stride>
CUTE_HOST_DEVICE constexpr auto
upcast(ComposedLayout<Layout<OuterShape, tuple<C<1>, tilerec::sm90::GatherStride<GatherT>>>, Offset,
                      Layout<Shape, Stride>> const &layout) {
  constexpr int kUnit = 0;  // the gathered tensors here are unit-stride in mode 0
  auto outer = upcast<N>(layout.layout_a());
  auto offset = as_arithmetic_tuple(replace<kUnit>(layout.offset(), upcast<N>(get<kUnit>(layout.offset()))));
  auto inner = tw_upcast_coords<N, kUnit>(layout.layout_b().shape(), layout.layout_b().stride());
  return composition(outer, offset, inner);
}

}  // namespace cute

namespace tilerec {
namespace sm90 {

// (N', K') view of X^T whose K' coordinate k reads row index[k] of a row-major (K, ld) matrix.
template <class Element>
CUTE_HOST_DEVICE auto make_row_gather_tensor(Element const *ptr, int n, int k, int64_t ld,
                                        int const *index) {
  using namespace cute;
  auto coords = make_identity_layout(make_shape(n, k));
  auto gather = make_layout(make_shape(_1{}, _1{}),
                            make_stride(_1{}, GatherStride<int64_t>{index, ld}));
  auto offset = as_arithmetic_tuple(make_tuple(_0{}, _0{}));
  return make_tensor(make_gmem_ptr(ptr), ComposedLayout{gather, offset, coords});
}

// Whether accumulators i and i + 1 of a thread's C partition (coordinates `coords`, tile-local
// (m, n)) are (m, n) and (m, n + 1) with n even: the epilogue then stores them as one 32-bit
// pair (n is the batch, contiguous in Y^T; the CTA's batch offset is a multiple of the tile).
// wgmma's accumulator layout pairs every even i so (checked on the CPU by
// tw_sm90_address_check.cu); any other layout falls back to 16-bit stores.
template <class Coords>
CUTE_HOST_DEVICE bool accum_pair(Coords const &coords, int i) {
  using cute::get;
  return i + 1 < int(cute::size(coords)) && get<0>(coords(i + 1)) == get<0>(coords(i)) &&
         get<1>(coords(i + 1)) == get<1>(coords(i)) + 1 && get<1>(coords(i)) % 2 == 0;
}

template <typename Element_, typename ElementAccumulator_, int TileM, int TileN, int TileK,
          int Stages>
struct TwGemmSm90Traits {
  using Element = Element_;
  using ElementAccumulator = ElementAccumulator_;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  static int const kAlignment = 128 / cutlass::sizeof_bits<Element>::value;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::ColumnMajor, kAlignment,   // A' = packed W^T blocks (M'-major)
      Element, cutlass::layout::RowMajor, kAlignment,      // B' = X^T (N'-major), gathered on K'
      ElementAccumulator, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
      cutlass::gemm::collective::StageCount<Stages>,
      cutlass::gemm::KernelCpAsyncWarpSpecialized>::CollectiveOp;
};

template <typename Traits>
struct TwGemmSm90Kernel {
  using Mainloop = typename Traits::Mainloop;
  using Element = typename Traits::Element;
  using ElementAccumulator = typename Traits::ElementAccumulator;
  using TileShape = typename Traits::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;

  static constexpr int kWarpGroupThreads = cutlass::NumThreadsPerWarpGroup;
  static constexpr int kLoadWarpGroups = cute::size(typename Mainloop::GmemTiledCopyA{}) / kWarpGroupThreads;
  static constexpr int kMmaWarpGroups = cute::size(TiledMma{}) / kWarpGroupThreads;
  static constexpr int kThreadCount = (kLoadWarpGroups + kMmaWarpGroups) * kWarpGroupThreads;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static_assert(kMmaWarpGroups == 1, "one consumer warp group");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };

  CUTLASS_DEVICE
  void operator()(TwGemmArgs const &args, SharedStorage &shared) const {
    using namespace cute;
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();  // wgmma exists only on sm_90a
#endif
    int const tile = blockIdx.x;
    int const n_block = blockIdx.y;
    int const n_offset = n_block * kTileN;
    if (tile >= args.num_tiles || n_offset >= args.batch) {
      return;
    }
    int4 const meta = reinterpret_cast<int4 const *>(args.tile_meta)[tile];
    int const col_off = meta.x, ncols = meta.y, row_off = meta.z, nrows = meta.w;

    int const thread_idx = int(threadIdx.x);
    int const warp_group = cutlass::canonical_warp_group_idx();
    bool const producer = warp_group < kLoadWarpGroups;

    typename Pipeline::Params pipe_params;
    pipe_params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipe_params.producer_arv_count = kLoadWarpGroups * kWarpGroupThreads;
    pipe_params.consumer_arv_count = kMmaWarpGroups * kWarpGroupThreads;
    Pipeline pipeline(shared.pipeline, pipe_params);
    __syncthreads();

    // A' (M', K') column-major, pitch lda; B' (N', K') gathered rows of X^T.
    Element const *ptr_w = static_cast<Element const *>(args.w) + int64_t(row_off) * args.lda;
    Tensor mA = make_tensor(make_gmem_ptr(ptr_w), make_shape(ncols, nrows),
                            make_stride(_1{}, int64_t(args.lda)));
    Tensor mB = make_row_gather_tensor(static_cast<Element const *>(args.xt), args.batch, nrows,
                                       int64_t(args.ldx), args.row_idx + row_off);
    Tensor gA = local_tile(mA, select<0, 2>(TileShape{}), make_coord(0, _));        // (BM,BK,k)
    Tensor gB = local_tile(mB, select<1, 2>(TileShape{}), make_coord(n_block, _));  // (BN,BK,k)
    int const k_tiles = (nrows + kTileK - 1) / kTileK;

    Mainloop mainloop;
    if (producer) {
      if (k_tiles > 0) {
        PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
        auto residue = make_tuple(ncols, args.batch - n_offset, nrows - k_tiles * kTileK);
        mainloop.load(pipeline, write_state, gA, gB, make_coord_iterator(k_tiles), k_tiles,
                      residue, thread_idx, shared.tensors);
        write_state.advance(k_tiles);
        mainloop.load_tail(pipeline, write_state);
      }
      return;
    }

    int const mma_thread = thread_idx - kLoadWarpGroups * kWarpGroupThreads;
    TiledMma tiled_mma;
    Tensor accum = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));  // (MMA,MMA_M,MMA_N)
    if (k_tiles > 0) {
      PipelineState read_state;
      typename Mainloop::Params mainloop_params{};
      mainloop.mma(pipeline, read_state, accum, k_tiles, mma_thread, shared.tensors, mainloop_params);
      mainloop.mma_tail(pipeline, read_state, k_tiles);
    } else {
      clear(accum);
    }

    // Epilogue: D = act(alpha * acc + beta * C) or act(acc + bias[row]), rows scattered through
    // col_idx.
    auto thr_mma = tiled_mma.get_thread_slice(mma_thread);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
    Element *ptr_y = static_cast<Element *>(args.yt);
    int const *scatter = args.col_idx + col_off;
    cutlass::NumericConverter<Element, ElementAccumulator> to_out;
    cutlass::NumericConverter<ElementAccumulator, Element> to_acc;
    Element const *bias = static_cast<Element const *>(args.bias);
    float const alpha = bias ? 1.f : args.alpha;
    float const beta = bias ? 1.f : args.beta;  // the bias is the source, added once
    bool const read_c = bias == nullptr && args.beta != 0.f;
    int const act = args.activation;
    // The value of accumulator i: c is its row's bias, or the old D, or unused.
    auto value = [&](int i, ElementAccumulator c) {
      return tw_epilogue_value(float(accum(i)), float(c), alpha, beta, bias != nullptr || read_c,
                               act);
    };
    auto store_one = [&](int i) {
      int const m = get<0>(coords(i));
      int const n = n_offset + get<1>(coords(i));
      if (m < ncols && n < args.batch) {
        Element *dst = ptr_y + int64_t(scatter[m]) * args.ldy + n;
        ElementAccumulator c = bias ? to_acc(bias[scatter[m]]) : (read_c ? to_acc(*dst) : 0.f);
        *dst = to_out(value(i, c));
      }
    };
    // Pairs (m, n), (m, n + 1) go out as one 32-bit store: half the store instructions and twice
    // the bytes per touched sector. ldy is a multiple of the alignment (checked at launch) and
    // n is even, so the pair is 4-byte aligned when Y^T's base is.
    using Pair = cutlass::AlignedArray<Element, 2>;
    bool const paired = !read_c && (reinterpret_cast<uintptr_t>(ptr_y) % sizeof(Pair)) == 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
      int const m = get<0>(coords(i));
      int const n = n_offset + get<1>(coords(i));
      if (paired && accum_pair(coords, i) && n + 1 < args.batch) {
        if (m < ncols) {
          ElementAccumulator const c = bias ? to_acc(bias[scatter[m]]) : 0.f;
          Pair v;
          v[0] = to_out(value(i, c));
          v[1] = to_out(value(i + 1, c));
          *reinterpret_cast<Pair *>(ptr_y + int64_t(scatter[m]) * args.ldy + n) = v;
        }
      } else {
        store_one(i);
        if (i + 1 < size(accum)) {
          store_one(i + 1);
        }
      }
    }
  }
};

template <typename Kernel>
__global__ void __launch_bounds__(Kernel::kThreadCount, 1)
tw_gemm_sm90_device(TwGemmArgs args) {
  extern __shared__ __align__(128) char tw_sm90_smem[];
  Kernel kernel;
  kernel(args, *reinterpret_cast<typename Kernel::SharedStorage *>(tw_sm90_smem));
}

template <typename Traits>
int tw_gemm_sm90_launch(TwGemmArgs const &args, cudaStream_t stream) {
  using Kernel = TwGemmSm90Kernel<Traits>;
  int const align = Traits::kAlignment;
  if (args.num_tiles <= 0 || args.batch <= 0) {
    return kTwOk;
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
  cudaError_t err = cudaFuncSetAttribute(tw_gemm_sm90_device<Kernel>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) {
    return int(err);
  }
  dim3 grid(unsigned(args.num_tiles), unsigned(blocks_n), 1);
  dim3 block(Kernel::kThreadCount, 1, 1);
  tw_gemm_sm90_device<Kernel><<<grid, block, smem, stream>>>(args);
  return int(cudaGetLastError());
}

}  // namespace sm90
}  // namespace tilerec
