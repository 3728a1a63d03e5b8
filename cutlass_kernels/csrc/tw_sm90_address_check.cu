// tilerec: host-side check of the sm_90a TW kernel's gathered operand (tw_gemm_sm90.h), no GPU.
//
// The producer warp groups of TwGemmSm90Kernel read B' = X^T through a CuTe tensor whose K' stride
// looks the row up in row_idx, and the 16-byte cp.async recasts it with our upcast. Both are
// host-device code, so this program builds the same tensors on the CPU, partitions them with the
// main loop's own GmemTiledCopyB for every producer thread exactly as the collective's load()
// does (residue shift, n and k predicates), and checks every address a cp.async would read:
//   element (n, k) of the tile  ->  xt + row_idx[k] * ldx + n            (k, n global)
// and that the predicated copies cover each in-range element exactly once. It also checks that
// the consumer's accumulator partition covers the CTA tile once (the epilogue's coordinates), in
// (m, n), (m, n + 1) pairs with n even (the epilogue's 32-bit stores).
// Exit status 0 when all hold; the last line says how many addresses were checked.
// Built and run by tests/cutlass_kernels/test_cutlass_sm90_layout.py.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "tw_gemm_sm90.h"

namespace {

long long g_checked = 0;
int g_errors = 0;

void fail(const char *what, int a, int b, int c, int d) {
  if (g_errors++ < 20) std::printf("MISMATCH %s: %d %d %d %d\n", what, a, b, c, d);
}

// One CTA tile configuration (the manifest's gmma threadblocks; fp16, 4 stages: the stage count
// and bf16 change neither the copy partition nor the MMA partition).
template <int TileM, int TileN, int TileK>
struct Check {
  using Element = cutlass::half_t;
  using Traits = tilerec::sm90::TwGemmSm90Traits<Element, float, TileM, TileN, TileK, 4>;
  using Kernel = tilerec::sm90::TwGemmSm90Kernel<Traits>;
  using Mainloop = typename Traits::Mainloop;
  using TileShape = typename Traits::TileShape;

  // One CTA's B' loads: batch columns (padded), nrows gathered rows of a K x ldx X^T, batch block nb.
  static void check_b(int batch, int nrows, int K, int ldx, int nb, unsigned seed) {
    using namespace cute;
    constexpr int BN = Kernel::kTileN, BK = Kernel::kTileK;
    std::mt19937 rng(seed);
    std::vector<int> rows(K);
    for (int i = 0; i < K; ++i) rows[i] = i;
    std::shuffle(rows.begin(), rows.end(), rng);
    std::vector<int> index(rows.begin(), rows.begin() + nrows);
    std::vector<Element> xt(size_t(K) * ldx);
    Element const *base = xt.data();

    auto mB = tilerec::sm90::make_row_gather_tensor(base, batch, nrows, int64_t(ldx), index.data());
    auto gB_in = local_tile(mB, select<1, 2>(TileShape{}), make_coord(nb, _));  // (BN, BK, k)
    int const k_tiles = (nrows + BK - 1) / BK;
    int const residue_k = nrows - k_tiles * BK;  // <= 0, as the kernel passes it
    int const residue_n = batch - nb * BN;
    auto gB = domain_offset(make_coord(0, residue_k, 0), gB_in);

    std::vector<int> seen(size_t(nrows) * BN, 0);
    typename Mainloop::GmemTiledCopyB copy_b;
    int const threads = int(size(copy_b));
    if (threads != Kernel::kLoadWarpGroups * Kernel::kWarpGroupThreads) fail("producer threads", threads, 0, 0, 0);
    for (int t = 0; t < threads; ++t) {
      auto thr = copy_b.get_slice(t);
      auto tBgB = thr.partition_S(gB);                                          // (CPY, N, K, k)
      auto tBcB = thr.partition_S(make_identity_tensor(make_shape(Int<BN>{}, Int<BK>{})));  // (CPY, N, K)
      for (int kt = 0; kt < k_tiles; ++kt) {
        for (int n = 0; n < size<1>(tBgB); ++n) {
          if (!(get<0>(tBcB(0, n, 0)) < residue_n)) continue;                  // the n predicate
          for (int k = 0; k < size<2>(tBgB); ++k) {
            if (kt == 0 && !(get<1>(tBcB(0, 0, k)) >= -residue_k)) continue;  // the residue tile's k predicate
            auto src = tBgB(_, n, k, kt);
            auto vec = recast<cute::uint128_t>(src);                            // what the cp.async reads
            if (size(vec) != 1) fail("vector count", int(size(vec)), t, n, k);
            for (int v = 0; v < size(src); ++v) {
              int const bn = get<0>(tBcB(v, n, k)), bk = get<1>(tBcB(v, n, k));
              int const ng = nb * BN + bn, kg = kt * BK + bk + residue_k;
              if (kg < 0 || kg >= nrows) { fail("k out of range", kg, t, n, k); continue; }
              Element const *want = base + int64_t(index[kg]) * ldx + ng;
              Element const *got = &src(v);
              if (got != want) fail("element address", t, kt, n, v);
              if (v == 0 && reinterpret_cast<void const *>(&vec(0)) != static_cast<void const *>(want))
                fail("vector address", t, kt, n, k);
              if (bn < residue_n) ++seen[size_t(kg) * BN + bn];
              ++g_checked;
            }
          }
        }
      }
    }
    for (int kg = 0; kg < nrows; ++kg)
      for (int bn = 0; bn < BN && bn < residue_n; ++bn)
        if (seen[size_t(kg) * BN + bn] != 1) fail("coverage", kg, bn, seen[size_t(kg) * BN + bn], nb);
  }

  // The consumer warp group's accumulators: every (m, n) of the CTA tile exactly once, and every
  // even i pairs with i + 1 as (m, n), (m, n + 1), n even (the epilogue's 32-bit stores).
  static void check_c() {
    using namespace cute;
    typename Kernel::TiledMma mma;
    std::vector<int> seen(Kernel::kTileM * Kernel::kTileN, 0);
    for (int t = 0; t < Kernel::kWarpGroupThreads; ++t) {
      auto coords = mma.get_thread_slice(t).partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
      for (int i = 0; i < size(coords); ++i) ++seen[get<0>(coords(i)) * Kernel::kTileN + get<1>(coords(i))];
      if (size(coords) % 2 != 0) fail("odd accumulator count", t, int(size(coords)), 0, 0);
      for (int i = 0; i < size(coords); i += 2) {
        if (!tilerec::sm90::accum_pair(coords, i)) fail("unpaired accumulators", t, i, get<0>(coords(i)), get<1>(coords(i)));
        ++g_checked;
      }
    }
    for (int i = 0; i < int(seen.size()); ++i)
      if (seen[i] != 1) fail("accumulator coverage", i / Kernel::kTileN, i % Kernel::kTileN, seen[i], 0);
    g_checked += long(seen.size());
  }

  static void run() {
    // (batch, nrows, K, ldx, batch block): ragged last k tile, one short tile, exact multiples,
    // a ragged last batch block, a pitch wider than the batch.
    const int cases[][5] = {
        {128, 100, 300, 128, 0}, {256, 64, 64, 256, 1}, {200, 1, 7, 208, 1},
        {40, 129, 517, 48, 0},   {512, 250, 1000, 520, 3}, {136, 65, 65, 136, 1},
    };
    unsigned seed = 1;
    for (auto const &c : cases) {
      if (c[4] * Kernel::kTileN >= c[0]) continue;  // no CTA for that block
      check_b(c[0], c[1], c[2], c[3], c[4], seed++);
    }
    check_c();
    std::printf("tile %dx%dx%d: %d producer + %d consumer threads, %lld addresses/coordinates checked so far, %d errors\n",
                Kernel::kTileM, Kernel::kTileN, Kernel::kTileK, Kernel::kLoadWarpGroups * Kernel::kWarpGroupThreads,
                Kernel::kMmaWarpGroups * Kernel::kWarpGroupThreads, g_checked, g_errors);
  }
};

}  // namespace

int main() {
  Check<128, 128, 64>::run();
  Check<128, 64, 64>::run();
  Check<64, 128, 64>::run();
  std::printf("total: %lld checked, %d errors\n", g_checked, g_errors);
  return g_errors == 0 ? 0 : 1;
}
