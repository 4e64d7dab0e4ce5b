// The int8 linears' halves of tq_linear / tq_dequantize_rows (weight_abi.h; see int8_linear.h):
// argument checks, activation conversion and quantization, threading. The kernels come from the active ISA's table (kernels.h).
#include "int8_linear.h"
#include "lut4_linear.h"  // lut4_paths(): the GEMM switch

#include <float.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>

#include "bf16_amx.h"
#include "common.h"
#include "kernels.h"
#include "weight_abi.h"

namespace tq {
namespace {

// In a model, PyTorch's own ops run between two linears: workers sleep right away (see
// lut4_linear.cpp).
constexpr int kSpinUs = 0;

struct RowsJob {
  Int8Params p;
  Int8RowsFn rows;
};

void run_rows(void* ctx, int64_t n0, int64_t n1) {
  const RowsJob& j = *static_cast<const RowsJob*>(ctx);
  j.rows(j.p, n0, n1);
}

// The AMX mode (Int8Amx): on unless TORCHQ_NATIVE_AMX=0 at load; tq_set_int8_amx sets it. The
// calls that took the AMX form (either mode), for tests: tq_amx_int8_calls.
std::atomic<int> g_amx{[] {
  const char* s = getenv("TORCHQ_NATIVE_AMX");
  return s && strcmp(s, "0") == 0 ? INT8_AMX_OFF : INT8_AMX_ON;
}()};
std::atomic<int64_t> g_amx_calls{0};

struct QuantJob {
  Int8QuantizeFn quantize;
  const void* x;  // [M, K] of dtype
  int dtype;
  int64_t K, Kp;
  Int8Quant q;
  int offset;
  void* codes;
  float* xs;
  std::atomic<bool>* failed;  // set when a range could not allocate its row buffer
};

// Rows [m0, m1): fp32 rows quantized in place; bf16 / fp16 rows each widened (exactly) into one
// row of fp32 first, so the quantization sees the reference's fp32 values without an [M, K] fp32
// copy (at 256 x 1536, the copy and its first touch took a third of the call).
void quantize_rows(void* ctx, int64_t m0, int64_t m1) {
  const QuantJob& j = *static_cast<const QuantJob*>(ctx);
  if (j.dtype == DT_F32) {
    j.quantize(static_cast<const float*>(j.x), j.K, j.Kp, j.q, j.offset, j.codes, j.xs, m0, m1);
    return;
  }
  float* row = static_cast<float*>(aligned_alloc(64, (j.K * sizeof(float) + 63) / 64 * 64));
  if (!row) {
    j.failed->store(true, std::memory_order_relaxed);
    return;
  }
  const char* x = static_cast<const char*>(j.x);
  for (int64_t m = m0; m < m1; ++m) {
    to_f32_row(x + m * j.K * dtype_size(j.dtype), j.dtype, j.K, j.K, row);
    j.quantize(row, j.K, j.Kp, j.q, j.offset, static_cast<uint8_t*>(j.codes) + m * j.Kp, j.xs + m, 0, 1);
  }
  free(row);
}

struct DequantJob {
  Int8DequantFn dequant;
  const int8_t* w;
  const float* scale;
  int64_t K, n0;
  void* out;
  bool bf16;
};

void dequant_rows(void* ctx, int64_t a, int64_t b) {
  const DequantJob& j = *static_cast<const DequantJob*>(ctx);
  char* out = static_cast<char*>(j.out) + a * j.K * (j.bf16 ? 2 : 4);
  j.dequant(j.w, j.scale, j.K, j.n0 + a, j.n0 + b, out, j.bf16);
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
  void finish(void* out, int dtype, int64_t count, int threads) {
    if (owned) from_f32_rows(f32, count, dtype, out, threads);
  }
  ~Output() { free(owned); }
};

// The bf16 AMX GEMM (bf16_amx.h) on an int8 weight-only weight: rows q * s as bf16, exactly as the
// dequantized tiles hold them, zero-padded to Kp.
struct AmxDecode {
  const int8_t* codes;
  const float* scale;
  int64_t K, Kp;
};

void amx_decode(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst) {
  const AmxDecode& d = *static_cast<const AmxDecode*>(ctx);
  const Int8DequantFn dequant = kernels().int8.dequant_rows;
  for (int64_t n = n0; n < n1; ++n) {
    uint16_t* row = dst + (n - n0) * d.Kp;
    dequant(d.codes, d.scale, d.K, n, n + 1, row, true);
    memset(row + d.K, 0, static_cast<size_t>(d.Kp - d.K) * 2);
  }
}

// out[M, N] = x[M, K] @ (q * s).T (+ bias): x and out contiguous of `dtype` (DType), int8 codes
// [N, K], fp32 scales [N], fp32 bias or null; products and sums in fp32, one rounding at the end
// (bf16 x of kBf16AmxMinM to kBf16AmxMaxM rows: the bf16 AMX GEMM where it runs).
int weight_only_linear(const void* x, int dtype, int64_t M, int64_t K, const int8_t* codes, int64_t N, const float* scale,
                       const float* bias, void* out, int threads) {
  if (dtype == DT_BF16 && M >= kBf16AmxMinM && M <= kBf16AmxMaxM && bf16_amx_active()) {
    const AmxDecode decode{codes, scale, K, (K + 31) / 32 * 32};
    const int status = bf16_amx_linear(static_cast<const uint16_t*>(x), M, K, decode.Kp, N, bias, amx_decode, &decode, out, threads, kSpinUs);
    if (status >= 0) return status;
  }
  const int64_t Kp = padded(K);
  float* xp = static_cast<float*>(aligned_alloc(64, M * Kp * sizeof(float)));
  Output o;
  if (!xp || !o.init(out, dtype, M * N)) {
    free(xp);
    return OUT_OF_MEMORY;
  }
  to_f32_rows(x, dtype, M, K, Kp, xp, threads);
  const Int8Kernels& kern = kernels().int8;
  const bool gemm = M >= kern.weight_gemm_min_m && int8_weight_gemm_active();
  RowsJob job{{M, K, N, Kp, xp, nullptr, nullptr, nullptr, codes, scale, bias, o.f32, nullptr, 0}, gemm ? kern.weight_gemm : kern.weight_rows};
  parallel_for(N, gemm ? 16 : 4, threads, run_rows, &job, kSpinUs, M * N * K);  // the GEMM's ranges: whole AVX2 panels
  o.finish(out, dtype, M * N, threads);
  free(xp);
  return OK;
}

// out[M, N] = int8(x) @ q.T rescaled (see int8_linear.h): activations quantized per row
// (TQ_FORMAT_INT8_DYNAMIC) or with w's fixed scale and zero point (TQ_FORMAT_INT8_STATIC); x and
// out contiguous of `dtype`. No bias (the reference adds it after rounding to the activation
// dtype). Codes in [qmin, qmax] with qmin >= -127 (the AVX2 sign trick needs |x| <= 127).
int activation_linear(const tq_weight& w, const void* x, int dtype, int64_t M, void* out, int threads) {
  const bool is_static = w.format == TQ_FORMAT_INT8_STATIC;
  const int64_t K = w.k, N = w.n, Kp = padded(K);
  const int qmin = w.act_qmin, qmax = w.act_qmax;
  const Int8Kernels& kern = kernels().int8;
  // a zero point's correction; none for the dynamic format (and none needed for z = 0)
  const bool correct = is_static && w.act_zero_point != 0;
  const bool gemm_allowed = (lut4_paths() & LUT4_GEMM) && !(correct && K > kInt8StaticGemmMaxK);  // the int32 correction could wrap
  const Int8RowsFn amx = gemm_allowed && M >= kInt8AmxMinM ? int8_amx_gemm() : nullptr;
  if (amx) g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  // Narrow kernels from kInt8NarrowGemmMinM rows only: below, the row sums they need cost as much
  // as the sign trick they save.
  const bool narrow = !amx && qmin >= kNarrowMin && qmax <= kNarrowMax && kern.narrow_rows && M >= kInt8NarrowGemmMinM;
  const int offset = amx ? 0 : narrow ? kNarrowOffset : kern.dynamic_offset;
  const bool offset_codes = offset != 0;
  const size_t codes_bytes = (M * Kp + 63) / 64 * 64, xs_bytes = (M * sizeof(float) + 63) / 64 * 64;
  char* buf = static_cast<char*>(aligned_alloc(64, codes_bytes + xs_bytes));
  Output o;
  // the AMX GEMM writes bf16 outputs itself (the fp32 buffer, untouched, serves its fallback)
  const bool direct_bf16 = amx && dtype == DT_BF16;
  if (!buf || !o.init(out, dtype, M * N)) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  float* xs = reinterpret_cast<float*>(buf + codes_bytes);
  const Int8Quant quant{w.act_denom, w.act_eps, qmin, qmax, w.act_scale, w.act_zero_point};
  std::atomic<bool> failed{false};
  QuantJob q{is_static ? kern.quantize_static_rows : kern.quantize_rows, x, dtype, K, Kp, quant, offset, buf, xs, &failed};
  parallel_for(M, 1, threads, quantize_rows, &q, 0, M * K);
  if (failed.load()) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  const Int8Params p{M, K, N, Kp, nullptr, offset_codes ? nullptr : reinterpret_cast<const int8_t*>(buf),
                     offset_codes ? reinterpret_cast<const uint8_t*>(buf) : nullptr, xs, w.codes, w.scales, nullptr,
                     o.f32, correct ? w.row_sums : nullptr, correct ? w.act_zero_point : 0,
                     direct_bf16 ? static_cast<uint16_t*>(out) : nullptr};
  const Int8RowsFn gemm_fn = narrow ? kern.narrow_gemm : kern.dynamic_gemm;
  const bool gemm = amx || ((narrow || M >= kern.dynamic_gemm_min_m) && gemm_fn && gemm_allowed);
  RowsJob job{p, amx ? amx : gemm ? gemm_fn : narrow ? kern.narrow_rows : kern.dynamic_rows};
  parallel_for(N, gemm ? 16 : 4, threads, run_rows, &job, kSpinUs, M * N * K);  // the GEMM's ranges: whole panels
  if (!direct_bf16) o.finish(out, dtype, M * N, threads);
  free(buf);
  return OK;
}

// The int8 fields of w (see weight_abi.h) are consistent: unpadded rows, codes and scales, the
// activation quantization of the dynamic and static formats, and no lut4 fields.
bool valid_int8(const tq_weight& w) {
  if (w.row_length != w.k || !w.codes || !w.scales) return false;
  if (w.packed || w.codebook || w.shifts || w.zeros || w.nested_codes || w.nested_absmax || w.nested_offset || w.nested_map)
    return false;
  const bool range = w.act_qmin >= -127 && w.act_qmax <= 127 && w.act_qmin < w.act_qmax;
  if (w.format == TQ_FORMAT_INT8_STATIC)  // a normal scale: its reciprocal is finite, as the reference requires
    return range && w.row_sums && w.act_scale >= FLT_MIN && w.act_scale <= FLT_MAX && w.act_zero_point >= w.act_qmin &&
           w.act_zero_point <= w.act_qmax;
  if (w.row_sums) return false;
  return w.format != TQ_FORMAT_INT8_DYNAMIC || (range && w.act_denom > 0.0f && w.act_eps > 0.0f);
}

}  // namespace

int int8_linear(const tq_weight& w, const void* x, int dtype, int64_t M, const float* bias, void* out, int threads) {
  if (!valid_int8(w)) return BAD_ARGUMENT;
  if (w.format == TQ_FORMAT_INT8) return weight_only_linear(x, dtype, M, w.k, w.codes, w.n, w.scales, bias, out, threads);
  if (bias) return BAD_ARGUMENT;  // the reference adds it after rounding to the activation dtype: the caller does
  return activation_linear(w, x, dtype, M, out, threads);
}

int int8_amx_mode() { return g_amx.load(std::memory_order_relaxed); }
void note_amx_int8_call() { g_amx_calls.fetch_add(1, std::memory_order_relaxed); }

Int8RowsFn int8_amx_gemm() {
  const int mode = g_amx.load(std::memory_order_relaxed);
  if (mode == INT8_AMX_EMULATED) return kInt8AmxEmulatedGemm;
  return mode == INT8_AMX_ON && active_isa() == ISA_AVX512 && amx_int8_supported() ? kInt8AmxGemm : nullptr;
}

bool int8_weight_gemm_active() { return (lut4_paths() & LUT4_GEMM) && kernels().int8.weight_gemm; }

// Rows [n0, n1) of the weight, q * s, into dst ([n1 - n0, K]) as fp32 or bf16.
int int8_dequantize(const tq_weight& w, int64_t n0, int64_t n1, void* dst, bool bf16, int threads) {
  if (!valid_int8(w)) return BAD_ARGUMENT;
  DequantJob job{kernels().int8.dequant_rows, w.codes, w.scales, w.k, n0, dst, bf16};
  parallel_for(n1 - n0, 1, threads, dequant_rows, &job);
  return OK;
}

}  // namespace tq

// The AMX mode (tq::Int8Amx; negative: read); returns the mode before, or -1 (unchanged) for a
// mode that is not one. INT8_AMX_ON where the CPU has no AMX (or Linux refuses it) leaves the
// VNNI / AVX2 kernels serving every call.
TQ_API int tq_set_int8_amx(int mode) {
  if (mode < 0) return tq::g_amx.load();
  if (mode > tq::INT8_AMX_EMULATED) return -1;
  return tq::g_amx.exchange(mode);
}
// How many calls have taken the AMX form (on AMX or emulated tiles) since the library loaded.
TQ_API int64_t tq_amx_int8_calls() { return tq::g_amx_calls.load(); }
// Whether this process may run the AMX int8 kernel (the CPU has AMX-INT8, Linux granted the tile state).
TQ_API int tq_amx_int8_supported() { return tq::amx_int8_supported() ? 1 : 0; }
