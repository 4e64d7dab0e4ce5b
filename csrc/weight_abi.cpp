// The exported linears over the weight struct (weight_abi.h) and the struct's self-description.
#include "weight_abi.h"

#include <type_traits>

#include "bf16_amx.h"
#include "bf16_dp_gemm.h"
#include "common.h"
#include "kernels.h"

namespace {

constexpr size_t kind_size(int kind) {
  return kind == TQ_KIND_I64 ? 8 : kind == TQ_KIND_PTR ? sizeof(void*) : 4;
}

struct FieldInfo {
  const char* name;
  int kind;
  int64_t offset;
};

// Each field's kind says its C type: size, float or not, pointer or not.
#define TQ_DESCRIBE_FIELD(name, type, kind)                                                   \
  static_assert(sizeof(type) == kind_size(kind) && std::is_pointer<type>::value == (kind == TQ_KIND_PTR) && \
                    std::is_floating_point<type>::value == (kind == TQ_KIND_F32),             \
                "tq_weight." #name ": its kind does not match its type");
TQ_WEIGHT_FIELDS(TQ_DESCRIBE_FIELD)
#undef TQ_DESCRIBE_FIELD

const FieldInfo kFields[] = {
#define TQ_DESCRIBE_FIELD(name, type, kind) {#name, kind, static_cast<int64_t>(offsetof(tq_weight, name))},
    TQ_WEIGHT_FIELDS(TQ_DESCRIBE_FIELD)
#undef TQ_DESCRIBE_FIELD
};
constexpr int kFieldCount = sizeof(kFields) / sizeof(kFields[0]);

// What every format needs: n, k, row_length and a known format tag.
bool valid_weight(const tq_weight* w) {
  return w && w->n >= 1 && w->k >= 1 && w->row_length >= w->k &&
         (w->format == TQ_FORMAT_LUT4 || w->format == TQ_FORMAT_INT8 || w->format == TQ_FORMAT_INT8_DYNAMIC ||
          w->format == TQ_FORMAT_LUT4_INT8ACT || w->format == TQ_FORMAT_INT8_STATIC);
}

}  // namespace

// Field i of tq_weight: its name, kind (tq_field_kind) and byte offset; returns 1, or 0 (nothing
// written) when i is past the last field.
TQ_API int tq_weight_abi(int i, const char** name, int* kind, int64_t* offset) {
  if (i < 0 || i >= kFieldCount) return 0;
  *name = kFields[i].name;
  *kind = kFields[i].kind;
  *offset = kFields[i].offset;
  return 1;
}

TQ_API int64_t tq_weight_size() { return sizeof(tq_weight); }

// out[M, n] = x[M, k] @ W.T (+ bias): x and out contiguous of `x_dtype` (DType), bias fp32 [n] or
// null (must be null for TQ_FORMAT_INT8_DYNAMIC and TQ_FORMAT_INT8_STATIC); products and sums in
// fp32 (int32 for the int8-activation formats), one rounding to x_dtype at the end. Returns a Status: BAD_ARGUMENT for any inconsistent argument or field.
TQ_API int tq_linear(const tq_weight* w, const void* x, int x_dtype, int64_t M, const float* bias, void* out, int threads) {
  using namespace tq;
  if (!valid_weight(w) || M < 1 || !valid_dtype(x_dtype) || !x || !out) return BAD_ARGUMENT;
  if (w->format == TQ_FORMAT_LUT4 || w->format == TQ_FORMAT_LUT4_INT8ACT) return lut4_linear(*w, x, x_dtype, M, bias, out, threads);
  return int8_linear(*w, x, x_dtype, M, bias, out, threads);
}

// 1 when weight-only calls of `format` (tq_weight_format) with many rows take a native fp32 GEMM
// form on the active ISA (allowed: tq_set_lut4_paths): TQ_FORMAT_LUT4 from kLut4GemmMinM rows,
// TQ_FORMAT_INT8 from the ISA's weight_gemm_min_m (below, the native row tiles); 0 otherwise.
TQ_API int tq_gemm_active(int format) {
  using namespace tq;
  if (format == TQ_FORMAT_LUT4) return lut4_gemm_active() ? 1 : 0;
  if (format == TQ_FORMAT_INT8) return int8_weight_gemm_active() ? 1 : 0;
  return 0;
}

// The most activation rows of `x_dtype` for which tq_linear runs a path of its own above the
// decode-sized ones on the active kernels, so that callers pass it those rows instead of
// dequantized tiles: the largest of the bf16 dot-product GEMM's (bf16_dp_gemm.h: every row count, or
// kBf16DpAmxCpuMaxM on AMX CPUs), kBf16AmxMaxM where the bf16 AMX GEMM is on (bf16_amx.h: bf16
// activations, lut4 and int8 weight-only weights) and the AVX512_BF16 dot paths' (lut4_linear.h:
// kLut4DotMaxM for int4 with bf16 scales in blocks of 32, kLut4ScaledDotMaxM for int4 with fp32
// scales and NF4 / FP4; int8_linear.h: kInt8DotMaxM); 0 where it has none.
TQ_API int tq_dot_max_m(const tq_weight* w, int x_dtype) {
  using namespace tq;
  if (!valid_weight(w) || x_dtype != DT_BF16) return 0;
  if (w->format == TQ_FORMAT_INT8) {
    int64_t most = bf16_dp_max_m();
    if (bf16_amx_active() && kBf16AmxMaxM > most) most = kBf16AmxMaxM;
    if (int8_dot_rows(kInt8DotMaxM, DT_BF16) && kInt8DotMaxM > most) most = kInt8DotMaxM;
    return static_cast<int>(most);
  }
  if (w->format != TQ_FORMAT_LUT4) return 0;
  return lut4_dot_max_m(*w);
}

// Weight rows [n0, n1), dequantized into dst ([n1 - n0, row_length], contiguous) as fp32
// (dst_bf16 = 0) or bf16 (1, rounded to nearest even): exactly the reference's values.
TQ_API int tq_dequantize_rows(const tq_weight* w, int64_t n0, int64_t n1, void* dst, int dst_bf16, int threads) {
  using namespace tq;
  if (!valid_weight(w) || n0 < 0 || n1 > w->n || n0 >= n1 || !dst) return BAD_ARGUMENT;
  if (w->format == TQ_FORMAT_LUT4 || w->format == TQ_FORMAT_LUT4_INT8ACT) return lut4_dequantize(*w, n0, n1, dst, dst_bf16 != 0, threads);
  return int8_dequantize(*w, n0, n1, dst, dst_bf16 != 0, threads);
}
