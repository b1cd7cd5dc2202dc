// CPU reference of the tile ops: the readable definition of correct for tiles_cuda.cu.
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

}  // namespace

void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const In* xi = static_cast<const In*>(x);
      Out* y = static_cast<Out*>(out);
      for (int64_t tr = 0; tr < t.grid_rows(); ++tr) {
        for (int64_t tc = 0; tc < t.grid_cols(); ++tc) {
          uint32_t key = 0;
          for_tile(t, tr, tc, [&](int64_t r, int64_t c) {
            key = std::max(key, numerics::amax_key(numerics::to_float(xi[r * t.cols + c])));
          });
          const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), numerics::format_max<Out>(), recipe);
          scale_inv[tr * t.grid_cols() + tc] = pair.scale_inv;
          for_tile(t, tr, tc, [&](int64_t r, int64_t c) {
            y[r * t.cols + c] = numerics::quantize_to<Out>(rn::mul(numerics::to_float(xi[r * t.cols + c]), pair.scale));
          });
        }
      }
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
