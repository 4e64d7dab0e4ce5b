// The lut4 linear's halves of tq_linear / tq_dequantize_rows (weight_abi.h; NF4 / FP4 and affine
// int4, see lut4_linear.h): argument checks, activation permutation, threading. The kernels come
// from the active ISA's table (kernels.h).
#include "lut4_linear.h"

#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "bf16_amx.h"
#include "bf16_dp_gemm.h"
#include "common.h"
#include "kernels.h"
#include "stream_prefetch.h"
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

// The paths calls may take (Lut4Paths bits): both unless TORCHQ_NATIVE_DECODE=0 /
// TORCHQ_NATIVE_GEMM=0 at load or tq_set_lut4_paths turn one off (for comparisons and tests).
std::atomic<int> g_paths{[] {
  const char* d = getenv("TORCHQ_NATIVE_DECODE");
  const char* g = getenv("TORCHQ_NATIVE_GEMM");
  return (d && strcmp(d, "0") == 0 ? 0 : LUT4_DECODE) | (g && strcmp(g, "0") == 0 ? 0 : LUT4_GEMM);
}()};

// The scaled dot path's mode (Lut4ScaledDotMode) and the calls that took it (tq_scaled_dot_calls_lut4, for tests).
std::atomic<int> g_scaled_dot{LUT4_SCALED_DOT_ON};
std::atomic<int64_t> g_scaled_dot_calls{0};
// Whether the scaled dot path's table kind (NF4 / FP4) runs (tq_set_lut4_table_dot): by default on
// AMD CPUs, where it was measured faster than the table path (Zen 4), not on Intel ones, where
// vdpbf16ps costs about two FMAs and it was measured slower (lut4_linear.h);
// TORCHQ_NATIVE_TABLE_DOT=0 / 1 (read at load) overrides.
std::atomic<int> g_table_dot{[] {
  const char* s = getenv("TORCHQ_NATIVE_TABLE_DOT");
  if (s && *s) return strcmp(s, "0") != 0 ? 1 : 0;
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 1 : 0;
}()};
// The bf16 dot path's mode (Lut4DotMode) and the calls that took it (tq_dot_calls_lut4).
std::atomic<int> g_dot{LUT4_DOT_ON};
std::atomic<int64_t> g_dot_calls{0};

// The decode path for this call (p.decode, and its function and lane width), or DECODE_NONE.
int choose_decode(const Lut4Params& p, Lut4DecodeFn* fn, int* lanes) {
  const Lut4Kernels& ks = kernels().lut4;
  const int paths = lut4_paths();
  if ((paths & LUT4_DECODE) && ks.lookup && (ks.lookup_preferred || (paths & LUT4_LOOKUP_ANY_ISA)) && p.M == 1 &&
      lut4_lookup_allowed(p)) {
    *fn = ks.lookup;
    return DECODE_LOOKUP;
  }
  if (!(paths & LUT4_DECODE) || p.M > kLut4DecodeMaxM || !ks.decode) return DECODE_NONE;
  const int kind = lut4_decode_kind(p);
  if (kind == DECODE_NONE) return DECODE_NONE;
  if (p.K % (8 * ks.decode_lanes) == 0) {
    *fn = ks.decode;
    *lanes = ks.decode_lanes;
    return kind;
  }
  return DECODE_NONE;
}

// each(ctx, m, row) for every row m of x [M, K_in] of `dtype`, converted to fp32 and zero-padded
// to `padded` elements in a buffer of the calling thread's own. Rows are independent, so they run
// in parallel (`work`: parallel_for's estimate of the call's size): at M = 256, K = 1536 the
// activation preparation below took 0.6 ms on one thread, a fifth of the GEMM after it. False
// when a thread could not allocate its buffer.
typedef void (*RowFn)(void* ctx, int64_t m, float* row);
struct EachRowJob {
  const void* x;
  int dtype;
  int64_t K_in, padded;
  RowFn each;
  void* ctx;
  std::atomic<bool> failed{false};
};

void each_row_range(void* ctx, int64_t m0, int64_t m1) {
  EachRowJob& j = *static_cast<EachRowJob*>(ctx);
  float* row = static_cast<float*>(aligned_alloc(64, (j.padded * sizeof(float) + 63) / 64 * 64));
  if (!row) {
    j.failed.store(true, std::memory_order_relaxed);
    return;
  }
  const size_t esize = dtype_size(j.dtype);
  for (int64_t m = m0; m < m1; ++m) {
    to_f32_row(static_cast<const char*>(j.x) + m * j.K_in * esize, j.dtype, j.K_in, j.padded, row);
    j.each(j.ctx, m, row);
  }
  free(row);
}

bool for_each_f32_row(const void* x, int dtype, int64_t M, int64_t K_in, int64_t padded, int threads, int64_t work, RowFn each,
                      void* ctx) {
  EachRowJob job{x, dtype, K_in, padded, each, ctx};
  parallel_for(M, 1, threads, each_row_range, &job, 0, work);
  return !job.failed.load(std::memory_order_relaxed);
}

// An activation row in a kernel path's order: permuted per chunk by `order` into xp and, for the
// affine decode path, each span's per-lane sums (in double, rounded once) into xsums.
struct PrepJob {
  int64_t K, chunk;
  int16_t order[128];  // the element each position of a chunk takes
  float* xp;
  float* xsums;
  bool affine_sums;
  int64_t span;
  int lanes;
  int64_t sum_block;  // the lookup path with zeros: each block's sum of x (in double, rounded once) into xsums
};

void prepare_row(void* ctx, int64_t m, float* row) {
  const PrepJob& j = *static_cast<const PrepJob*>(ctx);
  const int64_t K = j.K;
  float* dst = j.xp + m * K;
  for (int64_t k = 0; k < K; k += j.chunk)
    for (int64_t i = 0; i < j.chunk; ++i) dst[k + i] = row[k + j.order[i]];
  if (j.affine_sums)  // per span and lane: the sum of the lane's activations
    for (int64_t k0 = 0; k0 < K; k0 += j.span)
      for (int l = 0; l < j.lanes; ++l) {
        double sum = 0.0;
        for (int64_t k = k0; k < k0 + j.span; k += j.chunk)
          for (int v = 0; v < 8; ++v) sum += dst[k + v * j.lanes + l];
        j.xsums[(m * (K / j.span) + k0 / j.span) * j.lanes + l] = static_cast<float>(sum);
      }
  if (j.sum_block)
    for (int64_t b = 0; b < K / j.sum_block; ++b) {
      double sum = 0.0;
      for (int64_t k = b * j.sum_block; k < (b + 1) * j.sum_block; ++k) sum += dst[k];
      j.xsums[m * (K / j.sum_block) + b] = static_cast<float>(sum);
    }
  if (j.affine_sums)  // vector v of a chunk meets the nibbles in place (c 16^v): x 16^-v, exact
    for (int64_t k = 0; k < K; k += j.chunk)
      for (int v = 1; v < 7; ++v) {
        const float scale = 1.0f / static_cast<float>(1 << (4 * v));
        for (int l = 0; l < j.lanes; ++l) dst[k + v * j.lanes + l] *= scale;
      }
}

// Whether activations (n values) may take the bf16 dot path (lut4_linear.h): finite, below 2^64,
// and each 0 or of magnitude >= 2^-59.
bool dot_activations(const float* x, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = __builtin_fabsf(x[i]);
    ok &= (a < 0x1p64f) & ((a >= 0x1p-59f) | (a == 0.0f));  // false for NaN
  }
  return ok;
}

// A bf16 activation row in the table path's order (xp: per 32, the 16 even positions then the 16
// odd ones) into the bf16 dot paths' (per 64, the 32 odd positions then the 32 even ones; zero
// past K), positions [64 j, 64 j + 64) at dst + j * stride. The values are bf16 (x was), so the
// high halves are exact.
void to_dot_order(const float* xp, int64_t K, uint16_t* dst, int64_t stride) {
  auto bf16 = [](float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return static_cast<uint16_t>(u >> 16);
  };
  for (int64_t k = 0; k < K; k += 64, dst += stride) {
    const bool second = k + 32 < K;  // K is a multiple of 32
    for (int j = 0; j < 16; ++j) {
      dst[j] = bf16(xp[k + 16 + j]);
      dst[16 + j] = second ? bf16(xp[k + 48 + j]) : 0;
      dst[32 + j] = bf16(xp[k + j]);
      dst[48 + j] = second ? bf16(xp[k + 32 + j]) : 0;
    }
  }
}

// A bf16 activation row in the table path's order (xp, as to_dot_order reads it) into the scaled dot
// path's (lut4_scaled_dot_body.h): per 128 positions, four runs of 32 words, run i word j the
// position 4j + (1, 0, 3, 2)[i] (the order the weights' nibbles come out of 16-bit words; zero past
// K), positions [128 c, 128 c + 128) at dst + c * stride.
void to_chunk_order(const float* xp, int64_t K, uint16_t* dst, int64_t stride) {
  static constexpr int kNibblePosition[4] = {1, 0, 3, 2};
  for (int64_t k = 0; k < K; k += 128, dst += stride)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 32; ++j) {
        const int64_t pos = k + 4 * j + kNibblePosition[i], r = pos & 31;
        uint32_t u = 0;
        if (pos < K) memcpy(&u, xp + (pos - r) + (r % 2 ? 16 + r / 2 : r / 2), sizeof u);
        dst[32 * i + j] = static_cast<uint16_t>(u >> 16);
      }
}

// The bf16 AMX GEMM (bf16_amx.h) on p's weight: each panel decoded as the dequantized tiles hold it.
struct AmxDecode {
  const Lut4Params* p;
  Lut4DequantFn dequant;
};

// Four rows at a time, each time fetching into L2 the codes and per-block values of the rows
// kStreamFarBytes of codes ahead (rows of a few hundred bytes: the hardware prefetchers do not ramp
// up on them).
void amx_decode(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst) {
  const AmxDecode& d = *static_cast<const AmxDecode*>(ctx);
  const Lut4Params& p = *d.p;
  const int64_t row_bytes = p.K / 2, G = p.blocks_per_row, ahead = (kStreamFarBytes + row_bytes - 1) / row_bytes;
  for (int64_t a = n0; a < n1; a += 4) {
    const int64_t b = n1 - a < 4 ? n1 : a + 4, f = a + ahead, rows = b - a;
    prefetch_l2(p.packed + f * row_bytes, rows * row_bytes, p.packed + p.N * row_bytes);
    const auto values = [&](const void* base, int64_t esize) {
      if (base) prefetch_l2(static_cast<const char*>(base) + f * G * esize, rows * G * esize, static_cast<const char*>(base) + p.N * G * esize);
    };
    values(p.absmax, 4);
    values(p.nested_codes, 1);
    values(p.shifts, 4);
    values(p.zeros, 4);
    d.dequant(p, a, b, dst + (a - n0) * p.K, true);
  }
}

// out = x @ W.T (+ bias), x [M, K_in] and out [M, N] of `dtype`: converts and zero-pads the
// activations to fp32 rows of p.K and permutes them for the chosen path (see lut4_linear.h), runs
// the rows into an fp32 output, then rounds it to `dtype` (once, at the end).
int linear(Lut4Params p, const void* x, int dtype, int64_t K_in, void* out, int threads) {
  const int64_t M = p.M, K = p.K, N = p.N;
  const Lut4Kernels& lk = kernels().lut4;
  const AmxDecode gemm_decode{&p, lk.dequant_bf16 && lut4_bf16_pairs(p) ? lk.dequant_bf16 : lk.dequant};
  if (dtype == DT_BF16 && M >= kBf16AmxMinM && M <= kBf16AmxMaxM && bf16_amx_active()) {
    const int status = bf16_amx_linear(static_cast<const uint16_t*>(x), M, K_in, K, N, p.bias, amx_decode, &gemm_decode, out, threads,
                                       kLinearSpinUs);
    if (status >= 0) return status;
  }
  const int64_t dp_min_m = lut4_bf16_dot_weights(p) && lut4_dot_kernel()                 ? kLut4DotMaxM + 1
                           : lut4_scaled_dot_allowed(p) && lut4_scaled_dot_kernel() ? kBf16DpLut4ScaledMinM
                                                                                    : kBf16DpLut4MinM;
  if (const Bf16DpGemmFn dp = dtype == DT_BF16 ? bf16_dp_gemm(M, dp_min_m, false) : nullptr) {
    Bf16DpGemm g{};
    g.N = N;
    g.K = K;
    g.bias = p.bias;
    g.decode = amx_decode;
    g.ctx = &gemm_decode;
    const int status = bf16_dp_linear(dp, g, static_cast<const uint16_t*>(x), M, K_in, out, threads, kLinearSpinUs);
    if (status >= 0) return status;
  }
  // The scaled dot path serves its weights' bf16 calls up to kLut4ScaledDotMaxM rows, one row too
  // (ahead of the lookup path); the activations' guard comes after they are prepared.
  const Lut4RowsFn scaled = dtype == DT_BF16 && M >= kLut4ScaledDotMinM && M <= kLut4ScaledDotMaxM &&
                                    (lut4_scaled_dot_allowed(p) || lut4_table_dot_active(p))
                                ? lut4_scaled_dot_kernel()
                                : nullptr;
  Lut4DecodeFn decode = nullptr;
  int lanes = 0;
  p.decode = scaled ? DECODE_NONE : choose_decode(p, &decode, &lanes);
  const bool block_sums = (p.decode == DECODE_LOOKUP || scaled) && p.zeros;  // [M, K / block] activation sums
  const size_t esize = dtype_size(dtype);
  const size_t xp_bytes = (M * K * sizeof(float) + 63) / 64 * 64;
  const int64_t span = lanes ? (p.block > 8 * lanes ? p.block : 8 * lanes) : 0;  // the lane-order paths
  const size_t xsum_bytes = p.decode == DECODE_AFFINE ? (M * (K / span) * lanes * sizeof(float) + 63) / 64 * 64
                            : block_sums ? (M * (K / p.block) * sizeof(float) + 63) / 64 * 64 : 0;
  const size_t row_bytes = (K * sizeof(float) + 63) / 64 * 64;
  const size_t out_bytes = dtype == DT_F32 ? 0 : (M * N * sizeof(float) + 63) / 64 * 64;
  char* buf = static_cast<char*>(aligned_alloc(64, xp_bytes + xsum_bytes + row_bytes + out_bytes + 64));
  if (!buf) return OUT_OF_MEMORY;
  float* xp = reinterpret_cast<float*>(buf);
  float* xsums = reinterpret_cast<float*>(buf + xp_bytes);
  float* row = reinterpret_cast<float*>(buf + xp_bytes + xsum_bytes);
  // Non-finite activations take the table path (its inf * w is the reference's), and so do huge
  // ones: the decode paths' separate terms (c x and d X) can overflow where sum (c + d) x does not;
  // for the affine path also tiny ones (0 < |x| < 2^-102), whose prescaled x 16^-6 could lose bits.
  if (p.decode) {
    const float tiny = p.decode == DECODE_AFFINE ? 0x1p-102f : 0.0f;
    for (int64_t m = 0; m < M && p.decode; ++m) {
      to_f32_row(static_cast<const char*>(x) + m * K_in * esize, dtype, K_in, K, row);
      for (int64_t k = 0; k < K; ++k)
        if (!(__builtin_fabsf(row[k]) < 0x1p64f) || (__builtin_fabsf(row[k]) < tiny && row[k] != 0.0f)) {  // also NaN
          p.decode = DECODE_NONE;
          decode = nullptr;
          break;
        }
    }
  }
  // the lane order of DECODE_AFFINE / DECODE_CODEBOOK, else the table path's (also DECODE_LOOKUP's)
  const bool lane_order = p.decode == DECODE_AFFINE || p.decode == DECODE_CODEBOOK;
  PrepJob prep{K, lane_order ? 8 * lanes : 32, {}, xp, xsums, p.decode == DECODE_AFFINE, span, lanes, block_sums ? p.block : 0};
  for (int64_t i = 0; i < prep.chunk; ++i)
    prep.order[i] = static_cast<int16_t>(lane_order ? lut4_decode_element(lanes, i) : i < 16 ? 2 * i : 2 * (i - 16) + 1);
  if (!for_each_f32_row(x, dtype, M, K_in, K, threads, M * K * 8, prepare_row, &prep)) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  p.xp = xp;
  p.xsums = xsums;
  p.out = dtype == DT_F32 ? static_cast<float*>(out) : reinterpret_cast<float*>(buf + xp_bytes + xsum_bytes + row_bytes);
  const bool gemm = p.M >= kLut4GemmMinM && lut4_gemm_active();
  const Lut4Kernels& k = kernels().lut4;
  const bool pairs = k.rows_bf16 && lut4_bf16_pairs(p);
  Lut4RowsFn rows = decode ? decode : gemm ? k.gemm : pairs ? k.rows_bf16 : k.rows;
  uint16_t* xb = nullptr;
  const Lut4RowsFn dot = dtype == DT_BF16 && !decode && M >= kLut4DotMinM && M <= kLut4DotMaxM && lut4_bf16_dot_weights(p) ? lut4_dot_kernel() : nullptr;
  if (dot && dot_activations(xp, M * K)) {
    p.kx = (K + 63) / 64 * 64;
    xb = static_cast<uint16_t*>(aligned_alloc(64, (M * p.kx * sizeof(uint16_t) + 63) / 64 * 64));
    if (xb) {
      for (int64_t m = 0; m < M; ++m) to_dot_order(xp + m * K, K, xb + m * p.kx, 64);
      p.xb = xb;
      rows = dot;
      g_dot_calls.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (scaled && dot_activations(xp, M * K)) {
    p.kx = (K + 127) / 128 * 128;
    xb = static_cast<uint16_t*>(aligned_alloc(64, M * p.kx * sizeof(uint16_t)));
    if (xb) {  // chunk-major: positions [128 c, 128 c + 128) of row m at (c * M + m) * 128 (lut4_scaled_dot_body.h)
      for (int64_t m = 0; m < M; ++m) to_chunk_order(xp + m * K, K, xb + m * 128, M * 128);
      p.xb = xb;
      rows = scaled;
      g_scaled_dot_calls.fetch_add(1, std::memory_order_relaxed);
    }
  }
  RowsJob job{p, rows};
  parallel_for(N, 4, threads, run_rows, &job, kLinearSpinUs, M * N * K);
  if (dtype != DT_F32) from_f32_rows(p.out, M * N, dtype, out, threads);
  free(xb);
  free(buf);
  return OK;
}

}  // namespace

// The portable quantization of one activation block (Lut4Q8BlockFn, lut4_linear.h).
float lut4_q8_block_portable(const float* v, int8_t* dst, int32_t* qsum) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < 32; ++i) {
    const float a = __builtin_fabsf(v[i]);
    finite = finite && a <= 3.4028235e38f;  // false for inf and NaN
    amax = a > amax ? a : amax;
  }
  const float a = finite ? amax / 127.0f : __builtin_nanf("");
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    float q = finite && a > 0.0f ? __builtin_nearbyintf(v[i] / a) : 0.0f;
    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
    dst[(i & 1) * 32 + i / 2] = static_cast<int8_t>(q);
    sum += static_cast<int32_t>(q);
  }
  *qsum = sum;
  return a;
}

Lut4RowsFn lut4_q8_amx_gemm() {
  const int mode = int8_amx_mode();
  if (mode == INT8_AMX_EMULATED) return __builtin_cpu_supports("avx2") ? kLut4Q8AmxEmulatedGemm : nullptr;
  return mode == INT8_AMX_ON && active_isa() == ISA_AVX512 && amx_int8_supported() ? kLut4Q8AmxGemm : nullptr;
}

namespace {

// More rows than kLut4Q8MaxM where no integer GEMM form runs (the portable table, a block that is
// not a multiple of 32, TORCHQ_NATIVE_GEMM=0): the fp32 paths (table / GEMM) on the fake-quantized
// activations a * q, rounded in fp32 as the reference forms them.
struct FakeQuantJob {
  int64_t K;
  float* xhat;
};

void fake_quantize_row(void* ctx, int64_t m, float* row) {  // row: zero-padded to a multiple of 32
  const FakeQuantJob& j = *static_cast<const FakeQuantJob*>(ctx);
  const Lut4Q8BlockFn quantize = kernels().lut4.q8_block;
  int8_t codes[48];  // evens at [0, 16), odds at [32, 48)
  int32_t qsum;
  for (int64_t k = 0; k < j.K; k += 32) {
    const float a = quantize(row + k, codes, &qsum);
    for (int64_t i = 0; i < 32 && k + i < j.K; ++i) j.xhat[m * j.K + k + i] = a * static_cast<float>(codes[(i & 1) * 32 + i / 2]);
  }
}

int linear_fake_quantized(const Lut4Params& p, const void* x, int dtype, int64_t K_in, void* out, int threads) {
  const int64_t M = p.M, K = p.K, kq = (K + 63) / 64 * 64;
  float* xhat = static_cast<float*>(aligned_alloc(64, (M * K * sizeof(float) + 63) / 64 * 64));
  if (!xhat) return OUT_OF_MEMORY;
  FakeQuantJob job{K, xhat};
  if (!for_each_f32_row(x, dtype, M, K_in, kq, threads, M * K * 16, fake_quantize_row, &job)) {
    free(xhat);
    return OUT_OF_MEMORY;
  }
  int status;
  if (dtype == DT_F32) {
    status = linear(p, xhat, DT_F32, K, out, threads);
  } else {
    float* y = static_cast<float*>(aligned_alloc(64, (M * p.N * sizeof(float) + 63) / 64 * 64));
    status = y ? linear(p, xhat, DT_F32, K, y, threads) : OUT_OF_MEMORY;
    if (status == OK) from_f32_rows(y, M * p.N, dtype, out, threads);
    free(y);
  }
  free(xhat);
  return status;
}

// One activation row of the int8-activation path in the kernels' order (lut4_linear.h): codes
// into xq8, each block's scale (4 copies; times the codebook kind's unit) into xa, and per weight
// block sum_j a_j Q_j (in double, rounded once) into xblk.
struct Q8PrepJob {
  const Lut4Params* p;
  int8_t* xq8;
  float* xa;
  float* xblk;
  bool affine;
};

void quantize_q8_row(void* ctx, int64_t m, float* row) {  // row: zero-padded to kq
  const Q8PrepJob& j = *static_cast<const Q8PrepJob*>(ctx);
  const Lut4Params& p = *j.p;
  const int64_t K = p.K, kq = p.kq, G = p.blocks_per_row;
  const Lut4Q8BlockFn quantize = kernels().lut4.q8_block;
  double block_sum = 0.0;  // sum over the current weight block of a_j * Q_j
  for (int64_t b = 0; b < kq / 32; ++b) {
    int32_t qsum;
    const float a = quantize(row + 32 * b, j.xq8 + m * kq + (b / 2) * 64 + (b % 2) * 16, &qsum);
    float* av = j.xa + (m * (kq / 64) + b / 2) * 8 + (b % 2) * 4;
    for (int l = 0; l < 4; ++l) av[l] = j.affine ? a : a * p.q8_unit;  // the codebook kind's unit folded in
    if (32 * b < K) {
      block_sum += static_cast<double>(a) * qsum;
      if ((32 * (b + 1)) % p.block == 0 || 32 * (b + 1) >= K) {
        j.xblk[m * G + 32 * b / p.block] = static_cast<float>(block_sum);
        block_sum = 0.0;
      }
    }
  }
}

// The int8-activation path (lut4_linear.h): quantizes each activation row per 32-block exactly as
// torchq.activation.PerBlockInt8 does into the kernels' order (rows in parallel), then runs
// kernels().lut4.q8 up to kLut4Q8MaxM rows; above (from q8_gemm_min_m rows where that is fewer),
// its GEMM form where the ISA has one (block a multiple of 32), else linear_fake_quantized.
int linear_q8(Lut4Params p, const void* x, int dtype, int64_t K_in, void* out, int threads) {
  if (p.round_mul != ROUND_NONE || p.round_add != ROUND_NONE) return BAD_ARGUMENT;
  bool affine = true;
  float cmax = 0.0f;
  for (int c = 0; c < 16; ++c) {
    affine = affine && p.codebook[c] == p.codebook[0] + static_cast<float>(c);
    const float v = __builtin_fabsf(p.codebook[c]);
    if (!(v <= 3.0e38f)) return BAD_ARGUMENT;  // also NaN
    cmax = v > cmax ? v : cmax;
  }
  if (!affine && (p.shifts || p.zeros || cmax == 0.0f)) return BAD_ARGUMENT;
  const Lut4RowsFn gemm = p.block % 32 == 0 && (lut4_paths() & LUT4_GEMM) ? kernels().lut4.q8_gemm : nullptr;
  if (p.M > kLut4Q8MaxM && !gemm) return linear_fake_quantized(p, x, dtype, K_in, out, threads);
  p.q8_affine = affine ? 1 : 0;
  p.q8_unit = cmax / 127.0f;
  for (int c = 0; c < 16; ++c)
    p.q8_table[c] = affine ? 0 : static_cast<int8_t>(__builtin_nearbyintf(127.0f * (p.codebook[c] / cmax)));
  const int64_t M = p.M, K = p.K, N = p.N, kq = (K + 63) / 64 * 64, G = p.blocks_per_row;
  p.kq = kq;
  const size_t q_bytes = (M * kq + 63) / 64 * 64;
  const size_t a_bytes = (M * (kq / 64) * 8 * sizeof(float) + 63) / 64 * 64;
  const size_t blk_bytes = (M * G * sizeof(float) + 63) / 64 * 64;
  const size_t out_bytes = dtype == DT_F32 ? 0 : (M * N * sizeof(float) + 63) / 64 * 64;
  char* buf = static_cast<char*>(aligned_alloc(64, q_bytes + a_bytes + blk_bytes + out_bytes + 64));
  if (!buf) return OUT_OF_MEMORY;
  Q8PrepJob prep{&p, reinterpret_cast<int8_t*>(buf), reinterpret_cast<float*>(buf + q_bytes),
                 reinterpret_cast<float*>(buf + q_bytes + a_bytes), affine};
  p.xq8 = prep.xq8;
  p.xa = prep.xa;
  p.xblk = prep.xblk;
  if (!for_each_f32_row(x, dtype, M, K_in, kq, threads, M * K * 16, quantize_q8_row, &prep)) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  p.out = dtype == DT_F32 ? static_cast<float*>(out) : reinterpret_cast<float*>(buf + q_bytes + a_bytes + blk_bytes);
  const int64_t gemm_min_m = kernels().lut4.q8_gemm_min_m > 0 ? kernels().lut4.q8_gemm_min_m : kLut4Q8MaxM + 1;
  const bool use_gemm = gemm && (M > kLut4Q8MaxM || M >= gemm_min_m);
  Lut4RowsFn amx = use_gemm && !affine && M >= kLut4Q8AmxMinM ? lut4_q8_amx_gemm() : nullptr;
  int8_t* blocks = amx ? static_cast<int8_t*>(aligned_alloc(64, q_bytes)) : nullptr;
  if (blocks) {  // each 32-block's codes together (Lut4Params.xq8_blocks): quarters 0, 2, 1, 3
    for (int64_t c = 0; c < M * kq; c += 64) {
      memcpy(blocks + c, prep.xq8 + c, 16);
      memcpy(blocks + c + 16, prep.xq8 + c + 32, 16);
      memcpy(blocks + c + 32, prep.xq8 + c + 16, 16);
      memcpy(blocks + c + 48, prep.xq8 + c + 48, 16);
    }
    p.xq8_blocks = blocks;
    note_amx_int8_call();
  } else {
    amx = nullptr;
  }
  RowsJob job{p, amx ? amx : use_gemm ? gemm : kernels().lut4.q8};
  // The GEMM form's ranges are whole panels of 16 weight rows. The row kernel's work counts half
  // an fp32 multiply-add per weight: at a quarter, SmolLM2's 576x576 M=1 calls ran on one thread
  // (AVX2, 2 threads: 15.5 us, split 10.6 us; int4a8 decode steps 16.8 -> 16.0 and 16.4 -> 15.5 ms
  // in two runs with the equivalent min_parallel_work alternated in one process). The GEMM form's
  // counts a sixteenth per product plus its panels' unpacking, one pass over the weight like a row
  // of the row kernel: without it, 5-8-row calls of SmolLM2's 576 x 576 ran on one thread (VNNI, 2
  // threads, M = 5: 77 us, the row kernel split in two 79).
  const int64_t work = use_gemm ? N * K / 2 + M * N * K / 16 : M * N * K / 2;
  parallel_for(N, use_gemm ? 16 : 4, threads, run_rows, &job, kLinearSpinUs, work);
  if (dtype != DT_F32) from_f32_rows(p.out, M * N, dtype, out, threads);
  free(blocks);
  free(buf);
  return OK;
}

int dequantize(const Lut4Params& p, int64_t n0, int64_t n1, void* out, bool out_bf16, int threads) {
  const Lut4Kernels& k = kernels().lut4;
  DequantJob job{&p, k.dequant_bf16 && lut4_bf16_pairs(p) ? k.dequant_bf16 : k.dequant, n0, out, out_bf16};
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
         !w.codes && !w.row_sums && w.codes_order == 0 && !w.code_sums;
}

Lut4Params params(const tq_weight& w, int64_t M, const float* bias) {
  Lut4Params p{nullptr, M, w.row_length, w.n, w.block, w.packed, w.codebook, w.scales, w.nested_codes,
               w.nested_absmax, w.nested_offset ? *w.nested_offset : 0.0f, w.nested_map, bias, nullptr,
               w.shifts, w.zeros, w.round_mul, w.round_add, DECODE_NONE, nullptr, w.row_length / w.block};
  return p;  // the int8-activation fields are zero until linear_q8 sets them
}

}  // namespace

int lut4_paths() { return g_paths.load(std::memory_order_relaxed); }
bool lut4_gemm_active() { return (lut4_paths() & LUT4_GEMM) && kernels().lut4.gemm; }

int lut4_linear(const tq_weight& w, const void* x, int dtype, int64_t M, const float* bias, void* out, int threads) {
  if (!valid_lut4(w)) return BAD_ARGUMENT;
  if (w.format == TQ_FORMAT_LUT4_INT8ACT) return linear_q8(params(w, M, bias), x, dtype, w.k, out, threads);
  return linear(params(w, M, bias), x, dtype, w.k, out, threads);
}

int lut4_dot_max_m(const tq_weight& w) {
  if (!valid_lut4(w) || w.format != TQ_FORMAT_LUT4) return 0;
  // the largest of the dot-product GEMM's (every row count above the dot paths', but on AMX CPUs),
  // the AMX GEMM's and the dot paths'
  int64_t most = bf16_dp_max_m();
  if (bf16_amx_active() && kBf16AmxMaxM > most) most = kBf16AmxMaxM;
  const Lut4Params p = params(w, 0, nullptr);
  const int64_t dot = (lut4_scaled_dot_allowed(p) || lut4_table_dot_active(p)) && lut4_scaled_dot_kernel() ? kLut4ScaledDotMaxM
                      : lut4_bf16_dot_weights(p) && lut4_dot_kernel()                                   ? kLut4DotMaxM
                                                                                                         : 0;
  return static_cast<int>(dot > most ? dot : most);
}

Lut4RowsFn lut4_dot_kernel() {
  if (!(lut4_paths() & LUT4_DECODE)) return nullptr;
  const int mode = g_dot.load(std::memory_order_relaxed);
  return mode == LUT4_DOT_EMULATED ? kLut4EmulatedDot : mode == LUT4_DOT_ON ? kernels().lut4.dot_bf16 : nullptr;
}

bool lut4_table_dot_active(const Lut4Params& p) { return g_table_dot.load(std::memory_order_relaxed) && lut4_table_dot_allowed(p); }

// The guard of `kernel` (one of the scaled dot kernels, or null: -1) with the given lower bound.
int scaled_dot_values_ok(Lut4RowsFn kernel, const float* v, const float* w, int64_t count, uint32_t min_bits) {
  if (!v || count < 0) return -1;
  if (kernel == kLut4EmulatedScaledDot) return kLut4EmulatedScaledDotValuesOk(v, w, count, min_bits);
  if (kernel && kernel == kLut4Avx512Bf16ScaledDot) return kLut4Avx512Bf16ScaledDotValuesOk(v, w, count, min_bits);
  return -1;
}

Lut4RowsFn lut4_scaled_dot_kernel() {
  if (!(lut4_paths() & LUT4_DECODE)) return nullptr;
  const int mode = g_scaled_dot.load(std::memory_order_relaxed);
  return mode == LUT4_SCALED_DOT_EMULATED ? kLut4EmulatedScaledDot : mode == LUT4_SCALED_DOT_ON ? kernels().lut4.scaled_dot : nullptr;
}

int lut4_dequantize(const tq_weight& w, int64_t n0, int64_t n1, void* dst, bool bf16, int threads) {
  if (!valid_lut4(w)) return BAD_ARGUMENT;
  const Lut4Params p = params(w, 0, nullptr);
  return dequantize(p, n0, n1, dst, bf16, threads);
}

}  // namespace tq

// Allow the lut4 paths in `paths` (Lut4Paths bits), forbid the others; returns the previous
// bits (a negative `paths` only reads them).
TQ_API int tq_set_lut4_paths(int paths) { return paths < 0 ? tq::lut4_paths() : tq::g_paths.exchange(paths & 7); }
// The scaled dot path's mode (tq::Lut4ScaledDotMode; negative: read); returns the mode before, or -1
// (unchanged) for a mode that is not one. LUT4_SCALED_DOT_ON where the CPU lacks AVX512_BF16 (or the
// ISA is capped below AVX-512) leaves the other paths serving every call.
TQ_API int tq_set_lut4_scaled_dot(int mode) {
  if (mode < 0) return tq::g_scaled_dot.load();
  if (mode > tq::LUT4_SCALED_DOT_EMULATED) return -1;
  return tq::g_scaled_dot.exchange(mode);
}
// The guard of the scaled dot kernel that the current mode runs (lut4_scaled_dot_body.h's
// values_ok), for tests: 1 where every v[i] and w[i] (w may be null; count >= 0 of each) lets its
// weight row take the path (0, or normal and at most 2^100), 0 where one does not; -1 where no
// kernel runs (the mode, the ISA or lut4_paths) or v is null.
TQ_API int tq_lut4_scaled_dot_values_ok(const float* v, const float* w, int64_t count) {
  return tq::scaled_dot_values_ok(tq::lut4_scaled_dot_kernel(), v, w, count, 0x00800000u);
}
// The table kind's guard (NF4 / FP4 absmax, lut4_linear.h) likewise: 1 where every v[i] of [0, count)
// is 0 or of magnitude in [2^-40, 2^100], 0 where one is not; -1 where no kernel runs or v is null.
TQ_API int tq_lut4_table_dot_values_ok(const float* v, int64_t count) {
  return tq::scaled_dot_values_ok(tq::lut4_scaled_dot_kernel(), v, nullptr, count, tq::kLut4TableDotMinBits);
}
// The scaled dot path's table kind on (1) or off (0; negative: read); returns the setting before, or
// -1 (unchanged) for a value that is not one.
TQ_API int tq_set_lut4_table_dot(int on) {
  if (on < 0) return tq::g_table_dot.load();
  if (on > 1) return -1;
  return tq::g_table_dot.exchange(on);
}
// How many lut4 calls have taken the scaled dot path since the library loaded.
TQ_API int64_t tq_scaled_dot_calls_lut4() { return tq::g_scaled_dot_calls.load(); }
// The bf16 dot path's mode (tq::Lut4DotMode; negative: read), as tq_set_lut4_scaled_dot's.
TQ_API int tq_set_lut4_dot(int mode) {
  if (mode < 0) return tq::g_dot.load();
  if (mode > tq::LUT4_DOT_EMULATED) return -1;
  return tq::g_dot.exchange(mode);
}
// How many lut4 calls have taken the bf16 dot path since the library loaded.
TQ_API int64_t tq_dot_calls_lut4() { return tq::g_dot_calls.load(); }
