// The bf16 weight-only GEMM on AVX512_BF16 dot products (vdpbf16ps) for bf16 activations of many
// rows, on CPUs without AMX (Zen 4, Cooper Lake): per panel of 16 weight rows, once per call, the
// weights become bf16 pairs in lane order (panel word (16 q + t) * 2 + j = weight row t, position
// 2 q + j: a 16 x 16 dword transpose of 32 positions at a time, in L1); then every block of up to
// 16 activation rows keeps one accumulator per row (a lane per weight row) and takes, per pair of
// positions, vdpbf16ps of the panel's pair vector with the activation row's pair broadcast: 16
// exact bf16 products per lane per instruction, no horizontal sums, outputs stored as rows.
//
// Weights: a lut4 weight's rows as its dequantized bf16 tiles hold them (tq_dequantize_rows: the
// reference's weights in a bf16 model); an int8 weight-only weight's codes, exact in bf16, with
// each output scaled once (out = s[n] * sum_k q[n, k] x[m, k] (+ bias[n]), as its bf16 dot path):
// read in panel order (Int8VnniLayout's, row-major codes put in it once per panel) and converted
// to bf16 pairs in registers by every block of activation rows.
// Sums in fp32 in an order of their own (per lane: position pairs in order, each pair as vdpbf16ps
// adds it), within the bound bf16_amx.h states; one-hot activations give exactly the weight.
// vdpbf16ps reads subnormal inputs as zero and flushes subnormal results, so calls take it only
// with the activations bf16_amx_pack admits (finite, below 2^64, 0 or of magnitude >= 2^-59), a
// lut4 panel only where every weight is 0, inf, NaN or of magnitude >= 2^-66 (else a portable loop
// over the same values), an int8 call only where every scale is 0 or normal.
//
// Written once over an Ops type (bf16_dp_gemm_body.h): bf16_dp_gemm_avx512bf16.cpp and
// int8_linear_avx512bf16.cpp run the instructions, bf16_dp_gemm_emulated.cpp and
// int8_dot_emulated.cpp the same operations on arrays (the same bits on any CPU, for tests).
#pragma once
#include <stdint.h>

namespace tq {

struct Bf16DpGemm {
  int64_t M, N, K;       // K: the activation rows' and decoded weight rows' length, a multiple of 32
  const uint16_t* x;     // the activations as bf16_amx_pack's B tiles (blocks of 16 rows, rows past M zero)
  uint16_t* out;         // [M, N] bf16: each fp32 result rounded to nearest even, NaN to 0x7FC0
  const float* bias;     // [N] or null
  const float* scale;    // [N]: each sum times scale[n] (int8 weight-only), or null
  // lut4: weight rows [n0, n1) (n1 - n0 <= 16) as bf16 into dst ([n1 - n0, K], row stride K).
  void (*decode)(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst);
  const void* ctx;
  // int8: codes [N, codes_k] row-major (codes_k <= K), or in panel order (int8_linear.h: per 16
  // rows, 64-byte chunks of 4 positions x 16 rows, rows of codes_k rounded up to 64)
  const int8_t* codes;
  int64_t codes_k;
  bool codes_panels;
  int* failed;  // set (atomically) where a range could not allocate its scratch
};
// Output columns [n0, n1) (whole panels of 16 but the call's last) for all M activation rows.
typedef void (*Bf16DpGemmFn)(const Bf16DpGemm& g, int64_t n0, int64_t n1);

// The mode: on by default where the CPU has AVX512_BF16 (TORCHQ_NATIVE_AVX512BF16=0 at load leaves
// it no kernel), off with TORCHQ_NATIVE_BF16_DP=0 at load, every row count with =all; tq_set_bf16_dp_gemm sets it. The GEMM switch (TORCHQ_NATIVE_GEMM=0) turns it off
// in any mode. BF16_DP_ON serves at most kBf16DpAmxCpuMaxM rows on CPUs with AMX-BF16, BF16_DP_ALL
// every row count on any CPU with the instructions (tests, A/B runs); BF16_DP_EMULATED runs its body on
// emulated instructions on any ISA, every row count (tests).
enum Bf16Dp : int { BF16_DP_OFF = 0, BF16_DP_ON = 1, BF16_DP_EMULATED = 2, BF16_DP_ALL = 3 };
// The kernels, decoded (lut4) and codes (int8) forms: AVX512_BF16 (cpu.cpp puts them into the AVX-512
// table) and emulated.
extern const Bf16DpGemmFn kBf16DpAvx512Bf16Gemm, kInt8Avx512Bf16DpGemm, kBf16DpEmulatedGemm, kBf16DpEmulatedInt8Gemm;
// Activation rows from which calls take it (below, the paths before it were faster: one Zen 4
// core, 576 x 3072, the GEMM against them: row-major int8 10 rows 274-281 / 293-298 us, 8 rows 202-249
// / 203-205 (the int8 dot path; the codes' transpose costs about 40 us a call); panel-order int8
// from 1 row, 1 row 119 / 151-156, 2 rows 132 / 155, 16 rows 320 / 443; int4 with fp32 scales
// (the scaled dot path) 9 rows 422 / 440, 8 rows 402 / 346; NF4 (table paths) 5 rows 328 / 451;
// lut4 weights with the bf16 pair dot path keep it through kLut4DotMaxM rows), and the most (the
// call packs its M x K activations: a prompt's).
constexpr int64_t kBf16DpInt8MinM = 10, kBf16DpInt8PanelMinM = 1, kBf16DpLut4ScaledMinM = 9, kBf16DpLut4MinM = 5,
                  kBf16DpMaxM = int64_t{1} << 20;
// The most rows it takes in BF16_DP_ON on CPUs with AMX-BF16 (amx_bf16_supported): there torch.mm's
// bf16 GEMM runs on AMX, so dequantized tiles + torch.mm (and the bf16 AMX GEMM, 5-64 rows) beat
// vdpbf16ps from a few rows. One Sapphire Rapids-class core (a 2-core VM), 3072 x 576, bf16, the AMX
// GEMM off, the paths without it -> the GEMM (us, benchmarks/bench_bf16_dp.py): NF4 8 rows 608 -> 512, 16
// rows 638 -> 759, 32 rows 698 -> 1257; int4 g32 32 rows 826 -> 1426; panel-order int8 16 rows 864 ->
// 681, 64 rows 975 -> 2627; with the AMX GEMM on, 65 rows: tiles 875-1000 against the GEMM 2365-2745,
// 256 rows 1710-1817 against 8198-10113 (bf16 F.linear 461, 903).
constexpr int64_t kBf16DpAmxCpuMaxM = 16;
// The GEMM (int8: the codes' form) for M rows from min_m on this call's ISA and mode, or null.
Bf16DpGemmFn bf16_dp_gemm(int64_t M, int64_t min_m, bool int8);
// The most rows it serves now (0: none; tq_dot_max_m): kBf16DpMaxM, or kBf16DpAmxCpuMaxM (above).
int64_t bf16_dp_max_m();
// out = x @ W.T through `gemm` (null: -1) for bf16 x [M, K_in] (K_in <= args.K): args as above
// but for x, out, M and failed. OK, or -1 where an activation rules it out or scratch could not be
// had (the caller's paths serve the call).
int bf16_dp_linear(Bf16DpGemmFn gemm, Bf16DpGemm args, const uint16_t* x, int64_t M, int64_t K_in, void* out, int threads,
                   int spin_us);

}  // namespace tq
