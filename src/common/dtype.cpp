#include "fp8amp/dtype.h"

#include "fp8amp/error.h"

namespace fp8amp {

namespace {
// Indexed by the DType value.
constexpr DTypeInfo kTable[] = {
    {DType::kFloat32, "float32", 4, 3.40282347e38f},
    {DType::kFloat16, "float16", 2, 65504.0f},
    {DType::kBFloat16, "bfloat16", 2, 3.38953139e38f},
    {DType::kFloat8E4M3, "float8_e4m3fn", 1, 448.0f},
    {DType::kFloat8E5M2, "float8_e5m2", 1, 57344.0f},
    {DType::kInt32, "int32", 4, 0.0f},
};
}  // namespace

const DTypeInfo& dtype_info(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  FP8AMP_CHECK(index < sizeof(kTable) / sizeof(kTable[0]), kValue, "dtype", "unknown dtype code ",
               static_cast<int>(dtype));
  return kTable[index];
}

}  // namespace fp8amp
