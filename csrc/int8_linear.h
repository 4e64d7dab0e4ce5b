// int8 weight kernels: weight-only (float activations), dynamic and static (int8 activations).
//
// Files: int8_linear.cpp (the int8 half of tq_linear / tq_dequantize_rows, weight_abi.h: checks,
// activation conversion / quantization, threading), int8_linear_body.h (the vector kernels,
// written once over ISA traits), int8_linear_avx2.cpp / int8_linear_avx512.cpp (their
// instantiations, with the int8 dot products: vpmaddubsw sign trick / VNNI),
// int8_linear_scalar.cpp (the portable kernels).
//
// Weight bytes (torchq PlainLayout, symmetric per channel): int8 codes [N, K] row-major and one
// fp32 scale per row (output channel).
// * Weight-only: out[m, n] = sum_k (q[n, k] * s[n]) * x[m, k] (+ bias[n]), every weight the
//   reference's fp32 value q * s, products and sums in fp32.
// * Dynamic: each activation row is quantized exactly as torchq.activation.PerTokenInt8 does
//   (s_x = max(max|x|, 0) / denom clamped to eps, q = clamp(rint(x * (1 / s_x)), qmin, qmax)),
//   the int8 x int8 dot products accumulate exactly in int32, and
//   out[m, n] = (float(acc) * s_x[m]) * s_w[n]: the same bits as torchq's reference.
// * Static: the activations are quantized with one fixed scale s and zero point z, as
//   torchq.activation.StaticInt8 does (q = clamp(rint(x * (1 / s)), qmin - z, qmax - z) + z, a
//   row holding a NaN gets s_x = NaN), then the dynamic kernels run on those codes with s_x[m] = s
//   and the zero point's correction: out[m, n] = (float(acc - z * rowsum_w[n]) * s_x[m]) * s_w[n].
//
// Panel order (tq_weight.codes_order 1, torchq's Int8VnniLayout): the same codes stored per 16
// weight rows and 4 positions, the operand order of VNNI and of AMX's B tiles: code (n, k) at byte
//   (n / 16) * 16 * Kp + (k / 4) * 64 + (n % 16) * 4 + k % 4      (Kp = K rounded up to 64),
// zero where n >= N or k >= K, with each row's sum of codes beside them (code_sums, int32 [N]). From
// kInt8AmxMinM rows AMX CPUs take the AMX GEMM with the panels as its B tiles (activation codes as A
// tiles in place); other calls on VNNI take a kernel reading the panels as stored (registers of
// 16 rows' 4 codes, no horizontal sums, the stored row sums for the +128 offset); every other call
// unpacks chunks of rows into row-major scratch (unpack_panels) for the row-major kernels. The same
// bits everywhere as the row-major codes.
#pragma once
#include <float.h>
#include <stdint.h>

namespace tq {

struct Int8Params {
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
  // Static activations: the weight rows' sums of codes [N] (null: no zero point's correction)
  // and the zero point z; every dynamic kernel subtracts z * row_sums[n] from its int32 sum.
  const int32_t* row_sums;
  int32_t zero_point;
  // The AMX GEMM and the VNNI panel kernel only: where set, the outputs go here as bf16 ([M, N],
  // rounded as from_f32_row rounds) instead of to `out` as fp32.
  uint16_t* out_bf16 = nullptr;
  // How many weight rows p.w holds (bounds prefetches; -1: N). A panel-order weight's chunks of
  // rows, unpacked into scratch, hold fewer.
  int64_t w_rows = -1;
  // Panel order (the panel kernel and the AMX GEMM's panel form): each weight row's sum of codes.
  const int32_t* code_sums = nullptr;
  // The weight-only bf16 dot path (Int8Kernels.dot_bf16): bf16 activations in chunks of 32
  // positions, chunk-major (chunk c of row m at (c * M + m) * 32), kx = K rounded up to 32,
  // zero-padded (p.x holds the same rows as fp32 for the weight rows that fall back).
  const uint16_t* xb = nullptr;
  int64_t kx = 0;
};

// A panel-order weight's bytes per weight row, Kp: K rounded up to 64 (also the stride of the padded
// activation codes).
inline int64_t int8_panel_k(int64_t K) { return (K + 63) / 64 * 64; }
// The byte offset of panel n / 16 (of 16 rows x Kp codes) in a panel-order weight.
inline int64_t int8_panel_offset(int64_t n, int64_t Kp) { return n / 16 * 16 * Kp; }
// The VNNI panel kernel (where the AMX form does not run: below kInt8AmxMinM rows on AMX CPUs, every
// row count on others): register tiles of up to 4 rows x 64 weight rows, the rows 4 at a time. 2
// threads, bf16, against the plain layout: with AMX, M = 5-7 1.3-2.0x (its row kernels), while at
// 8-16 rows this kernel ran at 0.6-0.9x the plain layout's AMX form (which the panel AMX form
// matches); without AMX (Zen 4) 8-64 rows 0.95-1.47x plain's VNNI GEMM. At 128-256 rows it had run
// at 0.65-0.91x that GEMM on unpacked panels with fp32 outputs converted after; writing bf16
// outputs itself, it runs at 1.10-1.21x (one Zen 4 core, SmolLM2's 3072 x 576 and 576 x 1536,
// against the unpacked GEMM: 128 rows 1341 -> 1107 and 714 -> 564 us, 256 rows 2555 -> 2263 and
// 1381 -> 1123; vLLM's oneDNN W8A8 1122-1134 / 560-586 and 2266-2337 / 1095-1165).

struct Int8Quant {
  float denom, eps;  // dynamic
  int qmin, qmax;
  float scale;  // static: the activation scale and zero point
  int zero;
};

// Output rows [n0, n1) for all M activation rows.
typedef void (*Int8RowsFn)(const Int8Params& p, int64_t n0, int64_t n1);
// Weight rows [n0, n1) as q * s into out (row r - n0 at out + (r - n0) * K), fp32 or bf16 (RNE).
typedef void (*Int8DequantFn)(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16);
// Rows [n0, n1) of a panel-order weight (K positions a row) into dst, row-major [n1 - n0, K].
typedef void (*Int8UnpackFn)(const int8_t* panels, int64_t K, int64_t n0, int64_t n1, int8_t* dst);
// Quantize activation rows [m0, m1) of x ([M, K] fp32) into codes (row stride Kp, zero padded;
// `offset` 128 stores codes + 128 as uint8, padded with 128) and scales.
typedef void (*Int8QuantizeFn)(const float* x, int64_t K, int64_t Kp, const Int8Quant& q, int offset, void* codes, float* xs,
                               int64_t m0, int64_t m1);
// The static form (Int8Kernels.quantize_static_rows): codes clamp(rint(x * (1 / q.scale)), qmin - z,
// qmax - z) + z (+ offset), the clamp in fp32 before the conversion (so inf and huge values
// saturate; NaN -> z), padded with z (+ offset); xs[m] = q.scale, or NaN for a row holding a NaN.

// One ISA's kernels (see kernels.h). dynamic_rows reads p.xq (dynamic_offset 0) or p.xu (128,
// the VNNI kernel), quantized with that offset by quantize_rows.
struct Int8Kernels {
  Int8RowsFn weight_rows;
  Int8RowsFn dynamic_rows;
  int dynamic_offset;
  Int8QuantizeFn quantize_rows;
  Int8QuantizeFn quantize_static_rows;
  Int8DequantFn dequant_rows;
  // The dynamic kernel's GEMM form for M >= dynamic_gemm_min_m (reads the activations as
  // dynamic_rows does; null where the ISA has none; int8_gemm_body.h): panels of 16 weight rows,
  // unpacked once per call into 4-position groups, register tiles of 4 activation rows x 16 weight
  // rows of broadcast activation codes (AVX2: the vpmaddubsw sign trick on the codes' absolute
  // values; AVX-512: VNNI on codes + 128, minus 128 * the row sums), int32 sums exact: the same
  // bits as dynamic_rows.
  Int8RowsFn dynamic_gemm;
  int64_t dynamic_gemm_min_m;
  // The weight-only kernel's GEMM form for M >= weight_gemm_min_m (null where the ISA has none):
  // the fp32 panel GEMM (gemm_f32_body.h) over panels of q * s, each weight converted once per
  // call; the same products, summed in another order.
  Int8RowsFn weight_gemm;
  int64_t weight_gemm_min_m;
  // Narrow activations (codes within [kNarrowMin, kNarrowMax]: 7-bit ranges) from
  // kInt8NarrowGemmMinM rows, where the ISA has kernels for them (null: dynamic_rows / dynamic_gemm
  // take them): p.xu holds the codes + kNarrowOffset (unsigned, at most 127, padded with
  // kNarrowOffset), multiplied straight with the signed weights, minus kNarrowOffset * each weight
  // row's sum: exact, the same bits. narrow_gemm is the GEMM form (16-row panels of the codes and
  // their row sums); narrow_rows the row tiles, where the GEMM forms are switched off.
  Int8RowsFn narrow_rows;
  Int8RowsFn narrow_gemm;
  // Panel order (see above): rows into row-major scratch, and the VNNI panel kernel for rows of
  // codes + 128 (p.xu; null where VNNI is absent or off; bf16 outputs to p.out_bf16), dynamic and
  // static (p.row_sums: the zero point's correction, exact while kInt8StaticGemmMaxK bounds K).
  Int8UnpackFn unpack_panels;
  Int8RowsFn panel_rows;
  // The weight-only bf16 dot path (see below; null where the CPU lacks AVX512_BF16 or
  // TORCHQ_NATIVE_AVX512BF16=0): p.xb's bf16 rows, kInt8DotMinM <= M <= kInt8DotMaxM.
  Int8RowsFn dot_bf16 = nullptr;
  // Rows as bf16 q * s (Int8DequantFn with bf16 true) where the CPU has AVX512_BF16 (null elsewhere,
  // or TORCHQ_NATIVE_AVX512BF16=0): see "bf16 dequantization" below. int8_dequant_kernel() picks.
  Int8DequantFn dequant_bf16 = nullptr;
};
// bf16 dot path (Int8Kernels.dot_bf16, int8_linear_avx512bf16.cpp): weight-only calls of bf16
// activations, kInt8DotMinM <= M <= kInt8DotMaxM rows, where lut4_paths() allows the decode paths.
// (On AMX CPUs from kInt8DotAmxCpuMinM rows: below.) Every code is a bf16 value, so vdpbf16ps multiplies the codes with the activations exactly in
// fp32 and sums in fp32; each output is then scaled once: out = s * sum_k q x (+ bias). Against the
// reference's sum_k (q * s) x that is the same products' sum in another order, with the weight's
// one rounding (fp32(q * s)) moved to the end: within the same fp32 bound, and a one-hot row gives
// fp32(q * s) exactly. vdpbf16ps reads subnormals as zero and flushes them, so a call takes it only
// where every activation is 0 or of magnitude in [2^-59, 2^64) (finite; else the row kernels): every
// product and partial sum is then 0 or a multiple of 2^-66, never subnormal, and no sum overflows.
// Weight rows whose scale is inf, NaN or subnormal take the fp32 row kernel (4 rows a tile).
// Tiles of 1-8 weight rows x up to 8 activation rows (at most 16 accumulators, reduced together),
// each weight converted once per chunk of activation rows; blocks of weight rows run chunk by chunk
// (both in L1). One Zen 4 core, bf16, SmolLM2's 3072 x 576 / 576 x 1536 / 576 x 576 against the
// path before (the fp32 row kernels for 2-4 rows, dequantized bf16 tiles + torch.mm from 5):
// 2 rows 1.02-1.07x, 4 rows 1.24-1.37x, 8 rows 2.4-3.6x (1.09-1.19x bf16 F.linear), 16 rows
// 1.63-2.27x (0.88-0.96x bf16 F.linear), 24 rows 1.31-1.76x, 32 rows 1.09-1.48x (0.73-0.80x bf16
// F.linear), 48 rows 0.96-1.25x, 64 rows 0.87-1.03x (the tiles keep 33+ rows); 1 row 0.97-1.00x
// (the row kernel keeps it). Since the tiles keep their accumulators in registers (every loop
// indexing them unrolled) and take the codes' bf16 words from their fp32 values with one vpermt2w
// (not vcvtne2ps2bf16), against the tiles before, same shapes, alternating builds: 2 rows
// 1.0-1.16x, 4 rows 1.03-1.13x, 8 rows 1.04-1.14x, 16 rows 1.03-1.17x, 32 rows 1.08-1.18x
// (3072 x 576: 2 rows 107 -> 92 us, 16 rows 414 -> 360; bf16 F.linear 156 and 376).
constexpr int64_t kInt8DotMinM = 2, kInt8DotMaxM = 32;
// Whether a weight row's scale s lets the bf16 dot forms (this path, the bf16 dot-product GEMM's
// codes form) scale its exact code sums once: 0, or finite and normal (its product with the fp32
// sum is then the reference's weights' up to rounding; inf / NaN scales would give inf where the
// reference's 0 * inf weights give NaN).
static inline bool int8_dot_scale(float s) { return s == 0.0f || (__builtin_fabsf(s) >= FLT_MIN && __builtin_fabsf(s) <= FLT_MAX); }
// The AVX512_BF16 kernel, and its body on emulated instructions (int8_dot_emulated.cpp: the same
// bits on any CPU). INT8_DOT_ON (the default) runs the first where the active table has it,
// INT8_DOT_EMULATED the second on every ISA (tests), INT8_DOT_OFF neither (tq_set_int8_dot).
// INT8_DOT_ALL runs the first for every row count above, also on AMX CPUs: in INT8_DOT_ON those take it
// from kInt8DotAmxCpuMinM rows only.
extern const Int8RowsFn kInt8Avx512Bf16Dot, kInt8EmulatedDot;
enum Int8Dot : int { INT8_DOT_OFF = 0, INT8_DOT_ON = 1, INT8_DOT_EMULATED = 2, INT8_DOT_ALL = 3 };
// The fewest rows the dot path takes in INT8_DOT_ON on CPUs with AMX-BF16 (amx_bf16_supported()),
// where vdpbf16ps issues at about half the rate of an fp32 FMA: below, the fp32 row kernels won (one
// Sapphire Rapids VM core, bf16, a new copy of the weight per call, SmolLM2's 3072 x 576 / 576 x 1536:
// M = 2 253 / 159 us on the dot path against 165 / 85 on the rows, M = 4 363 / 206 against 205 / 104),
// and from kBf16AmxMinM the bf16 AMX GEMM takes the calls first (rows the dot path keeps only where
// the AMX GEMM is off).
constexpr int64_t kInt8DotAmxCpuMinM = 5;
// bf16 dequantization (Int8Kernels.dequant_bf16, int8_linear_avx512bf16.cpp; body: int8_dot_body.h):
// rows as bf16 q * s for the bf16 AMX GEMM's panels (5-64 rows), the dequantized tiles (more) and
// tq_dequantize_rows, the same bits as Int8Kernels.dequant_rows: each fp32 product q * s rounded to
// nearest even by vcvtne2ps2bf16, 32 weights per instruction, where the generic kernel rounds with
// five integer operations and a narrowing per 16. The instruction reads subnormal inputs as zero, so
// it takes a row only where int8_dot_scale(s) holds (0, or finite and normal: every product is then
// 0, normal, or inf); other rows, and fp32 outputs, take dequant_rows. One core of a Sapphire Rapids
// VM, bf16 activations, SmolLM2's 3072 x 576, a new copy of the weight per call, on the AMX GEMM
// (where the decode took 62% of the time): M = 8 478 -> 417 us, M = 16 507 -> 426; with the decode's
// fetch 8 KB ahead into L2 (int8_linear.cpp: amx_decode) 334 and 354. Modes: tq_set_int8_dot's (the int8 AVX512_BF16
// kernels): INT8_DOT_ON runs it where the table has it, INT8_DOT_EMULATED its body on arrays on any
// CPU (int8_dot_emulated.cpp, the same bits), INT8_DOT_OFF dequant_rows.
extern const Int8DequantFn kInt8Avx512Bf16Dequant, kInt8EmulatedDequant;
// The kernel that turns rows into bf16 (or fp32) q * s now: see above.
Int8DequantFn int8_dequant_kernel();
// The VNNI panel kernel (Int8Kernels.panel_rows, int8_panel_body.h) and its body on emulated
// instructions (int8_panel_emulated.cpp: the same bits on any CPU). INT8_PANEL_ON (the default) runs
// the first where the active table has it (VNNI), INT8_PANEL_EMULATED the second on every ISA
// (tests), INT8_PANEL_OFF neither: panel-order calls unpack chunks for the row-major kernels
// (tq_set_int8_panel).
extern const Int8RowsFn kInt8EmulatedPanelRows;
enum Int8Panel : int { INT8_PANEL_OFF = 0, INT8_PANEL_ON = 1, INT8_PANEL_EMULATED = 2 };
// The dot path's kernel for this call's ISA and mode, or null (off, absent, or the decode paths
// switched off: lut4_paths()).
Int8RowsFn int8_dot_kernel();
constexpr int kNarrowOffset = 64, kNarrowMin = -64, kNarrowMax = 63;
// The largest K for which a static call with a zero point takes the GEMM forms: their int32
// correction acc - (offset + z) * rowsum is exact while |sum_k (q - z) w| <= 254 * 128 * K < 2^31
// (the reference subtracts in int64); above, the row kernels subtract in int64.
constexpr int64_t kInt8StaticGemmMaxK = 66051;
// Activation rows from which the dynamic GEMM form runs: below, unpacking the panels costs more
// than it saves (AVX2, 2 threads, 4096^2: M = 4 1.12 vs 0.75 ms, M = 16 2.8 vs 2.5, M = 64 8.6 vs
// 10.2; 576^2: M = 64 0.23 vs 0.30, M = 256 0.88 vs 1.20).
constexpr int64_t kInt8GemmMinMAvx2 = 32;
// VNNI (AVX-512, 2 threads, GEMM form against the VNNI row tiles): 4096^2 M = 4 1.16 vs 0.78 ms,
// M = 8 1.50 vs 1.54, M = 16 2.14 vs 2.98, M = 64 4.47 vs 6.97; 576 x 1536 M = 8 0.052 vs 0.076.
constexpr int64_t kInt8GemmMinMVnni = 8;
// Rows from which narrow activations take the narrow kernels (AVX2, 2 threads, GEMM form against
// the sign-trick rows: 4096^2 M = 4 1.51 vs 1.11 ms, M = 8 2.20 vs 2.18, M = 16 2.75 vs 3.57;
// 576 x 1536 M = 8 0.084 vs 0.104). Below, the sign-trick kernels take every range.
constexpr int64_t kInt8NarrowGemmMinM = 8;
// Activation rows from which the weight-only GEMM form runs. AVX2, 2 threads, against the row
// tiles at M = 16: 576 x 1536 0.24 vs 0.30 ms, 384 x 1536 0.22 vs 0.25, 4096^2 4.3 vs 4.6 (above,
// the row tiles convert every weight once per 4 activation rows and lose more). AVX-512 FMAs
// are twice as wide, so the panels' unpacking weighs twice as much: at M = 16 4096^2 6.1 vs 3.5
// ms, 1536 x 576 0.24 vs 0.21; at M = 64 16.5 vs 21.3 (dequantized tiles + GEMM), 0.72 vs 1.14.
constexpr int64_t kInt8WeightGemmMinMAvx2 = 16, kInt8WeightGemmMinMAvx512 = 64;
// The AMX GEMM form of the dynamic and static kernels (int8_amx_body.h): from kInt8AmxMinM rows
// on CPUs with AMX-INT8 (and the AVX-512 ISA active), int8 x int8 tiles summed exactly in int32
// (tdpbssd) on offset-0 codes: the same bits. INT8_AMX_EMULATED runs its body on emulated tiles
// on any ISA (tests); TORCHQ_NATIVE_AMX=0 (at load) or tq_set_int8_amx turn it off.
enum Int8Amx : int { INT8_AMX_OFF = 0, INT8_AMX_ON = 1, INT8_AMX_EMULATED = 2 };
// From 8 rows (one Emerald Rapids core, bf16 activations, 20 distinct weights, AMX against the
// VNNI kernels: 3072 x 576 M = 4 209 vs 168 us, M = 8 301 vs 327, M = 16 336 vs 474, M = 64 591
// vs 1238, M = 256 1849 vs 4544; 576 x 1536 M = 16 280 vs 432, M = 256 1359 vs 2502).
constexpr int64_t kInt8AmxMinM = 8;
// The AMX unit's kernel (null where the compiler lacks the intrinsics) and the emulated one.
extern const Int8RowsFn kInt8AmxGemm, kInt8AmxEmulatedGemm;
// Their panel forms: the weight in panel order as B tiles (p.w, 1 KB per 16 rows x 64 positions),
// the offset-0 activation codes p.xq as A tiles in place (rows padded with zeros to a multiple of 16).
extern const Int8RowsFn kInt8AmxPanelGemm, kInt8AmxEmulatedPanelGemm;
// Whether the CPU has AMX-INT8, the kernel was built and Linux let this process use the tiles
// (cpu.cpp: asked once, at the first call).
bool amx_int8_supported();
// The AMX GEMM for this call's ISA and mode, or null (panels: its panel form).
Int8RowsFn int8_amx_gemm(bool panels = false);
// The AMX mode (Int8Amx), which also rules the nf4a8 / fp4a8 AMX form (lut4_linear.h), and the
// count of calls that took an AMX form (tq_amx_int8_calls), which that form adds to.
int int8_amx_mode();
void note_amx_int8_call();

// kInt8Avx512 runs the VNNI dynamic kernel; an AVX-512 CPU without VNNI (or with
// TORCHQ_NATIVE_VNNI=0) takes kInt8Avx2's dynamic kernel instead (cpu.cpp).
extern const Int8Kernels kInt8Scalar, kInt8Avx2, kInt8Avx512;
// Whether weight-only calls of many rows take the GEMM form (the active ISA has one, allowed).
bool int8_weight_gemm_active();
// Whether weight-only calls of M rows of `dtype` (DType) take the bf16 dot path (activations allowing;
// int8_dot_kernel()).
bool int8_dot_rows(int64_t M, int dtype);

}  // namespace tq
