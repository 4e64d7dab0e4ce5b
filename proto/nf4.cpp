// NF4 x int8 (block 64 absmax fp32), int8 codebook round(127*nf4), vpshufb + sign trick.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <chrono>
#include <vector>
static const int K = 4096, B = 64;
static const float NF4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
  -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
  0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
template <int NT>
void kern(const uint8_t* w, const float* am, const int8_t* qe, const int8_t* qo, const float* av, const int8_t* cb8, float* out, int n0, int n1) {
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)cb8));
  for (int n = n0; n < n1; n += NT) {
    __m256 tot[NT];
    for (int r = 0; r < NT; ++r) tot[r] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 64) {
      __m256i e = _mm256_loadu_si256((const __m256i*)(qe + k / 2)), o = _mm256_loadu_si256((const __m256i*)(qo + k / 2));
      __m256 a = _mm256_loadu_ps(av + k / 64 * 8);
      for (int r = 0; r < NT; ++r) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(w + (size_t)(n + r) * (K / 2) + k / 2));
        __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(v, m4));
        // pair sums reach 2*127*127: each maddubs is summed to int32 on its own (their int16 sum would overflow)
        __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(e, hi)), ones),
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(o, lo)), ones));
        __m256 f = _mm256_cvtepi32_ps(p);
        tot[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(a, _mm256_set1_ps(am[(size_t)(n + r) * (K / B) + k / B])), tot[r]);
      }
    }
    for (int r = 0; r < NT; ++r) out[n + r] = hsum(tot[r]) / 127.f;
  }
}
void run(int N, int reps) {
  std::vector<uint8_t> w((size_t)N * K / 2); std::vector<float> am((size_t)N * K / B), x(K), out(N), av(K / 64 * 8);
  std::vector<int8_t> qe(K / 2), qo(K / 2), cb8(16); std::vector<double> xh(K);
  for (int i = 0; i < 16; ++i) cb8[i] = (int8_t)nearbyintf(NF4[i] * 127.f);
  srand(1); for (auto& b : w) b = rand() & 255; for (auto& v : am) v = 0.01f + (rand() % 100) * 1e-4f;
  for (auto& v : x) v = ((rand() % 2001) - 1000) * 1e-3f;
  for (int b = 0; b < K / 32; ++b) {
    float amax = 0; for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[b * 32 + i]));
    float a = amax / 127.f, inv = a > 0 ? 1.f / a : 0.f;
    for (int i = 0; i < 32; ++i) { int q = (int)nearbyintf(x[b * 32 + i] * inv); xh[b * 32 + i] = (double)a * q;
      ((i % 2 == 0) ? qe : qo)[(b / 2) * 32 + (b % 2) * 16 + i / 2] = (int8_t)q; }
    for (int l = 0; l < 4; ++l) av[(b / 2) * 8 + (b % 2) * 4 + l] = a;
  }
  kern<4>(w.data(), am.data(), qe.data(), qo.data(), av.data(), cb8.data(), out.data(), 0, N);
  double maxrel = 0, maxrel8 = 0;
  for (int n = 0; n < (N < 256 ? N : 256); ++n) {
    double ref = 0, ref8 = 0, mag = 0;
    for (int k = 0; k < K; ++k) { int byte = w[(size_t)n * K / 2 + k / 2]; int c = (k % 2 == 0) ? byte >> 4 : byte & 15;
      double a = am[(size_t)n * (K / B) + k / B]; ref += a * NF4[c] * xh[k]; ref8 += a * cb8[c] / 127.0 * xh[k]; mag += fabs(a * NF4[c] * xh[k]); }
    maxrel = fmax(maxrel, fabs(ref - out[n]) / mag); maxrel8 = fmax(maxrel8, fabs(ref8 - out[n]) / mag);
  }
  double best = 1e30;
  for (int t = 0; t < reps; ++t) { auto t0 = std::chrono::steady_clock::now();
    kern<4>(w.data(), am.data(), qe.data(), qo.data(), av.data(), cb8.data(), out.data(), 0, N);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count(); if (us < best) best = us; }
  double bytes = (double)N * K / 2 + (double)N * K / B * 4;
  printf("NF4 b64 N=%d: %.1f us  %.1f GB/s  rel err vs exact-codebook %.2e, vs int8-codebook %.2e\n", N, best, bytes / best / 1e3, maxrel, maxrel8);
}
int main() { run(256, 200); run(32768, 5); }
