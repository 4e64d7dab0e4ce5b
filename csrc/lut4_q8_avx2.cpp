// The int8-activation rows of the lut4 kernel (lut4_linear.h) for AVX2: per 64 weights of a row,
// one 32-byte load split into high / low nibbles (the chunk's even / odd elements), vpmaddubsw
// against the activation codes in that order, vpmaddwd to int32 per 32-block half, one int-to-float
// conversion and one FMA per activation row. Also the AVX-512 table's (32-byte lanes suffice:
// the loop is bound by memory at 11 instructions per 64 weights).
//
// Linkage: compiled with AVX2 flags; everything but lut4_q8_rows_avx2 has internal linkage.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "lut4_linear.h"

namespace tq {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int kRows = 4;  // activation rows per pass over a weight row

// Integer sums of one 64-weight chunk against one activation row's codes: int32 per lane,
// lanes 0..3 the chunk's first 32-block, 4..7 its second. AFFINE: codes 0..15 (u8) x q;
// otherwise the int8 table values (sign trick: |t| x sign(q, t)), each vpmaddubsw widened on
// its own (pairs reach 2 * 127 * 127, their int16 sum would overflow).
template <bool AFFINE>
inline __m256i chunk_sums(__m256i hi, __m256i lo, const int8_t* q) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i qe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i qo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
  if (AFFINE)  // pairs <= 2 * 15 * 127: the int16 sum of both halves fits
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(hi, qe), _mm256_maddubs_epi16(lo, qo)), ones);
  return _mm256_add_epi32(
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(qe, hi)), ones),
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(qo, lo)), ones));
}

// Activation rows [m0, m0 + R) against weight rows [n, n + NW): R, NW and the two accumulator
// sets (even / odd chunks, two independent FMA chains) are compile-time, so every accumulator stays
// in a register; NW = 2 at one activation row shares its activation loads between two weight rows.
template <bool AFFINE, int R, int NW>
void row_pass(const Lut4Params& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, B = p.block, kq = p.kq, full = K / 64 * 64;
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q8_table)));
  const __m256i pairs = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const uint8_t* w[NW];
  const float* srow[NW];  // plain scales (int4, NF4 without nesting), else null
  for (int i = 0; i < NW; ++i) {
    w[i] = p.packed + (n + i) * (K / 2);
    srow[i] = p.absmax ? p.absmax + (n + i) * p.blocks_per_row : nullptr;
  }
  const int8_t* q = p.xq8 + m0 * kq;
  const float* xa = p.xa + m0 * (kq / 64) * 8;
  __m256 tot[2][NW][R];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < R; ++r) tot[0][i][r] = tot[1][i][r] = _mm256_setzero_ps();
  __m256 sv[NW];
  for (int i = 0; i < NW; ++i) sv[i] = _mm256_setzero_ps();
  // One 64-weight chunk into accumulator set `acc` (a compile-time index at each call site).
  auto step = [&](int64_t k, __m256 (*acc)[R]) __attribute__((always_inline)) {
    __m256i hi[NW], lo[NW];
    for (int i = 0; i < NW; ++i) {
      if (B == 32) {  // the chunk's two block scales
        sv[i] = srow[i] ? _mm256_permutevar8x32_ps(
                              _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(srow[i] + k / 32)))), pairs)
                        : _mm256_setr_m128(_mm_set1_ps(lut4_scale(p, n + i, k / 32)), _mm_set1_ps(lut4_scale(p, n + i, k / 32 + 1)));
      } else if ((k & (B - 1)) == 0) {  // one block per chunk, a new one every B / 64 chunks
        sv[i] = _mm256_set1_ps(srow[i] ? srow[i][k / B] : lut4_scale(p, n + i, k / B));
      }
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + k / 2));
      hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      lo[i] = _mm256_and_si256(v, m4);
      if (!AFFINE) {
        hi[i] = _mm256_shuffle_epi8(table, hi[i]);
        lo[i] = _mm256_shuffle_epi8(table, lo[i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_loadu_ps(xa + (r * (kq / 64) + k / 64) * 8);
      for (int i = 0; i < NW; ++i) {
        const __m256 f = _mm256_cvtepi32_ps(chunk_sums<AFFINE>(hi[i], lo[i], q + r * kq + k));
        acc[i][r] = _mm256_fmadd_ps(f, _mm256_mul_ps(a, sv[i]), acc[i][r]);
      }
    }
  };
  int64_t k = 0;
  for (; k + 128 <= full; k += 128) {  // two chunks: two independent FMA chains
    step(k, tot[0]);
    step(k + 64, tot[1]);
  }
  if (k < full) step(k, tot[0]);
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r, row = n + i;
      float acc = hsum(_mm256_add_ps(tot[0][i][r], tot[1][i][r]));
      if (full < K) {  // a last 32-block (K = 64i + 32): its 16 bytes, the even / odd runs' first halves
        const int8_t* qe = p.xq8 + m * kq + full;
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = w[i][full / 2 + j];
          isum += AFFINE ? (byte >> 4) * qe[j] + (byte & 15) * qe[32 + j]
                         : p.q8_table[byte >> 4] * qe[j] + p.q8_table[byte & 15] * qe[32 + j];
        }
        acc += static_cast<float>(isum) * (p.xa[(m * (kq / 64) + full / 64) * 8] * lut4_scale(p, row, full / B));
      }
      if (AFFINE) {  // sum_b (s_b d_b + z_b) X_b, 8 blocks at a time (int4 scales are plain)
        const int64_t G = p.blocks_per_row, b0 = row * G;
        const float* X = p.xblk + m * G;
        const __m256 c0 = _mm256_set1_ps(p.codebook[0]);
        __m256 o = _mm256_setzero_ps();
        int64_t g = 0;
        for (; srow[i] && g + 8 <= G; g += 8) {
          __m256 d = p.shifts ? _mm256_add_ps(c0, _mm256_loadu_ps(p.shifts + b0 + g)) : c0;
          __m256 t = _mm256_mul_ps(_mm256_loadu_ps(srow[i] + g), d);
          if (p.zeros) t = _mm256_add_ps(t, _mm256_loadu_ps(p.zeros + b0 + g));
          o = _mm256_fmadd_ps(t, _mm256_loadu_ps(X + g), o);
        }
        acc += hsum(o);
        for (; g < G; ++g) acc += lut4_q8_offset(p, row, g, lut4_scale(p, row, g)) * X[g];
      }
      p.out[m * p.N + row] = p.bias ? acc + p.bias[row] : acc;
    }
}

template <bool AFFINE>
void rows(const Lut4Params& p, int64_t n0, int64_t n1) {
  if (p.M == 1) {  // decode: two weight rows per pass share the activation loads
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) row_pass<AFFINE, 1, 2>(p, n, 0);
    if (n < n1) row_pass<AFFINE, 1, 1>(p, n, 0);
    return;
  }
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < p.M; m0 += kRows) {
      switch (p.M - m0 < kRows ? p.M - m0 : kRows) {
        case 1: row_pass<AFFINE, 1, 1>(p, n, m0); break;
        case 2: row_pass<AFFINE, 2, 1>(p, n, m0); break;
        case 3: row_pass<AFFINE, 3, 1>(p, n, m0); break;
        default: row_pass<AFFINE, 4, 1>(p, n, m0); break;
      }
    }
}

}  // namespace

void lut4_q8_rows_avx2(const Lut4Params& p, int64_t n0, int64_t n1) {
  if (p.q8_affine) rows<true>(p, n0, n1);
  else rows<false>(p, n0, n1);
}

}  // namespace tq
