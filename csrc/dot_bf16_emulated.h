// dot_bf16_avx512.h's operations on arrays, in the order the instructions define (Intel's
// VDPBF16PS: per lane, the odd pair's product added first, then the even pair's, each an fp32
// rounding; the dot paths' inputs never make a product or a sum subnormal, so its DAZ / FTZ never
// acts): the same bits as the AVX512_BF16 kernels on any CPU, for tests. Compiled for the baseline
// ISA. In an anonymous namespace (see common.h).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

namespace tq {
namespace {

struct EmulatedDotOps {
  struct V {
    float f[16];
  };
  struct B {
    uint16_t h[32];
  };

  static V zero() { return V{}; }

  static float f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }

  // The bf16 word of v, which must be a bf16 value (its low 16 bits zero: exact).
  static uint16_t bf16_word(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return static_cast<uint16_t>(u >> 16);
  }

  static B x32(const uint16_t* p) {
    B b;
    memcpy(b.h, p, sizeof b.h);
    return b;
  }

  static B pair(const uint16_t* p) {
    B b;
    for (int i = 0; i < 16; ++i) {
      b.h[2 * i] = p[0];
      b.h[2 * i + 1] = p[1];
    }
    return b;
  }
  static void store(float* out, const V& v) { memcpy(out, v.f, sizeof v.f); }
  static B zero_words() { return B{}; }
  static void store_words(uint16_t* p, const B& b) { memcpy(p, b.h, sizeof b.h); }
  static void transpose16(B (&v)[16]) {  // as dwords: dword j of v[i] to dword i of v[j]
    B r[16];
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        r[j].h[2 * i] = v[i].h[2 * j];
        r[j].h[2 * i + 1] = v[i].h[2 * j + 1];
      }
    for (int i = 0; i < 16; ++i) v[i] = r[i];
  }
  static V mul(const V& a, const V& b) {
    V r;
    for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] * b.f[i];
    return r;
  }
  static void store_bf16(uint16_t* dst, const V& v, int64_t count) {  // as the instructions round (bf16_rne_nan's rule)
    for (int64_t i = 0; i < count && i < 16; ++i) dst[i] = bf16_rne_nan(v.f[i]);
  }
  static V dp(V acc, const B& a, const B& b) {
    for (int i = 0; i < 16; ++i) {
      acc.f[i] = acc.f[i] + f32(a.h[2 * i + 1]) * f32(b.h[2 * i + 1]);
      acc.f[i] = acc.f[i] + f32(a.h[2 * i]) * f32(b.h[2 * i]);
    }
    return acc;
  }

  static V fma(const V& a, const V& b, const V& c) {
    V r;
    for (int i = 0; i < 16; ++i) r.f[i] = fmaf(a.f[i], b.f[i], c.f[i]);  // one rounding, as vfmadd
    return r;
  }
  static V load_partial(const float* v, int64_t count) {
    V r{};
    for (int64_t i = 0; i < count; ++i) r.f[i] = v[i];
    return r;
  }

  static void keep(B&) {}

  // _mm512_shuffle_f32x4 and _mm512_shuffle_ps on arrays.
  static V shuffle_quarters(const V& a, const V& b, int imm) {
    V r;
    for (int q = 0; q < 4; ++q) {
      const V& s = q < 2 ? a : b;
      const int from = (imm >> (2 * q)) & 3;
      for (int i = 0; i < 4; ++i) r.f[4 * q + i] = s.f[4 * from + i];
    }
    return r;
  }
  static V shuffle_within(const V& a, const V& b, int imm) {
    V r;
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i) r.f[4 * q + i] = (i < 2 ? a : b).f[4 * q + ((imm >> (2 * i)) & 3)];
    return r;
  }
  static V add(const V& a, const V& b) {
    V r;
    for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] + b.f[i];
    return r;
  }

  static void sum16(const V (&v)[16], float* out) {  // the tree of Avx512Bf16DotOps::sum16
    V c[8], e[4], g[2];
    for (int i = 0; i < 8; ++i) c[i] = add(shuffle_quarters(v[2 * i], v[2 * i + 1], 0x44), shuffle_quarters(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; ++j) e[j] = add(shuffle_quarters(c[2 * j], c[2 * j + 1], 0x88), shuffle_quarters(c[2 * j], c[2 * j + 1], 0xDD));
    for (int l = 0; l < 2; ++l) g[l] = add(shuffle_within(e[2 * l], e[2 * l + 1], 0x44), shuffle_within(e[2 * l], e[2 * l + 1], 0xEE));
    const V r = add(shuffle_within(g[0], g[1], 0x88), shuffle_within(g[0], g[1], 0xDD));
    memcpy(out, r.f, sizeof r.f);
  }
};

}  // namespace
}  // namespace tq
