// AVX2 + FMA int8 kernels (see int8.h); same tiling as the AVX-512 file with 8-lane vectors.
// Dynamic int8 multiplies |w| (unsigned) by sign(w) * x (signed) with vpmaddubsw: with
// |x| <= 127 and |w| <= 128 a pair sums to at most 32512, so the int16 step never saturates.
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <string.h>

#include "int8.h"

namespace tq {
namespace {

constexpr int kRows = 4;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <int NT, int MT>
void weight_tile(const I8Params& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, kfull = K / 8 * 8;
  __m256 acc[NT][MT], s[NT];
  const int8_t* w[NT];
  for (int t = 0; t < NT; ++t) {
    s[t] = _mm256_set1_ps(p.scale[n + t]);
    w[t] = p.w + (n + t) * K;
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm256_setzero_ps();
  }
  const char* ahead = reinterpret_cast<const char*>(p.w + (n + NT) * K);
  const char* ahead_end = reinterpret_cast<const char*>(p.w + p.N * K);
  auto step = [&](const int8_t* const* src, int64_t k, int64_t xk) {
    for (int t = 0; t < NT; ++t) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src[t] + k)));
      const __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(q), s[t]);
      for (int m = 0; m < MT; ++m) acc[t][m] = _mm256_fmadd_ps(wv, _mm256_load_ps(p.x + (m0 + m) * p.Kp + xk), acc[t][m]);
    }
  };
  for (int64_t k = 0; k < kfull; k += 8) {
    if (!(k & 15) && ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
    ahead += 8 * NT;
    step(w, k, k);
  }
  if (kfull < K) {
    alignas(16) int8_t tail[NT][8];
    const int8_t* src[NT];
    for (int t = 0; t < NT; ++t) {
      memset(tail[t], 0, 8);
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
  const int64_t K = p.K, kfull = K / 32 * 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NT][MT];
  const int8_t* w[NT];
  for (int t = 0; t < NT; ++t) {
    w[t] = p.w + (n + t) * K;
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm256_setzero_si256();
  }
  const char* ahead = reinterpret_cast<const char*>(p.w + (n + NT) * K);
  const char* ahead_end = reinterpret_cast<const char*>(p.w + p.N * K);
  auto step = [&](const int8_t* const* src, int64_t k, int64_t xk) {
    __m256i wv[NT], aw[NT];
    for (int t = 0; t < NT; ++t) {
      wv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[t] + k));
      aw[t] = _mm256_abs_epi8(wv[t]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.xq + (m0 + m) * p.Kp + xk));
      for (int t = 0; t < NT; ++t) {
        const __m256i pairs = _mm256_maddubs_epi16(aw[t], _mm256_sign_epi8(xv, wv[t]));
        acc[t][m] = _mm256_add_epi32(acc[t][m], _mm256_madd_epi16(pairs, ones));
      }
    }
  };
  for (int64_t k = 0; k < kfull; k += 32) {
    if (!(k & 63) && ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
    for (int t = 1; t < NT; ++t)
      if (!(k & 63) && ahead + 64 * t < ahead_end) _mm_prefetch(ahead + 64 * t, _MM_HINT_T0);
    ahead += !(k & 63) ? 64 * NT : 0;
    step(w, k, k);
  }
  if (kfull < K) {
    alignas(32) int8_t tail[NT][32];
    const int8_t* src[NT];
    for (int t = 0; t < NT; ++t) {
      memset(tail[t], 0, 32);
      memcpy(tail[t], w[t] + kfull, K - kfull);
      src[t] = tail[t];
    }
    step(src, 0, kfull);
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m)
      p.out[(m0 + m) * p.N + n + t] = (static_cast<float>(hsum_epi32(acc[t][m])) * p.xs[m0 + m]) * p.scale[n + t];
}

template <int NT, int MT>
struct WeightTile {
  static void run(const I8Params& p, int64_t n, int64_t m) { weight_tile<NT, MT>(p, n, m); }
};
template <int NT, int MT>
struct DynamicTile {
  static void run(const I8Params& p, int64_t n, int64_t m) { dynamic_tile<NT, MT>(p, n, m); }
};

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

}  // namespace

void i8_weight_rows_avx2(const I8Params& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) rows_of<kRows, WeightTile>(p, n);
  for (; n < n1; ++n) rows_of<1, WeightTile>(p, n);
}

void i8_dynamic_rows_avx2(const I8Params& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) rows_of<kRows, DynamicTile>(p, n);
  for (; n < n1; ++n) rows_of<1, DynamicTile>(p, n);
}

void i8_dequant_rows_avx2(const int8_t* w, const float* scale, int64_t K, int64_t n0, int64_t n1, void* out, bool bf16) {
  const int64_t kfull = K / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    const __m256 s = _mm256_set1_ps(scale[n]);
    const int64_t base = (n - n0) * K;
    for (int64_t k = 0; k < kfull; k += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)))), s);
      if (bf16) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + base + k),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
      } else {
        _mm256_storeu_ps(static_cast<float*>(out) + base + k, v);
      }
    }
    for (int64_t k = kfull; k < K; ++k) {
      const float v = static_cast<float>(row[k]) * scale[n];
      if (bf16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        u += 0x7FFFu + ((u >> 16) & 1u);
        static_cast<uint16_t*>(out)[base + k] = static_cast<uint16_t>(u >> 16);
      } else {
        static_cast<float*>(out)[base + k] = v;
      }
    }
  }
}

void i8_quantize_rows_avx2(const float* x, int64_t K, int64_t Kp, const I8Quant& q, int offset, void* codes, float* xs,
                           int64_t m0, int64_t m1) {
  const int64_t kfull = K / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(q.qmin), hi = _mm256_set1_epi32(q.qmax), off = _mm256_set1_epi32(offset);
  for (int64_t m = m0; m < m1; ++m) {
    const float* row = x + m * K;
    __m256 amax = _mm256_setzero_ps();
    int nan = 0;
    for (int64_t k = 0; k < kfull; k += 8) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(row + k));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      amax = _mm256_max_ps(amax, a);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float a = 0.0f;
    for (float v : lanes) a = v > a ? v : a;
    for (int64_t k = kfull; k < K; ++k) {
      const float v = row[k] < 0 ? -row[k] : row[k];
      nan |= v != v;
      a = v > a ? v : a;
    }
    float s = nan ? __builtin_nanf("") : a / q.denom;
    s = s < q.eps ? q.eps : s;
    xs[m] = s;
    const float rs = 1.0f / s;
    const __m256 r = _mm256_set1_ps(rs);
    uint8_t* dst = static_cast<uint8_t*>(codes) + m * Kp;
    for (int64_t k = 0; k < Kp; k += 8) {
      alignas(32) float in[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const float* src = row + k;
      if (k + 8 > K) {
        for (int64_t j = k; j < K; ++j) in[j - k] = row[j];
        src = in;
      }
      __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src), r);
      v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // NaN (inf * 0 in a row with an inf) -> 0, as the reference
      __m256i c = _mm256_cvtps_epi32(v);  // round half to even
      c = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(c, lo), hi), off);
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      const __m128i b8 = offset ? _mm_packus_epi16(w16, w16) : _mm_packs_epi16(w16, w16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + k), b8);
    }
  }
}

}  // namespace tq
