// tilerec: the scalar arithmetic of the TW GEMM's epilogue (cutlass_kernels/epilogue.py states
// it and the CPU emulation runs it op for op): the activations and the fma of alpha * acc +
// beta * c. Only round-to-nearest multiplies, adds and divides (__fmul_rn/__fadd_rn/__fdiv_rn
// on the device: never contracted into an fma; plain operators on the host, which a test
// compiles with -ffp-contract=off and compares bit for bit with the emulation) and the same fp32
// constants as epilogue.py (hex literals). No CUTLASS or CUDA header: the host test builds it
// with the host compiler alone.
#pragma once

#include <cmath>

#include "tw_args.h"

#if defined(__CUDACC__)
#define TW_HOST_DEVICE __forceinline__ __host__ __device__
#else
#define TW_HOST_DEVICE inline
#endif

namespace tilerec {

// erf_r / tanh_r coefficients (epilogue.py ERF_NUM ... GELU_CUBIC): numerator x^13 .. x^1
// (Horner in x^2, then times x), denominator x^8 .. x^0 (erf) / x^6 .. x^0 (tanh).
#define TW_ERF_NUM -0x1.2bbe16p-32f, 0x1.dbffdcp-26f, -0x1.19fea2p-19f, -0x1.dd85a4p-15f, \
                   -0x1.8158c6p-11f, -0x1.8343ecp-9f, -0x1.07b7a8p-6f
#define TW_ERF_DEN -0x1.e8c19ap-17f, -0x1.bf7a52p-13f, -0x1.b9249cp-10f, -0x1.e337f0p-8f, \
                   -0x1.d36d4ep-7f
#define TW_ERF_CLAMP 0x1p+2f
#define TW_TANH_NUM -0x1.3e4b80p-52f, 0x1.c266fcp-43f, -0x1.7a6ffep-34f, 0x1.b80082p-25f, \
                    0x1.f28694p-17f, 0x1.4e1bdap-11f, 0x1.40b3b8p-8f
#define TW_TANH_DEN 0x1.41a7b0p-20f, 0x1.f12bacp-14f, 0x1.29540ap-9f, 0x1.40b3bap-8f
#define TW_TANH_CLAMP 0x1.ffec88p+2f
#define TW_SQRT1_2 0x1.6a09e6p-1f
#define TW_SQRT_2_OVER_PI 0x1.988454p-1f
#define TW_GELU_CUBIC 0x1.6e4e26p-5f

TW_HOST_DEVICE float tw_clamp(float x, float hi) {
  return x < -hi ? -hi : (x > hi ? hi : x);  // NaN passes through
}

#if defined(__CUDA_ARCH__)
#define TW_MUL(a, b) __fmul_rn((a), (b))
#define TW_ADD(a, b) __fadd_rn((a), (b))
#define TW_DIV(a, b) __fdiv_rn((a), (b))
#else
#define TW_MUL(a, b) ((a) * (b))
#define TW_ADD(a, b) ((a) + (b))
#define TW_DIV(a, b) ((a) / (b))
#endif

// ((c0 * x2 + c1) * x2 + c2) ..., one rounding per multiply and per add.
TW_HOST_DEVICE float tw_horner(float x2, float p) { return p; }

template <typename... Rest>
TW_HOST_DEVICE float tw_horner(float x2, float p, float c, Rest... rest) {
  return tw_horner(x2, TW_ADD(TW_MUL(p, x2), c), rest...);
}

TW_HOST_DEVICE float tw_erf(float x) {
  x = tw_clamp(x, TW_ERF_CLAMP);
  float const x2 = TW_MUL(x, x);
  return TW_DIV(TW_MUL(x, tw_horner(x2, TW_ERF_NUM)), tw_horner(x2, TW_ERF_DEN));
}

TW_HOST_DEVICE float tw_tanh(float x) {
  x = tw_clamp(x, TW_TANH_CLAMP);
  float const x2 = TW_MUL(x, x);
  return TW_DIV(TW_MUL(x, tw_horner(x2, TW_TANH_NUM)), tw_horner(x2, TW_TANH_DEN));
}

// act(x) for a TwActivation code (uniform across a launch: the branch does not diverge).
TW_HOST_DEVICE float tw_activation(float x, int activation) {
  switch (activation) {
    case kTwActRelu:
      return x < 0.f ? 0.f : x;
    case kTwActGelu:
      return TW_MUL(TW_MUL(x, 0.5f), TW_ADD(1.f, tw_erf(TW_MUL(x, TW_SQRT1_2))));
    case kTwActGeluTanh: {
      float const cube = TW_MUL(TW_MUL(TW_MUL(TW_GELU_CUBIC, x), x), x);
      float const inner = TW_MUL(TW_ADD(x, cube), TW_SQRT_2_OVER_PI);
      return TW_MUL(TW_MUL(x, 0.5f), TW_ADD(1.f, tw_tanh(inner)));
    }
    default:
      return x;
  }
}

#undef TW_MUL
#undef TW_ADD
#undef TW_DIV

// alpha * acc + beta * c as one fma (c = C or the bias), then the activation.
TW_HOST_DEVICE float tw_epilogue_value(float acc, float c, float alpha, float beta,
                                            bool source, int activation) {
#if defined(__CUDA_ARCH__)
  float const v = source ? __fmaf_rn(alpha, acc, __fmul_rn(beta, c)) : __fmul_rn(alpha, acc);
#else
  float const v = source ? std::fma(alpha, acc, beta * c) : alpha * acc;
#endif
  return tw_activation(v, activation);
}

}  // namespace tilerec
