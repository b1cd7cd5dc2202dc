// CPU reference of the tile ops: the readable definition of correct for the CUDA kernels. Every
// quantizing op is quantize_by_tiles over some element value (x's own, its transpose's, or the
// accumulated sum) and a scale rule (a ScalingRecipe's float32 scales, or MXFP8's E8M0 codes).
#include <algorithm>
#include <cmath>

#include "common/dispatch.h"
#include "tiles/tiles_kernels.h"

namespace fp8amp {
namespace cpu {

namespace {

// Calls f(r, c) for every element of tile (tr, tc), row by row.
template <class F>
void for_tile(const TileShape& t, int64_t tr, int64_t tc, F&& f) {
  const int64_t r_end = std::min(t.rows, (tr + 1) * t.tile_rows);
  const int64_t c_end = std::min(t.cols, (tc + 1) * t.tile_cols);
  for (int64_t r = tr * t.tile_rows; r < r_end; ++r) {
    for (int64_t c = tc * t.tile_cols; c < c_end; ++c) f(r, c);
  }
}

// y [t.rows, t.cols] (row-major) = the quantized value(r, c), each tile with the scale `rule`
// gives its own amax; scales [t.grid_rows(), t.grid_cols()] what the rule stores.
template <class Out, class Value, class Rule>
void quantize_by_tiles(const Value& value, Out* y, typename Rule::Stored* scales, const TileShape& t,
                       const Rule& rule) {
  for (int64_t tr = 0; tr < t.grid_rows(); ++tr) {
    for (int64_t tc = 0; tc < t.grid_cols(); ++tc) {
      uint32_t key = 0;
      for_tile(t, tr, tc, [&](int64_t r, int64_t c) { key = std::max(key, numerics::amax_key(value(r, c))); });
      const auto block = rule(numerics::amax_from_key(key), numerics::format_max<Out>());
      scales[tr * t.grid_cols() + tc] = block.stored;
      for_tile(t, tr, tc, [&](int64_t r, int64_t c) {
        y[r * t.cols + c] = numerics::quantize_to<Out>(rn::mul(value(r, c), block.scale));
      });
    }
  }
}

// x and, unless p.out_t is null, its transpose, each by its own tiles and the rule.
template <class Rule>
void cast_transpose_by_tiles(DType in_dtype, DType out_dtype, const CastTransposeOf<typename Rule::Stored>& p,
                             const Rule& rule) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using Out = decltype(o);
      const auto* xi = static_cast<const decltype(in)*>(p.x);
      const auto value = [&](int64_t r, int64_t c) { return numerics::to_float(xi[r * p.t.cols + c]); };
      quantize_by_tiles(value, static_cast<Out*>(p.out), p.scale_inv, p.t, rule);
      if (p.out_t == nullptr) return;
      // Element (r, c) of the transpose is x[c, r].
      const auto value_t = [&](int64_t r, int64_t c) { return numerics::to_float(xi[c * p.t.cols + r]); };
      quantize_by_tiles(value_t, static_cast<Out*>(p.out_t), p.scale_inv_t, p.t_t, rule);
    });
  });
}

// out = decode(x) * the scale_inv of its tile's stored scale, rounded once to out's dtype.
template <class Rule>
void dequantize_by_tiles(DType in_dtype, DType out_dtype, const void* x, const typename Rule::Stored* scales,
                         void* out, const TileShape& t) {
  visit(Fp8Types{}, in_dtype, [&](auto in) {
    visit(HighPrecisionTypes{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const In* xi = static_cast<const In*>(x);
      Out* y = static_cast<Out*>(out);
      for (int64_t r = 0; r < t.rows; ++r) {
        const auto* row_scales = scales + (r / t.tile_rows) * t.grid_cols();
        for (int64_t c = 0; c < t.cols; ++c) {
          const float v = rn::mul(numerics::to_float(xi[r * t.cols + c]), Rule::scale_inv(row_scales[c / t.tile_cols]));
          y[r * t.cols + c] = numerics::round_to<Out>(v);
        }
      }
    });
  });
}

}  // namespace

void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe) {
  cast_transpose_by_tiles(in_dtype, out_dtype, CastTransposeTiles{x, out, scale_inv, nullptr, nullptr, t, t},
                          RecipeScaleRule{recipe});
}

void cast_transpose_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe) {
  cast_transpose_by_tiles(in_dtype, out_dtype, p, RecipeScaleRule{recipe});
}

void quantize_mx(DType in_dtype, DType out_dtype, const CastTransposeMx& p) {
  cast_transpose_by_tiles(in_dtype, out_dtype, p, E8M0ScaleRule{});
}

void scaled_accumulate_tiles(DType acc_dtype, DType update_dtype, const AccumulateTiles& p,
                             const ScalingRecipe& recipe) {
  visit(Fp8Types{}, acc_dtype, [&](auto a) {
    visit(HighPrecisionTypes{}, update_dtype, [&](auto u) {
      using Acc = decltype(a);
      const Acc* acc = static_cast<const Acc*>(p.acc);
      const auto* update = static_cast<const decltype(u)*>(p.update);
      const TileShape& t = p.t;
      const auto value = [&](int64_t r, int64_t c) {
        const float si = p.acc_scale_inv[(r / t.tile_rows) * t.grid_cols() + c / t.tile_cols];
        return accumulated(acc[r * t.cols + c], si, update[r * t.cols + c]);
      };
      quantize_by_tiles(value, static_cast<Acc*>(p.out), p.scale_inv, t, RecipeScaleRule{recipe});
    });
  });
}

void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t) {
  dequantize_by_tiles<RecipeScaleRule>(in_dtype, out_dtype, x, scale_inv, out, t);
}

void dequantize_mx(DType in_dtype, DType out_dtype, const void* x, const uint8_t* scales, void* out,
                   const TileShape& t) {
  dequantize_by_tiles<E8M0ScaleRule>(in_dtype, out_dtype, x, scales, out, t);
}

void multi_norm_tiles(DType dtype, const std::vector<NormTensor>& tensors, float* out) {
  visit(ScaledFormatTypes{}, dtype, [&](auto x_type) {
    using T = decltype(x_type);
    constexpr int64_t kPack = 16 / sizeof(T);  // the CUDA kernel's 16-byte packs of a row
    for (size_t i = 0; i < tensors.size(); ++i) {
      const NormTensor& n = tensors[i];
      const TileShape& t = n.t;
      const T* x = static_cast<const T*>(n.x);
      double total = 0.0;
      for (int64_t r = 0; r < t.rows; ++r) {
        const float* scale_row = n.scale_inv + (r / t.tile_rows) * t.grid_cols();
        for (int64_t c = 0; c < t.cols; c += kPack) {
          const int len = static_cast<int>(std::min(kPack, t.cols - c));
          float v[kPack] = {};
          for (int e = 0; e < len; ++e) v[e] = numerics::to_float(x[r * t.cols + c + e]);
          total += pack_norm_squared(v, len, c, c / t.tile_cols, t.tile_cols, scale_row);
        }
      }
      out[i] = static_cast<float>(std::sqrt(total));
    }
  });
}

}  // namespace cpu
}  // namespace fp8amp
