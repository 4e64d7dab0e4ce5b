// AVX-512 int8 kernels (see int8.h). A tile of 4 weight rows x up to 4 activation rows keeps
// its dot products in registers; the next tile's rows (which follow in memory) are prefetched
// while it computes. Dynamic int8 uses VNNI (vpdpbusd) on activation codes + 128 and subtracts
// 128 * (row sum of the weight codes), computed alongside.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")
#include <immintrin.h>
#include <string.h>

#include "int8.h"

namespace tq {
namespace {

constexpr int kRows = 4;

inline float hsum(__m512 v) {  // (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized)
  __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m512i v) {
  __m256i h = _mm256_add_epi32(_mm512_extracti64x4_epi64(v, 0), _mm512_extracti64x4_epi64(v, 1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <int NT, int MT>
void weight_tile(const I8Params& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, kfull = K / 16 * 16;
  __m512 acc[NT][MT], s[NT];
  const int8_t* w[NT];
  for (int t = 0; t < NT; ++t) {
    s[t] = _mm512_set1_ps(p.scale[n + t]);
    w[t] = p.w + (n + t) * K;
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_ps();
  }
  const char* ahead = reinterpret_cast<const char*>(p.w + (n + NT) * K);
  const char* ahead_end = reinterpret_cast<const char*>(p.w + p.N * K);
  auto step = [&](const int8_t* const* src, int64_t k, int64_t xk) {
    for (int t = 0; t < NT; ++t) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src[t] + k)));
      const __m512 wv = _mm512_mul_ps(_mm512_cvtepi32_ps(q), s[t]);
      for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_fmadd_ps(wv, _mm512_load_ps(p.x + (m0 + m) * p.Kp + xk), acc[t][m]);
    }
  };
  for (int64_t k = 0; k < kfull; k += 16) {
    if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
    ahead += 16 * NT;
    step(w, k, k);
  }
  if (kfull < K) {  // tail: zero-padded copies (the activations are zero padded too)
    alignas(16) int8_t tail[NT][16];
    const int8_t* src[NT];
    for (int t = 0; t < NT; ++t) {
      memset(tail[t], 0, 16);
      memcpy(tail[t], w[t] + kfull, K - kfull);
      src[t] = tail[t];
    }
    step(src, 0, kfull);
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) {
      const float v = hsum(acc[t][m]);
      p.out[(m0 + m) * p.N + n + t] = p.bias ? v + p.bias[n + t] : v;
    }
}

template <int NT, int MT>
void dynamic_tile(const I8Params& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, kfull = K / 64 * 64;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[NT][MT], wsum[NT];
  const int8_t* w[NT];
  for (int t = 0; t < NT; ++t) {
    w[t] = p.w + (n + t) * K;
    wsum[t] = _mm512_setzero_si512();
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_si512();
  }
  const char* ahead = reinterpret_cast<const char*>(p.w + (n + NT) * K);
  const char* ahead_end = reinterpret_cast<const char*>(p.w + p.N * K);
  auto step = [&](const int8_t* const* src, int64_t k, int64_t xk) {
    __m512i wv[NT];
    for (int t = 0; t < NT; ++t) {
      wv[t] = _mm512_loadu_si512(src[t] + k);
      wsum[t] = _mm512_dpbusd_epi32(wsum[t], ones, wv[t]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i xv = _mm512_load_si512(p.xu + (m0 + m) * p.Kp + xk);
      for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_dpbusd_epi32(acc[t][m], xv, wv[t]);
    }
  };
  for (int64_t k = 0; k < kfull; k += 64) {
    for (int t = 0; t < NT; ++t)
      if (ahead + 64 * t < ahead_end) _mm_prefetch(ahead + 64 * t, _MM_HINT_T0);
    ahead += 64 * NT;
    step(w, k, k);
  }
  if (kfull < K) {  // tail: zero weight codes (the activation codes are padded with 128)
    alignas(64) int8_t tail[NT][64];
    const int8_t* src[NT];
    for (int t = 0; t < NT; ++t) {
      memset(tail[t], 0, 64);
      memcpy(tail[t], w[t] + kfull, K - kfull);
      src[t] = tail[t];
    }
    step(src, 0, kfull);
  }
  for (int t = 0; t < NT; ++t) {
    const int32_t offset = 128 * hsum_epi32(wsum[t]);
    for (int m = 0; m < MT; ++m) {
      const int32_t dot = hsum_epi32(acc[t][m]) - offset;
      p.out[(m0 + m) * p.N + n + t] = (static_cast<float>(dot) * p.xs[m0 + m]) * p.scale[n + t];
    }
  }
}

template <int NT, template <int, int> class Tile>
void rows_of(const I8Params& p, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) Tile<NT, 4>::run(p, n, m);
  switch (p.M - m) {
    case 3: Tile<NT, 3>::run(p, n, m); break;
    case 2: Tile<NT, 2>::run(p, n, m); break;
    case 1: Tile<NT, 1>::run(p, n, m); break;
    default: break;
  }
}

template <int NT, int MT>
struct WeightTile {
  static void run(const I8Params& p, int64_t n, int64_t m) { weight_tile<NT, MT>(p, n, m); }
};
template <int NT, int MT>
struct DynamicTile {
  static void run(const I8Params& p, int64_t n, int64_t m) { dynamic_tile<NT, MT>(p, n, m); }
};

}  // namespace

void i8_weight_rows_avx512(const I8Params& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) rows_of<kRows, WeightTile>(p, n);
  for (; n < n1; ++n) rows_of<1, WeightTile>(p, n);
}

void i8_dynamic_rows_vnni(const I8Params& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) rows_of<kRows, DynamicTile>(p, n);
  for (; n < n1; ++n) rows_of<1, DynamicTile>(p, n);
}

void i8_dequant_rows_avx512(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
  const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    const __m512 s = _mm512_set1_ps(scale[n]);
    const int64_t base = (n - n0) * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 in = k + 16 <= K ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(in, row + k))), s);
      if (bf16) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + base + k, in, _mm512_cvtepi32_epi16(r));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(out) + base + k, in, v);
      }
    }
  }
}

void i8_quantize_rows_avx512(const float* x, int64_t K, int64_t Kp, const I8Quant& q, int offset, void* codes, float* xs,
                             int64_t m0, int64_t m1) {
  const int64_t kfull = K / 16 * 16;
  const __m512i lo = _mm512_set1_epi32(q.qmin), hi = _mm512_set1_epi32(q.qmax), off = _mm512_set1_epi32(offset);
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 in = k < kfull ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(in, row + k));
      nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
      amax = _mm512_max_ps(amax, a);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, amax);
    float a = 0.0f;
    for (float v : lanes) a = v > a ? v : a;
    float s = nan ? __builtin_nanf("") : a / q.denom;
    s = s < q.eps ? q.eps : s;
    xs[m] = s;
    const __m512 r = _mm512_set1_ps(1.0f / s);
    uint8_t* dst = static_cast<uint8_t*>(codes) + m * Kp;
    for (int64_t k = 0; k < Kp; k += 16) {
      const __mmask16 in = k + 16 <= K ? 0xFFFF : k >= K ? 0 : static_cast<__mmask16>((1u << (K - k)) - 1);
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, row + k), r);
      v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);  // NaN (inf * 0 in a row with an inf) -> 0, as the reference
      __m512i c = _mm512_cvtps_epi32(v);  // round half to even
      c = _mm512_min_epi32(_mm512_max_epi32(c, lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(c, off)));
    }
  }
}

}  // namespace tq
