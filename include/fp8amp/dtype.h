// Element types the core understands, and the one table that describes them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fp8amp/error.h"

namespace fp8amp {

enum class DType : int8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // torch.float8_e4m3fn: no infinities, NaN = 0x7F / 0xFF
  kFloat8E5M2 = 4,  // torch.float8_e5m2: IEEE-like, has infinities
  kInt32 = 5,
  kUInt8 = 6,  // torch.uint8: MXFP8's E8M0 block scales (docs/tiles.md#mxfp8)
};

struct DTypeInfo {
  DType dtype;
  const char* name;   // as torch spells it
  size_t size;        // bytes per element
  float max_finite;   // largest finite magnitude; 0 for integer types
  int exponent_bits;  // of a floating type; 0 for integer types
  int mantissa_bits;  // stored (without the implicit leading 1); 0 for integer types
  bool has_inf;       // whether the all-ones exponent encodes infinities (E4M3 uses it for normals)
};

// The one table, indexed by the DType value: every property of a dtype is read from here. It is
// constexpr so that numerics.h's format constants, which device code reads, derive from it.
inline constexpr DTypeInfo kDTypeTable[] = {
    {DType::kFloat32, "float32", 4, 3.40282347e38f, 8, 23, true},
    {DType::kFloat16, "float16", 2, 65504.0f, 5, 10, true},
    {DType::kBFloat16, "bfloat16", 2, 3.38953139e38f, 8, 7, true},
    {DType::kFloat8E4M3, "float8_e4m3fn", 1, 448.0f, 4, 3, false},
    {DType::kFloat8E5M2, "float8_e5m2", 1, 57344.0f, 5, 2, true},
    {DType::kInt32, "int32", 4, 0.0f, 0, 0, false},
    {DType::kUInt8, "uint8", 1, 0.0f, 0, 0, false},
};
inline constexpr size_t kNumDTypes = sizeof(kDTypeTable) / sizeof(kDTypeTable[0]);

namespace detail {
constexpr float times_pow2(float v, int e) {
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v /= 2.0f;
  return v;
}

// The largest finite magnitude a floating type's widths give: all-ones mantissa one binade below
// the all-ones exponent, or, without infinities (E4M3), in that binade with the mantissa below
// all-ones (the NaN).
constexpr float largest_finite(const DTypeInfo& t) {
  const int m = t.has_inf ? t.mantissa_bits : t.mantissa_bits - 1;
  const int emax = (1 << (t.exponent_bits - 1)) - (t.has_inf ? 1 : 0);
  return times_pow2(2.0f - times_pow2(1.0f, -m), emax);
}

// Each entry sits at its dtype's index, and a floating type's size and maximum agree with its
// widths (sign + exponent + mantissa bits).
constexpr bool table_is_consistent() {
  for (size_t i = 0; i < kNumDTypes; ++i) {
    const DTypeInfo& t = kDTypeTable[i];
    if (static_cast<size_t>(t.dtype) != i) return false;
    if (t.exponent_bits == 0) continue;
    if (t.size * 8 != static_cast<size_t>(1 + t.exponent_bits + t.mantissa_bits)) return false;
    if (t.max_finite != largest_finite(t)) return false;
  }
  return true;
}
}  // namespace detail
static_assert(detail::table_is_consistent(), "kDTypeTable: entries out of order, or a size or maximum off its widths");

// The entry of a dtype; an unknown code (a corrupt DType) throws a ValueError. Usable in constant
// expressions for the dtypes of the table.
constexpr const DTypeInfo& dtype_info(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  FP8AMP_CHECK(index < kNumDTypes, kValue, "dtype", "unknown dtype code ", static_cast<int>(dtype));
  return kDTypeTable[index];
}
inline const char* dtype_name(DType dtype) { return dtype_info(dtype).name; }
inline size_t dtype_size(DType dtype) { return dtype_info(dtype).size; }

inline bool is_fp8(DType dtype) {
  return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2;
}
// Types a scaled quantize may produce: the two FP8 formats and FP16 (the master-weight format).
inline bool is_scaled_format(DType dtype) { return is_fp8(dtype) || dtype == DType::kFloat16; }
// High-precision floating types an op may read from or write to.
inline bool is_high_precision(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

}  // namespace fp8amp
