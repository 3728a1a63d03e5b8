// The fused backward of an FP16 / BF16 embedding table with stochastic rounding
// (embark/training/half_kernel.py builds and calls it; embark/training/sparse_rows.py and
// embark/training/rounding.py hold the pure-torch reference it is tested against).
//
// One call per table and backward: the bag gradient (B, dim) float32 is reduced to each
// distinct row the batch touched, that row's optimizer state is updated, and the row is
// rewritten rounded stochastically — one pass over each touched row, no (U, dim) temporary.
//
//   1. keys = id << pos_bits | pos over the nnz looked-up ids, sorted: equal ids form a run,
//      in position order within it (the order torch's index_add_ sums them in).
//   2. per run (rows in parallel; each row's result depends on that row alone): the row's
//      gradient summed over its occurrences in position order (mean: each bag's gradient
//      divided by its length first), then
//        sgd:             w += g * (-lr)
//        rowwise_adagrad: s[r] += sum(g^2) / dim;   w += (g / (sqrt(s[r]) + eps)) * (-lr)
//        adagrad:         s[r] += g * g;            w += (g / (sqrt(s[r]) + eps)) * (-lr)
//      in float32, each operation correctly rounded (built with -ffp-contract=off so no
//      multiply-add is fused; sqrt is IEEE's), and the new row rounded to the storage dtype.
//      sum(g^2) runs in sum_squares' fixed order: 8 lanes (lane l over g[8j + l]^2, j rising),
//      the lanes added ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then the dim % 8
//      tail in order. The reference (sparse_rows.py: row_gradients, row_mean_squares,
//      RowOptimizer.apply_) runs the same operations in the same order, so the two paths give
//      the same rows and state bit for bit and a run may switch between them.
//   3. stochastic rounding (rounding.py's rule): add k random bits (13 FP16, 16 BF16) to the
//      float32 magnitude bits, clear them, saturate at the dtype's max; FP16 subnormals by
//      the rule's definition in double; inf stays inf, NaN becomes torch's NaN of the dtype.
//
// The random bits are counter-based (rounding.py's counter_bits): value (row, col) of a
// call with key K takes the 16-bit lane col % 4 of
//   word(K, row, col / 4) = mix64(h + (col / 4 + 1) * GOLDEN),  h = mix64(K ^ mix64(row + GOLDEN))
// (mix64: SplitMix64's finalizer), its low k bits. A function of (K, row, col) alone: the same
// rows and key give the same bits whatever the thread count or the order rows are visited in.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace embark_cpu {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// FP16 below its smallest normal (2^-14), inf and NaN: rounding.py's reference in double.
uint16_t fp16_special(uint32_t u, uint32_t r) {
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7E00u;  // NaN: torch's float -> half NaN
  if (mag == 0x7F800000u) return sign | 0x7C00u;  // inf
  const double q = static_cast<double>(bits_f32(mag)) * 16777216.0;  // |x| / 2^-24, exact
  const double lo = std::floor(q);
  const double frac = std::nearbyint((q - lo) * 8192.0);  // ties to even, as torch.round
  const uint32_t up = (frac + static_cast<double>(r & 0x1FFFu)) >= 8192.0 ? 1u : 0u;
  // lo + up <= 1024: the subnormal bits, or 0x0400 (the smallest normal) when it carries
  return sign | static_cast<uint16_t>(static_cast<uint32_t>(lo) + up);
}

inline uint16_t round_fp16(float x, uint32_t r) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = u & 0x80000000u;
  uint32_t mag = u ^ sign;
  if (mag < 0x38800000u || mag >= 0x7F800000u) return fp16_special(u, r);
  mag = (mag + (r & 0x1FFFu)) & ~0x1FFFu;
  mag = std::min(mag, 0x477FE000u);  // 65504: a finite value never rounds to inf
  return static_cast<uint16_t>((sign >> 16) | ((mag - 0x38000000u) >> 13));
}

inline uint16_t round_bf16(float x, uint32_t r) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = u & 0x80000000u;
  uint32_t mag = u ^ sign;
  if (mag > 0x7F800000u) return 0xFFFFu;  // NaN: torch's float -> bfloat16 NaN
  if (mag == 0x7F800000u) return static_cast<uint16_t>((sign | mag) >> 16);
  mag = (mag + (r & 0xFFFFu)) & 0xFFFF0000u;
  mag = std::min(mag, 0x7F7F0000u);  // bfloat16's max
  return static_cast<uint16_t>((sign | mag) >> 16);
}

inline float fp16_to_f32(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

enum class Kind { SGD, ROWWISE_ADAGRAD, ADAGRAD };

Kind parse_kind(const std::string& kind) {
  if (kind == "sgd") return Kind::SGD;
  if (kind == "rowwise_adagrad") return Kind::ROWWISE_ADAGRAD;
  if (kind == "adagrad") return Kind::ADAGRAD;
  throw std::invalid_argument("half_rows: optimizer must be sgd, rowwise_adagrad or adagrad, got '" +
                              kind + "'");
}

// The counter-based bits of one row: (dim,) values' 16-bit lanes, 4 per 64-bit word.
inline void row_bits(uint64_t key, int64_t row, int64_t dim, uint16_t* out) {
  const uint64_t h = mix64(key ^ mix64(static_cast<uint64_t>(row) + GOLDEN));
  const int64_t words = (dim + 3) / 4;
  for (int64_t j = 0; j < words; ++j) {
    const uint64_t w = mix64(h + static_cast<uint64_t>(j + 1) * GOLDEN);
    for (int64_t l = 0; l < 4 && 4 * j + l < dim; ++l) {
      out[4 * j + l] = static_cast<uint16_t>(w >> (16 * l));
    }
  }
}

// The bits counter_bits gives for `rows` (U,) int64 and `dim`: (U, dim) int32 (tests).
torch::Tensor counter_bits(int64_t key, const torch::Tensor& rows, int64_t dim) {
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1,
              "counter_bits: rows must be (U,) int64, got ", rows.sizes(), " ", rows.dtype());
  TORCH_CHECK(dim >= 0, "counter_bits: dim must be >= 0, got ", dim);
  auto r = rows.contiguous();
  auto out = torch::empty({r.size(0), dim}, torch::kInt32);
  std::vector<uint16_t> lane(static_cast<size_t>(dim));
  const int64_t* rp = r.data_ptr<int64_t>();
  int32_t* op = out.data_ptr<int32_t>();
  for (int64_t i = 0; i < r.size(0); ++i) {
    row_bits(static_cast<uint64_t>(key), rp[i], dim, lane.data());
    for (int64_t d = 0; d < dim; ++d) op[i * dim + d] = lane[d];
  }
  return out;
}

// What one call's row updates read and write (fused_backward's step 2).
struct RowUpdate {
  const uint64_t* keys;  // (nnz,) sorted id << pos_bits | pos
  const int64_t* run;    // (U + 1,) start of each distinct row's run in keys
  const int32_t* bag_of;  // (nnz,) the bag of each position
  const float* length;   // (B,) bag lengths (at least 1)
  const float* grad;     // (B, dim)
  uint16_t* weight;      // (num_rows, dim) fp16 / bf16 bits
  float* state;          // (num_rows,) row-wise, (num_rows, dim) adagrad, null for sgd
  int64_t dim;
  int pos_bits;
  bool mean;
  float neg_lr, eps;
  uint64_t key;
};

// sum(g[d]^2) in a fixed order whatever the build: 8 partial sums (lane d % 8 over the whole
// groups of 8), added pairwise, then the tail in order (sparse_rows.py's row_mean_squares
// computes the same sums with torch ops).
inline float sum_squares(const float* g, int64_t dim) {
  float p[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t whole = dim - dim % 8;
  for (int64_t d = 0; d < whole; d += 8) {
    for (int l = 0; l < 8; ++l) p[l] += g[d + l] * g[d + l];
  }
  float sum = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
  for (int64_t d = whole; d < dim; ++d) sum += g[d] * g[d];
  return sum;
}

// The step of value d (the module comment's update), its state written.
template <Kind K>
inline float step_of(const RowUpdate& up, const float* g, int64_t row, int64_t d, float row_std) {
  if constexpr (K == Kind::SGD) {
    return g[d] * up.neg_lr;
  } else if constexpr (K == Kind::ROWWISE_ADAGRAD) {
    return (g[d] / row_std) * up.neg_lr;
  } else {
    const float acc = up.state[row * up.dim + d] + g[d] * g[d];
    up.state[row * up.dim + d] = acc;
    return (g[d] / (std::sqrt(acc) + up.eps)) * up.neg_lr;
  }
}

template <Kind K, bool FP16>
inline void update_scalar(const RowUpdate& up, const float* g, const uint16_t* bits, int64_t row,
                          float row_std, int64_t d0, int64_t d1) {
  uint16_t* w = up.weight + row * up.dim;
  for (int64_t d = d0; d < d1; ++d) {
    const float delta = step_of<K>(up, g, row, d, row_std);
    if constexpr (FP16) {
      w[d] = round_fp16(fp16_to_f32(w[d]) + delta, bits[d]);
    } else {
      w[d] = round_bf16(bf16_to_f32(w[d]) + delta, bits[d]);
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// Values d .. d + 7 of a row: the same operations as update_scalar on 8 lanes (IEEE add, mul,
// div and sqrt round alike in both), the rounding's normal-range case on the bit pattern; a
// group holding a value outside it (FP16 subnormal, inf, NaN) is rounded value by value.
template <Kind K, bool FP16>
inline void update_avx2(const RowUpdate& up, const float* g, const uint16_t* bits, int64_t row,
                        float row_std, int64_t d) {
  uint16_t* w = up.weight + row * up.dim + d;
  const __m256 g8 = _mm256_loadu_ps(g + d);
  __m256 delta;
  if constexpr (K == Kind::SGD) {
    delta = _mm256_mul_ps(g8, _mm256_set1_ps(up.neg_lr));
  } else if constexpr (K == Kind::ROWWISE_ADAGRAD) {
    delta = _mm256_mul_ps(_mm256_div_ps(g8, _mm256_set1_ps(row_std)), _mm256_set1_ps(up.neg_lr));
  } else {
    float* s = up.state + row * up.dim + d;
    const __m256 acc = _mm256_add_ps(_mm256_loadu_ps(s), _mm256_mul_ps(g8, g8));
    const __m256 std8 = _mm256_add_ps(_mm256_sqrt_ps(acc), _mm256_set1_ps(up.eps));
    delta = _mm256_mul_ps(_mm256_div_ps(g8, std8), _mm256_set1_ps(up.neg_lr));
    _mm256_storeu_ps(s, acc);
  }
  const __m128i w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  __m256 old;
  if constexpr (FP16) {
    old = _mm256_cvtph_ps(w16);
  } else {
    old = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w16), 16));
  }
  const __m256i u = _mm256_castps_si256(_mm256_add_ps(old, delta));
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  __m256i mag = _mm256_xor_si256(u, sign);
  const __m256i r = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + d)));
  const __m256i below_inf = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), mag);
  if constexpr (FP16) {
    const __m256i normal =
        _mm256_and_si256(below_inf, _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x387FFFFF)));
    if (_mm256_movemask_epi8(normal) != -1) {
      alignas(32) float x[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(x), u);
      for (int l = 0; l < 8; ++l) w[l] = round_fp16(x[l], bits[d + l]);
      return;
    }
    mag = _mm256_and_si256(_mm256_add_epi32(mag, _mm256_and_si256(r, _mm256_set1_epi32(0x1FFF))),
                           _mm256_set1_epi32(~0x1FFF));
    mag = _mm256_min_epi32(mag, _mm256_set1_epi32(0x477FE000));
    const __m256 out = _mm256_castsi256_ps(_mm256_or_si256(sign, mag));  // exact in FP16
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm256_cvtps_ph(out, _MM_FROUND_TO_ZERO));
  } else {
    if (_mm256_movemask_epi8(below_inf) != -1) {
      alignas(32) float x[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(x), u);
      for (int l = 0; l < 8; ++l) w[l] = round_bf16(x[l], bits[d + l]);
      return;
    }
    mag = _mm256_and_si256(_mm256_add_epi32(mag, r), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    mag = _mm256_min_epi32(mag, _mm256_set1_epi32(0x7F7F0000));
    const __m256i h = _mm256_srli_epi32(_mm256_or_si256(sign, mag), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w), _mm256_castsi256_si128(packed));
  }
}
#endif

template <Kind K, bool FP16>
void update_rows(const RowUpdate& up, int64_t begin, int64_t end) {
  const int64_t dim = up.dim;
  const uint64_t pos_mask = (uint64_t{1} << up.pos_bits) - 1;
  std::vector<float> grow(static_cast<size_t>(dim));
  std::vector<uint16_t> brow(static_cast<size_t>(dim));
  float* g = grow.data();
  uint16_t* bits = brow.data();
  for (int64_t u = begin; u < end; ++u) {
    const int64_t row = static_cast<int64_t>(up.keys[up.run[u]] >> up.pos_bits);
    std::fill(g, g + dim, 0.0f);
    for (int64_t q = up.run[u]; q < up.run[u + 1]; ++q) {
      const int32_t b = up.bag_of[up.keys[q] & pos_mask];
      const float* __restrict src = up.grad + static_cast<int64_t>(b) * dim;
      if (up.mean) {
        const float n = up.length[b];
        for (int64_t d = 0; d < dim; ++d) g[d] += src[d] / n;
      } else {
        for (int64_t d = 0; d < dim; ++d) g[d] += src[d];
      }
    }
    row_bits(up.key, row, dim, bits);
    float row_std = 0.0f;
    if constexpr (K == Kind::ROWWISE_ADAGRAD) {
      const float acc = up.state[row] + sum_squares(g, dim) / static_cast<float>(dim);
      up.state[row] = acc;
      row_std = std::sqrt(acc) + up.eps;
    }
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; d + 8 <= dim; d += 8) update_avx2<K, FP16>(up, g, bits, row, row_std, d);
#endif
    update_scalar<K, FP16>(up, g, bits, row, row_std, d, dim);
  }
}

void fused_backward(const torch::Tensor& grad, const torch::Tensor& ids,
                    const torch::Tensor& offsets, bool mean, torch::Tensor weight,
                    c10::optional<torch::Tensor> state, const std::string& kind_name, double lr,
                    double eps, int64_t key, const std::string& table) {
  const Kind kind = parse_kind(kind_name);
  TORCH_CHECK(grad.dtype() == torch::kFloat32 && grad.dim() == 2 && grad.is_contiguous(),
              "table '", table, "': grad must be (B, dim) contiguous float32, got ", grad.sizes(),
              " ", grad.dtype(), grad.is_contiguous() ? "" : " non-contiguous");
  TORCH_CHECK(ids.dtype() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "table '", table, "': ids must be (nnz,) contiguous int64, got ", ids.sizes(), " ",
              ids.dtype(), ids.is_contiguous() ? "" : " non-contiguous");
  TORCH_CHECK(offsets.dtype() == torch::kInt64 && offsets.dim() == 1 && offsets.is_contiguous(),
              "table '", table, "': offsets must be (B,) contiguous int64, got ", offsets.sizes(),
              " ", offsets.dtype(), offsets.is_contiguous() ? "" : " non-contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.dtype() == torch::kFloat16 || weight.dtype() == torch::kBFloat16),
              "table '", table, "': weight must be a contiguous (num_rows, dim) float16 or bfloat16 "
              "table, got ", weight.sizes(), " ", weight.dtype(),
              weight.is_contiguous() ? "" : " non-contiguous");
  const bool fp16 = weight.dtype() == torch::kFloat16;
  const int64_t batch = grad.size(0), dim = grad.size(1), nnz = ids.size(0);
  const int64_t num_rows = weight.size(0);
  TORCH_CHECK(weight.size(1) == dim, "table '", table, "': weight has dim ", weight.size(1),
              ", grad ", dim);
  TORCH_CHECK(offsets.size(0) == batch, "table '", table, "': offsets has ", offsets.size(0),
              " bags, grad ", batch);
  float* sp = nullptr;
  if (kind != Kind::SGD) {
    TORCH_CHECK(state.has_value(), "table '", table, "': ", kind_name,
                " needs its float32 state, got none");
    TORCH_CHECK(state->dtype() == torch::kFloat32 && state->is_contiguous(), "table '", table,
                "': ", kind_name, " needs its state contiguous float32, got ", state->dtype(),
                state->is_contiguous() ? "" : " non-contiguous");
    const int64_t want = kind == Kind::ADAGRAD ? num_rows * dim : num_rows;
    TORCH_CHECK(state->numel() == want, "table '", table, "': ", kind_name, " state has ",
                state->numel(), " values, expected ", want);
    sp = state->data_ptr<float>();
  }
  if (nnz == 0) return;
  TORCH_CHECK(batch > 0, "table '", table, "': ", nnz, " ids in no bag");
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t* offp = offsets.data_ptr<int64_t>();
  const float* gp = grad.data_ptr<float>();
  uint16_t* wp = reinterpret_cast<uint16_t*>(weight.data_ptr());

  // bag and bag length of every position
  std::vector<int32_t> bag_of(static_cast<size_t>(nnz));
  std::vector<float> length(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = offp[b], hi = b + 1 < batch ? offp[b + 1] : nnz;
    TORCH_CHECK(0 <= lo && lo <= hi && hi <= nnz, "table '", table, "': offsets must rise within [0, ",
                nnz, "]: bag ", b, " starts at ", lo, " and ends at ", hi);
    for (int64_t p = lo; p < hi; ++p) bag_of[p] = static_cast<int32_t>(b);
    length[b] = static_cast<float>(std::max<int64_t>(hi - lo, 1));
  }
  TORCH_CHECK(offp[0] == 0, "table '", table, "': offsets must start at 0, got ", offp[0]);

  int pos_bits = 1;
  while ((int64_t{1} << pos_bits) < nnz) ++pos_bits;
  TORCH_CHECK(num_rows <= (int64_t{1} << (63 - pos_bits)),
              "table '", table, "': ", num_rows, " rows and ", nnz,
              " ids do not fit one 63-bit sort key");
  std::vector<uint64_t> keys(static_cast<size_t>(nnz));
  for (int64_t p = 0; p < nnz; ++p) {
    TORCH_CHECK(0 <= idp[p] && idp[p] < num_rows, "table '", table, "': id ", idp[p],
                " at position ", p, " outside its ", num_rows, " rows [0, ", num_rows, ")");
    keys[p] = (static_cast<uint64_t>(idp[p]) << pos_bits) | static_cast<uint64_t>(p);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<int64_t> run;  // start of each distinct row's run, then nnz
  run.reserve(static_cast<size_t>(nnz) + 1);
  for (int64_t p = 0; p < nnz; ++p) {
    if (p == 0 || (keys[p] >> pos_bits) != (keys[p - 1] >> pos_bits)) run.push_back(p);
  }
  const int64_t unique = static_cast<int64_t>(run.size());
  run.push_back(nnz);

  const RowUpdate up{keys.data(), run.data(), bag_of.data(), length.data(), gp, wp, sp, dim,
                     pos_bits, mean, static_cast<float>(-lr), static_cast<float>(eps),
                     static_cast<uint64_t>(key)};
  at::parallel_for(0, unique, 64, [&](int64_t begin, int64_t end) {
    if (fp16) {
      switch (kind) {
        case Kind::SGD: return update_rows<Kind::SGD, true>(up, begin, end);
        case Kind::ROWWISE_ADAGRAD: return update_rows<Kind::ROWWISE_ADAGRAD, true>(up, begin, end);
        case Kind::ADAGRAD: return update_rows<Kind::ADAGRAD, true>(up, begin, end);
      }
    }
    switch (kind) {
      case Kind::SGD: return update_rows<Kind::SGD, false>(up, begin, end);
      case Kind::ROWWISE_ADAGRAD: return update_rows<Kind::ROWWISE_ADAGRAD, false>(up, begin, end);
      case Kind::ADAGRAD: return update_rows<Kind::ADAGRAD, false>(up, begin, end);
    }
  });
}

}  // namespace embark_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_backward", &embark_cpu::fused_backward,
        "reduce a bag gradient to its rows, update them and their state, round stochastically",
        py::arg("grad"), py::arg("ids"), py::arg("offsets"), py::arg("mean"), py::arg("weight"),
        py::arg("state"), py::arg("kind"), py::arg("lr"), py::arg("eps"), py::arg("key"),
        py::arg("table"));
  m.def("counter_bits", &embark_cpu::counter_bits, "the rounding bits of rows (U, dim) int32",
        py::arg("key"), py::arg("rows"), py::arg("dim"));
}
