// The weight argument of the exported linears (tq_linear, tq_dequantize_rows): one struct with a
// format tag, declared once here as an X-macro list of (name, C type, kind). The library exports
// the list (tq_weight_abi: name, kind and byte offset of field i; tq_weight_size), and
// torchq/backends/native_cpu/abi.py builds its ctypes.Structure from it when the library loads, refusing a
// library whose fields, offsets, kinds, size or ABI version differ from what torchq fills.
//
// Formats and the fields each reads (every other pointer must be null; sizes in elements):
// * TQ_FORMAT_LUT4: 4-bit codes looked up in a 16-entry table (lut4_linear.h): NF4 / FP4 and
//   torchq's affine int4. packed uint8 [n * row_length / 2]; codebook fp32 [16]; block (a power of
//   two >= 32 dividing row_length); row_length >= k, < k + block (int4 rows are zero-padded to a
//   multiple of block); either scales fp32 [n * row_length / block] or the nested (double-quantized)
//   scales: nested_codes uint8 [n * row_length / block], nested_absmax fp32 [ceil(codes / 256)],
//   nested_offset fp32 [1] (read at every call), nested_map fp32 [256]; optional shifts / zeros fp32
//   [n * row_length / block]; round_mul / round_add: 0 none, 1 bf16, 2 fp16.
// * TQ_FORMAT_INT8: int8 weight-only (int8_linear.h): codes int8 [n * k], scales fp32 [n] (one per
//   row), row_length == k. codes_order 0: codes row-major [n, k], code_sums null; codes_order 1
//   (every int8 format): the codes in VNNI panel order (int8_linear.h, "Panel order":
//   int8 [ceil(n / 16) * 16 * kp], kp = k rounded up to 64, zero padded) and code_sums int32 [n]
//   (sum_k codes[n, k]).
// * TQ_FORMAT_INT8_DYNAMIC: the same weight, activations quantized per row with
//   act_denom, act_eps, act_qmin >= -127, act_qmax (torchq.activation.PerTokenInt8); no bias.
// * TQ_FORMAT_INT8_STATIC: the same weight, activations quantized with one fixed scale and zero
//   point (torchq.activation.StaticInt8): act_scale (a normal, finite fp32 > 0), act_zero_point in
//   [act_qmin, act_qmax], -127 <= act_qmin < act_qmax <= 127, and row_sums int32 [n] (sum_k
//   codes[n, k], for the zero point's correction; null in every other format); no bias.
// * TQ_FORMAT_LUT4_INT8ACT: a TQ_FORMAT_LUT4 weight (same fields) with activations quantized per
//   32-element block to int8 (torchq.activation.PerBlockInt8) and integer dot products
//   (lut4_linear.h, "int8-activation path"); round_mul and round_add must be 0, and either the
//   codebook is affine (codebook[c] = codebook[0] + c: int4) or there are no shifts / zeros.
#pragma once
#include <stddef.h>
#include <stdint.h>

// Bumped whenever an exported signature or the weight struct changes; torchq/native.py refuses a mismatch.
#define TQ_ABI_VERSION 17

enum tq_weight_format : int32_t { TQ_FORMAT_LUT4 = 1, TQ_FORMAT_INT8 = 2, TQ_FORMAT_INT8_DYNAMIC = 3, TQ_FORMAT_LUT4_INT8ACT = 4,
                                    TQ_FORMAT_INT8_STATIC = 5 };
// A field's kind as tq_weight_abi reports it: its C type, as torchq/backends/native_cpu/abi.py maps it to ctypes.
enum tq_field_kind : int { TQ_KIND_I32 = 0, TQ_KIND_I64 = 1, TQ_KIND_F32 = 2, TQ_KIND_PTR = 3 };

#define TQ_WEIGHT_FIELDS(X)                                                                                   \
  X(format, int32_t, TQ_KIND_I32)       /* tq_weight_format */                                                \
  X(n, int64_t, TQ_KIND_I64)            /* output features: weight rows */                                    \
  X(k, int64_t, TQ_KIND_I64)            /* input features: elements per activation row */                     \
  X(row_length, int64_t, TQ_KIND_I64)   /* elements per stored weight row */                                  \
  X(scales, const float*, TQ_KIND_PTR)  /* lut4: per block, or null when nested; int8: per row */             \
  X(block, int64_t, TQ_KIND_I64)        /* lut4 */                                                            \
  X(packed, const uint8_t*, TQ_KIND_PTR)                                                                      \
  X(codebook, const float*, TQ_KIND_PTR)                                                                      \
  X(shifts, const float*, TQ_KIND_PTR)  /* added to the table value before scaling, or null */                \
  X(zeros, const float*, TQ_KIND_PTR)   /* added after scaling, or null */                                    \
  X(round_mul, int32_t, TQ_KIND_I32)                                                                          \
  X(round_add, int32_t, TQ_KIND_I32)                                                                          \
  X(nested_codes, const uint8_t*, TQ_KIND_PTR)                                                                \
  X(nested_absmax, const float*, TQ_KIND_PTR)                                                                 \
  X(nested_offset, const float*, TQ_KIND_PTR)                                                                 \
  X(nested_map, const float*, TQ_KIND_PTR)                                                                    \
  X(codes, const int8_t*, TQ_KIND_PTR)  /* int8 */                                                            \
  X(act_denom, float, TQ_KIND_F32)      /* int8 dynamic */                                                    \
  X(act_eps, float, TQ_KIND_F32)                                                                              \
  X(act_qmin, int32_t, TQ_KIND_I32)     /* int8 dynamic and static */                                         \
  X(act_qmax, int32_t, TQ_KIND_I32)                                                                           \
  X(act_scale, float, TQ_KIND_F32)      /* int8 static */                                                     \
  X(act_zero_point, int32_t, TQ_KIND_I32)                                                                     \
  X(row_sums, const int32_t*, TQ_KIND_PTR) /* int8 static: [n] */                                            \
  X(codes_order, int32_t, TQ_KIND_I32)  /* int8: 0 row-major codes, 1 VNNI panels */                          \
  X(code_sums, const int32_t*, TQ_KIND_PTR) /* int8 VNNI panels: sum_k codes[n, k], [n] */

struct tq_weight {
#define TQ_DECLARE_FIELD(name, type, kind) type name;
  TQ_WEIGHT_FIELDS(TQ_DECLARE_FIELD)
#undef TQ_DECLARE_FIELD
};

namespace tq {

// The per-family halves of tq_linear / tq_dequantize_rows (lut4_linear.cpp, int8_linear.cpp), called
// with w's format theirs and the arguments every format shares checked (weight_abi.cpp). Each checks
// its own fields and returns a Status.
int lut4_linear(const tq_weight& w, const void* x, int dtype, int64_t M, const float* bias, void* out, int threads);
int lut4_dequantize(const tq_weight& w, int64_t n0, int64_t n1, void* dst, bool bf16, int threads);
int lut4_dot_max_m(const tq_weight& w);  // see tq_dot_max_m
int int8_linear(const tq_weight& w, const void* x, int dtype, int64_t M, const float* bias, void* out, int threads);
int int8_dequantize(const tq_weight& w, int64_t n0, int64_t n1, void* dst, bool bf16, int threads);

}  // namespace tq
