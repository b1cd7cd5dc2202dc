// Element types the core understands, and the one table that describes them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fp8amp {

enum class DType : int8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // torch.float8_e4m3fn: no infinities, NaN = 0x7F / 0xFF
  kFloat8E5M2 = 4,  // torch.float8_e5m2: IEEE-like, has infinities
  kInt32 = 5,
};

struct DTypeInfo {
  DType dtype;
  const char* name;   // as torch spells it
  size_t size;        // bytes per element
  float max_finite;   // largest finite magnitude; 0 for integer types
};

// The one table: every property of a dtype is read from here.
const DTypeInfo& dtype_info(DType dtype);
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
