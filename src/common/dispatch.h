// The one dtype visitor: maps a runtime DType to its storage type from numerics.h.
#pragma once

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/error.h"

namespace fp8amp {

template <class... Ts>
struct TypeSet {};

using HighPrecisionTypes = TypeSet<float, numerics::bf16, numerics::fp16>;
using ScaledFormatTypes = TypeSet<numerics::fp8_e4m3, numerics::fp8_e5m2, numerics::fp16>;
using Fp8Types = TypeSet<numerics::fp8_e4m3, numerics::fp8_e5m2>;
// multi_amax reads these: the high-precision types and FP8 codes (the amax of the codes' values).
using AmaxTypes = TypeSet<float, numerics::bf16, numerics::fp16, numerics::fp8_e4m3, numerics::fp8_e5m2>;
using BiasTypes = TypeSet<numerics::bf16, numerics::fp16>;  // the bias types of cuBLASLt's FP8 GEMMs

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kFloat32; }
template <> constexpr DType dtype_of<numerics::bf16>() { return DType::kBFloat16; }
template <> constexpr DType dtype_of<numerics::fp16>() { return DType::kFloat16; }
template <> constexpr DType dtype_of<numerics::fp8_e4m3>() { return DType::kFloat8E4M3; }
template <> constexpr DType dtype_of<numerics::fp8_e5m2>() { return DType::kFloat8E5M2; }

// The storage types agree with the dtype table: each has its dtype's size, and a scaled one the
// format (numerics.h) of its dtype.
template <class... Ts>
constexpr bool sizes_match_table(TypeSet<Ts...>) {
  return ((sizeof(Ts) == dtype_info(dtype_of<Ts>()).size) && ...);
}
template <class... Ts>
constexpr bool formats_match_table(TypeSet<Ts...>) {
  return ((numerics::FormatOf<Ts>::type::dtype == dtype_of<Ts>()) && ...);
}
static_assert(sizes_match_table(HighPrecisionTypes{}) && sizes_match_table(ScaledFormatTypes{}),
              "a storage type's size disagrees with the dtype table");
static_assert(formats_match_table(ScaledFormatTypes{}), "a storage type's format is not its dtype's");

// Calls f(T{}) for the T in the set whose dtype is `dtype`. Arguments are validated before any
// visit, so a miss is an internal error, reported rather than ignored.
template <class... Ts, class F>
void visit(TypeSet<Ts...>, DType dtype, F&& f) {
  const bool hit = ((dtype == dtype_of<Ts>() ? (f(Ts{}), true) : false) || ...);
  FP8AMP_CHECK(hit, kRuntime, "dispatch", "internal error: no kernel for dtype ", dtype_name(dtype));
}

}  // namespace fp8amp
