// The bf16 weight-only GEMM on AMX tiles (tdpbf16ps) for bf16 activations of many rows: the lut4
// (int4, NF4, FP4) and int8 weight-only kernels decode each panel of 16 weight rows once per call
// into exactly the bf16 values their dequantized tiles hold (the reference's weights in a bf16
// model: tq_dequantize_rows), and AMX multiplies them with the activations. Written once over a
// Tiles trait (bf16_amx_body.h): bf16_amx.cpp runs the AMX instructions, bf16_amx_emulated.cpp
// the same operations in portable C++ that tests run on every machine.
//
// Operands (tdpbf16ps: C[16 x 16 fp32] += A[16 x 32 bf16] . B[16 x 16 bf16 pairs]):
//  * A: 16 weight rows x 32 positions of a decoded panel (row stride K), rows past N zero; up to
//    4 panels decoded at a time, so that every pass keeps 4 accumulations in flight;
//  * B: per 16 activation rows and 32-position step, row q holds positions 2q, 2q + 1 of the 16
//    rows, 4 bytes each (bf16_amx_pack; positions past the activations' K and rows past M zero);
//  * C[t][r]: sum_k w[n + t, k] x[m + r, k] in fp32: each product of two bf16 values is exact in
//    fp32 and the sums round to nearest even (an order of their own): within the fp32 bound of
//    the reference's bf16 GEMM on the same weights, |out - sum_k w_k x_k| <= ~K u sum_k |w_k x_k|,
//    u = 2^-24; a one-hot row of x gives exactly the weight.
// AMX reads subnormal bf16 inputs as zero and flushes subnormal results, so calls take it only
// where every activation is finite, below 2^64 and 0 or of magnitude >= 2^-59
// (bf16_amx_activations_ok), and a panel only where every decoded weight is 0, inf, NaN or of
// magnitude >= 2^-66: every product is then 0 or normal. Other panels (scales that small) take a
// portable loop over the same decoded weights and activations (the products exact, summed in
// order, with the CPU's own subnormals). What remains: a partial sum that cancels into the
// subnormal range is flushed (an error below 2^-126 each), and products or sums overflow to
// infinity as the reference's do (the 2^64 cap on activations is the bf16 dot path's, kept so
// that both paths decline the same calls).
#pragma once
#include <stdint.h>

namespace tq {

struct Bf16AmxGemm {
  int64_t M, N, K;     // K: the decoded rows' length, a multiple of 32
  const uint16_t* xt;  // the activations' B tiles (bf16_amx_pack)
  uint16_t* out;       // [M, N] bf16: each fp32 sum (+ bias) rounded to nearest even, NaN to 0x7FC0
  const float* bias;   // [N] or null
  // Weight rows [n0, n1) (n1 - n0 <= 64) as bf16 into dst ([n1 - n0, K], row stride K).
  void (*decode)(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst);
  const void* ctx;
  int* failed;  // set (atomically) where a range could not allocate its scratch: the caller reruns the call another way
};
// Output columns [n0, n1) (whole panels of 16 but the call's last) for all M activation rows.
typedef void (*Bf16AmxGemmFn)(const Bf16AmxGemm& g, int64_t n0, int64_t n1);

// The AMX mode of the bf16 GEMM: on unless TORCHQ_NATIVE_AMX=0 at load; tq_set_bf16_amx sets it.
// The GEMM switch (LUT4_GEMM: TORCHQ_NATIVE_GEMM=0, tq_set_lut4_paths) turns it off in any mode.
// BF16_AMX_EMULATED runs its body on emulated tiles on any ISA (tests).
enum Bf16Amx : int { BF16_AMX_OFF = 0, BF16_AMX_ON = 1, BF16_AMX_EMULATED = 2 };
// Rows from which calls take it (below, the decode-sized paths: lut4's tables and bf16 dot path,
// the int8 weight-only rows, were faster) and up to which: one pass of 64 rows per panel; above,
// each panel's tiles are reloaded per pass and dequantized tiles + torch.mm won (one Emerald
// Rapids core, 3072 x 576 NF4: M = 64 0.82 against 1.11 ms, M = 128 1.38 / 1.45, M = 256 2.35 /
// 2.18; int4 g32 bf16 M = 16 0.56 against 1.13, M = 4 0.50 against 0.43 on the dot path; a
// Sapphire Rapids-class VM core, the limit raised: M = 65 0.80 against 0.80, M = 512 2.10 against 2.03 ms).
constexpr int64_t kBf16AmxMinM = 5, kBf16AmxMaxM = 64;
// The AMX unit's kernel (null where the compiler lacks the intrinsics) and the emulated one.
extern const Bf16AmxGemmFn kBf16AmxGemm, kBf16AmxEmulatedGemm;
// Whether the CPU has AMX-BF16, the kernel was built and Linux let this process use the tiles.
bool amx_bf16_supported();
// The GEMM for this call's ISA and mode, or null (bf16_amx_linear counts the calls it completes).
Bf16AmxGemmFn bf16_amx_gemm();
// The mode now (Bf16Amx).
int bf16_amx_mode();
// Whether bf16 calls of kBf16AmxMinM to kBf16AmxMaxM rows take the GEMM now (mode, CPU, ISA).
bool bf16_amx_active();
// out = x @ W.T (+ bias) for bf16 x [M, K_in] and out [M, N] through the GEMM, W's rows from
// `decode` (K: their length, a multiple of 32, >= K_in): OK, or -1 where the call is not the GEMM's
// (the mode, an activation it cannot take, scratch it could not get): the caller's paths serve it.
int bf16_amx_linear(const uint16_t* x, int64_t M, int64_t K_in, int64_t K, int64_t N, const float* bias,
                    void (*decode)(const void* ctx, int64_t n0, int64_t n1, uint16_t* dst), const void* ctx, void* out,
                    int threads, int spin_us);
// Bytes of the B tiles of M rows of K positions (K a multiple of 32).
int64_t bf16_amx_packed_bytes(int64_t M, int64_t K);
// x: [M, K_in] bf16 rows (K_in <= K) into the B tiles at dst (bf16_amx_packed_bytes): m-block i,
// step s at dst + (i * K / 32 + s) * 512 words. False if an activation rules the GEMM out (above).
bool bf16_amx_pack(const uint16_t* x, int64_t M, int64_t K_in, int64_t K, uint16_t* dst);

}  // namespace tq
