// CPU reference of the tile ops: the readable definition of correct for the CUDA kernels. Every
// quantizing op is quantize_by_tiles over some element value: x's own, its transpose's, or the
// accumulated sum.
#include <algorithm>

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

// y [t.rows, t.cols] (row-major) = the quantized value(r, c), each tile with the scale of its own
// amax; scale_inv [t.grid_rows(), t.grid_cols()].
template <class Out, class Value>
void quantize_by_tiles(const Value& value, Out* y, float* scale_inv, const TileShape& t, const ScalingRecipe& recipe) {
  for (int64_t tr = 0; tr < t.grid_rows(); ++tr) {
    for (int64_t tc = 0; tc < t.grid_cols(); ++tc) {
      uint32_t key = 0;
      for_tile(t, tr, tc, [&](int64_t r, int64_t c) { key = std::max(key, numerics::amax_key(value(r, c))); });
      const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), numerics::format_max<Out>(), recipe);
      scale_inv[tr * t.grid_cols() + tc] = pair.scale_inv;
      for_tile(t, tr, tc, [&](int64_t r, int64_t c) {
        y[r * t.cols + c] = numerics::quantize_to<Out>(rn::mul(value(r, c), pair.scale));
      });
    }
  }
}

}  // namespace

void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      const auto* xi = static_cast<const decltype(in)*>(x);
      const auto value = [&](int64_t r, int64_t c) { return numerics::to_float(xi[r * t.cols + c]); };
      quantize_by_tiles(value, static_cast<decltype(o)*>(out), scale_inv, t, recipe);
    });
  });
}

void cast_transpose_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe) {
  quantize_tiles(in_dtype, out_dtype, p.x, p.out, p.scale_inv, p.t, recipe);
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      const auto* xi = static_cast<const decltype(in)*>(p.x);
      // Element (r, c) of the transpose is x[c, r].
      const auto value = [&](int64_t r, int64_t c) { return numerics::to_float(xi[c * p.t.cols + r]); };
      quantize_by_tiles(value, static_cast<decltype(o)*>(p.out_t), p.scale_inv_t, p.t_t, recipe);
    });
  });
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
      quantize_by_tiles(value, static_cast<Acc*>(p.out), p.scale_inv, t, recipe);
    });
  });
}

void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t) {
  visit(Fp8Types{}, in_dtype, [&](auto in) {
    visit(HighPrecisionTypes{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const In* xi = static_cast<const In*>(x);
      Out* y = static_cast<Out*>(out);
      for (int64_t r = 0; r < t.rows; ++r) {
        const float* row_scales = scale_inv + (r / t.tile_rows) * t.grid_cols();
        for (int64_t c = 0; c < t.cols; ++c) {
          const float v = rn::mul(numerics::to_float(xi[r * t.cols + c]), row_scales[c / t.tile_cols]);
          y[r * t.cols + c] = numerics::round_to<Out>(v);
        }
      }
    });
  });
}

}  // namespace cpu
}  // namespace fp8amp
