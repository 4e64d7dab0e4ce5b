// The 4-bit table-lookup linear ("lut4"): fused dequantize + linear for 4-bit weights whose 16
// values per block come from a 16-entry table. One kernel serves bitsandbytes' NF4 / FP4
// blockwise formats and torchq's groupwise affine int4 format (TQ_FORMAT_LUT4, weight_abi.h).
//
// Files: lut4_linear.cpp (the lut4 half of tq_linear / tq_dequantize_rows: checks, activation
// permutation, threading), lut4_linear_body.h (the vector kernel, written once over ISA traits),
// lut4_linear_avx2.cpp / lut4_linear_avx512.cpp (its instantiations), lut4_linear_scalar.cpp (the
// portable kernel).
//
// Weight bytes: packed uint8 [N, K/2], element 2j of a row in the high nibble of byte j; one
// fp32 scale per block of B consecutive elements of a row (B divides K), either plain
// ([N*K/B]) or double-quantized (uint8 codes [N*K/B], fp32 absmax2 per 256 codes, fp32 offset:
// scale = map[code] * absmax2[i/256] + offset).
// Weight value of nibble c in block b (compiled without FP contraction, so each step is one
// rounding, as in PyTorch):
//   v = codebook[c] (+ shifts[b]);  v = R_mul(v * scale[b]);  (v = R_add(v + zeros[b]))
// with R the rounding to the reference's arithmetic dtype (none for fp32, bf16 or fp16).
// NF4 / FP4: codebook = the format's values, no shifts / zeros / rounding: exactly
// torchq::dequantize_4bit. int4 (torchq.layouts.int4_native): codebook[c] = c + qmin - mid
// (float zero point: zeros = z, ``(q - mid) * s + z``) or c + qmin with shifts = -z (integer
// zero point, ``(q - z) * s``), rounded in the scale / zero dtypes: exactly dequantize_affine.
//
// Activations arrive as fp32 rows permuted per chunk of 32 elements: the 16 even elements,
// then the 16 odd ones (the order in which high and low nibbles of 16 bytes unpack).
#pragma once
#include <stdint.h>

namespace tq {

struct Lut4Params {
  const float* xp;  // [M, K], permuted per chunk of 32 (see above)
  int64_t M, K, N, block;
  const uint8_t* packed;     // [N, K/2]
  const float* codebook;     // 16 fp32 values
  const float* absmax;       // [N*K/block], or null when nested
  const uint8_t* nested_codes;
  const float* nested_absmax;
  float nested_offset;
  const float* nested_map;   // 256 fp32 values
  const float* bias;         // [N] or null
  float* out;                // [M, N]
  const float* shifts;       // [N*K/block] added to the codebook value before scaling, or null
  const float* zeros;        // [N*K/block] added after scaling, or null
  int round_mul, round_add;  // Round kinds after the multiply / the add
};

enum Round : int { ROUND_NONE = 0, ROUND_BF16 = 1, ROUND_FP16 = 2 };

// The absmax of block g of row n, bit-exact to torchq's reference (compiled without FP
// contraction, so map * absmax2 + offset is two roundings as in PyTorch).
static inline float lut4_scale(const Lut4Params& p, int64_t n, int64_t g) {
  const int64_t b = n * (p.K / p.block) + g;
  if (p.absmax) return p.absmax[b];
  const float t = p.nested_map[p.nested_codes[b]] * p.nested_absmax[b >> 8];
  return t + p.nested_offset;
}

// Rows [n0, n1) of the output, for all M activation rows.
typedef void (*Lut4RowsFn)(const Lut4Params& p, int64_t n0, int64_t n1);
// Weight rows [n0, n1) in natural order into dst (row n at dst + (n - n0) * K elements), as fp32
// or as bf16 (round to nearest even, as torch's .to(torch.bfloat16)). Uses p's weight fields only.
typedef void (*Lut4DequantFn)(const Lut4Params& p, int64_t n0, int64_t n1, void* dst, bool bf16);

// One ISA's kernels (see kernels.h).
struct Lut4Kernels {
  Lut4RowsFn rows;
  Lut4DequantFn dequant;
};
extern const Lut4Kernels kLut4Scalar, kLut4Avx2, kLut4Avx512;

// The portable rows (kLut4Scalar.rows), also the vector kernels' fallback when their unpacking
// buffer cannot be allocated.
void lut4_rows_portable(const Lut4Params& p, int64_t n0, int64_t n1);

}  // namespace tq
