// The portable lut4 kernel (ISA_SCALAR, TORCHQ_NATIVE_ISA=scalar): one fp32 sum per output in
// element order of the permuted activations, table entries built as the reference does.
#include "common.h"
#include "lut4_linear.h"

namespace tq {
namespace {

float round_to(float v, int kind) {
  if (kind == ROUND_BF16) {
    const uint32_t u = static_cast<uint32_t>(bf16_rne(v)) << 16;
    float r;
    __builtin_memcpy(&r, &u, 4);
    return r;
  }
  if (kind == ROUND_FP16) return static_cast<float>(static_cast<_Float16>(v));  // round to nearest even
  return v;
}

// The table entry for code value c of block g of row n (the scalar form of the vector tables).
float lut4_value(const Lut4Params& p, float c, int64_t n, int64_t g) {
  const int64_t b = n * p.blocks_per_row + g;
  if (p.shifts) c += p.shifts[b];
  float v = round_to(c * lut4_scale(p, n, g), p.round_mul);
  if (p.zeros) v = round_to(v + p.zeros[b], p.round_add);
  return v;
}

void dequant(const Lut4Params& p, int64_t n0, int64_t n1, void* dst, bool bf16) {
  const int64_t K = p.K, G = K / p.block;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.packed + n * (K / 2);
    for (int64_t g = 0; g < G; ++g) {
      float lut[16];
      for (int c = 0; c < 16; ++c) lut[c] = lut4_value(p, p.codebook[c], n, g);
      for (int64_t k = g * p.block; k < (g + 1) * p.block; ++k) {
        const float v = lut[k & 1 ? w[k / 2] & 15 : w[k / 2] >> 4];
        const int64_t i = (n - n0) * K + k;
        if (bf16) static_cast<uint16_t*>(dst)[i] = bf16_rne(v);
        else static_cast<float*>(dst)[i] = v;
      }
    }
  }
}

}  // namespace

void lut4_rows_portable(const Lut4Params& p, int64_t n0, int64_t n1) {
  const int64_t K = p.K, G = K / p.block;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.packed + n * (K / 2);
    for (int64_t m = 0; m < p.M; ++m) {
      const float* x = p.xp + m * K;
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        float lut[16];
        for (int c = 0; c < 16; ++c) lut[c] = lut4_value(p, p.codebook[c], n, g);
        for (int64_t k = g * p.block; k < (g + 1) * p.block; k += 32) {
          const uint8_t* bytes = w + k / 2;
          for (int j = 0; j < 16; ++j) {
            acc += lut[bytes[j] >> 4] * x[k + j];
            acc += lut[bytes[j] & 15] * x[k + 16 + j];
          }
        }
      }
      p.out[m * p.N + n] = p.bias ? acc + p.bias[n] : acc;
    }
  }
}

// One sum per output: per 32-block j the exact integer sum, then fp32 terms in element order.
void lut4_q8_rows_portable(const Lut4Params& p, int64_t n0, int64_t n1) {
  const int64_t K = p.K, B = p.block;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.packed + n * (K / 2);
    for (int64_t m = 0; m < p.M; ++m) {
      const int8_t* q = p.xq8 + m * p.kq;
      const float* xa = p.xa + m * (p.kq / 64) * 8;
      float acc = 0.0f;
      for (int64_t j = 0; j < K / 32; ++j) {
        // block j's codes: chunk j / 2, half j % 2 of the even and odd runs
        const int8_t* qe = q + (j / 2) * 64 + (j % 2) * 16;
        const int8_t* qo = qe + 32;
        int32_t isum = 0;
        for (int i = 0; i < 16; ++i) {
          const uint8_t byte = w[j * 16 + i];
          const int hi = byte >> 4, lo = byte & 15;
          if (p.q8_affine) isum += hi * qe[i] + lo * qo[i];
          else isum += p.q8_table[hi] * qe[i] + p.q8_table[lo] * qo[i];
        }
        const int64_t g = j * 32 / B;
        const float s = lut4_scale(p, n, g);  // (xa holds a * q8_unit for the codebook kind)
        acc += static_cast<float>(isum) * (xa[(j / 2) * 8 + (j % 2) * 4] * s);
      }
      if (p.q8_affine)
        for (int64_t g = 0; g < p.blocks_per_row; ++g)
          acc += lut4_q8_offset(p, n, g, lut4_scale(p, n, g)) * p.xblk[m * p.blocks_per_row + g];
      p.out[m * p.N + n] = p.bias ? acc + p.bias[n] : acc;
    }
  }
}

extern const Lut4Kernels kLut4Scalar = {&lut4_rows_portable, &dequant, nullptr, 0, nullptr, false, nullptr, &lut4_q8_rows_portable, nullptr, &lut4_q8_block_portable, nullptr, nullptr, nullptr, 0};

}  // namespace tq
