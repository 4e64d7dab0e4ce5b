// The lut4 linear's exported entry points (tq_blockwise4bit_* for NF4 / FP4, tq_int4_* for
// affine int4; see lut4_linear.h): argument checks, activation permutation, threading. The
// kernels come from the active ISA's table (kernels.h).
#include "lut4_linear.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

namespace tq {

// How long workers spin for the next linear before sleeping (TORCHQ_NATIVE_SPIN_US). Default 0:
// in a model, PyTorch's own ops run between two linears and a spinning worker slows them down
// more than a futex wake-up costs (measured on a 2-core machine: a 3-layer MLP took 2.2 ms with
// 0, 4.3 ms with 50 us, 5.6 ms with 500 us).
static const int kLinearSpinUs = [] {
  const char* s = getenv("TORCHQ_NATIVE_SPIN_US");
  return s && *s ? atoi(s) : 0;
}();

namespace {

struct RowsJob {
  Lut4Params p;
  Lut4RowsFn rows;
};

void run_rows(void* ctx, int64_t n0, int64_t n1) {
  const RowsJob& j = *static_cast<const RowsJob*>(ctx);
  j.rows(j.p, n0, n1);
}

struct DequantJob {
  const Lut4Params* p;
  Lut4DequantFn dequant;
  int64_t n0;
  void* dst;
  bool bf16;
};

void run_dequant(void* ctx, int64_t a, int64_t b) {
  const DequantJob& j = *static_cast<const DequantJob*>(ctx);
  char* dst = static_cast<char*>(j.dst) + a * j.p->K * (j.bf16 ? 2 : 4);
  j.dequant(*j.p, j.n0 + a, j.n0 + b, dst, j.bf16);
}

bool valid_shape(int64_t N, int64_t K, int64_t block) {
  return N >= 1 && K >= 32 && block >= 32 && !(block & (block - 1)) && K % block == 0;
}

// out = x @ W.T (+ bias), x [M, K_in] and out [M, N] of `dtype`: converts and zero-pads the
// activations to fp32 rows of p.K and permutes them (see lut4_linear.h), runs the rows into an
// fp32 output, then rounds it to `dtype` (once, at the end).
int linear(Lut4Params p, const void* x, int dtype, int64_t K_in, void* out, int threads) {
  const int64_t M = p.M, K = p.K, N = p.N;
  const size_t xp_bytes = (M * K * sizeof(float) + 63) / 64 * 64;
  const size_t out_bytes = dtype == DT_F32 ? 0 : (M * N * sizeof(float) + 63) / 64 * 64;
  char* buf = static_cast<char*>(aligned_alloc(64, xp_bytes + K * sizeof(float) + out_bytes + 64));
  if (!buf) return OUT_OF_MEMORY;
  float* xp = reinterpret_cast<float*>(buf);
  float* row = reinterpret_cast<float*>(buf + xp_bytes);
  const size_t esize = dtype_size(dtype);
  for (int64_t m = 0; m < M; ++m) {
    to_f32_row(static_cast<const char*>(x) + m * K_in * esize, dtype, K_in, K, row);
    for (int64_t k = 0; k < K; k += 32)
      for (int j = 0; j < 16; ++j) {
        xp[m * K + k + j] = row[k + 2 * j];
        xp[m * K + k + 16 + j] = row[k + 2 * j + 1];
      }
  }
  p.xp = xp;
  p.out = dtype == DT_F32 ? static_cast<float*>(out) : reinterpret_cast<float*>(buf + xp_bytes + (K * sizeof(float) + 63) / 64 * 64);
  RowsJob job{p, kernels().lut4.rows};
  parallel_for(N, 4, threads, run_rows, &job, kLinearSpinUs);
  if (dtype != DT_F32) from_f32_row(p.out, M * N, dtype, out);
  free(buf);
  return OK;
}

int dequantize(const Lut4Params& p, int64_t n0, int64_t n1, void* out, int out_bf16, int threads) {
  DequantJob job{&p, kernels().lut4.dequant, n0, out, out_bf16 != 0};
  parallel_for(n1 - n0, 1, threads, run_dequant, &job);
  return OK;
}

}  // namespace
}  // namespace tq

// out[M, N] = x[M, K] @ W.T (+ bias), W the 4-bit blockwise weight (see lut4_linear.h); x and
// out contiguous of `dtype` (DType), bias fp32 or null; products and sums in fp32, one rounding
// to `dtype` at the end. Pass absmax, or the three nested arrays.
TQ_API int tq_blockwise4bit_linear(const void* x, int dtype, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                                   int64_t block, const float* codebook, const float* absmax, const uint8_t* nested_codes,
                                   const float* nested_absmax, float nested_offset, const float* nested_map,
                                   const float* bias, void* out, int threads) {
  using namespace tq;
  if (M < 1 || !valid_shape(N, K, block) || !valid_dtype(dtype) || !x || !packed || !codebook || !out) return BAD_ARGUMENT;
  if (!absmax && !(nested_codes && nested_absmax && nested_map)) return BAD_ARGUMENT;
  Lut4Params p{nullptr, M, K, N, block, packed, codebook, absmax, nested_codes, nested_absmax, nested_offset, nested_map, bias, nullptr};
  return linear(p, x, dtype, K, out, threads);
}

// Rows [n0, n1) of the [N, K] 4-bit weight, dequantized into out ([n1 - n0, K], contiguous) as
// fp32 (out_bf16 = 0) or bf16 (1): exactly torchq::dequantize_4bit's values.
TQ_API int tq_blockwise4bit_dequantize(const uint8_t* packed, int64_t N, int64_t K, int64_t block, const float* codebook,
                                       const float* absmax, const uint8_t* nested_codes, const float* nested_absmax,
                                       float nested_offset, const float* nested_map, int64_t n0, int64_t n1, void* out,
                                       int out_bf16, int threads) {
  using namespace tq;
  if (!valid_shape(N, K, block) || n0 < 0 || n1 > N || n0 >= n1 || !packed || !codebook || !out) return BAD_ARGUMENT;
  if (!absmax && !(nested_codes && nested_absmax && nested_map)) return BAD_ARGUMENT;
  Lut4Params p{nullptr, 0, K, N, block, packed, codebook, absmax, nested_codes, nested_absmax, nested_offset, nested_map, nullptr, nullptr};
  return dequantize(p, n0, n1, out, out_bf16, threads);
}

// The same for torchq's groupwise int4 format (torchq.layouts.int4_native): fp32 scales per
// group of `group` elements, optional per-group shifts (integer zero point) or zeros (float zero
// point), table entries rounded as round_mul / round_add say (0 none, 1 bf16, 2 fp16).
// x is [M, K] (K <= Kp < K + group); the weight rows hold Kp = a multiple of `group` columns.
TQ_API int tq_int4_linear(const void* x, int dtype, int64_t M, int64_t K, int64_t Kp, const uint8_t* packed, int64_t N,
                          int64_t group, const float* codebook, const float* scales, const float* shifts, const float* zeros,
                          int round_mul, int round_add, const float* bias, void* out, int threads) {
  using namespace tq;
  if (M < 1 || !valid_shape(N, Kp, group) || K < 1 || K > Kp || Kp - K >= group || !valid_dtype(dtype)) return BAD_ARGUMENT;
  if (!x || !packed || !codebook || !scales || !out) return BAD_ARGUMENT;
  if (round_mul < 0 || round_mul > 2 || round_add < 0 || round_add > 2) return BAD_ARGUMENT;
  Lut4Params p{nullptr, M, Kp, N, group, packed, codebook, scales, nullptr, nullptr, 0.0f, nullptr, bias, nullptr,
             shifts, zeros, round_mul, round_add};
  return linear(p, x, dtype, K, out, threads);
}

TQ_API int tq_int4_dequantize(const uint8_t* packed, int64_t N, int64_t K, int64_t group, const float* codebook,
                              const float* scales, const float* shifts, const float* zeros, int round_mul, int round_add,
                              int64_t n0, int64_t n1, void* out, int out_bf16, int threads) {
  using namespace tq;
  if (!valid_shape(N, K, group) || n0 < 0 || n1 > N || n0 >= n1 || !packed || !codebook || !scales || !out) return BAD_ARGUMENT;
  if (round_mul < 0 || round_mul > 2 || round_add < 0 || round_add > 2) return BAD_ARGUMENT;
  Lut4Params p{nullptr, 0, K, N, group, packed, codebook, scales, nullptr, nullptr, 0.0f, nullptr, nullptr, nullptr,
             shifts, zeros, round_mul, round_add};
  return dequantize(p, n0, n1, out, out_bf16, threads);
}
