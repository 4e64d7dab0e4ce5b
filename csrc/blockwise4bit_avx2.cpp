// AVX2 + FMA kernels for tq_blockwise4bit_linear (see blockwise4bit.h for the formats).
//
// Same structure as the AVX-512 file with 8-lane vectors. A 16-entry table takes two 8-entry
// vpermps lookups and a blend on bit 3 of the nibble.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdlib.h>

#include "blockwise4bit.h"

namespace tq {
namespace {

constexpr int kFusedMaxM = 4;
constexpr int64_t kPanelRows = 4;
constexpr int64_t kActivationBlockBytes = 1 << 20;

struct Table {
  __m256 lo, hi;  // codebook[0..8) * absmax, codebook[8..16) * absmax
};

inline __m256 round_to(__m256 v, int kind) {
  if (kind == ROUND_BF16) {  // round to nearest even, keep the result in fp32
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  if (kind == ROUND_FP16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return v;
}

inline __m256 entries(const B4Params& p, __m256 code, __m256 s, int64_t b) {
  if (!p.shifts && !p.zeros && p.round_mul == ROUND_NONE) return _mm256_mul_ps(code, s);
  const __m256 c = p.shifts ? _mm256_add_ps(code, _mm256_set1_ps(p.shifts[b])) : code;
  const __m256 v = round_to(_mm256_mul_ps(c, s), p.round_mul);
  return p.zeros ? round_to(_mm256_add_ps(v, _mm256_set1_ps(p.zeros[b])), p.round_add) : v;
}

// The block's 16 weight values (see blockwise4bit.h).
inline Table table(const B4Params& p, int64_t n, int64_t g) {
  const __m256 s = _mm256_set1_ps(b4_scale(p, n, g));
  const int64_t b = n * (p.K / p.block) + g;
  return {entries(p, _mm256_loadu_ps(p.codebook), s, b), entries(p, _mm256_loadu_ps(p.codebook + 8), s, b)};
}

// Values of 8 nibbles (the low 4 bits of each 32-bit lane; higher bits are ignored).
inline __m256 lookup(const Table& lut, __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(lut.lo, idx);
  const __m256 b = _mm256_permutevar8x32_ps(lut.hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// The 32 weights of a 16-byte chunk, in the permuted activation order:
// w[0] elements 0,2..14 | w[1] 16,18..30 | w[2] 1,3..15 | w[3] 17,19..31.
inline void unpack_chunk(const Table& lut, const uint8_t* bytes, __m256 w[4]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m256i v0 = _mm256_cvtepu8_epi32(raw);
  const __m256i v1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw));
  w[0] = lookup(lut, _mm256_srli_epi32(v0, 4));
  w[1] = lookup(lut, _mm256_srli_epi32(v1, 4));
  w[2] = lookup(lut, v0);
  w[3] = lookup(lut, v1);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int NT, int MT>
void fused_tile(const B4Params& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, B = p.block, G = K / B;
  __m256 acc[NT][MT][2];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m][0] = acc[t][m][1] = _mm256_setzero_ps();
  // Fetch the next tile's rows (they follow these in memory) one line per NT steps' worth of
  // bytes, so memory streams while this tile computes (see the AVX-512 file).
  const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
  const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
  for (int64_t g = 0; g < G; ++g) {
    Table lut[NT];
    for (int t = 0; t < NT; ++t) lut[t] = table(p, n + t, g);
    for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
      if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
      ahead += 16 * NT;
      for (int t = 0; t < NT; ++t) {
        __m256 w[4];
        unpack_chunk(lut[t], p.packed + (n + t) * (K / 2) + k / 2, w);
        for (int m = 0; m < MT; ++m) {
          const float* x = p.xp + (m0 + m) * K + k;
          acc[t][m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), acc[t][m][0]);
          acc[t][m][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), acc[t][m][1]);
          acc[t][m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), acc[t][m][0]);
          acc[t][m][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), acc[t][m][1]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) {
      float s = hsum(_mm256_add_ps(acc[t][m][0], acc[t][m][1]));
      p.out[(m0 + m) * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
    }
}

template <int NT>
void fused_rows(const B4Params& p, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= p.M; m += 2) fused_tile<NT, 2>(p, n, m);
  if (m < p.M) fused_tile<NT, 1>(p, n, m);
}

void unpack_panel(const B4Params& p, int64_t n, int64_t rows, float* buf) {
  const int64_t K = p.K, B = p.block, G = K / B;
  for (int64_t t = 0; t < rows; ++t) {
    const uint8_t* w = p.packed + (n + t) * (K / 2);
    float* dst = buf + t * K;
    for (int64_t g = 0; g < G; ++g) {
      const Table lut = table(p, n + t, g);
      for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
        __m256 v[4];
        unpack_chunk(lut, w + k / 2, v);
        for (int i = 0; i < 4; ++i) _mm256_store_ps(dst + k + 8 * i, v[i]);
      }
    }
  }
}

template <int NT, int MT>
void panel_tile(const B4Params& p, const float* buf, int64_t n, int64_t m0) {
  const int64_t K = p.K;
  __m256 acc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[NT];
    for (int t = 0; t < NT; ++t) w[t] = _mm256_load_ps(buf + t * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(p.xp + (m0 + m) * K + k);
      for (int t = 0; t < NT; ++t) acc[t][m] = _mm256_fmadd_ps(w[t], xv, acc[t][m]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) {
      float s = hsum(acc[t][m]);
      p.out[(m0 + m) * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
    }
}

template <int NT>
void panel_rows(const B4Params& p, const float* buf, int64_t n, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + 3 <= m1; m += 3) panel_tile<NT, 3>(p, buf, n, m);
  switch (m1 - m) {
    case 2: panel_tile<NT, 2>(p, buf, n, m); break;
    case 1: panel_tile<NT, 1>(p, buf, n, m); break;
    default: break;
  }
}

void panel_dispatch(const B4Params& p, const float* buf, int64_t rows, int64_t n, int64_t m0, int64_t m1) {
  switch (rows) {
    case 4: panel_rows<4>(p, buf, n, m0, m1); break;
    case 3: panel_rows<3>(p, buf, n, m0, m1); break;
    case 2: panel_rows<2>(p, buf, n, m0, m1); break;
    default: panel_rows<1>(p, buf, n, m0, m1); break;
  }
}

inline __m128i to_bf16(__m256 v) {  // round to nearest even, 8 lanes -> 8 x uint16
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

}  // namespace

void b4_dequant_avx2(const B4Params& p, int64_t n0, int64_t n1, void* dst, bool bf16) {
  const int64_t K = p.K, B = p.block, G = K / B;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.packed + n * (K / 2);
    const int64_t row = (n - n0) * K;
    for (int64_t g = 0; g < G; ++g) {
      const Table lut = table(p, n, g);
      for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
        __m256 v[4];  // even 0..14 | even 16..30 | odd 1..15 | odd 17..31
        unpack_chunk(lut, w + k / 2, v);
        __m256 out[4];
        for (int h = 0; h < 2; ++h) {
          const __m256 lo = _mm256_unpacklo_ps(v[h], v[h + 2]), hi = _mm256_unpackhi_ps(v[h], v[h + 2]);
          out[2 * h] = _mm256_permute2f128_ps(lo, hi, 0x20);
          out[2 * h + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
        }
        for (int i = 0; i < 4; ++i) {
          if (bf16) _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + row + k + 8 * i), to_bf16(out[i]));
          else _mm256_storeu_ps(static_cast<float*>(dst) + row + k + 8 * i, out[i]);
        }
      }
    }
  }
}

void b4_rows_avx2(const B4Params& p, int64_t n0, int64_t n1) {
  if (p.M <= kFusedMaxM) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) fused_rows<2>(p, n);
    for (; n < n1; ++n) fused_rows<1>(p, n);
    return;
  }
  float* buf = static_cast<float*>(aligned_alloc(32, kPanelRows * p.K * sizeof(float)));
  if (!buf) {
    b4_rows_scalar(p, n0, n1);
    return;
  }
  int64_t block_rows = kActivationBlockBytes / (p.K * (int64_t)sizeof(float));
  block_rows = block_rows < 3 ? 3 : block_rows / 3 * 3;
  for (int64_t m0 = 0; m0 < p.M; m0 += block_rows) {
    const int64_t m1 = m0 + block_rows < p.M ? m0 + block_rows : p.M;
    for (int64_t n = n0; n < n1; n += kPanelRows) {
      const int64_t rows = n + kPanelRows <= n1 ? kPanelRows : n1 - n;
      unpack_panel(p, n, rows, buf);
      panel_dispatch(p, buf, rows, n, m0, m1);
    }
  }
  free(buf);
}

}  // namespace tq
