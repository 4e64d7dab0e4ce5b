// The lut4 kernels for AVX-512 with AVX512_BF16 (see lut4_linear.h): the AVX-512 kernel body
// (lut4_linear_body.h) whose bf16-rounded tables (int4 with bf16 scales and zeros in blocks of 32)
// are built two blocks at a time with vcvtne2ps2bf16 (simd_avx512bf16.h), the bf16 dot path for up
// to kLut4DotMaxM bf16 activation rows, and the scaled dot path's instructions (fp32 scales,
// lut4_scaled_dot_body.h). cpu.cpp puts them into the AVX-512 table's rows_bf16 / dequant_bf16 /
// dot_bf16 / scaled_dot on CPUs with AVX512_BF16 unless TORCHQ_NATIVE_AVX512BF16=0.
// Linkage: as lut4_linear_avx2.cpp.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#include "simd_avx512bf16.h"
#include "dot_bf16_avx512.h"
#include "lut4_linear_body.h"
#include "lut4_scaled_dot_body.h"

namespace tq {
namespace {

using Body = Lut4Kernel<Avx512Bf16>;

// The bf16 dot path (lut4_linear.h): tiles of NT weight rows x all M (<= kLut4DotMaxM) rows.
struct Lut4Dot {
  using F = __m512;
  using I = __m512i;

  // Whether every value of v[0..count) is 0, inf, NaN or of magnitude >= 2^-59.
  static bool dot_safe(const float* v, int64_t count) {
    constexpr uint32_t kTiny = (127u - 59u) << 23;  // the bits of 2^-59
    bool ok = true;
    for (int64_t i = 0; i < count; ++i) ok &= lut4_zero_or_not_below(v + i, kTiny);
    return ok;
  }

  // The bf16 words of blocks i and i + 1 (flat block indices of one row; i + 1 only if `pair`,
  // else B's half is zero): [A's 16 entries | B's 16], rounded as Body::entries rounds them.
  __attribute__((always_inline)) static I tables(const Lut4Params& p, F code, int64_t i, bool pair) {
    const F zero = _mm512_setzero_ps();
    F a = code, b = code;
    if (p.shifts) {
      a = _mm512_add_ps(a, _mm512_set1_ps(p.shifts[i]));
      b = pair ? _mm512_add_ps(b, _mm512_set1_ps(p.shifts[i + 1])) : zero;
    }
    a = _mm512_mul_ps(a, _mm512_set1_ps(p.absmax[i]));
    b = pair ? _mm512_mul_ps(b, _mm512_set1_ps(p.absmax[i + 1])) : zero;
    const I r = (I)_mm512_cvtne2ps_pbh(b, a);
    // without a pair, B's words are +0 and stay +0 plus +0
    return p.zeros ? Avx512Bf16::plus_then_bf16(r, _mm512_set1_ps(p.zeros[i]), pair ? _mm512_set1_ps(p.zeros[i + 1]) : zero) : r;
  }

  // 32 packed bytes (blocks A, B: 16 each; B's may be zero) -> the 64 weights as bf16 from tab:
  // lo = the low nibbles (odd positions), hi = the high nibbles (even positions), word j of each
  // from byte j (A's bytes, then B's, which index B's half of tab).
  __attribute__((always_inline)) static void weights(I bytes16, I tab, I& lo, I& hi) {
    const I bsel = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const I low = _mm512_ternarylogic_epi32(bytes16, _mm512_set1_epi16(15), bsel, 0xEA);  // (v & 15) | bsel
    const I high = _mm512_or_si512(_mm512_srli_epi16(bytes16, 4), bsel);
    lo = _mm512_permutexvar_epi16(low, tab);
    hi = _mm512_permutexvar_epi16(high, tab);
  }

  // The 64 positions from block g: weights from `bytes` (32 packed bytes as words) and tab into
  // every activation row's accumulator.
  template <int MT>
  __attribute__((always_inline)) static void dot(const Lut4Params& p, I tab, I bytes, int64_t g, F (&acc)[MT]) {
    I lo, hi;
    weights(bytes, tab, lo, hi);
    for (int m = 0; m < MT; ++m) {
      const uint16_t* x = p.xb + m * p.kx + g * 32;
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)lo, (__m512bh)_mm512_loadu_si512(x));
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)hi, (__m512bh)_mm512_loadu_si512(x + 32));
    }
  }

  template <int NT, int MT>
  TQ_TILE static void tile(const Lut4Params& p, int64_t n) {
    const int64_t G = p.blocks_per_row, K = p.K;
    const F code = _mm512_loadu_ps(p.codebook);
    F acc[NT][MT];
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_ps();
    const uint8_t* w[NT];
    for (int t = 0; t < NT; ++t) w[t] = p.packed + (n + t) * (K / 2);
    Body::prefetch_block_values(p, n + NT, NT);
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {  // 64 positions: one line of each row, two of the next tile's
      if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
      if (ahead + 64 < ahead_end) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      ahead += 32 * NT;
      for (int t = 0; t < NT; ++t) {
        const I bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[t] + g * 16)));
        dot<MT>(p, tables(p, code, (n + t) * G + g, true), bytes, g, acc[t]);
      }
    }
    if (g < G) {  // the last block alone: B's bytes and table words zero (as its padded activations)
      for (int t = 0; t < NT; ++t) {
        const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[t] + g * 16));
        dot<MT>(p, tables(p, code, (n + t) * G + g, false), _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(b16)), g, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float s = Avx512::hsum(acc[t][m]);
        p.out[m * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
      }
  }

  // Tiles of NT weight rows: 4 for up to 4 activation rows, 2 up to 8, else 1 (NT x M <= 16
  // accumulators). A tile with a scale or zero that could make a product subnormal runs the table
  // path (p.xp is prepared too).
  template <int NT, int MT>
  static void rows_m(const Lut4Params& p, int64_t n0, int64_t n1) {
    const int64_t G = p.blocks_per_row;
    tiles_then_singles<NT>(n0, n1, [&](auto nt, int64_t n) {
      constexpr int R = decltype(nt)::value;
      const bool safe = dot_safe(p.absmax + n * G, R * G) && (!p.zeros || dot_safe(p.zeros + n * G, R * G));
      if (safe) tile<R, MT>(p, n);
      else Body::rows(p, n, n + R);
    });
  }

  static void rows(const Lut4Params& p, int64_t n0, int64_t n1) {
    switch (p.M) {
#define TQ_DOT_CASE(m) \
  case m: return rows_m<(m <= 4 ? 4 : m <= 8 ? 2 : 1), m>(p, n0, n1);
      TQ_DOT_CASE(1) TQ_DOT_CASE(2) TQ_DOT_CASE(3) TQ_DOT_CASE(4) TQ_DOT_CASE(5) TQ_DOT_CASE(6) TQ_DOT_CASE(7) TQ_DOT_CASE(8)
      TQ_DOT_CASE(9) TQ_DOT_CASE(10) TQ_DOT_CASE(11) TQ_DOT_CASE(12) TQ_DOT_CASE(13) TQ_DOT_CASE(14) TQ_DOT_CASE(15) TQ_DOT_CASE(16)
#undef TQ_DOT_CASE
      default: return Body::rows(p, n0, n1);  // not reached: the caller takes it for M <= kLut4DotMaxM
    }
  }
};
static_assert(kLut4DotMaxM == 16, "Lut4Dot::rows has a case per M");

// The scaled dot path's weights (lut4_scaled_dot_body.h): codebook values as bf16 words by vpermw.
struct Lut4ScaledDotOps : Avx512Bf16DotOps {
  using Tab = __m512i;

  // Words c and c + 16: codebook[c] as bf16 (exact: the caller allows only integer codebooks that are bf16 values).
  static Tab table(const float* codebook) {
    alignas(64) uint16_t words[32];
    for (int c = 0; c < 16; ++c) {
      uint32_t u;
      memcpy(&u, codebook + c, sizeof u);
      words[c] = words[c + 16] = static_cast<uint16_t>(u >> 16);
    }
    return _mm512_load_si512(words);
  }

  // vpermw reads an index's low 5 bits: a whole byte indexes by its low nibble (words c and c + 16
  // are equal), its high nibble after one shift.
  __attribute__((always_inline)) static void weights(const Tab& tab, const uint8_t* w, int bytes, B& lo, B& hi) {
    const __m256i b = bytes == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m512i v = _mm512_cvtepu8_epi16(b);
    lo = (B)_mm512_permutexvar_epi16(v, tab);
    hi = (B)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
  }
};

void scaled_dot_rows(const Lut4Params& p, int64_t n0, int64_t n1) { Lut4ScaledDot<Lut4ScaledDotOps>::rows(p, n0, n1, &Body::rows); }

}  // namespace

// Only rows, dequant and dot_bf16 are used (cpu.cpp: rows_bf16 / dequant_bf16 / dot_bf16 of the
// AVX-512 table); the scaled dot path goes to its scaled_dot.
extern const Lut4Kernels kLut4Avx512Bf16 = {&Body::rows, &Body::dequant, nullptr, 0, nullptr, false, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &Lut4Dot::rows, 0};
extern const Lut4RowsFn kLut4Avx512Bf16ScaledDot = &scaled_dot_rows;
}  // namespace tq
