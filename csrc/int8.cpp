// int8 kernels: portable paths, ISA choice, threading and the exported entry points.
#include "int8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

namespace tq {

void i8_weight_rows_scalar(const I8Params& p, int64_t n0, int64_t n1) {
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

void i8_dynamic_rows_scalar(const I8Params& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * p.K;
    for (int64_t m = 0; m < p.M; ++m) {
      const int8_t* x = p.xq + m * p.Kp;
      int32_t acc = 0;
      for (int64_t k = 0; k < p.K; ++k) acc += static_cast<int32_t>(w[k]) * x[k];
      p.out[m * p.N + n] = (static_cast<float>(acc) * p.xs[m]) * p.scale[n];
    }
  }
}

void i8_dequant_rows_scalar(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    const float s = scale[n];
    for (int64_t k = 0; k < K; ++k) {
      const float v = static_cast<float>(row[k]) * s;
      const int64_t i = (n - n0) * K + k;
      if (bf16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (finite values)
        static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(u >> 16);
      } else {
        static_cast<float*>(out)[i] = v;
      }
    }
  }
}

void i8_quantize_rows_scalar(const float* x, int64_t K, int64_t Kp, const I8Quant& q, int offset, void* codes, float* xs,
                             int64_t m0, int64_t m1) {
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

namespace {

// In a model, PyTorch's own ops run between two linears: workers sleep right away (see
// blockwise4bit.cpp).
constexpr int kSpinUs = 0;

void weight_rows(void* ctx, int64_t n0, int64_t n1) {
  const I8Params& p = *static_cast<const I8Params*>(ctx);
  switch (active_isa()) {
    case ISA_AVX512: i8_weight_rows_avx512(p, n0, n1); break;
    case ISA_AVX2: i8_weight_rows_avx2(p, n0, n1); break;
    default: i8_weight_rows_scalar(p, n0, n1); break;
  }
}

// TORCHQ_NATIVE_VNNI=0 (read once) runs the AVX-512 CPU's int8 dynamic kernel without VNNI, the
// path of AVX-512 CPUs that lack it, so a VNNI machine tests it too.
bool vnni_allowed() {
  static const bool yes = [] {
    const char* s = getenv("TORCHQ_NATIVE_VNNI");
    return s == nullptr || strcmp(s, "0") != 0;
  }();
  return yes;
}

bool use_vnni() { return active_isa() == ISA_AVX512 && has_avx512_vnni() && vnni_allowed(); }

void dynamic_rows(void* ctx, int64_t n0, int64_t n1) {
  const I8Params& p = *static_cast<const I8Params*>(ctx);
  if (p.xu) i8_dynamic_rows_vnni(p, n0, n1);
  else if (active_isa() >= ISA_AVX2) i8_dynamic_rows_avx2(p, n0, n1);
  else i8_dynamic_rows_scalar(p, n0, n1);
}

struct QuantJob {
  const float* x;
  int64_t K, Kp;
  I8Quant q;
  int offset;
  void* codes;
  float* xs;
};

void quantize_rows(void* ctx, int64_t m0, int64_t m1) {
  const QuantJob& j = *static_cast<const QuantJob*>(ctx);
  switch (active_isa()) {
    case ISA_AVX512: i8_quantize_rows_avx512(j.x, j.K, j.Kp, j.q, j.offset, j.codes, j.xs, m0, m1); break;
    case ISA_AVX2: i8_quantize_rows_avx2(j.x, j.K, j.Kp, j.q, j.offset, j.codes, j.xs, m0, m1); break;
    default: i8_quantize_rows_scalar(j.x, j.K, j.Kp, j.q, j.offset, j.codes, j.xs, m0, m1); break;
  }
}

struct DequantJob {
  const int8_t* w;
  const float* scale;
  int64_t K, n0;
  void* out;
  bool bf16;
};

void dequant_rows(void* ctx, int64_t a, int64_t b) {
  const DequantJob& j = *static_cast<const DequantJob*>(ctx);
  char* out = static_cast<char*>(j.out) + a * j.K * (j.bf16 ? 2 : 4);
  switch (active_isa()) {
    case ISA_AVX512: i8_dequant_rows_avx512(j.w, j.scale, j.K, j.n0 + a, j.n0 + b, out, j.bf16); break;
    case ISA_AVX2: i8_dequant_rows_avx2(j.w, j.scale, j.K, j.n0 + a, j.n0 + b, out, j.bf16); break;
    default: i8_dequant_rows_scalar(j.w, j.scale, j.K, j.n0 + a, j.n0 + b, out, j.bf16); break;
  }
}

int64_t padded(int64_t K) { return (K + 63) / 64 * 64; }

// The fp32 output buffer of a linear whose out has `dtype`: out itself for fp32.
struct Output {
  float* f32 = nullptr;
  void* owned = nullptr;
  bool init(void* out, int dtype, int64_t count) {
    if (dtype == DT_F32) {
      f32 = static_cast<float*>(out);
      return true;
    }
    owned = aligned_alloc(64, (count * sizeof(float) + 63) / 64 * 64);
    f32 = static_cast<float*>(owned);
    return owned != nullptr;
  }
  void finish(void* out, int dtype, int64_t count) {
    if (owned) from_f32_row(f32, count, dtype, out);
  }
  ~Output() { free(owned); }
};

}  // namespace
}  // namespace tq

// out[M, N] = x[M, K] @ (q * s).T (+ bias): x and out contiguous of `dtype` (DType), int8 codes
// [N, K], fp32 scales [N], fp32 bias or null; products and sums in fp32, one rounding at the end.
TQ_API int tq_int8_linear(const void* x, int dtype, int64_t M, int64_t K, const int8_t* codes, int64_t N, const float* scale,
                          const float* bias, void* out, int threads) {
  using namespace tq;
  if (M < 1 || K < 1 || N < 1 || !valid_dtype(dtype) || !x || !codes || !scale || !out) return BAD_ARGUMENT;
  const int64_t Kp = padded(K);
  float* xp = static_cast<float*>(aligned_alloc(64, M * Kp * sizeof(float)));
  Output o;
  if (!xp || !o.init(out, dtype, M * N)) {
    free(xp);
    return OUT_OF_MEMORY;
  }
  const size_t esize = dtype_size(dtype);
  for (int64_t m = 0; m < M; ++m) to_f32_row(static_cast<const char*>(x) + m * K * esize, dtype, K, Kp, xp + m * Kp);
  I8Params p{M, K, N, Kp, xp, nullptr, nullptr, nullptr, codes, scale, bias, o.f32};
  parallel_for(N, 4, threads, weight_rows, &p, kSpinUs);
  o.finish(out, dtype, M * N);
  free(xp);
  return OK;
}

// Rows [n0, n1) of the weight, q * s, into out ([n1 - n0, K]) as fp32 (out_bf16 = 0) or bf16.
TQ_API int tq_int8_dequantize(const int8_t* codes, int64_t N, int64_t K, const float* scale, int64_t n0, int64_t n1,
                              void* out, int out_bf16, int threads) {
  using namespace tq;
  if (K < 1 || N < 1 || n0 < 0 || n1 > N || n0 >= n1 || !codes || !scale || !out) return BAD_ARGUMENT;
  DequantJob job{codes, scale, K, n0, out, out_bf16 != 0};
  parallel_for(n1 - n0, 1, threads, dequant_rows, &job);
  return OK;
}

// out[M, N] = per-token int8(x) @ q.T rescaled (see int8.h); x and out contiguous of `dtype`.
// No bias (the reference adds it after rounding to the activation dtype). Codes are symmetric
// in [qmin, qmax] with qmin >= -127 (the AVX2 sign trick needs |x| <= 127).
TQ_API int tq_int8_dynamic_linear(const void* x, int dtype, int64_t M, int64_t K, const int8_t* codes, int64_t N,
                                  const float* scale, float denom, float eps, int qmin, int qmax, void* out, int threads) {
  using namespace tq;
  if (M < 1 || K < 1 || N < 1 || !valid_dtype(dtype) || !x || !codes || !scale || !out) return BAD_ARGUMENT;
  if (qmin < -127 || qmax > 127 || qmin >= qmax || !(denom > 0.0f) || !(eps > 0.0f)) return BAD_ARGUMENT;
  const int64_t Kp = padded(K);
  const bool vnni = use_vnni();
  const size_t codes_bytes = (M * Kp + 63) / 64 * 64, xs_bytes = (M * sizeof(float) + 63) / 64 * 64;
  const size_t xf_bytes = dtype == DT_F32 ? 0 : M * K * sizeof(float);
  char* buf = static_cast<char*>(aligned_alloc(64, codes_bytes + xs_bytes + (xf_bytes + 63) / 64 * 64));
  Output o;
  if (!buf || !o.init(out, dtype, M * N)) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  float* xs = reinterpret_cast<float*>(buf + codes_bytes);
  const float* xf = static_cast<const float*>(x);
  if (dtype != DT_F32) {  // widen (exactly) first: the quantization then sees the reference's fp32 values
    float* w = reinterpret_cast<float*>(buf + codes_bytes + xs_bytes);
    for (int64_t m = 0; m < M; ++m) to_f32_row(static_cast<const char*>(x) + m * K * 2, dtype, K, K, w + m * K);
    xf = w;
  }
  QuantJob q{xf, K, Kp, I8Quant{denom, eps, qmin, qmax}, vnni ? 128 : 0, buf, xs};
  parallel_for(M, 1, threads, quantize_rows, &q, 0);
  I8Params p{M, K, N, Kp, nullptr, vnni ? nullptr : reinterpret_cast<const int8_t*>(buf), vnni ? reinterpret_cast<const uint8_t*>(buf) : nullptr,
             xs, codes, scale, nullptr, o.f32};
  parallel_for(N, 4, threads, dynamic_rows, &p, kSpinUs);
  o.finish(out, dtype, M * N);
  free(buf);
  return OK;
}
