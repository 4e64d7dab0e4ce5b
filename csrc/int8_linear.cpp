// The int8 linears' halves of tq_linear / tq_dequantize_rows (weight_abi.h; see int8_linear.h):
// argument checks, activation conversion and quantization, threading. The kernels come from the active ISA's table (kernels.h).
#include "int8_linear.h"
#include "lut4_linear.h"  // lut4_paths(): the GEMM switch

#include <float.h>
#include <math.h>
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
// The weight-only calls that took the bf16 dot path (tq_dot_calls_int8, for tests), and its mode (Int8Dot).
std::atomic<int64_t> g_dot_calls{0};
std::atomic<int> g_dot{INT8_DOT_ON};
std::atomic<int> g_panel{INT8_PANEL_ON};
std::atomic<int64_t> g_panel_calls{0};

// The panel kernel for this call's ISA and mode (activation codes + 128), or null.
Int8RowsFn int8_panel_kernel() {
  const int mode = g_panel.load(std::memory_order_relaxed);
  if (mode == INT8_PANEL_EMULATED) return kInt8EmulatedPanelRows;
  const Int8Kernels& kern = kernels().int8;
  return mode == INT8_PANEL_ON && kern.dynamic_offset == 128 ? kern.panel_rows : nullptr;
}

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
// copy (at 256 x 1536, one bf16 thread, widening alone took about a sixth of the native call).
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

// A panel-order weight (int8_linear.h, "Panel order") under a row-major kernel: each thread's rows
// unpacked a chunk at a time (about 256 KB: it stays in L2) into scratch, and the kernel run on the
// chunk with its weight-row-indexed pointers moved to the chunk's first row.
struct PanelRowsJob {
  Int8Params p;
  Int8RowsFn rows;
  Int8UnpackFn unpack;
  std::atomic<bool>* failed;  // set where a range could not allocate its scratch
};
constexpr int64_t kPanelChunkBytes = int64_t{1} << 18;

void run_panel_rows(void* ctx, int64_t n0, int64_t n1) {
  const PanelRowsJob& j = *static_cast<const PanelRowsJob*>(ctx);
  const int64_t K = j.p.K;
  int64_t chunk = kPanelChunkBytes / K / 16 * 16;
  if (chunk < 16) chunk = 16;
  if (chunk > n1 - n0) chunk = n1 - n0;
  int8_t* scratch = static_cast<int8_t*>(aligned_alloc(64, static_cast<size_t>((chunk * K + 63) / 64 * 64)));
  if (!scratch) {
    j.failed->store(true, std::memory_order_relaxed);
    return;
  }
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1;
    j.unpack(j.p.w, K, c0, c1, scratch);
    Int8Params q = j.p;
    q.w = scratch;
    q.w_rows = c1 - c0;
    q.scale += c0;
    q.out += c0;  // row stride N still
    if (q.bias) q.bias += c0;
    if (q.row_sums) q.row_sums += c0;
    if (q.out_bf16) q.out_bf16 += c0;
    q.code_sums = nullptr;
    j.rows(q, 0, c1 - c0);
  }
  free(scratch);
}

// Output rows of p (N of them) by `rows` over `threads`: in place for row-major codes, through
// run_panel_rows for a panel-order weight (whose ranges are whole panels). False: out of memory.
bool run_int8_rows(const Int8Params& p, Int8RowsFn rows, bool panels, int64_t grain, int threads) {
  if (!panels) {
    RowsJob job{p, rows};
    parallel_for(p.N, grain, threads, run_rows, &job, kSpinUs, p.M * p.N * p.K);
    return true;
  }
  std::atomic<bool> failed{false};
  PanelRowsJob job{p, rows, kernels().int8.unpack_panels, &failed};
  parallel_for(p.N, 16, threads, run_panel_rows, &job, kSpinUs, p.M * p.N * p.K);
  return !failed.load();
}

// Row n of a panel-order weight as q * s (fp32 or bf16, as the ISA's dequantization rounds) into
// dst, gathered a piece at a time into a stack buffer (no allocation).
void dequant_panel_row(const int8_t* panels, const float* scale, int64_t K, int64_t n, void* dst, bool bf16) {
  constexpr int64_t kPiece = 1024;
  alignas(64) int8_t piece[kPiece];
  const int8_t* row = panels + int8_panel_offset(n, int8_panel_k(K)) + (n % 16) * 4;
  for (int64_t k0 = 0; k0 < K; k0 += kPiece) {
    const int64_t len = K - k0 < kPiece ? K - k0 : kPiece;
    for (int64_t k = 0; k < len; k += 4) memcpy(piece + k, row + (k0 + k) * 16, static_cast<size_t>(len - k < 4 ? len - k : 4));
    int8_dequant_kernel()(piece, scale + n, len, 0, 1, static_cast<char*>(dst) + k0 * (bf16 ? 2 : 4), bf16);
  }
}

// Rows [n0, n1) of a panel-order weight as q * s, row n at dst + (n - n0) * stride elements (fp32
// or bf16): each whole panel unpacked into row-major scratch (Int8Kernels.unpack_panels, 16 rows at
// a time) and dequantized as row-major rows, the same values; rows of partial panels (and every row
// where the scratch cannot be allocated) gathered one at a time.
void dequant_panel_rows(const int8_t* panels, const float* scale, int64_t K, int64_t n0, int64_t n1, void* dst, bool bf16,
                        int64_t stride) {
  const Int8Kernels& kern = kernels().int8;
  const Int8DequantFn dequant = int8_dequant_kernel();
  const int64_t row_bytes = stride * (bf16 ? 2 : 4);
  char* out = static_cast<char*>(dst);
  int8_t* scratch = n1 - n0 >= 16 ? static_cast<int8_t*>(aligned_alloc(64, static_cast<size_t>((16 * K + 63) / 64 * 64))) : nullptr;
  for (int64_t n = n0; n < n1;) {
    if (!scratch || n % 16 || n + 16 > n1) {
      dequant_panel_row(panels, scale, K, n, out + (n - n0) * row_bytes, bf16);
      ++n;
      continue;
    }
    kern.unpack_panels(panels, K, n, n + 16, scratch);
    if (stride == K) {
      dequant(scratch, scale + n, K, 0, 16, out + (n - n0) * row_bytes, bf16);
    } else {
      for (int64_t r = 0; r < 16; ++r) dequant(scratch, scale + n, K, r, r + 1, out + (n - n0 + r) * row_bytes, bf16);
    }
    n += 16;
  }
  free(scratch);
}

struct DequantJob {
  Int8DequantFn dequant;
  const int8_t* w;
  const float* scale;
  int64_t K, n0;
  void* out;
  bool bf16;
  bool panels;  // w in panel order
};

void dequant_rows(void* ctx, int64_t a, int64_t b) {
  const DequantJob& j = *static_cast<const DequantJob*>(ctx);
  const int64_t row_bytes = j.K * (j.bf16 ? 2 : 4);
  char* out = static_cast<char*>(j.out) + a * row_bytes;
  if (!j.panels) {
    j.dequant(j.w, j.scale, j.K, j.n0 + a, j.n0 + b, out, j.bf16);
    return;
  }
  dequant_panel_rows(j.w, j.scale, j.K, j.n0 + a, j.n0 + b, out, j.bf16, j.K);
}

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
  bool panels;  // codes in panel order
  int64_t N;    // the weight's rows
};

void amx_decode(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst) {
  const AmxDecode& d = *static_cast<const AmxDecode*>(ctx);
  const Int8DequantFn dequant = int8_dequant_kernel();
  if (d.panels) dequant_panel_rows(d.codes, d.scale, d.K, n0, n1, dst, true, d.Kp);
  for (int64_t n = n0; n < n1; ++n) {
    uint16_t* row = dst + (n - n0) * d.Kp;
    if (!d.panels) {  // each row's bytes kStreamFarBytes ahead into L2 as the row is decoded
      prefetch_l2(d.codes + n * d.K + kStreamFarBytes, d.K, d.codes + d.N * d.K);
      dequant(d.codes, d.scale, d.K, n, n + 1, row, true);
    }
    memset(row + d.K, 0, static_cast<size_t>(d.Kp - d.K) * 2);
  }
}

// Whether every bf16 value of x[0..count) is 0 or finite of magnitude in [2^-59, 2^64): the bf16
// dot path's activations (int8_linear.h).
bool dot_activations(const uint16_t* x, int64_t count) {
  bool ok = true;
  for (int64_t i = 0; i < count; ++i) {
    const unsigned e = (x[i] >> 7) & 0xFFu;  // biased exponent
    ok &= (x[i] & 0x7FFFu) == 0 || (e >= 127u - 59u && e < 127u + 64u);
  }
  return ok;
}

// out[M, N] = x[M, K] @ (q * s).T (+ bias): x and out contiguous of `dtype` (DType), w's int8 codes
// (row-major or panels), fp32 scales [N], fp32 bias or null; products and sums in fp32, one rounding at the end
// (bf16 x of kBf16AmxMinM to kBf16AmxMaxM rows: the bf16 AMX GEMM where it runs).
int weight_only_linear(const tq_weight& w, const void* x, int dtype, int64_t M, const float* bias, void* out, int threads) {
  const int64_t K = w.k, N = w.n;
  const int8_t* codes = w.codes;
  const float* scale = w.scales;
  const bool panels = w.codes_order == 1;
  const AmxDecode decode{codes, scale, K, (K + 31) / 32 * 32, panels, N};
  if (dtype == DT_BF16 && M >= kBf16AmxMinM && M <= kBf16AmxMaxM && bf16_amx_active()) {
    const int status = bf16_amx_linear(static_cast<const uint16_t*>(x), M, K, decode.Kp, N, bias, amx_decode, &decode, out, threads, kSpinUs);
    if (status >= 0) return status;
  }
  // the bf16 dot-product GEMM: codes (row-major or panels) with scales it can apply to the sums
  // take its codes form, others their decoded rows q * s (the AMX GEMM's); the scales are read
  // only for a call it would take
  const int64_t dp_min_m = panels ? kBf16DpInt8PanelMinM : kBf16DpInt8MinM;
  if (dtype == DT_BF16 && bf16_dp_gemm(M, dp_min_m, true)) {
    bool scales_ok = true;
    for (int64_t n = 0; n < N && scales_ok; ++n) scales_ok = int8_dot_scale(scale[n]);
    const Bf16DpGemmFn dp = bf16_dp_gemm(M, scales_ok ? dp_min_m : kBf16DpInt8MinM, scales_ok);
    if (dp) {
      Bf16DpGemm g{};
      g.N = N;
      g.K = decode.Kp;
      g.bias = bias;
      if (scales_ok) {
        g.scale = scale;
        g.codes = codes;
        g.codes_k = K;
        g.codes_panels = panels;
      } else {
        g.decode = amx_decode;
        g.ctx = &decode;
      }
      const int status = bf16_dp_linear(dp, g, static_cast<const uint16_t*>(x), M, K, out, threads, kSpinUs);
      if (status >= 0) return status;
    }
  }
  const int64_t Kp = int8_panel_k(K);
  float* xp = static_cast<float*>(aligned_alloc(64, M * Kp * sizeof(float)));
  Output o;
  if (!xp || !o.init(out, dtype, M * N)) {
    free(xp);
    return OUT_OF_MEMORY;
  }
  to_f32_rows(x, dtype, M, K, Kp, xp, threads);
  const Int8Kernels& kern = kernels().int8;
  Int8Params p{M, K, N, Kp, xp, nullptr, nullptr, nullptr, codes, scale, bias, o.f32, nullptr, 0};
  uint16_t* xb = nullptr;
  if (int8_dot_rows(M, dtype) && dot_activations(static_cast<const uint16_t*>(x), M * K)) {
    p.kx = (K + 31) / 32 * 32;
    xb = static_cast<uint16_t*>(aligned_alloc(64, (M * p.kx * sizeof(uint16_t) + 63) / 64 * 64));
    if (xb) {
      const uint16_t* xs = static_cast<const uint16_t*>(x);
      memset(xb, 0, static_cast<size_t>(M * p.kx) * 2);
      for (int64_t m = 0; m < M; ++m)  // chunk-major: chunk c of row m at (c * M + m) * 32
        for (int64_t c = 0; c * 32 < K; ++c)
          memcpy(xb + (c * M + m) * 32, xs + m * K + c * 32, static_cast<size_t>(K - c * 32 < 32 ? K - c * 32 : 32) * 2);
      p.xb = xb;
      g_dot_calls.fetch_add(1, std::memory_order_relaxed);
    }
  }
  const bool gemm = !xb && M >= kern.weight_gemm_min_m && int8_weight_gemm_active();
  const Int8RowsFn rows = xb ? int8_dot_kernel() : gemm ? kern.weight_gemm : kern.weight_rows;
  // the GEMM's and the dot path's ranges: whole AVX2 panels / 16 rows
  const bool ran = run_int8_rows(p, rows, panels, xb || gemm ? 16 : 4, threads);
  if (ran) o.finish(out, dtype, M * N, threads);
  free(xb);
  free(xp);
  return ran ? OK : OUT_OF_MEMORY;
}

// out[M, N] = int8(x) @ q.T rescaled (see int8_linear.h): activations quantized per row
// (TQ_FORMAT_INT8_DYNAMIC) or with w's fixed scale and zero point (TQ_FORMAT_INT8_STATIC); x and
// out contiguous of `dtype`. No bias (the reference adds it after rounding to the activation
// dtype). Codes in [qmin, qmax] with qmin >= -127 (the AVX2 sign trick needs |x| <= 127).
int activation_linear(const tq_weight& w, const void* x, int dtype, int64_t M, void* out, int threads) {
  const bool is_static = w.format == TQ_FORMAT_INT8_STATIC;
  const int64_t K = w.k, N = w.n, Kp = int8_panel_k(K);
  const int qmin = w.act_qmin, qmax = w.act_qmax;
  const Int8Kernels& kern = kernels().int8;
  const bool panels = w.codes_order == 1;
  // a zero point's correction; none for the dynamic format (and none needed for z = 0)
  const bool correct = is_static && w.act_zero_point != 0;
  const bool gemm_allowed = (lut4_paths() & LUT4_GEMM) && !(correct && K > kInt8StaticGemmMaxK);  // the int32 correction could wrap
  const Int8RowsFn amx = gemm_allowed && M >= kInt8AmxMinM ? int8_amx_gemm(panels) : nullptr;
  if (amx) g_amx_calls.fetch_add(1, std::memory_order_relaxed);
  // a panel-order weight's decode rows: its VNNI kernel reads the panels as stored
  const Int8RowsFn panel_kernel = panels && !amx ? int8_panel_kernel() : nullptr;
  const bool panel_rows = panel_kernel != nullptr;
  // Narrow kernels from kInt8NarrowGemmMinM rows only: below, the row sums they need cost as much
  // as the sign trick they save.
  const bool narrow = !amx && !panel_rows && qmin >= kNarrowMin && qmax <= kNarrowMax && kern.narrow_rows && M >= kInt8NarrowGemmMinM;
  const int offset = amx ? 0 : panel_rows ? 128 : narrow ? kNarrowOffset : kern.dynamic_offset;
  const bool offset_codes = offset != 0;
  // the panel AMX form loads its activation tiles in place: rows up to a multiple of 16, zero
  const int64_t Mp = amx && panels ? (M + 15) / 16 * 16 : M;
  const size_t codes_bytes = (Mp * Kp + 63) / 64 * 64, xs_bytes = (M * sizeof(float) + 63) / 64 * 64;
  char* buf = static_cast<char*>(aligned_alloc(64, codes_bytes + xs_bytes));
  Output o;
  // the AMX GEMM and the panel kernel write bf16 outputs themselves (the AMX GEMM's fp32 buffer,
  // untouched, serves its fallback; the panel kernel needs none)
  const bool direct_bf16 = (amx || panel_rows) && dtype == DT_BF16;
  if (!buf || ((amx || !direct_bf16) && !o.init(out, dtype, M * N))) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  float* xs = reinterpret_cast<float*>(buf + codes_bytes);
  const Int8Quant quant{w.act_denom, w.act_eps, qmin, qmax, w.act_scale, w.act_zero_point};
  std::atomic<bool> failed{false};
  QuantJob q{is_static ? kern.quantize_static_rows : kern.quantize_rows, x, dtype, K, Kp, quant, offset, buf, xs, &failed};
  parallel_for(M, 1, threads, quantize_rows, &q, 0, M * K);
  if (Mp > M) memset(buf + M * Kp, 0, static_cast<size_t>((Mp - M) * Kp));
  if (failed.load()) {
    free(buf);
    return OUT_OF_MEMORY;
  }
  Int8Params p{M, K, N, Kp, nullptr, offset_codes ? nullptr : reinterpret_cast<const int8_t*>(buf),
               offset_codes ? reinterpret_cast<const uint8_t*>(buf) : nullptr, xs, w.codes, w.scales, nullptr,
               o.f32, correct ? w.row_sums : nullptr, correct ? w.act_zero_point : 0,
               direct_bf16 ? static_cast<uint16_t*>(out) : nullptr};
  p.code_sums = w.code_sums;
  const Int8RowsFn gemm_fn = narrow ? kern.narrow_gemm : kern.dynamic_gemm;
  const bool gemm = amx || ((narrow || M >= kern.dynamic_gemm_min_m) && gemm_fn && gemm_allowed);
  const Int8RowsFn rows = amx ? amx : gemm ? gemm_fn : narrow ? kern.narrow_rows : kern.dynamic_rows;
  bool ran = true;
  if (amx || panel_rows) {  // in place (a panel-order weight's own forms too): ranges of whole panels
    RowsJob job{p, panel_rows ? panel_kernel : rows};
    if (panel_rows) g_panel_calls.fetch_add(1, std::memory_order_relaxed);
    parallel_for(N, panel_rows || gemm ? 16 : 4, threads, run_rows, &job, kSpinUs, M * N * K);
  } else {
    ran = run_int8_rows(p, rows, panels, gemm ? 16 : 4, threads);  // the GEMM's ranges: whole panels
  }
  if (ran && !direct_bf16) o.finish(out, dtype, M * N, threads);
  free(buf);
  return ran ? OK : OUT_OF_MEMORY;
}

// The int8 fields of w (see weight_abi.h) are consistent: unpadded rows, codes and scales, the
// activation quantization of the dynamic and static formats, and no lut4 fields.
bool valid_int8(const tq_weight& w) {
  if (w.row_length != w.k || !w.codes || !w.scales) return false;
  if (w.codes_order == 0 ? w.code_sums != nullptr : w.codes_order != 1 || !w.code_sums) return false;
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
  if (w.format == TQ_FORMAT_INT8) return weight_only_linear(w, x, dtype, M, bias, out, threads);
  if (bias) return BAD_ARGUMENT;  // the reference adds it after rounding to the activation dtype: the caller does
  return activation_linear(w, x, dtype, M, out, threads);
}

int int8_amx_mode() { return g_amx.load(std::memory_order_relaxed); }
void note_amx_int8_call() { g_amx_calls.fetch_add(1, std::memory_order_relaxed); }

Int8RowsFn int8_amx_gemm(bool panels) {
  const int mode = g_amx.load(std::memory_order_relaxed);
  if (mode == INT8_AMX_EMULATED) return panels ? kInt8AmxEmulatedPanelGemm : kInt8AmxEmulatedGemm;
  if (mode != INT8_AMX_ON || active_isa() != ISA_AVX512 || !amx_int8_supported()) return nullptr;
  return panels ? kInt8AmxPanelGemm : kInt8AmxGemm;
}

Int8RowsFn int8_dot_kernel() {
  if (!(lut4_paths() & LUT4_DECODE)) return nullptr;
  const int mode = g_dot.load(std::memory_order_relaxed);
  return mode == INT8_DOT_EMULATED ? kInt8EmulatedDot : mode == INT8_DOT_ON || mode == INT8_DOT_ALL ? kernels().int8.dot_bf16 : nullptr;
}

Int8DequantFn int8_dequant_kernel() {
  const int mode = g_dot.load(std::memory_order_relaxed);
  if (mode == INT8_DOT_EMULATED) return kInt8EmulatedDequant;
  const Int8Kernels& k = kernels().int8;
  return mode != INT8_DOT_OFF && k.dequant_bf16 ? k.dequant_bf16 : k.dequant_rows;
}

bool int8_dot_rows(int64_t M, int dtype) {
  if (dtype != DT_BF16 || M < kInt8DotMinM || M > kInt8DotMaxM || !int8_dot_kernel()) return false;
  return M >= kInt8DotAmxCpuMinM || g_dot.load(std::memory_order_relaxed) != INT8_DOT_ON || !amx_bf16_supported();
}

bool int8_weight_gemm_active() { return (lut4_paths() & LUT4_GEMM) && kernels().int8.weight_gemm; }

// Rows [n0, n1) of the weight, q * s, into dst ([n1 - n0, K]) as fp32 or bf16.
int int8_dequantize(const tq_weight& w, int64_t n0, int64_t n1, void* dst, bool bf16, int threads) {
  if (!valid_int8(w)) return BAD_ARGUMENT;
  DequantJob job{int8_dequant_kernel(), w.codes, w.scales, w.k, n0, dst, bf16, w.codes_order == 1};
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
// The int8 weight-only bf16 dot path's mode (tq::Int8Dot; negative: read); returns the mode before,
// or -1 (unchanged) for a mode that is not one. INT8_DOT_ON where the CPU lacks AVX512_BF16 (or the
// ISA is capped below AVX-512) leaves the other paths serving every call.
TQ_API int tq_set_int8_dot(int mode) {
  if (mode < 0) return tq::g_dot.load();
  if (mode > tq::INT8_DOT_ALL) return -1;
  return tq::g_dot.exchange(mode);
}
// How many int8 weight-only calls have taken the bf16 dot path since the library loaded.
TQ_API int64_t tq_dot_calls_int8() { return tq::g_dot_calls.load(); }
// The panel kernel's mode (tq::Int8Panel; negative: read); returns the mode before, or -1
// (unchanged) for a mode that is not one. INT8_PANEL_ON where the CPU lacks VNNI (or the ISA is
// capped below AVX-512) leaves panel-order calls unpacking chunks for the row-major kernels.
TQ_API int tq_set_int8_panel(int mode) {
  if (mode < 0) return tq::g_panel.load();
  if (mode > tq::INT8_PANEL_EMULATED) return -1;
  return tq::g_panel.exchange(mode);
}
// How many int8 activation calls have taken the panel kernel (VNNI or emulated) since the library loaded.
TQ_API int64_t tq_panel_calls_int8() { return tq::g_panel_calls.load(); }
// Whether this process may run the AMX int8 kernel (the CPU has AMX-INT8, Linux granted the tile state).
TQ_API int tq_amx_int8_supported() { return tq::amx_int8_supported() ? 1 : 0; }
