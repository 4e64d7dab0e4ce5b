// The portable int8 kernels (ISA_SCALAR, TORCHQ_NATIVE_ISA=scalar): one sum per output in
// element order; the same bits as the vector kernels and torchq's reference (see int8_linear.h).
#include <math.h>
#include <string.h>

#include "common.h"
#include "int8_linear.h"

namespace tq {
namespace {

void weight_rows(const Int8Params& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.K;
    const float s = p.scale[n];
    for (int64_t m = 0; m < p.M; ++m) {
      const float* x = p.x + m * p.Kp;
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) acc += (static_cast<float>(w[k]) * s) * x[k];
      p.out[m * p.N + n] = p.bias ? acc + p.bias[n] : acc;
    }
  }
}

void dynamic_rows(const Int8Params& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.K;
    // static activations: minus z * the row's sum, in int64 as the reference
    const int64_t zero_correction = p.row_sums ? static_cast<int64_t>(p.zero_point) * p.row_sums[n] : 0;
    for (int64_t m = 0; m < p.M; ++m) {
      const int8_t* x = p.xq + m * p.Kp;
      int32_t acc = 0;
      for (int64_t k = 0; k < p.K; ++k) acc += static_cast<int32_t>(w[k]) * x[k];
      p.out[m * p.N + n] = (static_cast<float>(static_cast<int64_t>(acc) - zero_correction) * p.xs[m]) * p.scale[n];
    }
  }
}

// Rows of a panel-order weight, 4 codes at a time (int8_linear.h, "Panel order").
void unpack_panels(const int8_t* panels, int64_t K, int64_t n0, int64_t n1, int8_t* dst) {
  const int64_t Kp = int8_panel_k(K);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* src = panels + int8_panel_offset(n, Kp) + (n % 16) * 4;
    for (int64_t k = 0; k < K; k += 4) memcpy(dst + (n - n0) * K + k, src + k * 16, static_cast<size_t>(K - k < 4 ? K - k : 4));
  }
}

void dequant_rows(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    const float s = scale[n];
    for (int64_t k = 0; k < K; ++k) {
      const float v = static_cast<float>(row[k]) * s;
      const int64_t i = (n - n0) * K + k;
      if (bf16) static_cast<uint16_t*>(out)[i] = bf16_rne(v);
      else static_cast<float*>(out)[i] = v;
    }
  }
}

void quantize_rows(const float* x, int64_t K, int64_t Kp, const Int8Quant& q, int offset, void* codes, float* xs, int64_t m0,
                   int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = x + m * K;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t k = 0; k < K; ++k) {
      const float a = fabsf(row[k]);
      nan |= a != a;
      amax = a > amax ? a : amax;
    }
    float s = nan ? NAN : amax / q.denom;
    s = s < q.eps ? q.eps : s;  // a NaN scale stays NaN, as torch.clamp
    xs[m] = s;
    const float r = 1.0f / s;
    for (int64_t k = 0; k < Kp; ++k) {
      float v = k < K ? rintf(row[k] * r) : 0.0f;  // rint: round half to even (default rounding mode)
      v = v != v ? 0.0f : v < q.qmin ? q.qmin : v > q.qmax ? q.qmax : v;
      const int c = static_cast<int>(v);
      if (offset) static_cast<uint8_t*>(codes)[m * Kp + k] = static_cast<uint8_t>(c + 128);
      else static_cast<int8_t*>(codes)[m * Kp + k] = static_cast<int8_t>(c);
    }
  }
}

// Static activations (see int8_linear.h): the clamp in fp32 before the conversion, NaN -> 0 (the
// row's scale NaN), then round half to even (the bounds are integers: the same codes as rounding
// first).
void quantize_static_rows(const float* x, int64_t K, int64_t Kp, const Int8Quant& q, int offset, void* codes, float* xs,
                          int64_t m0, int64_t m1) {
  const float r = 1.0f / q.scale;
  const float lo = static_cast<float>(q.qmin - q.zero), hi = static_cast<float>(q.qmax - q.zero);
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = x + m * K;
    bool nan = false;
    for (int64_t k = 0; k < Kp; ++k) {
      float v = k < K ? row[k] * r : 0.0f;
      if (v != v) {
        nan = true;
        v = 0.0f;
      }
      v = rintf(v < lo ? lo : v > hi ? hi : v);  // rint: round half to even (default rounding mode)
      const int c = static_cast<int>(v) + q.zero + offset;
      if (offset) static_cast<uint8_t*>(codes)[m * Kp + k] = static_cast<uint8_t>(c);
      else static_cast<int8_t*>(codes)[m * Kp + k] = static_cast<int8_t>(c);
    }
    xs[m] = nan ? NAN : q.scale;
  }
}

}  // namespace

extern const Int8Kernels kInt8Scalar = {&weight_rows, &dynamic_rows, 0, &quantize_rows, &quantize_static_rows, &dequant_rows,
                                        nullptr, 0, nullptr, 0, nullptr, nullptr, &unpack_panels, nullptr};

}  // namespace tq
