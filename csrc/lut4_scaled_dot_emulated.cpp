// The lut4 scaled dot path on emulated instructions (lut4_scaled_dot_body.h over
// dot_bf16_emulated.h, plus the codebook lookup of lut4_linear_avx512bf16.cpp's Lut4ScaledDotOps on
// arrays). The same bits as the AVX512_BF16 kernel, on any CPU: tq_set_lut4_scaled_dot(
// LUT4_SCALED_DOT_EMULATED) runs it (tests), with the active ISA's table path for the weight rows
// that fall back. Compiled for the baseline ISA.
#include <initializer_list>

#include "dot_bf16_emulated.h"
#include "kernels.h"
#include "lut4_scaled_dot_body.h"

namespace tq {
namespace {

struct Lut4EmulatedDotOps : EmulatedDotOps {
  static constexpr bool kConstantBlocks = false;  // Lut4ScaledDot::tile
  struct Tab {
    uint16_t h[32];  // vpermw's 32 words
  };

  static Tab table(const float* codebook) {
    Tab t;
    for (int c = 0; c < 16; ++c) t.h[c] = t.h[c + 16] = bf16_word(codebook[c]);
    return t;
  }

  // Word j of the packed bytes as vpermw indexes by it: its bits 4i..4i+4 (bit 4 the next nibble's
  // low bit; none past bit 15).
  static void weights(const Tab& tab, const uint8_t* w, int bytes, B (&q)[4]) {
    for (int j = 0; j < 32; ++j) {
      const unsigned word = (2 * j < bytes ? w[2 * j] : 0u) | (2 * j + 1 < bytes ? w[2 * j + 1] : 0u) << 8;
      for (int i = 0; i < 4; ++i) q[i].h[j] = tab.h[(word >> (4 * i)) & 31];
    }
  }

  // weights() of bytes <= 32 on lanes 0-7 (words 0-15, indexing words 0-15: the 256-bit vpermw
  // reads 4 index bits), words 16-31 zero, as the kernel's; and dp() on lanes 0-7, lanes 8-15 of
  // the result acc's.
  static void weights_low(const Tab& tab, const uint8_t* w, int bytes, B (&q)[4]) {
    for (int j = 0; j < 32; ++j) {
      const unsigned word = (2 * j < bytes && j < 16 ? w[2 * j] : 0u) | (2 * j + 1 < bytes && j < 16 ? w[2 * j + 1] : 0u) << 8;
      for (int i = 0; i < 4; ++i) q[i].h[j] = j < 16 ? tab.h[(word >> (4 * i)) & 15] : 0;
    }
  }
  static V dp_low(const V& acc, const B& a, const B& b) {
    V r = acc;
    for (int i = 0; i < 8; ++i) {
      r.f[i] = acc.f[i] + f32(a.h[2 * i + 1]) * f32(b.h[2 * i + 1]);
      r.f[i] = r.f[i] + f32(a.h[2 * i]) * f32(b.h[2 * i]);
    }
    return r;
  }

  // The table kind's (see Lut4ScaledDotOps): the codebook; a chunk's two blocks' bf16 weights
  // (an fp32 multiply, then round to nearest even); weights() with each index's bit 4 the block
  // (words 16-31: 1); lut4_scale of flat blocks.
  static V code(const float* codebook) {
    V r;
    for (int c = 0; c < 16; ++c) r.f[c] = codebook[c];
    return r;
  }
  static Tab table2(const V& code, float a, float b) {
    Tab t;
    for (int c = 0; c < 16; ++c) {
      t.h[c] = bf16_rne_nan(code.f[c] * a);
      t.h[c + 16] = bf16_rne_nan(code.f[c] * b);
    }
    return t;
  }
  static void weights_split(const Tab& tab, const uint8_t* w, B (&q)[4]) {
    for (int j = 0; j < 32; ++j) {
      const unsigned word = w[2 * j] | static_cast<unsigned>(w[2 * j + 1]) << 8;
      for (int i = 0; i < 4; ++i) q[i].h[j] = tab.h[((word >> (4 * i)) & 15) | (j < 16 ? 0u : 16u)];
    }
  }
  static void decode_scales(const Lut4Params& p, int64_t b0, int64_t count, float* dst) {
    for (int64_t b = b0; b < b0 + count; ++b) {
      const float t = p.nested_map[p.nested_codes[b]] * p.nested_absmax[b >> 8];
      dst[b - b0] = t + p.nested_offset;
    }
  }

  // Whether each of v[0..count) and w[0..count) (w may be null) lets its weight row take the path:
  // 0, or of magnitude in [min, 2^100] (min_bits: min's fp32 bits; the scaled kind's FLT_MIN: normal) (so that no weight c s is subnormal or overflows where the
  // reference's would not; inf / NaN scales would give NaN where the reference's weights give inf).
  static bool values_ok(const float* v, const float* w, int64_t count, uint32_t min_bits) {
    for (const float* a : {v, w})
      for (int64_t i = 0; a && i < count; ++i) {
        uint32_t u;
        memcpy(&u, a + i, sizeof u);
        const uint32_t m = u & 0x7FFFFFFFu;
        if (m != 0u && (m < min_bits || m > 0x71800000u)) return false;
      }
    return true;
  }

  static V spread(const float* v, int per, int count) {
    V r;
    for (int l = 0; l < 16; ++l) r.f[l] = l / per < count ? v[l / per] : 0.0f;
    return r;
  }
};

void scaled_dot_rows(const Lut4Params& p, int64_t n0, int64_t n1) {
  Lut4ScaledDotPath<Lut4EmulatedDotOps>::rows(p, n0, n1, kernels().lut4.rows);
}

}  // namespace

extern const Lut4RowsFn kLut4EmulatedScaledDot = &scaled_dot_rows;
extern const Lut4ValuesOkFn kLut4EmulatedScaledDotValuesOk = &Lut4EmulatedDotOps::values_ok;

}  // namespace tq
