// TensorView's sizes and strides (Dims: inline up to kInline dims, on the heap beyond) and the
// names of list elements (ListItem), which every op call makes for each of its tensors.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "common/op_args.h"
#include "fp8amp/tensor.h"
#include "host_view.h"

namespace fp8amp {
namespace {

TEST(Dims, HoldInlineAndSpilledSizesAlike) {
  for (size_t n : {size_t{0}, size_t{1}, Dims::kInline, Dims::kInline + 1, Dims::kInline + 5}) {
    std::vector<int64_t> values(n);
    std::iota(values.begin(), values.end(), 2);
    Dims dims = values;
    ASSERT_EQ(dims.size(), n);
    EXPECT_EQ(dims.empty(), n == 0);
    EXPECT_EQ(std::vector<int64_t>(dims.begin(), dims.end()), values);
    if (n != 0) EXPECT_EQ(dims.back(), values.back());

    Dims copy = dims;  // a copy owns its values: writing it leaves the original
    if (n != 0) {
      copy[n - 1] = -1;
      EXPECT_EQ(dims[n - 1], values.back());
      EXPECT_NE(copy, dims);
    }
  }
}

TEST(Dims, CompareByValuesWhereverTheyLive) {
  const Dims seven{1, 2, 3, 4, 5, 6, 7};
  Dims reassigned{9};
  EXPECT_NE(reassigned, seven);
  reassigned = {1, 2, 3, 4, 5, 6, 7};  // from inline to spilled
  EXPECT_EQ(reassigned, seven);
  reassigned = {1, 2};  // and back
  EXPECT_EQ(reassigned, (Dims{1, 2}));
  EXPECT_NE(reassigned, seven);
  EXPECT_NE((Dims{1, 2}), (Dims{1, 2, 1}));
}

TEST(Dims, ViewsOfManyDimsKeepTheirGeometry) {
  std::vector<float> data(2 * 3 * 1 * 2 * 1 * 2 * 2 * 2);
  const TensorView contiguous = view(data, DType::kFloat32, {2, 3, 1, 2, 1, 2, 2, 2});
  EXPECT_EQ(contiguous.dim(), 8);
  EXPECT_EQ(contiguous.numel(), static_cast<int64_t>(data.size()));
  EXPECT_TRUE(contiguous.is_contiguous());
  EXPECT_EQ(contiguous.describe(), "float32[2, 3, 1, 2, 1, 2, 2, 2] on cpu");

  // The last dim's elements every other one: not contiguous, runs of one element.
  std::vector<float> wide(data.size() * 2);
  const TensorView strided =
      view(wide, DType::kFloat32, {2, 3, 1, 2, 1, 2, 2, 2}, {96, 32, 32, 16, 16, 8, 4, 2});
  EXPECT_FALSE(strided.is_contiguous());
  const auto runs = row_runs(strided);
  ASSERT_TRUE(runs.has_value());
  EXPECT_EQ(runs->cols, 1);
  EXPECT_EQ(runs->rows, strided.numel());
  EXPECT_EQ(runs->row_stride, 2);
}

TEST(ListItem, NamesAnElementOfAList) {
  EXPECT_STREQ(ListItem("xs", 0).c_str(), "xs[0]");
  EXPECT_STREQ(ListItem("exp_avg_sq_scale_invs", 123).c_str(), "exp_avg_sq_scale_invs[123]");
  EXPECT_STREQ(ListItem("grads", 18446744073709551615ull).c_str(), "grads[18446744073709551615]");
  const std::string long_list(60, 'a');  // longer than any list name: cut, never overrun
  EXPECT_EQ(std::string(ListItem(long_list.c_str(), 7).c_str()), std::string(40, 'a') + "[7]");
}

}  // namespace
}  // namespace fp8amp
