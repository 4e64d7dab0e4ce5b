// The lut4 linear's halves of tq_linear / tq_dequantize_rows (weight_abi.h; NF4 / FP4 and affine
// int4, see lut4_linear.h): argument checks, activation permutation, threading. The kernels come
// from the active ISA's table (kernels.h).
#include "lut4_linear.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"
#include "weight_abi.h"

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
  parallel_for(N, 4, threads, run_rows, &job, kLinearSpinUs, M * N * K);
  if (dtype != DT_F32) from_f32_row(p.out, M * N, dtype, out);
  free(buf);
  return OK;
}

int dequantize(const Lut4Params& p, int64_t n0, int64_t n1, void* out, bool out_bf16, int threads) {
  DequantJob job{&p, kernels().lut4.dequant, n0, out, out_bf16};
  parallel_for(n1 - n0, 1, threads, run_dequant, &job);
  return OK;
}

// The lut4 fields of w (see weight_abi.h) are consistent: shape, table, exactly one kind of
// scales, round kinds, and no int8 fields.
bool valid_lut4(const tq_weight& w) {
  if (!valid_shape(w.n, w.row_length, w.block) || w.row_length - w.k >= w.block || !w.packed || !w.codebook) return false;
  const bool nested = w.nested_codes || w.nested_absmax || w.nested_offset || w.nested_map;
  if (nested ? (w.scales || !w.nested_codes || !w.nested_absmax || !w.nested_offset || !w.nested_map) : !w.scales) return false;
  return w.round_mul >= ROUND_NONE && w.round_mul <= ROUND_FP16 && w.round_add >= ROUND_NONE && w.round_add <= ROUND_FP16 &&
         !w.codes;
}

Lut4Params params(const tq_weight& w, int64_t M, const float* bias) {
  return Lut4Params{nullptr, M, w.row_length, w.n, w.block, w.packed, w.codebook, w.scales, w.nested_codes,
                    w.nested_absmax, w.nested_offset ? *w.nested_offset : 0.0f, w.nested_map, bias, nullptr,
                    w.shifts, w.zeros, w.round_mul, w.round_add};
}

}  // namespace

int lut4_linear(const tq_weight& w, const void* x, int dtype, int64_t M, const float* bias, void* out, int threads) {
  if (!valid_lut4(w)) return BAD_ARGUMENT;
  return linear(params(w, M, bias), x, dtype, w.k, out, threads);
}

int lut4_dequantize(const tq_weight& w, int64_t n0, int64_t n1, void* dst, bool bf16, int threads) {
  if (!valid_lut4(w)) return BAD_ARGUMENT;
  const Lut4Params p = params(w, 0, nullptr);
  return dequantize(p, n0, n1, dst, bf16, threads);
}

}  // namespace tq
