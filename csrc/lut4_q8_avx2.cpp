// The int8-activation rows of the lut4 kernel (lut4_linear.h) for AVX2: per 64 weights of a row,
// one 32-byte load split into high / low nibbles (the chunk's even / odd elements), vpmaddubsw
// against the activation codes in that order, vpmaddwd to int32 per 32-block half, one int-to-float
// conversion and one FMA per activation row. Also the AVX-512 table's (32-byte lanes suffice:
// the loop is bound by memory at 11 instructions per 64 weights).
//
// lut4_q8_gemm_avx2 (more than kLut4Q8MaxM rows): panels of 16 weight rows are unpacked once per
// call, 16 rows x 4 positions per step. Affine kind: u8 codes, register tiles of 2 activation
// rows x 16 weight rows accumulate vpmaddubsw(codes, 4 broadcast activation codes) in int16 over
// each 32-block (8 steps, pairs <= 2 * 15 * 127: at most 30480), widen once per block (vpmaddwd),
// and add (float) I_j * (a_j * s_b) in fp32. Codebook kind: the int8 table values and their
// absolute values, the sign trick per step (pairs up to 2 * 127 * 127 cannot share an int16 sum),
// int32 per block, the same epilogue. Both: the same terms as the rows above, in another order.
//
// Linkage: compiled with AVX2 flags; everything but lut4_q8_rows_avx2, lut4_q8_gemm_avx2,
// lut4_q8_gemm_panels and lut4_q8_block_avx2 has internal linkage.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include <stdlib.h>
#include <string.h>

#include "lut4_linear.h"
#include "simd_avx2.h"  // transpose8_epi32

namespace tq {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#define TQ_Q8_TILE __attribute__((noinline))

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
  // The next pass's rows follow these in memory: stream them in while this pass computes, at the
  // rate this one reads (NW * 32 bytes per chunk), and their plain scales (a line per 16) now.
  // Rows of a few KB are too short for the hardware prefetchers to ramp up on their own; without
  // this, decode read DRAM at about a third of its bandwidth.
  const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NW) * (K / 2));
  const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
  if (p.absmax && n + NW < p.N) {
    const int64_t rows = p.N - n - NW < NW ? p.N - n - NW : NW;
    const char* s0 = reinterpret_cast<const char*>(p.absmax + (n + NW) * p.blocks_per_row);
    for (int64_t b = 0; b < rows * p.blocks_per_row * 4; b += 64) _mm_prefetch(s0 + b, _MM_HINT_T0);
  }
  // One 64-weight chunk into accumulator set `acc` (a compile-time index at each call site).
  auto step = [&](int64_t k, __m256 (*acc)[R]) __attribute__((always_inline)) {
    if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
    ahead += NW * 32;
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


// ---- GEMM form ----------------------------------------------------------------------------

constexpr int kPanelCols = 16;  // weight rows per panel: two vectors of 8 int32 lanes
constexpr int kGemmRows = 2;    // activation rows per register tile (4 int16 + 4 fp32 accumulators:
                                // 3 rows spilled to the stack)

// The codes of weight rows [n, n + rows) (rows <= 16; the others zero) in the activations' order
// (lut4_linear.h: per 64 positions the 32 even elements, then the 32 odd ones): for each step s of
// 4 positions, panel[64 s + 4 t + i] = the code of row n + t at position 4 s + i. A last half
// chunk (K = 64 i + 32) reads its row's last 16 bytes only; its missing half is zero codes.
template <bool CODEBOOK>
void unpack_q8_panel(const Lut4Params& p, int64_t n, int64_t rows, uint8_t* panel) {
  constexpr int64_t kStep = CODEBOOK ? 128 : 64;  // bytes per step: codes (and their |t|)
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q8_table)));
  const int64_t K = p.K, full = K / 64 * 64;
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t t0 = 0; t0 < kPanelCols; t0 += 8) {
    for (int64_t k = 0; k < K; k += 64) {
      __m256i hi[8], lo[8];
      for (int r = 0; r < 8; ++r) {
        __m256i v = _mm256_setzero_si256();
        if (t0 + r < rows) {
          const uint8_t* src = p.packed + (n + t0 + r) * (K / 2) + k / 2;
          v = k < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                       : _mm256_inserti128_si256(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)), 0);
        }
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);  // positions 0..31 of the chunk
        lo[r] = _mm256_and_si256(v, m4);                        // positions 32..63
      }
      if (CODEBOOK) {  // the int8 table values t_c (a zero row's code 0 maps to t_0: its scales are 0)
        for (int r = 0; r < 8; ++r) {
          hi[r] = _mm256_shuffle_epi8(table, hi[r]);
          lo[r] = _mm256_shuffle_epi8(table, lo[r]);
        }
      }
      transpose8_epi32(hi);
      transpose8_epi32(lo);
      uint8_t* dst = panel + (k / 4) * kStep + t0 * 4;
      for (int s = 0; s < 8; ++s) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + s * kStep), hi[s]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + (8 + s) * kStep), lo[s]);
        if (CODEBOOK) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst + s * kStep + 64), _mm256_abs_epi8(hi[s]));
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst + (8 + s) * kStep + 64), _mm256_abs_epi8(lo[s]));
        }
      }
    }
  }
}

// Positions [4 step0, 4 step0 + 16): code x activation per 16-bit pair, for activation rows x0 and
// (R = 2) x1, added to s[r][v] (v: the panel's two 8-row halves). Pairs <= 2 * 15 * 127, so the
// 8 steps of a 32-block fit int16. Each panel vector is loaded once for both rows.
template <int R>
inline void q8_steps(const uint8_t* pw, const int8_t* x0, const int8_t* x1, __m256i (&s)[2][2]) {
  for (int i = 0; i < 4; ++i) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 64 * i));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 64 * i + 32));
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      memcpy(&x4, (r ? x1 : x0) + 4 * i, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, xb));
      s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, xb));
      // Keeps the compiler from reassociating the int16 sums into a tree of all 16 products of a
      // block (which spilled most of them to the stack: the tile ran at fp32 GEMM speed).
      asm("" : "+x"(s[r][0]), "+x"(s[r][1]));
    }
  }
}

// The codebook kind's steps [step0, step0 + 4): |t| x sign(q, t) (vpmaddubsw sign trick: pairs up
// to 2 * 127 * 127, so each step is widened by vpmaddwd), added to the int32 sums s[r][v].
template <int R>
inline void q8_sign_steps(const uint8_t* pw, const int8_t* x0, const int8_t* x1, __m256i (&s)[2][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < 4; ++i) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 128 * i));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 128 * i + 32));
    const __m256i a0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 128 * i + 64));
    const __m256i a1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(pw + 128 * i + 96));
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      memcpy(&x4, (r ? x1 : x0) + 4 * i, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
      s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
      asm("" : "+x"(s[r][0]), "+x"(s[r][1]));  // in place (see q8_steps)
    }
  }
}

// out[m0 .. m0 + R, n .. n + cols) from the panel (R = 1 or 2); sc / off: [G][16] the panel rows'
// block scales and (affine kind) offsets s_b d_b + z_b (lut4_q8_offset). Per 32-block j, the int32
// sums I (affine: int16 over the block's 8 steps, then vpmaddwd; codebook: the sign trick) and
// acc += (float) I * (a_j * s_b); the affine kind then adds sum_b (s_b d_b + z_b) X_b.
template <bool CODEBOOK, int R>
TQ_Q8_TILE void q8_gemm_tile(const Lut4Params& p, const uint8_t* panel, const float* sc, const float* off, int64_t n, int64_t cols,
                             int64_t m0) {
  constexpr int64_t kStep = CODEBOOK ? 128 : 64;  // panel bytes per step (unpack_q8_panel)
  const int64_t K = p.K, kq = p.kq, G = p.blocks_per_row, per_block = p.block / 32, chunks = kq / 64;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;  // row r, panel half v
  const int8_t* q0 = p.xq8 + m0 * kq;
  const int8_t* q1 = q0 + (R > 1 ? kq : 0);
  const float* xa0 = p.xa + m0 * chunks * 8;
  const float* xa1 = xa0 + (R > 1 ? chunks * 8 : 0);
  int64_t g = 0, in_block = 0;  // the weight block of 32-block j, and j's index within it
  for (int64_t j = 0; 32 * j < K; ++j) {
    // 32-block j = 2c + h holds positions [16h, 16h + 16) and [32 + 16h, 48 + 16h) of chunk c
    const int64_t step0 = 16 * (j >> 1) + 4 * (j & 1);
    const uint8_t* pw = panel + step0 * kStep;
    __m256i sums[2][2];
    for (int r = 0; r < 2; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    if constexpr (CODEBOOK) {
      q8_sign_steps<R>(pw, q0 + 4 * step0, q1 + 4 * step0, sums);
      q8_sign_steps<R>(pw + 8 * kStep, q0 + 4 * step0 + 32, q1 + 4 * step0 + 32, sums);
    } else {
      q8_steps<R>(pw, q0 + 4 * step0, q1 + 4 * step0, sums);
      q8_steps<R>(pw + 8 * kStep, q0 + 4 * step0 + 32, q1 + 4 * step0 + 32, sums);
      for (int r = 0; r < R; ++r) sums[r][0] = _mm256_madd_epi16(sums[r][0], ones), sums[r][1] = _mm256_madd_epi16(sums[r][1], ones);
    }
    const __m256 sv0 = _mm256_load_ps(sc + 16 * g), sv1 = _mm256_load_ps(sc + 16 * g + 8);
    const int64_t ai = (j >> 1) * 8 + 4 * (j & 1);
    const __m256 x0 = _mm256_broadcast_ss(xa0 + ai);
    a00 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][0]), _mm256_mul_ps(x0, sv0), a00);
    a01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][1]), _mm256_mul_ps(x0, sv1), a01);
    if (R > 1) {
      const __m256 x1 = _mm256_broadcast_ss(xa1 + ai);
      a10 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1][0]), _mm256_mul_ps(x1, sv0), a10);
      a11 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1][1]), _mm256_mul_ps(x1, sv1), a11);
    }
    if (++in_block == per_block) in_block = 0, ++g;
  }
  __m256 acc[2][2] = {{a00, a01}, {a10, a11}};
  for (int64_t b = 0; !CODEBOOK && b < G; ++b) {  // sum_b (s_b d_b + z_b) X_b
    const __m256 o0 = _mm256_load_ps(off + 16 * b), o1 = _mm256_load_ps(off + 16 * b + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 X = _mm256_broadcast_ss(p.xblk + (m0 + r) * G + b);
      acc[r][0] = _mm256_fmadd_ps(o0, X, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(o1, X, acc[r][1]);
    }
  }
  alignas(32) float row[kPanelCols];
  for (int r = 0; r < R; ++r) {
    float* o = p.out + (m0 + r) * p.N + n;
    if (cols == kPanelCols && !p.bias) {
      _mm256_storeu_ps(o, acc[r][0]);
      _mm256_storeu_ps(o + 8, acc[r][1]);
      continue;
    }
    _mm256_store_ps(row, acc[r][0]);
    _mm256_store_ps(row + 8, acc[r][1]);
    for (int64_t t = 0; t < cols; ++t) o[t] = p.bias ? row[t] + p.bias[n + t] : row[t];
  }
}

// The AVX2 panel of one kind: every pair of activation rows against it.
template <bool CODEBOOK>
void q8_panel(const Lut4Params& p, const uint8_t* panel, const float* sc, const float* off, int64_t n, int64_t cols) {
  int64_t m = 0;
  for (; m + kGemmRows <= p.M; m += kGemmRows) q8_gemm_tile<CODEBOOK, kGemmRows>(p, panel, sc, off, n, cols, m);
  if (m < p.M) q8_gemm_tile<CODEBOOK, 1>(p, panel, sc, off, n, cols, m);
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

// lut4_q8_block_portable's contract (lut4_linear.h) in AVX2: the same divisions and roundings
// (vdivps and vroundps round as divss and nearbyintf do), so the same codes and scale.
float lut4_q8_block_avx2(const float* v, int8_t* dst, int32_t* qsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 fmax = _mm256_set1_ps(3.4028235e38f);
  __m256 x[4], amax = _mm256_setzero_ps();
  int finite = 0xff;
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    const __m256 a = _mm256_and_ps(x[i], abs_mask);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_LE_OQ));  // false for inf and NaN
    amax = _mm256_max_ps(amax, a);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float a = finite == 0xff ? _mm_cvtss_f32(m) / 127.0f : __builtin_nanf("");
  if (!(finite == 0xff && a > 0.0f)) {
    for (int i = 0; i < 16; ++i) dst[i] = dst[32 + i] = 0;
    *qsum = 0;
    return a;
  }
  const __m256 av = _mm256_set1_ps(a), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 q = _mm256_round_ps(_mm256_div_ps(x[i], av), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[i] = _mm256_cvttps_epi32(_mm256_max_ps(_mm256_min_ps(q, lim), nlim));
  }
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *qsum = _mm_cvtsi128_si32(s4);
  // int32 -> int8 (per 128-bit lane: c0[0..3] c1[0..3] c2[0..3] c3[0..3] | the upper halves), back
  // to element order, then each lane's even bytes before its odd ones, and the lanes' evens together.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i split = _mm256_shuffle_epi8(
      ordered, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m256i eo = _mm256_permute4x64_epi64(split, 0xD8);  // evens 0..30 | odds 1..31
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(eo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), _mm256_extracti128_si256(eo, 1));
  return a;
}

// The GEMM forms' driver (lut4_linear.h): per 16 weight rows of [n0, n1) the panel (its codes in
// unpack_q8_panel's order), its block scales and (affine kind) offsets s_b d_b + z_b, [G][16]
// each, then the kind's panel function. Each range allocates its panel; if it cannot, the AVX2
// rows compute the range.
void lut4_q8_gemm_panels(const Lut4Params& p, int64_t n0, int64_t n1, Lut4Q8PanelFn affine, Lut4Q8PanelFn codebook) {
  const bool is_codebook = !p.q8_affine;
  const int64_t G = p.blocks_per_row;
  const size_t panel_bytes = (p.kq / 4) * (is_codebook ? 128 : 64);
  const size_t table_bytes = (G * kPanelCols * sizeof(float) + 63) / 64 * 64;
  char* buf = static_cast<char*>(aligned_alloc(64, panel_bytes + 2 * table_bytes));
  if (!buf) {
    lut4_q8_rows_avx2(p, n0, n1);
    return;
  }
  uint8_t* panel = reinterpret_cast<uint8_t*>(buf);
  float* sc = reinterpret_cast<float*>(buf + panel_bytes);
  float* off = reinterpret_cast<float*>(buf + panel_bytes + table_bytes);
  for (int64_t n = n0; n < n1; n += kPanelCols) {
    const int64_t cols = n1 - n < kPanelCols ? n1 - n : kPanelCols;
    if (is_codebook) unpack_q8_panel<true>(p, n, cols, panel);
    else unpack_q8_panel<false>(p, n, cols, panel);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < kPanelCols; ++t) {
        const float s = t < cols ? lut4_scale(p, n + t, g) : 0.0f;
        sc[g * kPanelCols + t] = s;
        off[g * kPanelCols + t] = t < cols && !is_codebook ? lut4_q8_offset(p, n + t, g, s) : 0.0f;
      }
    (is_codebook ? codebook : affine)(p, panel, sc, off, n, cols);
  }
  free(buf);
}

void lut4_q8_gemm_avx2(const Lut4Params& p, int64_t n0, int64_t n1) {
  lut4_q8_gemm_panels(p, n0, n1, &q8_panel<false>, &q8_panel<true>);
}

}  // namespace tq
