// torchq native CPU kernels: shared declarations.
//
// A plain C ABI (no torch or Python headers): torchq/native.py loads the library with ctypes and
// calls it from torch.library ops whose pure-PyTorch references stay the fallback.
// Every ISA-specific translation unit keeps its helpers in an anonymous namespace or `static`
// so that no inline function is shared (and possibly picked with the wrong ISA) across units:
// the linker keeps one copy of an inline function (or template instantiation) with external
// linkage, possibly the one compiled for AVX-512, and every unit would call it. The templated
// kernel bodies (*_body.h) and the ISA traits (simd_*.h) therefore live in anonymous namespaces,
// so each unit that includes them gets its own, internal, copy (see lut4_linear_avx2.cpp).
#pragma once
#include <stddef.h>
#include <stdint.h>

#define TQ_API extern "C" __attribute__((visibility("default")))

namespace tq {

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// The widest ISA both supported by the CPU and allowed by tq_set_isa / TORCHQ_NATIVE_ISA.
int active_isa();

// Run fn(ctx, begin, end) over [0, n) split into at most `threads` contiguous ranges whose
// bounds are multiples of `grain` (except the end). The caller runs the first range itself.
// Afterwards the workers spin for `spin_us` microseconds before sleeping: worth it between
// back-to-back kernels, harmful when PyTorch's own threads run next (they share the cores).
// `work`: the call's size in multiply-adds (0: unknown); each range gets at least
// min_parallel_work() of it, so a small call runs on the caller's thread alone (waking a
// worker costs more than the work). The ranges only decide who computes what: every element's
// result is the same whichever thread runs it.
typedef void (*RangeFn)(void* ctx, int64_t begin, int64_t end);
void parallel_for(int64_t n, int64_t grain, int threads, RangeFn fn, void* ctx, int spin_us = 0, int64_t work = 0);
// The least work (multiply-adds) worth a range of its own: TORCHQ_NATIVE_MIN_PARALLEL_WORK at load,
// tq_set_min_parallel_work later.
int64_t min_parallel_work();

// Error codes returned by the exported kernels (0 = success).
enum Status : int { OK = 0, BAD_ARGUMENT = 1, OUT_OF_MEMORY = 2 };

// Element types of the activations and outputs of the exported linears (x and out share one).
enum DType : int { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
size_t dtype_size(int dtype);
inline bool valid_dtype(int dtype) { return dtype >= DT_F32 && dtype <= DT_F16; }
// dst[0, K) = row x[0, K) of `dtype` as fp32 (exact); dst[K, Kp) = 0.
void to_f32_row(const void* x, int dtype, int64_t K, int64_t Kp, float* dst);
// dst[0, n) = src rounded to `dtype` as torch's .to() rounds (nearest even; NaN stays NaN).
void from_f32_row(const float* src, int64_t n, int dtype, void* dst);
// from_f32_row in ranges across up to `threads` threads (a many-row output: one thread converting
// it after a parallel GEMM was a fifth of the int8 AMX call at 256 x 3072).
void from_f32_rows(const float* src, int64_t n, int dtype, void* dst, int threads);
// to_f32_row of rows m of x ([M, K] of `dtype`) into dst + m * Kp, across up to `threads` threads.
void to_f32_rows(const void* x, int dtype, int64_t M, int64_t K, int64_t Kp, float* dst, int threads);

// fp32 -> bf16 bits, round to nearest even (finite inputs: the dequantized weights are never NaN).
static inline uint16_t bf16_rne(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// fp32 -> bf16 bits as torch's .to(torch.bfloat16) rounds (from_f32_row): nearest even, every NaN
// to 0x7FC0 (torch's canonical bf16 NaN).
static inline uint16_t bf16_rne_nan(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : bf16_rne(f);
}

}  // namespace tq
