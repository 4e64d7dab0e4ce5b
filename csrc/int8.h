// int8 weight kernels: weight-only (float activations) and dynamic (int8 activations).
//
// Weight bytes (torchq PlainLayout, symmetric per channel): int8 codes [N, K] row-major and one
// fp32 scale per row (output channel).
// * Weight-only: out[m, n] = sum_k (q[n, k] * s[n]) * x[m, k] (+ bias[n]), every weight the
//   reference's fp32 value q * s, products and sums in fp32.
// * Dynamic: each activation row is quantized exactly as torchq.activation.PerTokenInt8 does
//   (s_x = max(max|x|, 0) / denom clamped to eps, q = clamp(rint(x * (1 / s_x)), qmin, qmax)),
//   the int8 x int8 dot products accumulate exactly in int32, and
//   out[m, n] = (float(acc) * s_x[m]) * s_w[n]: the same bits as torchq's reference.
#pragma once
#include <stdint.h>

namespace tq {

struct I8Params {
  int64_t M, K, N;
  int64_t Kp;               // row length of the activation buffers: K rounded up to 64
  const float* x;           // weight-only: fp32 activations [M, Kp], zero padded
  const int8_t* xq;         // dynamic: int8 activation codes [M, Kp], zero padded
  const uint8_t* xu;        // dynamic (VNNI): codes + 128 [M, Kp], padded with 128
  const float* xs;          // dynamic: activation scales [M]
  const int8_t* w;          // [N, K]
  const float* scale;       // [N]
  const float* bias;        // [N] or null (weight-only only)
  float* out;               // [M, N]
};

struct I8Quant {
  float denom, eps;
  int qmin, qmax;
};

// Output rows [n0, n1) for all M activation rows. One per ISA.
void i8_weight_rows_scalar(const I8Params& p, int64_t n0, int64_t n1);
void i8_weight_rows_avx2(const I8Params& p, int64_t n0, int64_t n1);
void i8_weight_rows_avx512(const I8Params& p, int64_t n0, int64_t n1);
void i8_dynamic_rows_scalar(const I8Params& p, int64_t n0, int64_t n1);
void i8_dynamic_rows_avx2(const I8Params& p, int64_t n0, int64_t n1);
void i8_dynamic_rows_vnni(const I8Params& p, int64_t n0, int64_t n1);

// Weight rows [n0, n1) as q * s into out (row r - n0 at out + (r - n0) * K), fp32 or bf16 (RNE).
void i8_dequant_rows_scalar(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16);
void i8_dequant_rows_avx2(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16);
void i8_dequant_rows_avx512(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16);

// Quantize activation rows [m0, m1) of x ([M, K] fp32) into codes (row stride Kp, zero padded;
// `offset` 128 stores codes + 128 as uint8, padded with 128) and scales.
void i8_quantize_rows_scalar(const float* x, int64_t K, int64_t Kp, const I8Quant& q, int offset, void* codes, float* xs,
                             int64_t m0, int64_t m1);
void i8_quantize_rows_avx2(const float* x, int64_t K, int64_t Kp, const I8Quant& q, int offset, void* codes, float* xs,
                           int64_t m0, int64_t m1);
void i8_quantize_rows_avx512(const float* x, int64_t K, int64_t Kp, const I8Quant& q, int offset, void* codes, float* xs,
                             int64_t m0, int64_t m1);

}  // namespace tq
