// AVX-512 kernels for tq_blockwise4bit_linear (see blockwise4bit.h for the formats).
//
// Small M (decode): each 16-byte chunk of a row unpacks to 32 weights with two vpermps lookups
// into the block's 16-entry table codebook * absmax, and feeds FMAs for every activation row
// while in registers. Larger M: a panel of 4 rows is unpacked once into an L2-resident fp32
// buffer, then a 4x4 register tile of dot products runs over it for blocks of activation rows.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#include <immintrin.h>
#include <stdlib.h>

#include "blockwise4bit.h"

namespace tq {
namespace {

constexpr int kFusedMaxM = 4;
constexpr int64_t kPanelRows = 4;
constexpr int64_t kActivationBlockBytes = 1 << 20;  // activation rows per pass stay in L2

inline float hsum(__m512 v) {  // (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized)
  __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m512 round_to(__m512 v, int kind) {
  if (kind == ROUND_BF16) {  // round to nearest even, keep the result in fp32
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  if (kind == ROUND_FP16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return v;
}

// The block's 16 weight values (see blockwise4bit.h); NF4 / FP4 take the first line only.
inline __m512 table(const B4Params& p, const __m512 code, int64_t n, int64_t g) {
  const __m512 s = _mm512_set1_ps(b4_scale(p, n, g));
  if (!p.shifts && !p.zeros && p.round_mul == ROUND_NONE) return _mm512_mul_ps(code, s);
  const int64_t b = n * (p.K / p.block) + g;
  const __m512 c = p.shifts ? _mm512_add_ps(code, _mm512_set1_ps(p.shifts[b])) : code;
  const __m512 v = round_to(_mm512_mul_ps(c, s), p.round_mul);
  return p.zeros ? round_to(_mm512_add_ps(v, _mm512_set1_ps(p.zeros[b])), p.round_add) : v;
}

// out[m0..m0+MT, n..n+NT] for rows whose weights unpack into registers chunk by chunk.
template <int NT, int MT>
void fused_tile(const B4Params& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, B = p.block, G = K / B;
  const __m512 code = _mm512_loadu_ps(p.codebook);
  __m512 even[NT][MT], odd[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) even[t][m] = odd[t][m] = _mm512_setzero_ps();
  const uint8_t* w[NT];
  for (int t = 0; t < NT; ++t) w[t] = p.packed + (n + t) * (K / 2);
  const float* x[MT];
  for (int m = 0; m < MT; ++m) x[m] = p.xp + (m0 + m) * K;
  // The next tile's rows follow these in memory: fetch them one line per step (NT rows of
  // K/2 bytes take NT*K/64 lines, which is exactly one per 32-element step of this tile), so
  // memory streams while this tile computes; rows of a few KB are too short for the hardware
  // prefetchers to ramp up on their own.
  const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
  const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
  for (int64_t g = 0; g < G; ++g) {
    __m512 lut[NT];
    for (int t = 0; t < NT; ++t) lut[t] = table(p, code, n + t, g);
    for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
      if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
      ahead += 16 * NT;
      for (int t = 0; t < NT; ++t) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[t] + k / 2)));
        const __m512 we = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[t]);
        const __m512 wo = _mm512_permutexvar_ps(v, lut[t]);  // vpermps reads the low 4 bits only
        for (int m = 0; m < MT; ++m) {
          even[t][m] = _mm512_fmadd_ps(we, _mm512_loadu_ps(x[m] + k), even[t][m]);
          odd[t][m] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(x[m] + k + 16), odd[t][m]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) {
      float s = hsum(_mm512_add_ps(even[t][m], odd[t][m]));
      p.out[(m0 + m) * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
    }
}

template <int NT>
void fused_rows(const B4Params& p, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= p.M; m += 2) fused_tile<NT, 2>(p, n, m);
  if (m < p.M) fused_tile<NT, 1>(p, n, m);
}

// Unpack rows n..n+rows into buf ([rows, K] fp32, in the permuted activation order).
void unpack_panel(const B4Params& p, int64_t n, int64_t rows, float* buf) {
  const int64_t K = p.K, B = p.block, G = K / B;
  const __m512 code = _mm512_loadu_ps(p.codebook);
  for (int64_t t = 0; t < rows; ++t) {
    const uint8_t* w = p.packed + (n + t) * (K / 2);
    float* dst = buf + t * K;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 lut = table(p, code, n + t, g);
      for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
        _mm512_store_ps(dst + k, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut));
        _mm512_store_ps(dst + k + 16, _mm512_permutexvar_ps(v, lut));
      }
    }
  }
}

template <int NT, int MT>
void panel_tile(const B4Params& p, const float* buf, int64_t n, int64_t m0) {
  const int64_t K = p.K;
  __m512 acc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[NT];
    for (int t = 0; t < NT; ++t) w[t] = _mm512_load_ps(buf + t * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_loadu_ps(p.xp + (m0 + m) * K + k);
      for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_fmadd_ps(w[t], xv, acc[t][m]);
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
  for (; m + 4 <= m1; m += 4) panel_tile<NT, 4>(p, buf, n, m);
  switch (m1 - m) {
    case 3: panel_tile<NT, 3>(p, buf, n, m); break;
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

}  // namespace

void b4_dequant_avx512(const B4Params& p, int64_t n0, int64_t n1, void* dst, bool bf16) {
  const int64_t K = p.K, B = p.block, G = K / B;
  const __m512 code = _mm512_loadu_ps(p.codebook);
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), low = _mm512_set1_epi32(15);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.packed + n * (K / 2);
    const int64_t row = (n - n0) * K;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 lut = table(p, code, n, g);
      if (bf16) {
        // The 16 entries rounded to bf16 once (as the fp32 path would round each weight), then
        // each dword of nibble indices (byte b -> words b >> 4, b & 15: elements 2j, 2j + 1) picks
        // two bf16 weights with one vpermw: 32 weights per 16 bytes, in natural order.
        const __m512i u = _mm512_castps_si512(lut);
        const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(round, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
        const __m512i lut16 = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(r));
        uint16_t* o = static_cast<uint16_t*>(dst) + row;
        for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
          const __m512i idx = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(_mm512_and_si512(v, low), 16));
          _mm512_storeu_si512(o + k, _mm512_permutexvar_epi16(idx, lut16));
        }
        continue;
      }
      for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
        const __m512 we = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
        const __m512 wo = _mm512_permutexvar_ps(v, lut);
        _mm512_storeu_ps(static_cast<float*>(dst) + row + k, _mm512_permutex2var_ps(we, first, wo));
        _mm512_storeu_ps(static_cast<float*>(dst) + row + k + 16, _mm512_permutex2var_ps(we, second, wo));
      }
    }
  }
}

void b4_rows_avx512(const B4Params& p, int64_t n0, int64_t n1) {
  if (p.M <= kFusedMaxM) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) fused_rows<4>(p, n);
    for (; n < n1; ++n) fused_rows<1>(p, n);
    return;
  }
  float* buf = static_cast<float*>(aligned_alloc(64, kPanelRows * p.K * sizeof(float)));
  if (!buf) {  // cannot happen for sane K; stay correct anyway
    b4_rows_scalar(p, n0, n1);
    return;
  }
  int64_t block_rows = kActivationBlockBytes / (p.K * (int64_t)sizeof(float));
  block_rows = block_rows < 4 ? 4 : block_rows / 4 * 4;
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
