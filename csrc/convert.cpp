// Activation rows in and output rows out of the exported linears: fp32, bf16 or fp16 elements,
// converted exactly as torch's .to() does (widening is exact; narrowing rounds to nearest even,
// NaN stays NaN, fp16 overflows to inf). F16C when the active ISA has it, portable otherwise.
#include <immintrin.h>
#include <string.h>

#include "common.h"

namespace tq {
namespace {

float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float f) { return bf16_rne_nan(f); }

float f16_to_f32_portable(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16_portable(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);  // NaN, quiet
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal fp16 (2^-14): subnormal or zero
    if (a < 0x33000000u) return sign;  // < 2^-25 rounds to 0 (2^-25 itself ties to even 0)
    const uint32_t e = a >> 23, man = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value = man * 2^(e-150); in units of 2^-24: man >> (126 - e)
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t v = a - 0x38000000u;  // rebias the exponent (127 -> 15)
  v += 0xFFFu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

__attribute__((target("f16c,avx"))) void f16_to_f32_f16c(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

__attribute__((target("f16c,avx"))) void f32_to_f16_f16c(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// f32_to_bf16 on 8 lanes: round to nearest even, every NaN to 0x7FC0.
__attribute__((target("avx2"))) void f32_to_bf16_avx2(const float* src, int64_t n, uint16_t* dst) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h[2];
    for (int j = 0; j < 2; ++j) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8 * j));
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, magnitude), inf);
      const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
      h[j] = _mm256_blendv_epi8(r, nan, is_nan);
    }
    // packus works per 128-bit lane (words of h0 lo, h1 lo, h0 hi, h1 hi): restore the order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// bf16_to_f32 on 8 lanes: the word shifted to the top half (exact).
__attribute__((target("avx2"))) void bf16_to_f32_avx2(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

}  // namespace

size_t dtype_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

void to_f32_row(const void* x, int dtype, int64_t K, int64_t Kp, float* dst) {
  if (dtype == DT_F32) {
    memcpy(dst, x, K * sizeof(float));
  } else if (dtype == DT_BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(x);
    if (active_isa() >= ISA_AVX2) bf16_to_f32_avx2(s, K, dst);
    else
      for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_f32(s[k]);
  } else if (active_isa() >= ISA_AVX2) {
    f16_to_f32_f16c(static_cast<const uint16_t*>(x), K, dst);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(x);
    for (int64_t k = 0; k < K; ++k) dst[k] = f16_to_f32_portable(s[k]);
  }
  if (Kp > K) memset(dst + K, 0, (Kp - K) * sizeof(float));
}

void from_f32_row(const float* src, int64_t n, int dtype, void* dst) {
  if (dtype == DT_F32) {
    memcpy(dst, src, n * sizeof(float));
  } else if (dtype == DT_BF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    if (active_isa() >= ISA_AVX2) f32_to_bf16_avx2(src, n, d);
    else
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else if (active_isa() >= ISA_AVX2) {
    f32_to_f16_f16c(src, n, static_cast<uint16_t*>(dst));
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16_portable(src[i]);
  }
}

namespace {

struct ConvertJob {
  const void* src;
  int dtype;
  int64_t K, Kp;  // to_f32_rows: row lengths
  void* dst;
};

void from_f32_range(void* ctx, int64_t i0, int64_t i1) {
  const ConvertJob& j = *static_cast<const ConvertJob*>(ctx);
  from_f32_row(static_cast<const float*>(j.src) + i0, i1 - i0, j.dtype, static_cast<char*>(j.dst) + i0 * dtype_size(j.dtype));
}

void to_f32_range(void* ctx, int64_t m0, int64_t m1) {
  const ConvertJob& j = *static_cast<const ConvertJob*>(ctx);
  for (int64_t m = m0; m < m1; ++m)
    to_f32_row(static_cast<const char*>(j.src) + m * j.K * dtype_size(j.dtype), j.dtype, j.K, j.Kp, static_cast<float*>(j.dst) + m * j.Kp);
}

}  // namespace

// Ranges of whole 64-element groups (128 or 256 bytes of the destination), the work counted as one
// multiply-add per element (min_parallel_work: from 2^17 elements on two threads).
void from_f32_rows(const float* src, int64_t n, int dtype, void* dst, int threads) {
  ConvertJob job{src, dtype, 0, 0, dst};
  parallel_for(n, 64, threads, from_f32_range, &job, 0, n);
}

void to_f32_rows(const void* x, int dtype, int64_t M, int64_t K, int64_t Kp, float* dst, int threads) {
  ConvertJob job{x, dtype, K, Kp, dst};
  parallel_for(M, 1, threads, to_f32_range, &job, 0, M * K);
}

}  // namespace tq

// Test hooks: n elements of `dtype` to fp32 and back (the conversions the linears use).
TQ_API int tq_to_f32(const void* x, int dtype, int64_t n, float* out) {
  if (n < 0 || dtype < tq::DT_F32 || dtype > tq::DT_F16 || (n && (!x || !out))) return tq::BAD_ARGUMENT;
  tq::to_f32_row(x, dtype, n, n, out);
  return tq::OK;
}

TQ_API int tq_from_f32(const float* x, int64_t n, int dtype, void* out) {
  if (n < 0 || dtype < tq::DT_F32 || dtype > tq::DT_F16 || (n && (!x || !out))) return tq::BAD_ARGUMENT;
  tq::from_f32_row(x, n, dtype, out);
  return tq::OK;
}
