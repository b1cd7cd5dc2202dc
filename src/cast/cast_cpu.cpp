// CPU reference of the cast op family: the readable definition of correct for cast_cuda.cu.
#include <algorithm>
#include <vector>

#include "cast/cast_kernels.h"
#include "common/dispatch.h"

namespace fp8amp {
namespace cpu {

namespace {

using numerics::amax_from_key;
using numerics::amax_key;

template <class T>
uint32_t amax_key_of(const T* x, int64_t numel) {
  uint32_t key = 0;
  for (int64_t i = 0; i < numel; ++i) key = std::max(key, amax_key(numerics::to_float(x[i])));
  return key;
}

void fold_amax(float* slot, uint32_t key) {
  *slot = amax_from_key(std::max(amax_key(*slot), key));
}

// Folds the tensor's amax when it is warming up, then returns the scale it is quantized with
// and writes its scale_inv: the order the CUDA pre-pass + quantize kernels follow.
template <class In, class Out>
float prepare_scale(const In* x, int64_t numel, const ScalingPtrs& s, int64_t i) {
  float* amax_slot = s.amax + i * s.amax_stride;
  if (current_scaling(s, i)) fold_amax(amax_slot, amax_key_of(x, numel));
  const numerics::ScalePair pair = select_scale(s, i, *amax_slot, numerics::format_max<Out>());
  s.scale_inv[i] = scale_inv_to_write(s, pair, *amax_slot);
  return pair.scale;
}

// A NaN as the GPU's float adds return it (the host's keep an operand's payload).
float canonical_nan(float v) { return numerics::is_nan(v) ? numerics::bits_float(numerics::kCanonicalNanBits) : v; }

// The column sums of cast_kernels.h, in its order: band sums into workspace [bands, cols], then
// their sum. Walks x row by row, keeping one running sum per column at each level.
template <class In>
void column_sums(const In* x, int64_t rows, int64_t cols, float* dbias, float* workspace) {
  const int64_t groups = kSumTileRows / kSumGroupRows;
  std::vector<float> group(static_cast<size_t>(groups * cols));
  for (int64_t b = 0; b < column_sum_bands(rows); ++b) {
    std::fill(group.begin(), group.end(), 0.0f);
    for (int64_t k = 0; k < kSumTiles; ++k) {
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < kSumGroupRows; ++i) {
          const int64_t r = b * kBandRows + k * kSumTileRows + g * kSumGroupRows + i;
          if (r >= rows) continue;
          for (int64_t c = 0; c < cols; ++c) {
            group[g * cols + c] = rn::add(group[g * cols + c], numerics::to_float(x[r * cols + c]));
          }
        }
      }
    }
    float* band = workspace + b * cols;
    std::fill(band, band + cols, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = 0; c < cols; ++c) band[c] = rn::add(band[c], group[g * cols + c]);
    }
    std::transform(band, band + cols, band, canonical_nan);
  }
  std::fill(dbias, dbias + cols, 0.0f);
  for (int64_t b = 0; b < column_sum_bands(rows); ++b) {
    for (int64_t c = 0; c < cols; ++c) dbias[c] = rn::add(dbias[c], workspace[b * cols + c]);
  }
  std::transform(dbias, dbias + cols, dbias, canonical_nan);
}

}  // namespace

void amax(DType dtype, const void* x, const RowRuns& runs, float* amax, const int32_t* warmup_counter,
          int warmup_steps) {
  if (warmup_counter != nullptr && !warming_up(warmup_counter, 0, warmup_steps)) return;
  visit(HighPrecisionTypes{}, dtype, [&](auto in) {
    using In = decltype(in);
    uint32_t key = 0;
    for (int64_t r = 0; r < runs.rows; ++r) {
      key = std::max(key, amax_key_of(static_cast<const In*>(x) + r * runs.row_stride, runs.cols));
    }
    fold_amax(amax, key);
  });
}

void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride) {
  visit(AmaxTypes{}, dtype, [&](auto in) {
    using In = decltype(in);
    for (size_t i = 0; i < tensors.size(); ++i) {
      fold_amax(amax + i * amax_stride, amax_key_of(static_cast<const In*>(tensors[i].in), tensors[i].numel));
    }
  });
}

void quantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const ScalingPtrs& s) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(ScaledFormatTypes{}, out_dtype, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const In* x = static_cast<const In*>(tensors[i].in);
        Out* y = static_cast<Out*>(tensors[i].out);
        const int64_t numel = tensors[i].numel;
        const float scale = prepare_scale<In, Out>(x, numel, s, i);
        for (int64_t j = 0; j < numel; ++j) y[j] = numerics::quantize_to<Out>(numerics::to_float(x[j]) * scale);
        fold_amax(s.amax + i * s.amax_stride, amax_key_of(x, numel));
      }
    });
  });
}

void quantize_current(DType in_dtype, DType out_dtype, const TensorSlice& tensor, const ScalingPtrs& s) {
  *s.amax = 0.0f;
  quantize(in_dtype, out_dtype, {tensor}, s);
}

void dequantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const float* scale_inv) {
  visit(ScaledFormatTypes{}, in_dtype, [&](auto in) {
    visit(HighPrecisionTypes{}, out_dtype, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const In* x = static_cast<const In*>(tensors[i].in);
        Out* y = static_cast<Out*>(tensors[i].out);
        for (int64_t j = 0; j < tensors[i].numel; ++j) {
          y[j] = numerics::round_to<Out>(numerics::to_float(x[j]) * scale_inv[i]);
        }
      }
    });
  });
}

void cast_transpose(DType in_dtype, DType out_dtype, const void* x, void* out, void* out_t, int64_t rows,
                    int64_t cols, const ScalingPtrs& s, float* dbias, float* workspace) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(ScaledFormatTypes{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const In* xi = static_cast<const In*>(x);
      Out* y = static_cast<Out*>(out);
      Out* yt = static_cast<Out*>(out_t);
      const float scale = prepare_scale<In, Out>(xi, rows * cols, s, 0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const Out q = numerics::quantize_to<Out>(numerics::to_float(xi[r * cols + c]) * scale);
          y[r * cols + c] = q;
          yt[c * rows + r] = q;
        }
      }
      fold_amax(s.amax, amax_key_of(xi, rows * cols));
      if (dbias != nullptr) column_sums(xi, rows, cols, dbias, workspace);
    });
  });
}

void cast_transpose_rescaled(DType out_dtype, const numerics::fp16* x, void* out_t, int64_t rows, int64_t cols,
                             const RescalePtrs& rescale) {
  const float scale = rescaled_scale(rescale);
  visit(ScaledFormatTypes{}, out_dtype, [&](auto o) {
    using Out = decltype(o);
    Out* yt = static_cast<Out*>(out_t);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        yt[c * rows + r] = numerics::quantize_to<Out>(numerics::to_float(x[r * cols + c]) * scale);
      }
    }
  });
}

}  // namespace cpu
}  // namespace fp8amp
