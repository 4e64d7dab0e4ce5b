// The int8 weight-only bf16 dot path for AVX-512 with AVX512_BF16 (see int8_linear.h, "bf16 dot
// path"): int8 codes become bf16 words exactly (every integer in [-128, 127] is a bf16 value),
// vdpbf16ps multiplies them with the bf16 activations (products exact in fp32) and sums in fp32,
// and each output is scaled once: out[m, n] = s[n] * sum_k q[n, k] x[m, k] (+ bias[n]). cpu.cpp puts
// it into the AVX-512 table's int8.dot_bf16 on CPUs with AVX512_BF16 unless
// TORCHQ_NATIVE_AVX512BF16=0. Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include <float.h>

#include "simd_avx512bf16.h"
#include "int8_linear.h"
#include "tiling.h"

namespace tq {
namespace {

using F = __m512;

// 32 codes of a row (w[0..31]) as bf16 words, word j from byte j.
__attribute__((always_inline)) inline __m512bh codes_bf16(const int8_t* w) {
  const F lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const F hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The first `count` (< 32) codes of w likewise, zero words after them (nothing read past w + count).
__attribute__((always_inline)) inline __m512bh codes_bf16_tail(const int8_t* w, int64_t count) {
  const __m256i b = _mm256_maskz_loadu_epi8((__mmask32)((1u << count) - 1u), w);
  const F lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const F hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The 16 lane sums of v[0..15] in one vector: lane 4q + r holds the sum of v[4r + q] (45 shuffles
// and adds where 16 separate horizontal sums take about 140).
__attribute__((always_inline)) inline F sum16(const F (&v)[16]) {
  F c[8], e[4], g[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s 8 partial sums, 8-15: v[2i + 1]'s
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarter q: v[4j + q]'s 4 partial sums
    e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88), _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  for (int l = 0; l < 2; ++l)  // quarter q: 2 partial sums of v[8l + q], then 2 of v[8l + 4 + q]
    g[l] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * l], e[2 * l + 1], 0x44), _mm512_shuffle_ps(e[2 * l], e[2 * l + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
}

// Whether scale s lets a weight row take the dot path: 0, or finite and normal (its product with
// the fp32 sum is then the reference's weights' up to rounding; inf / NaN scales would give inf
// where the reference's 0 * inf weights give NaN).
inline bool dot_scale(float s) { return s == 0.0f || (__builtin_fabsf(s) >= FLT_MIN && __builtin_fabsf(s) <= FLT_MAX); }

// 32 bf16 activations at p as vdpbf16ps's operand.
__attribute__((always_inline)) inline __m512bh x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_ps(reinterpret_cast<const float*>(p)); }

// NT weight rows from n x MT activation rows from m0: NT * MT (<= 16) accumulators over K. p.xb
// holds chunk c's 32 positions of row m at (c * M + m) * 32 (see Int8Params), so one pointer and
// constant offsets address a chunk's rows.
template <int NT, int MT>
TQ_TILE void dot_tile(const Int8Params& p, int64_t n, int64_t m0) {
  static_assert(NT * MT <= 16, "one sum16 per tile");
  const int64_t K = p.K, step = p.M * 32;
  F acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* w = p.w + n * K;
  const uint16_t* x = p.xb + m0 * 32;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32, x += step) {
    __m512bh xv[MT];  // loaded once for the NT weight rows
    for (int m = 0; m < MT; ++m) {
      xv[m] = x32(x + m * 32);
      if constexpr (NT > 1) asm("" : "+v"(xv[m]));  // kept in a register (else reloaded per weight row)
    }
    for (int t = 0; t < NT; ++t) {
      const __m512bh wv = codes_bf16(w + t * K + k);
      for (int m = 0; m < MT; ++m) acc[t * MT + m] = _mm512_dpbf16_ps(acc[t * MT + m], wv, xv[m]);
    }
  }
  if (k < K) {  // the last codes of each row; the activations are zero-padded to kx
    for (int t = 0; t < NT; ++t) {
      const __m512bh wv = codes_bf16_tail(w + t * K + k, K - k);
      for (int m = 0; m < MT; ++m) acc[t * MT + m] = _mm512_dpbf16_ps(acc[t * MT + m], wv, x32(x + m * 32));
    }
  }
  F v[16];
  for (int j = 0; j < 16; ++j) v[j] = acc[4 * (j % 4) + j / 4];  // so that lane i sums acc[i]
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum16(v));
  for (int t = 0; t < NT; ++t) {
    const float s = p.scale[n + t];
    for (int m = 0; m < MT; ++m) {
      const float y = s * sums[t * MT + m];
      p.out[(m0 + m) * p.N + n + t] = p.bias ? y + p.bias[n + t] : y;
    }
  }
}

// Weight rows [n0, n1) for activation rows [m0, m0 + MT): tiles of NT rows (NT * MT <= 16); a tile
// holding a scale that is not dot_scale's takes the fp32 row kernel (p.x holds the fp32 rows).
// The activation rows a tile runs at once: up to 8 (x loaded once per 2 weight rows: at 16 rows,
// 0.85-0.94x bf16 F.linear in chunks of 8 against 0.80-0.93x in chunks of 16 and 0.71-0.78x in
// chunks of 4, one Zen 4 core, SmolLM2's shapes), fewer where their K positions would exceed
// kDotChunkBytes (they are read once per weight tile: from L1 while they fit there; 576 x 1536 at
// 16 rows took 313 us in chunks of 16, 48 KB, and 220 in chunks of 8), but at least 4.
constexpr int64_t kDotChunkBytes = 24 << 10, kDotChunkMaxRows = 8;

// The weight rows a block holds: as many as keep their codes within kDotBlockBytes (a multiple of
// 8 rows, at least 8). Above one chunk of activation rows, each chunk runs over a block before the
// next chunk does, so the block's codes (and the chunk's activations) are read from L1.
constexpr int64_t kDotBlockBytes = 16 << 10;

// Activation rows [m0, m0 + mt) (mt <= chunk) against the NT weight rows from n, in tiles of up to
// 16 accumulators.
template <int NT>
void dot_weight_rows(const Int8Params& p, int64_t n, int64_t m0, int64_t mt) {
  with_tile_size<kDotChunkMaxRows>(mt, [&](auto size) {
    constexpr int MT = decltype(size)::value;
    constexpr int fit = 16 / MT < NT ? 16 / MT : NT;  // the most weight rows per tile at MT
    for (int t = 0; t < NT; t += fit) {
      if (t + fit <= NT) {
        dot_tile<fit, MT>(p, n + t, m0);
      } else {
        with_tile_size<fit>(NT - t, [&](auto rest) { dot_tile<decltype(rest)::value, MT>(p, n + t, m0); });
      }
    }
  });
}

// Weight rows [n0, n1) in tiles of NT: blocks of rows, each block's tiles for one chunk of
// activation rows at a time. A tile holding a scale that is not dot_scale's runs the fp32 row
// kernel for every activation row (p.x holds the fp32 rows) instead.
template <int NT>
void dot_blocks(const Int8Params& p, int64_t n0, int64_t n1, int64_t chunk, Int8RowsFn fallback) {
  int64_t block = kDotBlockBytes / p.K / 8 * 8;
  if (block < 8) block = 8;
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
    for (int64_t m0 = 0; m0 < p.M; m0 += chunk) {
      const int64_t mt = p.M - m0 < chunk ? p.M - m0 : chunk;
      tiles_then_singles<NT>(b0, b1, [&](auto r, int64_t n) {
        constexpr int R = decltype(r)::value;
        bool safe = true;
        for (int t = 0; t < R; ++t) safe &= dot_scale(p.scale[n + t]);
        if (safe) dot_weight_rows<R>(p, n, m0, mt);
        else if (m0 == 0) fallback(p, n, n + R);
      });
    }
  }
}

void dot_rows(const Int8Params& p, int64_t n0, int64_t n1) {
  const Int8RowsFn fallback = kInt8Avx512.weight_rows;
  int64_t chunk = kDotChunkBytes / (p.kx * 2);
  chunk = chunk < 4 ? 4 : chunk > kDotChunkMaxRows ? kDotChunkMaxRows : chunk;
  if (chunk > p.M) chunk = p.M;
  // weight tiles of NT rows: as many as 16 accumulators allow at the call's widest chunk
  if (chunk <= 2) dot_blocks<8>(p, n0, n1, chunk, fallback);
  else if (chunk <= 4) dot_blocks<4>(p, n0, n1, chunk, fallback);
  else if (chunk <= 5) dot_blocks<3>(p, n0, n1, chunk, fallback);
  else dot_blocks<2>(p, n0, n1, chunk, fallback);
}

}  // namespace

extern const Int8RowsFn kInt8Avx512Bf16Dot = &dot_rows;

}  // namespace tq
