// The dtype table (fp8amp/dtype.h) against the formats' known values, and what derives from it:
// numerics.h's format constants and the public format_max.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>

#include "common/numerics.h"
#include "expect_error.h"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"

namespace fp8amp {
namespace {

TEST(DTypeTable, MatchesTheKnownFormats) {
  struct Known {
    DType dtype;
    const char* name;
    size_t size;
    float max_finite;
    int exponent_bits, mantissa_bits;
    bool has_inf;
  };
  const Known known[] = {
      {DType::kFloat32, "float32", 4, std::numeric_limits<float>::max(), 8, 23, true},
      {DType::kFloat16, "float16", 2, 65504.0f, 5, 10, true},
      {DType::kBFloat16, "bfloat16", 2, 0x1.FEp127f, 8, 7, true},
      {DType::kFloat8E4M3, "float8_e4m3fn", 1, 448.0f, 4, 3, false},
      {DType::kFloat8E5M2, "float8_e5m2", 1, 57344.0f, 5, 2, true},
      {DType::kInt32, "int32", 4, 0.0f, 0, 0, false},
      {DType::kUInt8, "uint8", 1, 0.0f, 0, 0, false},
  };
  ASSERT_EQ(kNumDTypes, sizeof(known) / sizeof(known[0]));
  for (const Known& k : known) {
    const DTypeInfo& t = dtype_info(k.dtype);
    EXPECT_EQ(t.dtype, k.dtype) << k.name;
    EXPECT_EQ(std::string(t.name), k.name);
    EXPECT_EQ(std::string(dtype_name(k.dtype)), k.name);
    EXPECT_EQ(t.size, k.size) << k.name;
    EXPECT_EQ(dtype_size(k.dtype), k.size) << k.name;
    EXPECT_EQ(t.max_finite, k.max_finite) << k.name;
    EXPECT_EQ(t.exponent_bits, k.exponent_bits) << k.name;
    EXPECT_EQ(t.mantissa_bits, k.mantissa_bits) << k.name;
    EXPECT_EQ(t.has_inf, k.has_inf) << k.name;
  }
}

TEST(DTypeTable, FormatsAndFormatMaxDeriveFromIt) {
  EXPECT_EQ(numerics::E4M3::max, 448.0f);
  EXPECT_EQ(numerics::E5M2::max, 57344.0f);
  EXPECT_EQ(numerics::FP16::max, 65504.0f);
  EXPECT_EQ(numerics::format_max<numerics::fp8_e4m3>(), 448.0f);
  EXPECT_EQ(numerics::format_max<numerics::fp8_e5m2>(), 57344.0f);
  EXPECT_EQ(numerics::format_max<numerics::fp16>(), 65504.0f);
  EXPECT_EQ(format_max(DType::kFloat8E4M3), 448.0f);
  EXPECT_EQ(format_max(DType::kFloat8E5M2), 57344.0f);
  EXPECT_EQ(format_max(DType::kFloat16), 65504.0f);
  // The widths and biases of the codecs.
  EXPECT_EQ(numerics::E4M3::exp_bits, 4);
  EXPECT_EQ(numerics::E4M3::man_bits, 3);
  EXPECT_EQ(numerics::E4M3::bias, 7);
  EXPECT_EQ(numerics::E5M2::exp_bits, 5);
  EXPECT_EQ(numerics::E5M2::man_bits, 2);
  EXPECT_EQ(numerics::E5M2::bias, 15);
  EXPECT_EQ(numerics::FP16::exp_bits, 5);
  EXPECT_EQ(numerics::FP16::man_bits, 10);
  EXPECT_EQ(numerics::FP16::bias, 15);
  // The largest code decodes to the maximum, and the maximum encodes to it.
  EXPECT_EQ(numerics::decode<numerics::E4M3>(numerics::E4M3::max_code), 448.0f);
  EXPECT_EQ(numerics::decode<numerics::E5M2>(numerics::E5M2::max_code), 57344.0f);
  EXPECT_EQ(numerics::decode<numerics::FP16>(numerics::FP16::max_code), 65504.0f);
  EXPECT_EQ(numerics::encode<numerics::E4M3>(448.0f, true), numerics::E4M3::max_code);
  EXPECT_EQ(numerics::encode<numerics::E5M2>(57344.0f, true), numerics::E5M2::max_code);
  EXPECT_EQ(numerics::encode<numerics::FP16>(65504.0f, true), numerics::FP16::max_code);
}

TEST(DTypeTable, RefusesWhatIsNotInIt) {
  expect_value_error([] { dtype_info(static_cast<DType>(7)); }, "unknown dtype code 7");
  expect_value_error([] { dtype_info(static_cast<DType>(-1)); }, "unknown dtype code -1");
  expect_value_error([] { format_max(DType::kBFloat16); }, "format_max");
}

}  // namespace
}  // namespace fp8amp
