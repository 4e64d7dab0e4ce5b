// The 4-bit table-lookup linear ("lut4"): fused dequantize + linear for 4-bit weights whose 16
// values per block come from a 16-entry table. One kernel serves bitsandbytes' NF4 / FP4
// blockwise formats and torchq's groupwise affine int4 format (TQ_FORMAT_LUT4, weight_abi.h).
//
// Files: lut4_linear.cpp (the lut4 half of tq_linear / tq_dequantize_rows: checks, activation
// permutation, threading), lut4_linear_body.h (the vector kernel, written once over ISA traits),
// lut4_linear_avx2.cpp / lut4_linear_avx512.cpp (its instantiations), lut4_linear_scalar.cpp (the
// portable kernel).
//
// Weight bytes: packed uint8 [N, K/2], element 2j of a row in the high nibble of byte j; one
// fp32 scale per block of B consecutive elements of a row (B divides K), either plain
// ([N*K/B]) or double-quantized (uint8 codes [N*K/B], fp32 absmax2 per 256 codes, fp32 offset:
// scale = map[code] * absmax2[i/256] + offset).
// Weight value of nibble c in block b (compiled without FP contraction, so each step is one
// rounding, as in PyTorch):
//   v = codebook[c] (+ shifts[b]);  v = R_mul(v * scale[b]);  (v = R_add(v + zeros[b]))
// with R the rounding to the reference's arithmetic dtype (none for fp32, bf16 or fp16).
// NF4 / FP4: codebook = the format's values, no shifts / zeros / rounding: exactly
// torchq::dequantize_4bit. int4 (torchq.layouts.int4_native): codebook[c] = c + qmin - mid
// (float zero point: zeros = z, ``(q - mid) * s + z``) or c + qmin with shifts = -z (integer
// zero point, ``(q - z) * s``), rounded in the scale / zero dtypes: exactly dequantize_affine.
//
// Activations arrive as fp32 rows permuted per chunk: for the table path, per chunk of 32 elements,
// the 16 even elements then the 16 odd ones (the order in which high and low nibbles of 16 bytes
// unpack); for a decode path (below), in that path's lane order (lut4_decode_element).
//
// Decode paths (M <= kLut4DecodeMaxM, AVX2; chosen per call by lut4_decode_kind): a chunk
// of 8W weights (W = the ISA's fp32 lanes: 4W packed bytes) is loaded as W 32-bit lanes of 8
// nibbles each and unpacked with shifts and masks, no shuffles, into 8 vectors.
//  * DECODE_AFFINE (codebook[c] = codebook[0] + c, scales and zeros unrounded: affine int4 with
//    fp32 scale / zero): per lane l of the chunks of a span (max(block, chunk) weights), with
//    c the nibbles, d = codebook[0] + shift_b and X_l the lane's sum of x over the span
//    (xsums: summed in double, rounded once): tot_l += s_b (sum c x + d X_l), then
//    tot_l += z_b X_l; out = the sum of the lanes. Vector j of a chunk takes its nibbles in place
//    (c 16^j: one mask, no shift; j = 7 shifted) against x 16^-j (the permuted activations are
//    prescaled), so every product is c x exactly. The weights are exact and a one-hot row of x
//    gives exactly the weight (the reference's roundings of (c + d) s and + z); otherwise only
//    the order and grouping of the fp32 sum differ from sum_k w_k x_k:
//    |out - sum_k w_k x_k| <= ~(K + 2) u sum_k (|(c_k + d) s_b| + |z_b|) |x_k|, u = 2^-24.
//  * DECODE_CODEBOOK (no shifts / zeros / rounding: NF4, FP4, their double-quantized absmax):
//    per lane tot_l += s_b sum codebook[c] x (codebook[c]: vpermps): one-hot exact, the bound
//    above with |w_k| = |s_b codebook[c_k]|.
//
// Lookup path (DECODE_LOOKUP, AVX-512, M = 1, lut4_lookup_allowed: blocks of 32 with plain fp32
// scales and zeros, unrounded, no shifts; int4 g32 as quantized from an fp32 model): the table
// path rebuilds a 16-entry table every 32 weights (scale and zero broadcast, a multiply, an add),
// which costs about as much as the lookups. This path looks up the unscaled codebook values
// (codebook[c] = c + qmin - mid, exact) with the same vpermps, in the table path's activation
// order, and per block and lane sums them against x, times s_b once per block:
// tot_l += s_b sum codebook[c] x; then out = sum_l tot_l + sum_b z_b X_b, X_b the block's sum of x
// (xsums [M, K / 32], in double, rounded once). A one-hot row of x gives exactly the weight
// (codebook[c] s_b, then + z_b: the reference's roundings); otherwise the bound of the decode
// paths: |out - sum_k w_k x_k| <= ~(K + 2) u sum_k (|codebook[c_k] s_b| + |z_b|) |x_k|. It
// takes inf / NaN and huge activations to the table path like them, none for being tiny (no
// prescaling). SmolLM2's 30 layers + tied head at M = 1 streamed from memory, one Zen 4 core:
// 11.3 -> 8.6 ms (NF4: 8.5). From 2 rows the table path (each table serves every row). Under the
// LUT4_DECODE switch. The AVX2 instantiation runs only under LUT4_LOOKUP_ANY_ISA (tests: CI's
// AVX2-only machines run the body): AVX2 looks up 8 weights with two vpermps and a blend, and
// the affine decode path is faster there (3072x576: 310 against 458 us, one core).
//
// GEMM path (M >= kLut4GemmMinM, AVX2 and AVX-512; Lut4Kernels.gemm): weight panels of 2W rows x 256
// positions unpack to their exact values into an L1-resident, k-major buffer (a block of panels in
// L2), and 6 x 2W register tiles of broadcast-activation FMAs run every activation row over them:
// each weight is unpacked once per call. Per output, fp32 sums over each 256-position block,
// added in order: within the fp32 bound of sum_k w_k x_k, one-hot exact.
//
// Pair tables (AVX512_BF16, Lut4Kernels.rows_bf16 / dequant_bf16, lut4_bf16_pairs): int4 with bf16
// scales (and zeros) in blocks of 32 spends most of the table path's work building each block's
// 16 entries (two bf16 roundings of five integer operations each, per 32 weights). Where the CPU has
// AVX512_BF16 the tables of blocks g and g + 1 are built together, each rounding one vcvtne2ps2bf16
// for both: the same entries bit for bit (pairs with a scale or zero below 2^-100, whose products
// could be subnormal, take the one-block tables), so the same outputs. SmolLM2's 3072 x 576 at
// M = 1 on one Zen 4 core: 217 -> 181 us.
//
// bf16 dot path (Lut4Kernels.dot_bf16, kLut4DotMinM <= M <= kLut4DotMaxM, bf16 activations, lut4_bf16_dot_weights weights, AVX512_BF16; the
// body: lut4_dot_body.h, emulated in lut4_dot_emulated.cpp, tq_set_lut4_dot): those weights are bf16
// values (their tables are rounded to bf16), so a pair of blocks' [A | B] table (blocks of 32; in
// blocks of a multiple of 64 one block's table twice, built once per block: SmolLM2's layers at 4
// rows 1.5-1.9x the table path in blocks of 64-256) becomes 32 bf16 words (vcvtne2ps2bf16), 64 weights
// at a time come out of two vpermw lookups as bf16, and vdpbf16ps multiplies them with the bf16
// activations: the products are exact in fp32 as on the table path, summed in fp32 in another
// order (the same bound). vdpbf16ps reads subnormals as zero and flushes them, so a call takes it
// only where every activation is finite, below 2^64 and 0 or of magnitude >= 2^-59 (else the
// table path), and a tile of weight rows only where each scale and zero is 0, inf, NaN or of
// magnitude >= 2^-59 (else the tile takes the table path): every weight is then 0 or at least
// 2^-66 and every product 0 or normal. Each weight is decoded once per call for all rows, so from
// 5 rows it also replaces dequantized bf16 tiles + torch.mm (tq_dot_max_m tells the caller). One
// Zen 4 core, SmolLM2's 3072 x 576 in blocks of 32: M = 2 245 -> 157 us, M = 4 478 -> 191, M = 16
// (tiles before) 800 -> 570 (bf16 F.linear 365); M = 1 181 -> 134 us (bf16 F.linear 151), since the
// guard's check of a tile's scales and zeros vectorizes and the next tile's are prefetched (a
// scalar check cost 18% of a two-row call and kept one row on the pair tables).
//
// Scaled dot path (Lut4Kernels.scaled_dot, kLut4ScaledDotMinM <= M <= kLut4ScaledDotMaxM, bf16
// activations, lut4_scaled_dot_allowed weights: int4 quantized from an fp32 model, plain fp32 scales
// and float zeros, any group size; AVX512_BF16; the body: lut4_scaled_dot_body.h): the integer
// codebook values are bf16 words exactly, so 128 weights at a time come out of four vpermw lookups
// of one constant table as bf16 (the 64 packed bytes read as 16-bit words, each indexing by its
// nibbles in turn: no widening), vdpbf16ps multiplies them with the bf16 activations (exact
// products, fp32 sums), and each 128 positions' lanes are scaled by their blocks' scales with one
// FMA (lane l covers positions 8l..8l+7: blocks of 32 four lanes each, of 64 eight); the zeros' term sum_b z_b X_b (X_b the
// block's activation sum, in double, rounded once: xsums [M, K / block]) is added per lane before
// the lanes are summed. As the lookup path: one-hot rows give exactly the weight, else
// |out - sum_k w_k x_k| <= ~(K + 2) u sum_k (|codebook[c_k] s_b| + |z_b|) |x_k|. Guards as the bf16
// dot path's: a call takes it only where every activation is finite, below 2^64 and 0 or of
// magnitude >= 2^-59, a tile of weight rows only where each scale and zero is 0 or normal and at most
// 2^100 (else the table path), so no product or partial sum is subnormal and no c s overflows where
// the reference's weight would not. Activations chunk-major: positions [128 c, 128 c + 128) of row m
// at p.xb + (c * M + m) * 128, in the weights' order (to_chunk_order). It runs ahead of the lookup path at one
// row and of the table path and dequantized tiles up to 16. One Zen 4 core, SmolLM2's 3072 x 576 /
// 576 x 1536 / 576 x 576 and its 49152 x 576 head, bf16, against the paths before (same call):
// groups of 32 1.05-1.18x at M = 1, 1.24-1.32x at 2, 1.36-1.72x at 4, 1.27-1.36x at 8, 1.0-1.15x at
// 16; groups of 128 1.26-1.49x at 1, 1.1-1.3x at 2, 1.26-1.44x at 4, 1.1-1.4x at 8, 1.0-1.2x at 16.
// At 16 rows vdpbf16ps plus an FMA per 64 positions and row costs about what the table path's fp32
// FMAs do (bf16 F.linear: about 0.55x). The emulation (lut4_scaled_dot_emulated.cpp) gives the same
// bits on any CPU (tq_set_lut4_scaled_dot). At one row the tile is compiled per block size (fixed
// loads, masks and scale spreads); at every row count a last chunk of at most 64 positions runs on
// 256-bit halves, and the guard checks a tile's scales and zeros 16 at a time in one pass (a running
// minimum and maximum of their magnitudes' bits): one row on one Zen 4 core, cache-resident, best of
// 3 alternating runs, 3072 x 576 69.2 -> 63.6 us, 576 x 1536 37.8 -> 33.9, 960 x 576 26.4 -> 24.4,
// 576 x 576 17.9 -> 16.5 (through DirectLinear; 3072 x 576 streamed from memory 81.4 -> 77.3).
//
// Its table kind (lut4_table_dot_allowed weights: NF4 / FP4, plain or double-quantized absmax,
// blocks of a multiple of 64, bf16 activations; 1-4 rows where the bf16 AMX or dot-product GEMM
// takes NF4's rows from kBf16AmxMinM / kBf16DpLut4MinM = 5): the reference casts each fp32 weight
// codebook[c] * absmax_b to bf16 before F.linear (torchq.ops.blockwise), so per 128-position chunk
// the 16 entries of each of its blocks are built as those bf16 values (an fp32 multiply, then
// vcvtne2ps2bf16 for both blocks at once: [A | B] 32 words), the 128 weights come out of four vpermw
// lookups (the index's bit 4 set for the second block's words, a block of 64 being words 16-31; in
// blocks of 128 or more both halves are the chunk's one block) and vdpbf16ps multiplies them with the
// activations into the tile's sums directly (no scale FMA: the weights are the reference's, bit for
// bit). Double-quantized absmax is decoded per tile of weight rows (map[code] * absmax2 + offset, two
// roundings, 16 at a time), as the reference decodes it. One-hot rows give exactly the reference's
// weight; else the products are the reference's and only the fp32 sums' order differs:
// |out - sum_k w_k x_k| <= ~K u sum_k |w_k x_k|, w_k the bf16 weight. Guard: every absmax of a tile 0
// or in [2^-40, 2^100] (with the codebook's nonzero magnitudes in [2^-8, 1], each weight is 0 or at
// least 2^-48, so with the activations' guard every product and partial sum is 0 or a normal multiple
// of 2^-121; no weight rounds to inf), else the tile takes the table path. On by default on AMD CPUs
// (Zen 4: a standalone copy of its loop ran 3072 x 512 in 45-57 us against the fp32 table loop's 69-77), off on Intel ones, where
// vdpbf16ps costs about two FMAs (one core of an Intel AMX machine, SmolLM2's layers, NF4: 0.74-0.94x
// the table path at 1-4 rows; docs/native-cpu.md); tq_set_lut4_table_dot / TORCHQ_NATIVE_TABLE_DOT.
//
// Calls with inf / NaN activations, or any of magnitude 2^64 or more, take the table path (its
// products are the reference's; the separate terms above could overflow where the sum does not);
// for DECODE_AFFINE also nonzero ones below 2^-102 (their prescaled x 16^-6 could lose bits).
//
// Int8-activation path (TQ_FORMAT_LUT4_INT8ACT, Lut4Kernels.q8, M <= kLut4Q8MaxM; above, and from
// Lut4Kernels.q8_gemm_min_m rows where that is fewer (VNNI: 5), its GEMM form Lut4Kernels.q8_gemm
// (block a multiple of 32; the codebook kind from kLut4Q8AmxMinM rows on AMX tiles where allowed,
// bit-equal): the same terms, summed in another order;
// where the ISA has no GEMM form (the portable table), the fp32 paths on the fake-quantized
// activations a * q: the same numbers with the exact codebook, within fp32 order of the reference
// for every weight format): each activation row is
// quantized per 32-element block j exactly as torchq.activation.PerBlockInt8 does (fp32
// a_j = amax / 127, q = rint(x / a_j) in [-127, 127]; a block with inf / NaN gets a_j = NaN, codes
// 0; rows zero-padded), and the weights enter as integers:
//  * affine (codebook[c] = codebook[0] + c, int4): with d_b = codebook[0] + shift_b,
//    out = sum_b [ s_b * sum_{j in b} a_j I_j  +  (s_b d_b + z_b) * sum_{j in b} a_j Q_j ],
//    I_j = sum c q and Q_j = sum q exact in int32, sum_{j in b} a_j Q_j per call in double,
//    rounded once: within ~(K + 4) u sum_k (|(c_k + d_b) s_b| + |z_b|) |a q_k| of
//    sum_k w_k (a q)_k, w_k the exact weight;
//  * codebook (NF4 / FP4: no shifts / zeros): the 16 values as int8 t_c = rint(127 codebook[c] /
//    cmax), cmax = max |codebook|, out = sum_b s_b (cmax / 127) sum_{j in b} a_j sum t_c q: the
//    weights are approximated by s_b cmax t_c / 127 (|error| <= s_b cmax / 254 each), plus the
//    fp32 bound above.
// Activations for it: xq8 [M, kq] codes (kq = K rounded up to 64, zero-padded), per 64-element
// chunk the 32 even elements (the chunk's first 32-block's 16, then the second's) then the 32 odd
// ones; xa [M, kq / 64, 8] each chunk's two block scales (a_j, times cmax / 127 for the codebook
// kind), 4 copies each; xblk [M, K / block] sum_{j in b} a_j Q_j.
#pragma once
#include <stdint.h>
#include <string.h>
#include <xmmintrin.h>

namespace tq {

struct Lut4Params {
  const float* xp;  // [M, K], permuted for the call's path (see above)
  int64_t M, K, N, block;
  const uint8_t* packed;     // [N, K/2]
  const float* codebook;     // 16 fp32 values
  const float* absmax;       // [N*K/block], or null when nested
  const uint8_t* nested_codes;
  const float* nested_absmax;
  float nested_offset;
  const float* nested_map;   // 256 fp32 values
  const float* bias;         // [N] or null
  float* out;                // [M, N]
  const float* shifts;       // [N*K/block] added to the codebook value before scaling, or null
  const float* zeros;        // [N*K/block] added after scaling, or null
  int round_mul, round_add;  // Round kinds after the multiply / the add
  int decode;                // DecodeKind of this call (DECODE_NONE: the table path)
  const float* xsums;        // DECODE_AFFINE: [M, K / span, W] each lane's sum of x per span
  int64_t blocks_per_row;    // K / block (hoisted: a 64-bit division per block cost ~3 ns)
  // int8-activation path (see above)
  const int8_t* xq8;         // [M, kq]
  const float* xa;           // [M, kq / 64, 8]
  int64_t kq;                // K rounded up to 64
  const float* xblk;         // [M, K / block]
  int q8_affine;             // 1: affine codebook (offset term), 0: int8 codebook q8_table
  int8_t q8_table[16];       // codebook kind: rint(127 codebook[c] / cmax)
  float q8_unit;             // codebook kind: cmax / 127
  // bf16 dot path (Lut4Kernels.dot_bf16): [M, kx] bf16 activations, per 64 positions the 32 odd
  // ones then the 32 even ones (kx = K rounded up to 64, zero-padded)
  const uint16_t* xb;
  int64_t kx;
  // The int8-activation AMX form (lut4_q8_amx_body.h): xq8 with each 32-block's codes together,
  // its 16 even elements then its 16 odd ones ([M, kq]; per 64-element chunk xq8's 16-byte
  // quarters 0, 2, 1, 3)
  const int8_t* xq8_blocks;
};

enum Round : int { ROUND_NONE = 0, ROUND_BF16 = 1, ROUND_FP16 = 2 };
enum DecodeKind : int { DECODE_NONE = 0, DECODE_AFFINE = 1, DECODE_CODEBOOK = 2, DECODE_LOOKUP = 3 };
static constexpr int64_t kLut4DecodeMaxM = 4;
// Rows from which the GEMM path runs (below, the panels of rows: faster up to about 48 rows).
static constexpr int64_t kLut4GemmMinM = 64;
// Rows up to which the int8-activation path may run its integer row kernel (above: its GEMM form,
// or where the ISA has none the fp32 paths on the fake-quantized activations, lut4_linear.cpp).
static constexpr int64_t kLut4Q8MaxM = 8;

// The decode path p's weight allows (DECODE_NONE if none): see above.
static inline int lut4_decode_kind(const Lut4Params& p) {
  // Entries rounded to bf16 / fp16 are not affine in the code: the table path serves them (a
  // byte-shuffle lookup of bf16 tables per block measured no faster on AVX2 than its vpermps
  // lookup, the per-block table being rebuilt for every row).
  if (p.round_mul != ROUND_NONE || (p.zeros && p.round_add != ROUND_NONE)) return DECODE_NONE;
  bool affine = true;
  for (int c = 1; c < 16; ++c) affine = affine && p.codebook[c] == p.codebook[0] + static_cast<float>(c);
  if (affine) return DECODE_AFFINE;
  return p.shifts || p.zeros ? DECODE_NONE : DECODE_CODEBOOK;
}

// Whether *v is 0, inf, NaN, or of magnitude >= the power of two whose fp32 bits are `tiny` (the
// pair tables' and the dot path's guards against subnormal intermediates).
static inline bool lut4_zero_or_not_below(const float* v, uint32_t tiny) {
  uint32_t u;
  memcpy(&u, v, sizeof u);
  return ((u & 0x7FFFFFFFu) - 1u) >= tiny - 1u;
}

// Fetch the scales and zeros of weight rows [n, n + rows) (clipped to p.N) into the cache: the dot
// paths call it for the next tile, whose guard then reads them from the cache (without it the guard
// took each tile's misses: a third of a one-row call's time on a weight streamed from memory).
static inline void lut4_prefetch_values(const Lut4Params& p, int64_t n, int64_t rows) {
  if (n >= p.N) return;
  if (n + rows > p.N) rows = p.N - n;
  const int64_t G = p.blocks_per_row;
  const float* arrays[2] = {p.absmax, p.zeros};
  for (const float* v : arrays) {
    if (!v) continue;
    const char* b = reinterpret_cast<const char*>(v + n * G);
    for (int64_t off = 0; off < rows * G * 4; off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
  }
}

// Whether p's weight allows the lookup path (DECODE_LOOKUP, above): blocks of 32, plain fp32
// scales, unrounded products and sums, no shifts.
static inline bool lut4_lookup_allowed(const Lut4Params& p) {
  return p.block == 32 && p.absmax && !p.shifts && p.round_mul == ROUND_NONE && (!p.zeros || p.round_add == ROUND_NONE);
}

// Whether p's tables may be built in pairs (Lut4Kernels.rows_bf16, simd_avx512bf16.h): entries
// rounded to bf16 (after the multiply, and after the add of zeros if any), plain fp32 scales,
// blocks of 32 (where building tables costs the most per weight), at least two per row, and an
// integer codebook (int4; each product c s is then 0 or at least
// |s| in magnitude: see lut4_linear_body.h's Pairs).
// Whether p's weights are bf16 values built from bf16-rounded tables: products and sums rounded to
// bf16, plain scales, an integer codebook (below 2^24, so c + shift is exact in fp32).
static inline bool lut4_bf16_tables(const Lut4Params& p) {
  if (p.round_mul != ROUND_BF16 || (p.zeros && p.round_add != ROUND_BF16) || !p.absmax) return false;
  for (int c = 0; c < 16; ++c)
    if (!(p.codebook[c] == __builtin_truncf(p.codebook[c]) && __builtin_fabsf(p.codebook[c]) < 0x1p24f)) return false;  // also NaN
  return true;
}
static inline bool lut4_bf16_pairs(const Lut4Params& p) { return p.block == 32 && p.blocks_per_row >= 2 && lut4_bf16_tables(p); }
// The bf16 dot path's weights: those tables in pairs of blocks of 32, or in blocks of a multiple of
// 64 positions (one table per block, both halves of its 32 words the block's 16 entries).
static inline bool lut4_bf16_dot_weights(const Lut4Params& p) { return lut4_bf16_pairs(p) || (p.block % 64 == 0 && lut4_bf16_tables(p)); }

// The element (within its chunk of 8W) that position i of a permuted chunk holds for the decode
// paths on an ISA of W fp32 lanes: position i = v * W + l is nibble v of 32-bit lane l (byte
// 4l + v / 2, the high nibble for odd v).
static inline int64_t lut4_decode_element(int W, int64_t i) {
  const int64_t v = i / W, l = i % W;
  return 8 * l + (v ^ 1);
}

// The absmax of block g of row n, bit-exact to torchq's reference (compiled without FP
// contraction, so map * absmax2 + offset is two roundings as in PyTorch).
static inline float lut4_scale(const Lut4Params& p, int64_t n, int64_t g) {
  const int64_t b = n * p.blocks_per_row + g;
  if (p.absmax) return p.absmax[b];
  const float t = p.nested_map[p.nested_codes[b]] * p.nested_absmax[b >> 8];
  return t + p.nested_offset;
}

// Rows [n0, n1) of the output, for all M activation rows.
typedef void (*Lut4RowsFn)(const Lut4Params& p, int64_t n0, int64_t n1);
// Weight rows [n0, n1) in natural order into dst (row n at dst + (n - n0) * K elements), as fp32
// or as bf16 (round to nearest even, as torch's .to(torch.bfloat16)). Uses p's weight fields only.
typedef void (*Lut4DequantFn)(const Lut4Params& p, int64_t n0, int64_t n1, void* dst, bool bf16);

// One 32-block v of an activation row quantized exactly as torchq.activation.PerBlockInt8 does:
// returns the scale a (NaN for a block with inf / NaN), the codes rint(v / a) clamped to
// [-127, 127] (all 0 for a non-finite block or a = 0) with the even elements at dst[0..16) and the
// odd ones at dst[32..48) (the kernels' order), and their sum in *qsum.
typedef float (*Lut4Q8BlockFn)(const float* v, int8_t* dst, int32_t* qsum);

// Rows [n0, n1) of the output through p.decode's path; activations in its lane order.
typedef void (*Lut4DecodeFn)(const Lut4Params& p, int64_t n0, int64_t n1);

// One ISA's kernels (see kernels.h); decode_lanes = 0 and decode = null where the ISA has none.
struct Lut4Kernels {
  Lut4RowsFn rows;
  Lut4DequantFn dequant;
  Lut4DecodeFn decode;  // null where the table path is faster at every M (AVX-512)
  int decode_lanes;     // W of decode's lane order: it needs K to be a multiple of 8 * decode_lanes
  Lut4RowsFn lookup;    // the lookup path (one row, lut4_lookup_allowed weights); null where the ISA has none
  // Whether calls take it by default; else only with LUT4_LOOKUP_ANY_ISA (AVX2: its two 8-entry
  // vpermps and a blend per 8 weights measured 1.4-1.9x slower than the affine decode path).
  bool lookup_preferred;
  Lut4RowsFn gemm;      // M >= kLut4GemmMinM (table-path activation order); null where not faster
  Lut4RowsFn q8;        // the int8-activation path (every ISA)
  Lut4RowsFn q8_gemm;   // its GEMM form (M >= q8_gemm_min_m below, block % 32 == 0); null: none
  Lut4Q8BlockFn q8_block;  // its activation quantization (bit-identical on every ISA)
  // Calls whose tables may be built in pairs (lut4_bf16_pairs), where the ISA has such a kernel
  // (AVX512_BF16: simd_avx512bf16.h); null: rows / dequant serve them.
  Lut4RowsFn rows_bf16;
  Lut4DequantFn dequant_bf16;
  // bf16 activations, kLut4DotMinM <= M <= kLut4DotMaxM, weights that lut4_bf16_pairs allows
  // (AVX512_BF16): the bf16 weights from the pair tables into vdpbf16ps against p.xb; null where
  // the ISA has none.
  Lut4RowsFn dot_bf16;
  // The fewest rows q8_gemm takes (0: kLut4Q8MaxM + 1). The VNNI form beats the row kernel from 5
  // rows (3072 x 576 and 576 x 1536, int4 g32 and NF4, one core: M = 5 306 vs 522 us, M = 8 336 vs
  // 744); the AVX2 form only above kLut4Q8MaxM. Either way rows above kLut4Q8MaxM never take the row
  // kernel, and without a GEMM form they take linear_fake_quantized.
  int q8_gemm_min_m;
  // The scaled dot path (bf16 activations, up to kLut4ScaledDotMaxM rows, weights that
  // lut4_scaled_dot_allowed allows; AVX512_BF16); null where the ISA has none.
  Lut4RowsFn scaled_dot;
};
// From one row in every block size: one Zen 4 core, SmolLM2's layers at M = 1, 1.27-1.37x the table
// path (pair tables) in blocks of 32, 1.09-1.17x in blocks of 64, 1.12-1.19x in blocks of 128.
static constexpr int64_t kLut4DotMinM = 1, kLut4DotMaxM = 16;
static constexpr int64_t kLut4ScaledDotMinM = 1, kLut4ScaledDotMaxM = 16;

// Whether p's weight allows the scaled dot path (above): plain fp32 scales, unrounded products
// and sums, no shifts, and a codebook of integers of magnitude <= 256 (bf16 values exactly).
static inline bool lut4_scaled_dot_allowed(const Lut4Params& p) {
  if (!p.absmax || p.shifts || p.round_mul != ROUND_NONE || (p.zeros && p.round_add != ROUND_NONE) || p.block % 32 != 0) return false;
  for (int c = 0; c < 16; ++c)
    if (!(p.codebook[c] == __builtin_truncf(p.codebook[c]) && __builtin_fabsf(p.codebook[c]) <= 256.0f)) return false;  // also NaN
  return true;
}
// Whether p's weight allows the scaled dot path's table kind (above): no shifts, zeros or roundings
// (NF4 / FP4, absmax plain or double-quantized), blocks of a multiple of 64, and every codebook value
// finite, of magnitude at most 1 and 0 or at least 2^-8 (NF4's smallest nonzero is 0.0796, FP4's 1/192).
static inline bool lut4_table_dot_allowed(const Lut4Params& p) {
  if (p.shifts || p.zeros || p.round_mul != ROUND_NONE || p.block % 64 != 0 || lut4_scaled_dot_allowed(p)) return false;
  for (int c = 0; c < 16; ++c) {
    const float a = __builtin_fabsf(p.codebook[c]);
    if (!(a == 0.0f || (a >= 0x1p-8f && a <= 1.0f))) return false;  // also NaN
  }
  return true;
}
// Whether p's calls take the table kind: it is allowed and on (tq_set_lut4_table_dot, its default the
// CPU's: lut4_linear.cpp).
bool lut4_table_dot_active(const Lut4Params& p);
// The table kind's guard on an absmax (above): 0 or in [2^-40, 2^100] (fp32 bits 0x2B800000).
static constexpr uint32_t kLut4TableDotMinBits = 0x2B800000u;
// The AVX512_BF16 kernel, and its body on emulated instructions (lut4_scaled_dot_emulated.cpp: the
// same bits on any CPU). LUT4_SCALED_DOT_ON (the default) runs the first where the active table has
// it, LUT4_SCALED_DOT_EMULATED the second on every ISA (tests), LUT4_SCALED_DOT_OFF neither
// (tq_set_lut4_scaled_dot); LUT4_DECODE off (lut4_paths) turns it off in every mode.
extern const Lut4RowsFn kLut4Avx512Bf16ScaledDot, kLut4EmulatedScaledDot;
// Their guard (Ops::values_ok, lut4_scaled_dot_body.h): whether every v[i] and w[i] (w may be null)
// of [0, count) lets its weight row take the path (tq_lut4_scaled_dot_values_ok, for tests).
// The table kind's guard on absmax values: the same check with its lower bound (min_bits: fp32 bits of
// the least admitted magnitude; the scaled kind's is FLT_MIN's).
using Lut4ValuesOkFn = bool (*)(const float* v, const float* w, int64_t count, uint32_t min_bits);
extern const Lut4ValuesOkFn kLut4Avx512Bf16ScaledDotValuesOk, kLut4EmulatedScaledDotValuesOk;
enum Lut4ScaledDotMode : int { LUT4_SCALED_DOT_OFF = 0, LUT4_SCALED_DOT_ON = 1, LUT4_SCALED_DOT_EMULATED = 2 };
Lut4RowsFn lut4_scaled_dot_kernel();
int scaled_dot_values_ok(Lut4RowsFn kernel, const float* v, const float* w, int64_t count, uint32_t min_bits);
// The bf16 dot path likewise: the AVX512_BF16 kernel (Lut4Kernels.dot_bf16) and its body on emulated
// instructions (lut4_dot_emulated.cpp), by tq_set_lut4_dot's mode; LUT4_DECODE off turns it off.
extern const Lut4RowsFn kLut4EmulatedDot;
enum Lut4DotMode : int { LUT4_DOT_OFF = 0, LUT4_DOT_ON = 1, LUT4_DOT_EMULATED = 2 };
Lut4RowsFn lut4_dot_kernel();

// Which of the decode and GEMM paths calls may take (bits; LUT4_DECODE also switches the bf16 dot
// path, which likewise sums few rows in another order; LUT4_GEMM also switches the GEMM forms
// of the int8-activation path and of the int8 dynamic kernel, int8_linear.h), and whether the
// active ISA's table has a GEMM path that is allowed (then the native rows beat dequantized tiles +
// torch.mm at every M). LUT4_LOOKUP_ANY_ISA (off by default, for tests) lets the lookup path run
// on ISAs where it is not preferred (AVX2), so that its body runs on machines without AVX-512.
enum Lut4Paths : int { LUT4_DECODE = 1, LUT4_GEMM = 2, LUT4_LOOKUP_ANY_ISA = 4 };
int lut4_paths();
bool lut4_gemm_active();
extern const Lut4Kernels kLut4Scalar, kLut4Avx2, kLut4Avx512, kLut4Avx512Bf16;

// The portable rows (kLut4Scalar.rows), also the vector kernels' fallback when their unpacking
// buffer cannot be allocated.
void lut4_rows_portable(const Lut4Params& p, int64_t n0, int64_t n1);
// The int8-activation rows: portable, and AVX2 (also the AVX-512 table's: 32-byte vpmaddubsw).
void lut4_q8_rows_portable(const Lut4Params& p, int64_t n0, int64_t n1);
void lut4_q8_rows_avx2(const Lut4Params& p, int64_t n0, int64_t n1);
// The int8-activation GEMM forms: AVX2 (vpmaddubsw), and AVX-512 VNNI (vpdpbusd; the AVX-512
// table's where the CPU has VNNI and TORCHQ_NATIVE_VNNI is not 0). Both compute the same terms in
// the same order (exact int32 block sums, then the same fp32 operations per output): bit-equal.
void lut4_q8_gemm_avx2(const Lut4Params& p, int64_t n0, int64_t n1);
void lut4_q8_gemm_avx512vnni(const Lut4Params& p, int64_t n0, int64_t n1);
// Their shared driver (lut4_q8_avx2.cpp): for each panel of 16 weight rows n .. n + cols of [n0,
// n1), its codes (panel[kStep s + 4 t + i]: row n + t at position 4 s + i of the activations'
// order; kStep 64, or 128 for the codebook kind: 64 int8 table values, then their 64 absolute
// values), its block scales sc[16 g + t] and (affine kind) offsets off[16 g + t] (each 64-byte
// aligned), then the kind's panel function for all p.M activation rows.
typedef void (*Lut4Q8PanelFn)(const Lut4Params& p, const uint8_t* panel, const float* sc, const float* off, int64_t n,
                              int64_t cols);
void lut4_q8_gemm_panels(const Lut4Params& p, int64_t n0, int64_t n1, Lut4Q8PanelFn affine, Lut4Q8PanelFn codebook);
// The codebook kind's GEMM form on AMX tiles (lut4_q8_amx_body.h; bit-equal to the two above),
// from kLut4Q8AmxMinM rows where int8_amx_gemm() would serve the int8 kernels (an AMX-INT8 CPU,
// Linux's permission, the AVX-512 ISA active, the AMX mode on), and on emulated tiles in
// INT8_AMX_EMULATED mode on CPUs with AVX2 (its panels' unpacking). kLut4Q8AmxGemm is null where
// the compiler lacks AMX. From 64 rows: one Emerald Rapids core, nf4a8 3072 x 576 and 576 x 1536,
// bf16 activations, VNNI -> AMX 1.06-1.64x at M = 64 and 256, 0.8-1.5x at 16-32 (three runs).
constexpr int64_t kLut4Q8AmxMinM = 64;
extern const Lut4RowsFn kLut4Q8AmxGemm, kLut4Q8AmxEmulatedGemm;
// The AMX form this call may take (by the int8 AMX mode, CPU and active ISA), or null.
Lut4RowsFn lut4_q8_amx_gemm();
float lut4_q8_block_portable(const float* v, int8_t* dst, int32_t* qsum);
float lut4_q8_block_avx2(const float* v, int8_t* dst, int32_t* qsum);

// The affine offset and scale of block g of row n for the int8-activation path.
static inline float lut4_q8_offset(const Lut4Params& p, int64_t n, int64_t g, float s) {
  const int64_t b = n * p.blocks_per_row + g;
  const float d = p.shifts ? p.codebook[0] + p.shifts[b] : p.codebook[0];
  return s * d + (p.zeros ? p.zeros[b] : 0.0f);
}

}  // namespace tq
