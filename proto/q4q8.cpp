// Prototype: int4 (torchq byte order: element 2j in the high nibble of byte j) x int8 activations
// quantized per 32-block, AVX2 only (vpmaddubsw). Checks against a double reference, times 1 thread.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <chrono>
#include <vector>
static int K = 4096;
struct Act { std::vector<int8_t> qe, qo; std::vector<float> av; std::vector<float> xq; };  // per 64: even/odd codes, scale vector
// activation: per 32-block a = amax/127, q = rint(x / a); qe/qo: per 64 weights, 32 bytes each:
// lanes 0..15 = block 0's even (odd) elements, 16..31 = block 1's.
Act prep(const float* x, int G) {
  Act A; A.qe.resize(K / 2); A.qo.resize(K / 2); A.av.resize(K / 64 * 8); A.xq.assign(K / G, 0.f);
  for (int b = 0; b < K / 32; ++b) {
    float amax = 0; for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[b * 32 + i]));
    float a = amax / 127.f; float inv = a > 0 ? 1.f / a : 0.f;
    int qs = 0;
    for (int i = 0; i < 32; ++i) {
      int q = (int)nearbyintf(x[b * 32 + i] * inv); qs += q;
      int blk64 = b / 2, half = b % 2;
      int8_t* dst = (i % 2 == 0) ? A.qe.data() : A.qo.data();
      dst[blk64 * 32 + half * 16 + i / 2] = (int8_t)q;
    }
    for (int l = 0; l < 4; ++l) A.av[(b / 2) * 8 + (b % 2) * 4 + l] = a;
    A.xq[b * 32 / G] += a * qs;
  }
  return A;
}
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
// w = s * (c + base) + z per group G.  out[n] = sum_g s_g * sum_{b in g} a_b * (c . q)_b + (s_g*base + z_g) * xq_g
template <int NT, int G>
void kern(const uint8_t* w, const float* s, const float* z, float base, const Act& A, float* out, int n0, int n1) {
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int NG = K / G;
  for (int n = n0; n < n1; n += NT) {
    __m256 tot[NT];
    for (int r = 0; r < NT; ++r) tot[r] = _mm256_setzero_ps();
    for (int g = 0; g < NG; ++g) {
      __m256 acc[NT];
      for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
      constexpr int STEP = 64;
      const int kb = G >= 64 ? g * G : (g & ~1) * 32;  // G=32: two groups per 64-chunk, processed at even g
      if (G == 32 && (g & 1)) continue;
      const int ke = G >= 64 ? kb + G : kb + 64;
      for (int k = kb; k < ke; k += STEP) {
        __m256i qe = _mm256_loadu_si256((const __m256i*)(A.qe.data() + k / 2));
        __m256i qo = _mm256_loadu_si256((const __m256i*)(A.qo.data() + k / 2));
        __m256 av = _mm256_loadu_ps(A.av.data() + k / 64 * 8);
        for (int r = 0; r < NT; ++r) {
          __m256i v = _mm256_loadu_si256((const __m256i*)(w + (size_t)(n + r) * (K / 2) + k / 2));
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), lo = _mm256_and_si256(v, m4);
          // hi: bytes j -> element 2j (even), but byte order within the 32 bytes: bytes 0..15 = elements 0..31 of block 0
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(hi, qe), _mm256_maddubs_epi16(lo, qo));
          __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
          if (G == 32) {
            const float* sp = s + (size_t)(n + r) * NG + g;
            __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)sp))),
                                                 _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
            tot[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(av, sv), tot[r]);
          } else {
            acc[r] = _mm256_fmadd_ps(f, av, acc[r]);
          }
        }
      }
      if (G >= 64)
        for (int r = 0; r < NT; ++r) tot[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(s[(size_t)(n + r) * NG + g]), tot[r]);
    }
    for (int r = 0; r < NT; ++r) {
      // offset: sum_g (s_g*base + z_g) * xq_g, 8 groups at a time
      const float* sr = s + (size_t)(n + r) * NG; const float* zr = z + (size_t)(n + r) * NG;
      __m256 o = _mm256_setzero_ps(), bb = _mm256_set1_ps(base);
      for (int g = 0; g < NG; g += 8) {
        __m256 xq = _mm256_loadu_ps(A.xq.data() + g);
        o = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_loadu_ps(sr + g), bb, _mm256_loadu_ps(zr + g)), xq, o);
      }
      out[n + r] = hsum(_mm256_add_ps(tot[r], o));
    }
  }
}
template <int G> void run(int N, int reps) {
  const int NG = K / G;
  std::vector<uint8_t> w((size_t)N * K / 2); std::vector<float> s((size_t)N * NG), z((size_t)N * NG), x(K), out(N);
  srand(1);
  for (auto& b : w) b = rand() & 255;
  for (auto& v : s) v = 0.01f + (rand() % 100) * 1e-4f;
  for (auto& v : z) v = ((rand() % 200) - 100) * 1e-3f;
  for (auto& v : x) v = ((rand() % 2001) - 1000) * 1e-3f;
  float base = -8.f;
  Act A = prep(x.data(), G);
  kern<4, G>(w.data(), s.data(), z.data(), base, A, out.data(), 0, N);
  // reference (double) on the fake-quantized activation
  std::vector<double> xh(K);
  for (int b = 0; b < K / 32; ++b) { float amax = 0; for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[b*32+i])); float a = amax / 127.f; float inv = a > 0 ? 1.f / a : 0.f; for (int i = 0; i < 32; ++i) xh[b*32+i] = (double)a * nearbyintf(x[b*32+i] * inv); }
  double maxrel = 0;
  for (int n = 0; n < (N < 512 ? N : 512); ++n) {
    double ref = 0, mag = 0;
    for (int k = 0; k < K; ++k) { int byte = w[(size_t)n * K / 2 + k / 2]; int c = (k % 2 == 0) ? byte >> 4 : byte & 15;
      double wv = (double)s[(size_t)n * NG + k / G] * (c + base) + z[(size_t)n * NG + k / G]; ref += wv * xh[k]; mag += fabs(wv * xh[k]); }
    maxrel = fmax(maxrel, fabs(ref - out[n]) / mag);
  }
  double best = 1e30;
  for (int t = 0; t < reps; ++t) {
    auto t0 = std::chrono::steady_clock::now();
    kern<4, G>(w.data(), s.data(), z.data(), base, A, out.data(), 0, N);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (us < best) best = us;
  }
  double bytes = (double)N * K / 2 + (double)N * NG * 8;
  printf("G=%d N=%d: %.1f us  %.1f GB/s  max rel err (vs sum|wx|) %.2e\n", G, N, best, bytes / best / 1e3, maxrel);
}
int main() {
  run<32>(256, 200); run<128>(256, 200); run<64>(256, 200);
  run<32>(32768, 5); run<128>(32768, 5);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) { std::vector<float> x(K, 0.5f); volatile auto A = prep(x.data(), 32); }
  printf("prep (scalar proto) %.1f us\n", std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 100);
}
