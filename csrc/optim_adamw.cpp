// The fused AdamW step over blockwise-quantized states (torchq.optim.AdamW8bit / AdamW4bit).
//
// tq_adamw_blockwise updates one tensor in one pass over its memory, parallel over blocks
// (tq::parallel_for): per block it decodes both states (map[code] * absmax), runs the AdamW update
// of the block's parameters in fp32, takes the block's new absmax (max |value| of the updated
// states) and encodes the states again (nearest map value of value * (1 / absmax), exact fp32
// midpoints, ties to the lower value; bitsandbytes' sign rule for exp_avg, the zero-free rule for
// exp_avg_sq). Formats, operation order
// and the non-finite rule: torchq/optim/formats.py and torchq/optim/adamw.py (reference_update),
// which this kernel equals bit for bit: every step is one IEEE fp32 operation (the library builds
// with -ffp-contract=off and the AVX2 path uses no FMA), so the scalar and AVX2 paths agree too.
//
// Every size is checked before a pointer is read; a bad argument returns BAD_ARGUMENT and touches
// nothing.
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <memory>
#include <mutex>
#include <vector>

#include "common.h"

namespace tq {
namespace {

constexpr int64_t kMaxBlock = 4096;

struct BinTable;

struct AdamTask {
  void* p;
  const void* g;
  int dtype;  // DT_F32 or DT_BF16 (param and grad alike)
  int64_t n;
  uint8_t* c1;
  float* a1;
  uint8_t* c2;
  float* a2;
  const float *map1, *map2;
  const BinTable *tb1, *tb2;
  int bits, nmids;  // nmids = 2^bits - 1
  int64_t block;
  float beta1, omb1, beta2, omb2, decay, step_size, bc2s, eps;
  bool maximize;
  int zero1, zero2;  // the code of 0.0 (the bucket of 0.0) in each map
  int step1, step2;  // zero rules: exp_avg's sign rule (-1), exp_avg_sq's zero-free rule (+1), or none (0)
};

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// As c10::BFloat16 rounds: nearest even, NaN -> 0x7FC0.
inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  return bf16_rne(f);
}

inline float load(const void* base, int dtype, int64_t j) {
  return dtype == DT_F32 ? static_cast<const float*>(base)[j] : bf16_to_f32(static_cast<const uint16_t*>(base)[j]);
}

inline void store(void* base, int dtype, int64_t j, float v) {
  if (dtype == DT_F32) static_cast<float*>(base)[j] = v;
  else static_cast<uint16_t*>(base)[j] = f32_to_bf16(v);
}

// The number of midpoints below s (torch.bucketize(s, mids, right=False)); nmids = 2^k - 1.
inline int bucket(float s, const float* mids, int nmids) {
  int idx = 0;
  for (int step = (nmids + 1) >> 1; step > 0; step >>= 1)
    if (mids[idx + step - 1] < s) idx += step;
  return idx;
}

// Encoding without a search: the fp32 bits of s = x * (1 / absmax) (|s| <= 1 + 2 ulp) pick one of
// kBins bins (sign, exponent from 2^-24 up, 7 mantissa bits; every |s| < 2^-24 in one bin per
// sign). With t = the code of the bin's lowest value, the code of s is t plus the number of the
// next `span` midpoints mids[t], mids[t + 1] ... below s, where span is the most midpoints any
// bin holds (1 for torchq's maps: neighbouring values are further apart than a bin is wide). The
// table is built from the midpoints themselves, so the result is bucket(s) exactly; a map with
// span > 8 is searched instead. Table and midpoints: 7.7 KB, in L1.
constexpr int kTinyExp = 127 - 24;                  // exponents below: the tiny bin
constexpr int kExpBins = 127 - kTinyExp + 2;        // the tiny bin, then kTinyExp .. 127
constexpr int kBins = 2 * kExpBins * 128;

struct BinTable {
  int nmids = 0;
  int span = 0;             // the most midpoints inside one bin (1 for torchq's maps)
  float mids[255 + 8];      // the midpoints, then +inf: mids[t + k] exists for every k < span
  uint8_t t[kBins];         // the code of the bin's lowest value
  int32_t t32[kBins];       // the same, for AVX2 gathers
};

inline float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

inline int bin_of(float s) {
  const uint32_t u = to_bits(s);
  int e = static_cast<int>((u >> 23) & 0xFF);
  int m7 = static_cast<int>((u >> 16) & 0x7F);
  if (e < kTinyExp) {
    e = kTinyExp - 1;
    m7 = 0;
  } else if (e > 127) {  // cannot happen (|s| <= 1 + 2 ulp); keeps the index in range
    e = 127;
    m7 = 127;
  }
  return static_cast<int>(u >> 31) * kExpBins * 128 + (e - (kTinyExp - 1)) * 128 + m7;
}

void build_table(BinTable* tb, const float* mids, int nmids) {
  tb->nmids = nmids;
  memcpy(tb->mids, mids, sizeof(float) * nmids);
  for (int k = nmids; k < 255 + 8; ++k) tb->mids[k] = INFINITY;
  tb->span = 0;
  for (int sign = 0; sign < 2; ++sign) {
    for (int eb = 0; eb < kExpBins; ++eb) {
      for (int m7 = 0; m7 < 128; ++m7) {
        float lo, hi;  // magnitudes
        if (eb == 0) {
          if (m7 != 0) continue;  // the tiny bin uses m7 = 0 only
          lo = 0.0f;
          hi = from_bits((static_cast<uint32_t>(kTinyExp) << 23) - 1);
        } else {
          const uint32_t base = (static_cast<uint32_t>(eb + kTinyExp - 1) << 23) | (static_cast<uint32_t>(m7) << 16);
          lo = from_bits(base);
          hi = from_bits(base | 0xFFFFu);
        }
        const float a = sign ? -hi : lo, b = sign ? -lo : hi;  // the bin is [a, b]
        const int ca = bucket(a, mids, nmids), cb = bucket(b, mids, nmids);
        tb->t[sign * kExpBins * 128 + eb * 128 + m7] = static_cast<uint8_t>(ca);
        tb->t32[sign * kExpBins * 128 + eb * 128 + m7] = ca;
        if (cb - ca > tb->span) tb->span = cb - ca;
      }
    }
  }
}

// The table of `mids`, built once per distinct map (a few per process) and kept.
const BinTable* table_for(const float* mids, int nmids) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<BinTable>> tables;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& tb : tables)
    if (tb->nmids == nmids && memcmp(tb->mids, mids, sizeof(float) * nmids) == 0) return tb.get();
  tables.emplace_back(new BinTable());
  build_table(tables.back().get(), mids, nmids);
  return tables.back().get();
}

// The bins of 8 values s (bin_of's arithmetic, branch-free).
__attribute__((target("avx2"))) inline __m256i bins8(__m256 s) {
  const __m256i u = _mm256_castps_si256(s);
  __m256i e = _mm256_and_si256(_mm256_srli_epi32(u, 23), _mm256_set1_epi32(0xFF));
  __m256i m7 = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x7F));
  const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(kTinyExp), e);
  const __m256i huge = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(127));
  e = _mm256_blendv_epi8(e, _mm256_set1_epi32(kTinyExp - 1), tiny);
  e = _mm256_blendv_epi8(e, _mm256_set1_epi32(127), huge);
  m7 = _mm256_or_si256(_mm256_andnot_si256(tiny, m7), _mm256_and_si256(huge, _mm256_set1_epi32(127)));
  const __m256i sign = _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(kExpBins * 128));
  return _mm256_add_epi32(_mm256_add_epi32(sign, m7), _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(kTinyExp - 1)), 7));
}

// encode's work on whole groups of 8 for a table of span <= 1 (codes written); returns how many.
__attribute__((target("avx2"))) int64_t encode_avx2(const float* x, int64_t len, float inv, const BinTable& tb, int zero,
                                                   int zero_step, int bits, uint8_t* c, int64_t start) {
  const __m256 vinv = _mm256_set1_ps(inv), fzero = _mm256_setzero_ps();
  const __m256i vzero = _mm256_set1_epi32(zero), lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i hi_shift = _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0), pairs = _mm256_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 s = _mm256_mul_ps(xv, vinv);
    const __m256i t = _mm256_i32gather_epi32(tb.t32, bins8(s), 4);
    const __m256 mid = _mm256_i32gather_ps(tb.mids, t, 4);
    __m256i q = _mm256_sub_epi32(t, _mm256_castps_si256(_mm256_cmp_ps(mid, s, _CMP_LT_OQ)));  // true = -1
    if (zero_step < 0) {  // a negative value at the code of 0 steps down (true = -1)
      const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(xv, fzero, _CMP_LT_OQ));
      q = _mm256_add_epi32(q, _mm256_and_si256(neg, _mm256_cmpeq_epi32(q, vzero)));
    } else if (zero_step > 0) {  // a positive value at the code of 0 steps up
      const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(xv, fzero, _CMP_GT_OQ));
      q = _mm256_sub_epi32(q, _mm256_and_si256(pos, _mm256_cmpeq_epi32(q, vzero)));
    }
    if (bits == 8) {
      // lanes 0..7 -> bytes: pack to 16 then 8 bits within 128-bit halves, gather the two halves
      const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(q, q), _mm256_setzero_si256());
      const __m256i both = _mm256_permutevar8x32_epi32(w, lanes);  // dword 0: codes 0-3, dword 1: codes 4-7
      _mm_storel_epi64(reinterpret_cast<__m128i*>(c + start + i), _mm256_castsi256_si128(both));
    } else {
      const __m256i sh = _mm256_sllv_epi32(q, hi_shift);
      const __m256i sum = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(sh, sh), pairs);  // bytes 0..3 in lanes 0..3
      const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(sum, sum), _mm256_setzero_si256());
      const int32_t four = _mm256_cvtsi256_si32(w);
      memcpy(c + ((start + i) >> 1), &four, 4);
    }
  }
  return i;
}

// Codes of x[0, len) (the block at `start`; absmax `mx`, all finite when `ok`) into c, absmax into *a.
void encode(const float* x, int64_t len, bool ok, float mx, const BinTable& tb, int zero, int zero_step, int bits, uint8_t* c,
            int64_t start, float* a, bool avx2) {
  int32_t q[kMaxBlock];
  int64_t i0 = 0;
  if (!ok) {
    for (int64_t i = 0; i < len; ++i) q[i] = zero;
    *a = NAN;
  } else {
    const float inv = mx > 0.0f ? 1.0f / mx : 0.0f;
    if (avx2 && tb.span <= 1) i0 = encode_avx2(x, len, inv, tb, zero, zero_step, bits, c, start);
    for (int64_t i = i0; i < len; ++i) {
      const float s = x[i] * inv;
      int v;
      if (tb.span <= 8) {
        const int t0 = tb.t[bin_of(s)];
        v = t0;
        for (int k = 0; k < tb.span; ++k) v += tb.mids[t0 + k] < s ? 1 : 0;
      } else {
        v = bucket(s, tb.mids, tb.nmids);
      }
      if (v == zero && ((zero_step < 0 && x[i] < 0.0f) || (zero_step > 0 && x[i] > 0.0f))) v = zero + zero_step;
      q[i] = v;
    }
    *a = mx;
  }
  if (bits == 8) {
    for (int64_t i = i0; i < len; ++i) c[start + i] = static_cast<uint8_t>(q[i]);
  } else {  // start and i0 are even
    for (int64_t i = i0; i < len; i += 2) {
      const int lo = i + 1 < len ? q[i + 1] : 0;
      c[(start + i) >> 1] = static_cast<uint8_t>((q[i] << 4) | lo);
    }
  }
}

// One element of the update (the reference's operation order): m, v are the decoded states; the
// new states are written back to them. Returns the new param value.
inline float update_one(const AdamTask& t, float g, float p, float* m, float* v) {
  if (t.maximize) g = -g;
  const float mi = *m * t.beta1 + g * t.omb1;
  const float vi = *v * t.beta2 + (g * g) * t.omb2;
  p = p * t.decay;
  const float denom = sqrtf(vi) / t.bc2s + t.eps;
  *m = mi;
  *v = vi;
  return p - (mi / denom) * t.step_size;
}

struct BlockStats {
  float mx1 = 0.0f, mx2 = 0.0f;
  bool ok1 = true, ok2 = true;
};

void update_scalar_from(const AdamTask& t, int64_t start, int64_t i0, int64_t len, float s1, float s2, float* m, float* v,
                        BlockStats* st) {
  for (int64_t i = i0; i < len; ++i) {
    const int64_t j = start + i;
    m[i] = m[i] * s1;
    v[i] = v[i] * s2;
    store(t.p, t.dtype, j, update_one(t, load(t.g, t.dtype, j), load(t.p, t.dtype, j), m + i, v + i));
    const float am = fabsf(m[i]), av = fabsf(v[i]);
    st->ok1 = st->ok1 && am <= FLT_MAX;
    st->ok2 = st->ok2 && av <= FLT_MAX;
    st->mx1 = am > st->mx1 ? am : st->mx1;
    st->mx2 = av > st->mx2 ? av : st->mx2;
  }
}

__attribute__((target("avx2"))) inline __m256 load8(const void* base, int dtype, int64_t j) {
  if (dtype == DT_F32) return _mm256_loadu_ps(static_cast<const float*>(base) + j);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + j));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2"))) inline void store8(void* base, int dtype, int64_t j, __m256 v) {
  if (dtype == DT_F32) {
    _mm256_storeu_ps(static_cast<float*>(base) + j, v);
    return;
  }
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + j), _mm256_castsi256_si128(packed));
}

// update_scalar_from's work on whole groups of 8; returns how many elements it did.
__attribute__((target("avx2"))) int64_t update_avx2(const AdamTask& t, int64_t start, int64_t len, float s1, float s2, float* m,
                                                   float* v, BlockStats* st) {
  const __m256 b1 = _mm256_set1_ps(t.beta1), omb1 = _mm256_set1_ps(t.omb1), b2 = _mm256_set1_ps(t.beta2),
               omb2 = _mm256_set1_ps(t.omb2), decay = _mm256_set1_ps(t.decay), bc2s = _mm256_set1_ps(t.bc2s),
               eps = _mm256_set1_ps(t.eps), step = _mm256_set1_ps(t.step_size), vs1 = _mm256_set1_ps(s1),
               vs2 = _mm256_set1_ps(s2), big = _mm256_set1_ps(FLT_MAX),
               absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), sign = _mm256_set1_ps(-0.0f);
  __m256 mx1 = _mm256_setzero_ps(), mx2 = _mm256_setzero_ps();
  __m256 ok1 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), ok2 = ok1;
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const int64_t j = start + i;
    __m256 g = load8(t.g, t.dtype, j);
    if (t.maximize) g = _mm256_xor_ps(g, sign);
    __m256 mv = _mm256_mul_ps(_mm256_loadu_ps(m + i), vs1);
    __m256 vv = _mm256_mul_ps(_mm256_loadu_ps(v + i), vs2);
    mv = _mm256_add_ps(_mm256_mul_ps(mv, b1), _mm256_mul_ps(g, omb1));
    vv = _mm256_add_ps(_mm256_mul_ps(vv, b2), _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
    __m256 p = _mm256_mul_ps(load8(t.p, t.dtype, j), decay);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), bc2s), eps);
    p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_div_ps(mv, denom), step));
    store8(t.p, t.dtype, j, p);
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    const __m256 am = _mm256_and_ps(mv, absmask), av = _mm256_and_ps(vv, absmask);
    ok1 = _mm256_and_ps(ok1, _mm256_cmp_ps(am, big, _CMP_LE_OQ));
    ok2 = _mm256_and_ps(ok2, _mm256_cmp_ps(av, big, _CMP_LE_OQ));
    mx1 = _mm256_max_ps(mx1, am);
    mx2 = _mm256_max_ps(mx2, av);
  }
  float l1[8], l2[8];
  _mm256_storeu_ps(l1, mx1);
  _mm256_storeu_ps(l2, mx2);
  for (int k = 0; k < 8; ++k) {
    st->mx1 = l1[k] > st->mx1 ? l1[k] : st->mx1;
    st->mx2 = l2[k] > st->mx2 ? l2[k] : st->mx2;
  }
  st->ok1 = st->ok1 && _mm256_movemask_ps(ok1) == 0xFF;
  st->ok2 = st->ok2 && _mm256_movemask_ps(ok2) == 0xFF;
  return i;
}

void run_blocks(void* ctx, int64_t b0, int64_t b1) {
  const AdamTask& t = *static_cast<const AdamTask*>(ctx);
  const bool avx2 = active_isa() >= ISA_AVX2;
  float m[kMaxBlock], v[kMaxBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * t.block;
    const int64_t len = t.n - start < t.block ? t.n - start : t.block;
    if (t.bits == 8) {
      for (int64_t i = 0; i < len; ++i) {
        m[i] = t.map1[t.c1[start + i]];
        v[i] = t.map2[t.c2[start + i]];
      }
    } else {
      const uint8_t *b1 = t.c1 + (start >> 1), *b2 = t.c2 + (start >> 1);  // start is even
      int64_t i = 0;
      for (; i + 2 <= len; i += 2) {
        m[i] = t.map1[b1[i >> 1] >> 4];
        m[i + 1] = t.map1[b1[i >> 1] & 15];
        v[i] = t.map2[b2[i >> 1] >> 4];
        v[i + 1] = t.map2[b2[i >> 1] & 15];
      }
      if (i < len) {
        m[i] = t.map1[b1[i >> 1] >> 4];
        v[i] = t.map2[b2[i >> 1] >> 4];
      }
    }
    BlockStats st;
    const int64_t done = avx2 ? update_avx2(t, start, len, t.a1[b], t.a2[b], m, v, &st) : 0;
    update_scalar_from(t, start, done, len, t.a1[b], t.a2[b], m, v, &st);
    encode(m, len, st.ok1, st.mx1, *t.tb1, t.zero1, t.step1, t.bits, t.c1, start, t.a1 + b, avx2);
    encode(v, len, st.ok2, st.mx2, *t.tb2, t.zero2, t.step2, t.bits, t.c2, start, t.a2 + b, avx2);
  }
}

}  // namespace
}  // namespace tq

// One AdamW step of one tensor of n elements in place (see the file comment). p, g: fp32
// (dtype 0) or bf16 (1). c1 / c2: the codes of exp_avg / exp_avg_sq (n bytes for bits 8,
// ceil(n / 2) for bits 4), c*_bytes their capacity; a1 / a2: absmax, ceil(n / block) entries used of
// a*_len; map1 / map2: the sorted maps (2^bits values), mids1 / mids2: their 2^bits - 1 midpoints;
// block: 2..4096 and even; scalars: beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * weight_decay,
// lr / bias_correction1, sqrt(bias_correction2), eps. Returns OK or BAD_ARGUMENT.
TQ_API int tq_adamw_blockwise(void* p, const void* g, int dtype, int64_t n, uint8_t* c1, int64_t c1_bytes, float* a1, int64_t a1_len,
                              uint8_t* c2, int64_t c2_bytes, float* a2, int64_t a2_len, const float* map1, const float* mids1,
                              const float* map2, const float* mids2, int bits, int64_t block, const float* scalars, int maximize,
                              int threads) {
  using namespace tq;
  if (n < 0 || (bits != 8 && bits != 4) || block < 2 || block > kMaxBlock || block % 2 != 0) return BAD_ARGUMENT;
  if (dtype != DT_F32 && dtype != DT_BF16) return BAD_ARGUMENT;
  if (n == 0) return OK;
  const int64_t nb = (n + block - 1) / block, need = bits == 8 ? n : (n + 1) / 2;
  if (!p || !g || !c1 || !c2 || !a1 || !a2 || !map1 || !mids1 || !map2 || !mids2 || !scalars) return BAD_ARGUMENT;
  if (c1_bytes < need || c2_bytes < need || a1_len < nb || a2_len < nb) return BAD_ARGUMENT;
  AdamTask t;
  t.p = p;
  t.g = g;
  t.dtype = dtype;
  t.n = n;
  t.c1 = c1;
  t.a1 = a1;
  t.c2 = c2;
  t.a2 = a2;
  t.map1 = map1;
  t.map2 = map2;
  t.bits = bits;
  t.nmids = (1 << bits) - 1;
  t.block = block;
  t.beta1 = scalars[0];
  t.omb1 = scalars[1];
  t.beta2 = scalars[2];
  t.omb2 = scalars[3];
  t.decay = scalars[4];
  t.step_size = scalars[5];
  t.bc2s = scalars[6];
  t.eps = scalars[7];
  t.maximize = maximize != 0;
  t.zero1 = bucket(0.0f, mids1, t.nmids);
  t.zero2 = bucket(0.0f, mids2, t.nmids);
  // exp_avg: a negative value never takes the code of 0.0 (where the map has values below it);
  // exp_avg_sq: a positive value never takes the code of an exact 0.0 (where the map holds one)
  t.step1 = t.zero1 > 0 ? -1 : 0;
  t.step2 = map2[t.zero2] == 0.0f && t.zero2 < t.nmids ? 1 : 0;
  t.tb1 = table_for(mids1, t.nmids);
  t.tb2 = table_for(mids2, t.nmids);
  // work = n: below ~2 * min_parallel_work() elements (128K by default) one thread does it all; waking a
  // second costs more than it saves there, and a lot more on a loaded machine with OpenMP threads.
  parallel_for(nb, 1, threads, run_blocks, &t, 0, n);
  return OK;
}
