// The lut4 vector kernel (see lut4_linear.h for the formats), written once over ISA traits T
// (simd_avx2.h, simd_avx512.h) and instantiated by lut4_linear_<isa>.cpp.
//
// Small M (decode): each 16-byte chunk of a row unpacks to 32 weights with table lookups
// (T::lut4_unpack) into the block's 16-entry table, and feeds FMAs for every activation row
// while in registers. Larger M: a panel of 4 rows is unpacked once into an L2-resident fp32
// buffer, then a register tile of dot products runs over it for blocks of activation rows; from
// kLut4GemmMinM rows the fp32 panel GEMM (gemm_f32_body.h) over unpacked k-major panels. The
// AVX2 decode paths (M <= 4) are at the end.
//
// In an anonymous namespace, with T's types in one too: each ISA unit has its own internal copy
// (see common.h).
#pragma once
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_f32_body.h"
#include "lut4_linear.h"
#include "tiling.h"

namespace tq {
namespace {

template <class T>
struct Lut4Kernel {
  using F = typename T::F;
  using I = typename T::I;
  static constexpr int W = T::kLanes;
  static constexpr int kChunk = 32 / W;  // vectors per 16 packed bytes (32 weights)
  static constexpr int kFusedMaxM = 4;
  static constexpr int64_t kPanelRows = 4;
  static constexpr int64_t kActivationBlockBytes = 1 << 20;  // activation rows per pass stay in L2

  struct Table {
    F v[16 / W];  // 16 entries
  };

  static Table load_code(const float* codebook) {
    Table c;
    for (int i = 0; i < 16 / W; ++i) c.v[i] = T::loadu(codebook + W * i);
    return c;
  }

  static F entries(const Lut4Params& p, F code, F s, int64_t b) {
    if (!p.shifts && !p.zeros && p.round_mul == ROUND_NONE) return T::mul(code, s);
    const F c = p.shifts ? T::add(code, T::set1(p.shifts[b])) : code;
    const F v = T::round_to(T::mul(c, s), p.round_mul);
    return p.zeros ? T::round_to(T::add(v, T::set1(p.zeros[b])), p.round_add) : v;
  }

  // The 16 weight values of block g of row n (see lut4_linear.h); NF4 / FP4 take one multiply.
  static Table table(const Lut4Params& p, const Table& code, int64_t n, int64_t g) {
    const F s = T::set1(lut4_scale(p, n, g));
    const int64_t b = n * p.blocks_per_row + g;
    Table lut;
    for (int i = 0; i < 16 / W; ++i) lut.v[i] = entries(p, code.v[i], s, b);
    return lut;
  }

  // ---- pair tables (T::kLut4Bf16Pairs: AVX512_BF16, simd_avx512bf16.h) ----
  // A call whose entries are rounded to bf16 (int4 with bf16 scales, and zeros if any) builds the
  // tables of blocks g and g + 1 of a row together: vcvtne2ps2bf16 rounds both blocks' entries in
  // one instruction, where `entries` takes five integer operations per rounding and block. It
  // reads fp32 subnormals as zero, so it runs only where nothing it rounds can be subnormal: an
  // integer codebook (every product c s is 0 or at least |s|), integer shifts, and scales and
  // zeros each 0 or of magnitude >= 2^-100 (checked per pair, on the integer pipes; a bf16 sum of
  // two such values is 0 or >= 2^-107). Other pairs take `table`, bit-identical where both run.
  struct Pairs {
    bool on;
    F lo, hi;  // codebook entries 0..7 and 8..15, each twice (lanes alternate the two blocks)
  };

  static Pairs pairs_for(const Lut4Params& p) {
    Pairs pr{false, T::zero(), T::zero()};
    if constexpr (T::kLut4Bf16Pairs) {
      if (!lut4_bf16_pairs(p)) return pr;
      alignas(64) float lo[16], hi[16];
      for (int c = 0; c < 16; ++c) (c < 8 ? lo : hi)[2 * (c % 8)] = (c < 8 ? lo : hi)[2 * (c % 8) + 1] = p.codebook[c];
      pr.on = true;
      pr.lo = T::load(lo);
      pr.hi = T::load(hi);
    }
    return pr;
  }

  // Whether v[0] and v[1] are each 0, NaN, or of magnitude >= 2^-100 (see Pairs).
  __attribute__((always_inline)) static bool pair_not_tiny(const float* v) {
    constexpr uint32_t kTiny = 27u << 23;  // the bits of 2^-100
    return lut4_zero_or_not_below(v, kTiny) && lut4_zero_or_not_below(v + 1, kTiny);
  }
  __attribute__((always_inline)) static bool pair_integral(const float* v) { return v[0] == __builtin_truncf(v[0]) && v[1] == __builtin_truncf(v[1]); }

  // The tables of blocks g and g + 1 (< blocks_per_row) of row n: the pair path where allowed.
  __attribute__((always_inline)) static void table_pair(const Lut4Params& p, const Table& code, const Pairs& pr, int64_t n, int64_t g, Table& a, Table& b) {
    if constexpr (T::kLut4Bf16Pairs) {
      const int64_t i = n * p.blocks_per_row + g;
      const float* z = p.zeros ? p.zeros + i : nullptr;
      const float* sh = p.shifts ? p.shifts + i : nullptr;
      if (pair_not_tiny(p.absmax + i) && (!z || pair_not_tiny(z)) && (!sh || pair_integral(sh))) {
        T::lut4_bf16_table_pair(pr.lo, pr.hi, p.absmax + i, sh, z, a.v[0], b.v[0]);
        return;
      }
    }
    a = table(p, code, n, g);
    b = table(p, code, n, g + 1);
  }

  // Blocks g.. of a row whose tables are built together: 2 on the pair path, else 1.
  static int blocks_at(const Lut4Params& p, const Pairs& pr, int64_t g) { return pr.on && g + 1 < p.blocks_per_row ? 2 : 1; }

  // Fetch the per-block values (scales or nested codes, shifts, zeros) of weight rows [n, n + rows)
  // into the cache: a decode tile calls it for the next tile's rows, whose codes it streams in as it
  // goes. Without it each tile began with a DRAM miss per array (int4 g128, M = 1: ~3 per 4 rows).
  static void prefetch_block_values(const Lut4Params& p, int64_t n, int64_t rows) {
    if (n >= p.N) return;
    if (n + rows > p.N) rows = p.N - n;
    const int64_t first = n * p.blocks_per_row, count = rows * p.blocks_per_row;
    auto lines = [&](const void* base, int64_t esize) {
      if (!base) return;
      const char* b = static_cast<const char*>(base) + first * esize;
      for (int64_t off = 0; off < count * esize; off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
    };
    lines(p.absmax, 4);
    lines(p.nested_codes, 1);
    lines(p.shifts, 4);
    lines(p.zeros, 4);
  }

  // out[m0..m0+MT, n..n+NT] for rows whose weights unpack into registers chunk by chunk. Vector i
  // of a chunk accumulates into acc[i % 2].
  // fused_tile's work on block g of its rows (tables lut[0..NT)): every chunk into acc, fetching
  // one line of the next tile per chunk.
  template <int NT, int MT>
  static inline void fused_block(const Lut4Params& p, int64_t g, const Table* lut, const uint8_t* const* w,
                                                                const float* const* x, F (&acc)[NT][MT][2], const char*& ahead,
                                                                const char* ahead_end) {
    const int64_t B = p.block;
    for (int64_t k = g * B; k < (g + 1) * B; k += 32) {
      if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
      ahead += 16 * NT;
      for (int t = 0; t < NT; ++t) {
        F wv[kChunk];
        T::lut4_unpack(lut[t].v, w[t] + k / 2, wv);
        for (int m = 0; m < MT; ++m)
          for (int i = 0; i < kChunk; ++i) acc[t][m][i & 1] = T::fmadd(wv[i], T::loadu(x[m] + k + W * i), acc[t][m][i & 1]);
      }
    }
  }

  // PAIRED: pr.on (a separate instantiation, so that other formats run the loop without the pair
  // branch: with it, NF4 measured 15% slower).
  template <int NT, int MT, bool PAIRED>
  TQ_TILE static void fused_tile(const Lut4Params& p, const Pairs& pr, int64_t n, int64_t m0) {
    const int64_t K = p.K, G = p.blocks_per_row;  // hoisted: no division per tile (see decode_tile)
    const Table code = load_code(p.codebook);
    F acc[NT][MT][2];
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) acc[t][m][0] = acc[t][m][1] = T::zero();
    const uint8_t* w[NT];
    for (int t = 0; t < NT; ++t) w[t] = p.packed + (n + t) * (K / 2);
    const float* x[MT];
    for (int m = 0; m < MT; ++m) x[m] = p.xp + (m0 + m) * K;
    // The next tile's rows follow these in memory: fetch them one line per step (NT rows of
    // K/2 bytes take NT*K/64 lines, which is exactly one per 32-element step of this tile), so
    // memory streams while this tile computes; rows of a few KB are too short for the hardware
    // prefetchers to ramp up on their own.
    prefetch_block_values(p, n + NT, NT);
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    int64_t g = 0;
    if constexpr (PAIRED) {  // blocks of 32: one chunk each, straight-line code per pair
      for (; g + 1 < G; g += 2) {
        Table lut[2][NT];
        for (int t = 0; t < NT; ++t) table_pair(p, code, pr, n + t, g, lut[0][t], lut[1][t]);
        for (int j = 0; j < 2; ++j) {
          const int64_t k = (g + j) * 32;
          if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
          ahead += 16 * NT;
          for (int t = 0; t < NT; ++t) {
            F wv[kChunk];
            T::lut4_unpack(lut[j][t].v, w[t] + k / 2, wv);
            for (int m = 0; m < MT; ++m)
              for (int i = 0; i < kChunk; ++i) acc[t][m][i & 1] = T::fmadd(wv[i], T::loadu(x[m] + k + W * i), acc[t][m][i & 1]);
          }
        }
      }
    }
    for (; g < G; ++g) {
      Table lut[NT];
      for (int t = 0; t < NT; ++t) lut[t] = table(p, code, n + t, g);
      fused_block<NT, MT>(p, g, lut, w, x, acc, ahead, ahead_end);
    }
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float s = T::hsum(T::add(acc[t][m][0], acc[t][m][1]));
        p.out[(m0 + m) * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
      }
  }

  // Unpack rows n..n+rows into buf ([rows, K] fp32, in the permuted activation order).
  static void unpack_panel(const Lut4Params& p, int64_t n, int64_t rows, float* buf) {
    const int64_t K = p.K, B = p.block, G = K / B;
    const Table code = load_code(p.codebook);
    const Pairs pr = pairs_for(p);
    for (int64_t t = 0; t < rows; ++t) {
      const uint8_t* w = p.packed + (n + t) * (K / 2);
      float* dst = buf + t * K;
      for (int64_t g = 0; g < G;) {
        const int nb = blocks_at(p, pr, g);
        Table lut[2];
        if (nb == 2) table_pair(p, code, pr, n + t, g, lut[0], lut[1]);
        else lut[0] = table(p, code, n + t, g);
        for (int64_t k = g * B; k < (g + nb) * B; k += 32) {
          F v[kChunk];
          T::lut4_unpack(lut[k >= (g + 1) * B].v, w + k / 2, v);
          for (int i = 0; i < kChunk; ++i) T::store(dst + k + W * i, v[i]);
        }
        g += nb;
      }
    }
  }

  // out[m0..m0+MT, n..n+NT] from NT unpacked rows of buf.
  template <int NT, int MT>
  TQ_TILE static void panel_tile(const Lut4Params& p, const float* buf, int64_t n, int64_t m0) {
    const int64_t K = p.K;
    F acc[NT][MT];
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) acc[t][m] = T::zero();
    for (int64_t k = 0; k < K; k += W) {
      F w[NT];
      for (int t = 0; t < NT; ++t) w[t] = T::load(buf + t * K + k);
      for (int m = 0; m < MT; ++m) {
        const F xv = T::loadu(p.xp + (m0 + m) * K + k);
        for (int t = 0; t < NT; ++t) acc[t][m] = T::fmadd(w[t], xv, acc[t][m]);
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float s = T::hsum(acc[t][m]);
        p.out[(m0 + m) * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
      }
  }

  // ---- GEMM path (M >= kLut4GemmMinM, where the ISA's table has it: lut4_linear.h) ----
  // The fp32 panel GEMM (gemm_f32_body.h) over panels of exact weights in the permuted activation
  // order: each weight is unpacked once per call, the FMAs see only L1 data.
  using Gemm = PanelGemm<T>;
  static constexpr int NR = Gemm::NR;

  // panel[k * NR + t] = weight of row n + t at permuted position k0 + k (zero for t >= rows):
  // 8 rows at a time unpack 32 positions each into `rows8`, then 8x8 transposes.
  static void unpack_kpanel(const Lut4Params& p, const Table& code, int64_t n, int64_t rows, int64_t k0, int64_t kc, float* panel) {
    alignas(64) float rows8[8 * 32];
    for (int64_t t0 = 0; t0 < NR; t0 += 8) {
      Table lut[8];
      int64_t lut_block[8];
      for (int r = 0; r < 8; ++r) lut_block[r] = -1;
      for (int64_t k = k0; k < k0 + kc; k += 32) {
        const int64_t g = k / p.block;
        for (int r = 0; r < 8; ++r) {
          float* dst = rows8 + 32 * r;
          if (t0 + r >= rows) {
            for (int i = 0; i < 32; ++i) dst[i] = 0.0f;
            continue;
          }
          if (lut_block[r] != g) {
            lut[r] = table(p, code, n + t0 + r, g);
            lut_block[r] = g;
          }
          F wv[kChunk];
          T::lut4_unpack(lut[r].v, p.packed + (n + t0 + r) * (p.K / 2) + k / 2, wv);
          for (int i = 0; i < kChunk; ++i) T::store(dst + W * i, wv[i]);
        }
        for (int i = 0; i < 4; ++i) Gemm::transpose8(rows8 + 8 * i, 32, panel + (k - k0 + 8 * i) * NR + t0, NR);
      }
    }
  }

  static void gemm_rows(const Lut4Params& p, int64_t n0, int64_t n1) {
    const Table code = load_code(p.codebook);
    const PanelGemmArgs a{p.xp, p.K, p.M, p.K, p.N, p.bias, p.out};
    const bool ran = Gemm::run(a, n0, n1, [&](int64_t n, int64_t rows, int64_t k0, int64_t kc, float* panel) {
      unpack_kpanel(p, code, n, rows, k0, kc, panel);
    });
    if (!ran) lut4_rows_portable(p, n0, n1);
  }

  // M <= 4: fused tiles of kLut4FusedRows weight rows x 2 activation rows. Larger M: panels of
  // 4 weight rows, swept by kLut4PanelM activation rows at a time, block by block of activations.
  static void rows(const Lut4Params& p, int64_t n0, int64_t n1) {
    const Pairs pr = pairs_for(p);
    if (p.M <= kFusedMaxM) {
      tiles_then_singles<T::kLut4FusedRows>(n0, n1, [&](auto nt, int64_t n) {
        tiles_then_remainder<2>(0, p.M, [&](auto mt, int64_t m) {
          if constexpr (T::kLut4Bf16Pairs) {
            if (pr.on) return fused_tile<decltype(nt)::value, decltype(mt)::value, true>(p, pr, n, m);
          }
          fused_tile<decltype(nt)::value, decltype(mt)::value, false>(p, pr, n, m);
        });
      });
      return;
    }
    float* buf = static_cast<float*>(aligned_alloc(sizeof(F), kPanelRows * p.K * sizeof(float)));
    if (!buf) {  // cannot happen for sane K; stay correct anyway
      lut4_rows_portable(p, n0, n1);
      return;
    }
    constexpr int MP = T::kLut4PanelM;
    int64_t block_rows = kActivationBlockBytes / (p.K * (int64_t)sizeof(float));
    block_rows = block_rows < MP ? MP : block_rows / MP * MP;
    for (int64_t m0 = 0; m0 < p.M; m0 += block_rows) {
      const int64_t m1 = m0 + block_rows < p.M ? m0 + block_rows : p.M;
      for (int64_t n = n0; n < n1; n += kPanelRows) {
        const int64_t rows = n + kPanelRows <= n1 ? kPanelRows : n1 - n;
        unpack_panel(p, n, rows, buf);
        with_tile_size<kPanelRows>(rows, [&](auto nt) {
          tiles_then_remainder<MP>(m0, m1, [&](auto mt, int64_t m) { panel_tile<decltype(nt)::value, decltype(mt)::value>(p, buf, n, m); });
        });
      }
    }
    free(buf);
  }

  // ---- decode paths (M <= kLut4DecodeMaxM; see lut4_linear.h) ----
  static constexpr int64_t kDecodeChunk = 8 * W;  // weights per chunk: W lanes of 8 nibbles

  // Per weight row of a decode tile: the per-block scales s_b (the weight's own array, or computed
  // from double-quantized absmax into own), shifts and zeros (the weight's, or null).
  struct RowWork {
    char* own;  // row_work_bytes(G) of workspace
    const float* scales;
    const float* shifts;
    const float* zeros;
  };
  static size_t row_work_bytes(int64_t G) { return (G * sizeof(float) + 63) / 64 * 64; }

  static void prepare_row(const Lut4Params& p, int64_t n, RowWork& r) {
    const int64_t G = p.blocks_per_row;
    if (p.absmax) {
      r.scales = p.absmax + n * G;
    } else {
      float* s = reinterpret_cast<float*>(r.own);
      for (int64_t g = 0; g < G; ++g) s[g] = lut4_scale(p, n, g);
      r.scales = s;
    }
    r.shifts = p.shifts ? p.shifts + n * G : nullptr;
    r.zeros = p.zeros ? p.zeros + n * G : nullptr;
  }

  // The values of blocks g.. for the lanes of a chunk: one value for the whole chunk, or (blocks
  // shorter than a chunk) lane l's block's, reading only the chunk's blocks.
  static F per_lane(const float* v, int64_t g, bool whole, int64_t blocks, I lane_block) {
    return whole ? T::set1(v[g]) : T::block_lanes(v + g, blocks, lane_block);
  }

  // out[m0..m0+MT, n..n+NT] through decode path KIND, rows' RowWork in r[0..NT). Factored paths,
  // per span of max(block, chunk) weights and per lane: acc = sum c x (DECODE_AFFINE: the nibble
  // c; DECODE_CODEBOOK: codebook[c]); DECODE_AFFINE then acc = d X + acc, with X the lane's sum
  // of x over the span (p.xsums); tot = acc s + tot; with zeros tot = z X + tot. A one-hot row of
  // x thus gives exactly the weight ((c + d) s, then + z: the reference's roundings).
  template <int KIND, int NT, int MT>
  TQ_TILE static void decode_tile(const Lut4Params& p, const RowWork* r, int64_t n, int64_t m0) {
    constexpr int A = MT == 1 ? 2 : 1;  // accumulators per output
    constexpr int64_t C = kDecodeChunk;
    // Shifts, not divisions, from the block size (a power of two): each tile begins here, and its
    // 64-bit divisions (these and block_lane_index's) cost several percent: NF4 at one row on the
    // AVX2 kernel, one Zen 4 core, best of 3 alternating runs, 3072 x 576 165 -> 157 us, 576 x
    // 1536 81 -> 79.
    const int64_t K = p.K, B = p.block, span = B > C ? B : C;
    const int log_b = __builtin_ctzll(static_cast<unsigned long long>(B)), log_span = B > C ? log_b : __builtin_ctzll(C);
    const int64_t spans = K >> log_span;
    const Table code = load_code(p.codebook);
    const I lane_block = T::block_lane_index(B);
    const bool whole = B >= C;  // one block per chunk (else C / B blocks split each chunk)
    const int64_t blocks = whole ? 1 : C >> log_b;
    const int64_t span_blocks = span >> log_b;  // the block index advances by this per span (no divisions)
    const F code0 = T::set1(p.codebook[0]);
    const uint8_t* w[NT];
    const float *scales[NT], *shifts[NT], *zeros[NT];  // the rows' RowWork, in registers or the frame
    for (int t = 0; t < NT; ++t) {
      w[t] = p.packed + (n + t) * (K / 2);
      scales[t] = r[t].scales;
      shifts[t] = r[t].shifts;
      zeros[t] = r[t].zeros;
    }
    const float* x[MT];
    const float* xsums[MT];
    for (int m = 0; m < MT; ++m) {
      x[m] = p.xp + (m0 + m) * K;
      xsums[m] = KIND == DECODE_AFFINE ? p.xsums + (m0 + m) * spans * W : nullptr;
    }
    // As fused_tile, but two tiles ahead (AVX2, 4096^2 int4 g128 from DRAM, M = 1: about 7% faster
    // than one tile ahead, in 4 of 5 interleaved runs; four ahead: no better).
    prefetch_block_values(p, n + 2 * NT, NT);
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + 2 * NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    F tot[NT][MT];
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) tot[t][m] = T::zero();
    int64_t g = 0, xs_at = 0;  // the span's first block; its xsums offset
    for (int64_t k0 = 0; k0 < K; k0 += span, g += span_blocks, xs_at += W) {
      F acc[NT][MT][A];
      for (int t = 0; t < NT; ++t)
        for (int m = 0; m < MT; ++m)
          for (int a = 0; a < A; ++a) acc[t][m][a] = T::zero();
      for (int64_t k = k0; k < k0 + span; k += C) {
        if (ahead < ahead_end)  // lines past the end: the last tile fetches nothing ahead
          for (int q = 0; q < NT * C / 2; q += 64) _mm_prefetch(ahead + q, _MM_HINT_T0);
        ahead += NT * C / 2;
        for (int t = 0; t < NT; ++t) {
          const I v = T::load_chunk(w[t] + k / 2);
          for (int j = 0; j < 8; ++j) {
            // affine: c 16^j against x 16^-j (xp is prescaled: lut4_linear.h), the product c x exactly
            const F wv = KIND == DECODE_AFFINE ? T::nibble_in_place(v, j) : T::codebook_lookup(code.v, v, j);
            for (int m = 0; m < MT; ++m) acc[t][m][j % A] = T::fmadd(wv, T::loadu(x[m] + k + W * j), acc[t][m][j % A]);
          }
        }
      }
      // Per span and row: a handful of instructions, unrolled so that acc and tot stay in
      // registers (a rolled loop kept them on the stack, and two 64-bit divisions per span for
      // the block indices cost a third of the tile's time at block 128).
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        const F sv = per_lane(scales[t], g, whole, blocks, lane_block);
        F dv = code0, zv = T::zero();
        if constexpr (KIND == DECODE_AFFINE) {  // d = codebook[0] + shift: integers, exact
          if (shifts[t]) dv = T::add(code0, per_lane(shifts[t], g, whole, blocks, lane_block));
          if (zeros[t]) zv = per_lane(zeros[t], g, whole, blocks, lane_block);
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) {
          F a = A == 2 ? T::add(acc[t][m][0], acc[t][m][A - 1]) : acc[t][m][0];
          if constexpr (KIND == DECODE_AFFINE) {
            const F xs = T::loadu(xsums[m] + xs_at);
            a = T::fmadd(dv, xs, a);
            tot[t][m] = T::fmadd(a, sv, tot[t][m]);
            if (zeros[t]) tot[t][m] = T::fmadd(zv, xs, tot[t][m]);
          } else {
            tot[t][m] = T::fmadd(a, sv, tot[t][m]);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) {
        const float s = T::hsum(tot[t][m]);
        p.out[(m0 + m) * p.N + n + t] = p.bias ? s + p.bias[n + t] : s;
      }
  }

  template <int KIND>
  static void decode_kind(const Lut4Params& p, int64_t n0, int64_t n1) {
    constexpr int R = T::kLut4DecodeRows;
    const int64_t G = p.blocks_per_row;
    const size_t per_row = row_work_bytes(G);
    char* work = static_cast<char*>(aligned_alloc(64, R * per_row));
    if (!work) {
      lut4_rows_portable(p, n0, n1);  // cannot happen for sane K; stay correct anyway
      return;
    }
    RowWork r[R];
    for (int t = 0; t < R; ++t) r[t].own = work + t * per_row;
    auto run = [&](auto nt, int64_t n, auto&& m_tiles) {
      for (int t = 0; t < decltype(nt)::value; ++t) prepare_row(p, n + t, r[t]);
      m_tiles(nt, n);
    };
    if (p.M == 1) {
      tiles_then_singles<R>(n0, n1, [&](auto nt, int64_t n) {
        run(nt, n, [&](auto nt2, int64_t n2) { decode_tile<KIND, decltype(nt2)::value, 1>(p, r, n2, 0); });
      });
    } else {
      tiles_then_singles<R / 2>(n0, n1, [&](auto nt, int64_t n) {
        run(nt, n, [&](auto nt2, int64_t n2) {
          tiles_then_remainder<2>(0, p.M, [&](auto mt, int64_t m) { decode_tile<KIND, decltype(nt2)::value, decltype(mt)::value>(p, r, n2, m); });
        });
      });
    }
    free(work);
  }

  static void decode(const Lut4Params& p, int64_t n0, int64_t n1) {
    if (p.decode == DECODE_AFFINE) decode_kind<DECODE_AFFINE>(p, n0, n1);
    else if (p.decode == DECODE_CODEBOOK) decode_kind<DECODE_CODEBOOK>(p, n0, n1);
    else rows(p, n0, n1);  // not reached: the caller permutes for a decode kind
  }

  // ---- lookup path (DECODE_LOOKUP, M = 1, blocks of 32: lut4_linear.h; ISAs with T::load_partial) ----
  // out[0, n..n+NT]: per block, the table path's lookups into the unscaled codebook (no table to
  // build) summed against x, times the block's scale; then the zeros' term sum_b z_b X_b.
  template <int NT>
  TQ_TILE static void lookup_tile(const Lut4Params& p, int64_t n) {
    const int64_t K = p.K, G = p.blocks_per_row;
    const Table code = load_code(p.codebook);
    const uint8_t* w[NT];
    const float* s[NT];
    for (int t = 0; t < NT; ++t) {
      w[t] = p.packed + (n + t) * (K / 2);
      s[t] = p.absmax + (n + t) * G;
    }
    prefetch_block_values(p, n + NT, NT);  // as fused_tile
    const char* ahead = reinterpret_cast<const char*>(p.packed + (n + NT) * (K / 2));
    const char* ahead_end = reinterpret_cast<const char*>(p.packed + p.N * (K / 2));
    F tot[NT];
    for (int t = 0; t < NT; ++t) tot[t] = T::zero();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k = g * 32;
      if (ahead < ahead_end) _mm_prefetch(ahead, _MM_HINT_T0);
      ahead += 16 * NT;
      F xv[kChunk];
      for (int i = 0; i < kChunk; ++i) xv[i] = T::loadu(p.xp + k + W * i);
      for (int t = 0; t < NT; ++t) {
        F wv[kChunk];
        T::lut4_unpack(code.v, w[t] + k / 2, wv);
        F a = T::mul(wv[0], xv[0]);
        for (int i = 1; i < kChunk; ++i) a = T::fmadd(wv[i], xv[i], a);
        tot[t] = T::fmadd(a, T::set1(s[t][g]), tot[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      float v = T::hsum(tot[t]);
      if (p.zeros) {  // sum_b z_b X_b, X_b the block's activation sum (p.xsums)
        const float* z = p.zeros + (n + t) * G;
        F zt = T::zero();
        int64_t g = 0;
        for (; g + W <= G; g += W) zt = T::fmadd(T::loadu(z + g), T::loadu(p.xsums + g), zt);
        if (g < G) zt = T::fmadd(T::load_partial(z + g, G - g), T::load_partial(p.xsums + g, G - g), zt);
        v += T::hsum(zt);
      }
      p.out[n + t] = p.bias ? v + p.bias[n + t] : v;
    }
  }

  static void lookup_rows(const Lut4Params& p, int64_t n0, int64_t n1) {
    tiles_then_singles<T::kLut4FusedRows>(n0, n1, [&](auto nt, int64_t n) { lookup_tile<decltype(nt)::value>(p, n); });
  }

  static void dequant(const Lut4Params& p, int64_t n0, int64_t n1, void* dst, bool bf16) {
    const int64_t K = p.K, B = p.block, G = K / B;
    const Table code = load_code(p.codebook);
    const Pairs pr = pairs_for(p);
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = p.packed + n * (K / 2);
      char* row = static_cast<char*>(dst) + (n - n0) * K * esize;
      for (int64_t g = 0; g < G;) {
        const int nb = blocks_at(p, pr, g);
        Table lut[2];
        if (nb == 2) table_pair(p, code, pr, n, g, lut[0], lut[1]);
        else lut[0] = table(p, code, n, g);
        for (int j = 0; j < nb; ++j) T::lut4_dequant_block(lut[j].v, w + (g + j) * B / 2, B, row + (g + j) * B * esize, bf16);
        g += nb;
      }
    }
  }
};

}  // namespace
}  // namespace tq
