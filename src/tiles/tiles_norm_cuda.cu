// multi_norm_tiles on the GPU (tiles.h), the twin of tiles_cpu.cpp's: one block per work item
// (norm_items: about 64K elements of a tensor) sums the squares of its elements, pack by pack as
// the CPU does, into one float64 partial in the workspace; then one block per tensor sums its
// items' partials. Both sums run in a fixed order, so a norm is the same from run to run; it
// differs from the CPU's (one sequential sum of the same pack shares) by float64 rounding only,
// far below float32's. The codes are read once, kPacksInFlight 16-byte loads a thread at a time:
// 1 byte an element for FP8 gradients.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/fast_divide.h"
#include "common/word_pack.cuh"
#include "tiles/tiles_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kPacksInFlight = 4;    // a thread loads this many 16-byte packs before it sums any
constexpr int kMaxNormTensors = 24;  // a batch's parameters stay within 4 KB

// A tensor of a launch with its divisors, made on the host: a block's pack index by its packs a
// row (a whole column chunk's, or the last chunk's), rows and columns by the tile sizes (at most
// the matrix's, norm_tensors clamps them, so each quotient fits 32 bits).
struct NormLaunchTensor {
  NormTensor n;
  NormItems items;
  FastDivisor chunk_packs;
  FastDivisor last_chunk_packs;
  FastDivisor tile_rows;
  FastDivisor tile_cols;
};

// The tensors of one launch: tensor t owns blocks [block_begin[t], block_begin[t + 1]) of the item
// kernel (owning_tensor) and the partials at the same offsets from the batch's first partial;
// its norm goes to out[first + t].
struct NormBatch {
  NormLaunchTensor tensors[kMaxNormTensors];
  int32_t block_begin[kMaxNormTensors + 1];
  int count;
  int first;
};

template <class T>
constexpr int kPack = static_cast<int>(16 / sizeof(T));  // a pack: 16 bytes of a row, from a multiple of kPack columns

template <class T>
NormLaunchTensor launch_tensor(const NormTensor& n) {
  const NormItems items = norm_items(n.t.rows, n.t.cols);
  const int64_t last_chunk = n.t.cols - (items.col_items - 1) * items.col_chunk;
  return {n,
          items,
          FastDivisor::of(static_cast<uint32_t>(ceil_div(items.col_chunk, kPack<T>))),
          FastDivisor::of(static_cast<uint32_t>(ceil_div(last_chunk > 0 ? last_chunk : 1, kPack<T>))),
          FastDivisor::of(static_cast<uint32_t>(n.t.tile_rows)),
          FastDivisor::of(static_cast<uint32_t>(n.t.tile_cols))};
}

// The sum of the threads' values, in thread 0, in a fixed order. Called by every thread.
__device__ double block_sum(double v) {
  __shared__ double warp_sums[kNormThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kNormThreads / 32; ++w) v += warp_sums[w];
  }
  return v;
}

template <class T>
__global__ void __launch_bounds__(kNormThreads) norm_items_kernel(const __grid_constant__ NormBatch batch,
                                                                  double* partials) {
  constexpr int P = kPack<T>;
  const int t = owning_tensor(batch);
  const NormLaunchTensor& lt = batch.tensors[t];
  const TileShape& s = lt.n.t;
  const int64_t item = static_cast<int64_t>(blockIdx.x) - batch.block_begin[t];
  const int64_t col_item = item % lt.items.col_items;
  const int64_t r0 = (item / lt.items.col_items) * lt.items.row_chunk;
  const int64_t c0 = col_item * lt.items.col_chunk;
  const int64_t c_end = min(s.cols, c0 + lt.items.col_chunk);
  const FastDivisor& by_packs = col_item + 1 == lt.items.col_items ? lt.last_chunk_packs : lt.chunk_packs;
  const uint32_t packs = static_cast<uint32_t>(min(lt.items.row_chunk, s.rows - r0)) * by_packs.divisor;
  const T* x = static_cast<const T*>(lt.n.x);
  const bool vector_ok = s.cols % P == 0 && is_aligned(x, 16);
  const int64_t grid_cols = s.grid_cols();

  double sum = 0.0;
  for (uint32_t k0 = threadIdx.x; k0 < packs; k0 += kPacksInFlight * kNormThreads) {
    uint32_t w[kPacksInFlight][kWords<T, P>];
    int64_t r[kPacksInFlight], c[kPacksInFlight];
    int valid[kPacksInFlight];
#pragma unroll
    for (int g = 0; g < kPacksInFlight; ++g) {
      const uint32_t k = k0 + g * kNormThreads;
      const uint32_t row_in_item = by_packs.divide(k);
      r[g] = r0 + row_in_item;
      c[g] = c0 + static_cast<int64_t>(k - row_in_item * by_packs.divisor) * P;
      valid[g] = k < packs ? static_cast<int>(min(int64_t{P}, c_end - c[g])) : 0;
      load_pack<P>(x + r[g] * s.cols + c[g], valid[g], vector_ok, w[g]);
    }
#pragma unroll
    for (int g = 0; g < kPacksInFlight; ++g) {
      if (valid[g] == 0) continue;
      float v[P];
      decode_pack<T, P>(w[g], v);
      const float* scale_row = lt.n.scale_inv + lt.tile_rows.divide(static_cast<uint32_t>(r[g])) * grid_cols;
      const int64_t tile = lt.tile_cols.divide(static_cast<uint32_t>(c[g]));
      sum += pack_norm_squared(v, valid[g], c[g], tile, s.tile_cols, scale_row);
    }
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kNormThreads) norm_finish_kernel(const __grid_constant__ NormBatch batch,
                                                                   const double* partials, float* out) {
  const int t = static_cast<int>(blockIdx.x);
  double sum = 0.0;
  for (int32_t j = batch.block_begin[t] + static_cast<int32_t>(threadIdx.x); j < batch.block_begin[t + 1];
       j += kNormThreads) {
    sum += partials[j];
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) out[batch.first + t] = static_cast<float>(sqrt(sum));
}

}  // namespace

void multi_norm_tiles(DType dtype, const std::vector<NormTensor>& tensors, float* out, double* workspace,
                      Stream stream) {
  const char* op = "multi_norm_tiles";
  const cudaStream_t s = cuda_stream(stream);
  visit(ScaledFormatTypes{}, dtype, [&](auto x_type) {
    using T = decltype(x_type);
    NormBatch batch{};
    int64_t blocks = 0;
    const auto launch = [&] {
      batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
      if (blocks > 0) {
        norm_items_kernel<T><<<grid_size(blocks, op), kNormThreads, 0, s>>>(batch, workspace);
        FP8AMP_CUDA_CHECK_LAUNCH();
      }
      norm_finish_kernel<<<batch.count, kNormThreads, 0, s>>>(batch, workspace, out);
      FP8AMP_CUDA_CHECK_LAUNCH();
      workspace += blocks;
      batch.first += batch.count;
      batch.count = 0;
      blocks = 0;
    };
    for (const NormTensor& tensor : tensors) {
      const int64_t need = norm_items(tensor.t.rows, tensor.t.cols).count;
      if (batch.count == kMaxNormTensors || (batch.count > 0 && blocks + need > INT_MAX)) launch();
      batch.tensors[batch.count] = launch_tensor<T>(tensor);
      batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
      ++batch.count;
      blocks += need;
    }
    if (batch.count > 0) launch();
  });
}

}  // namespace cuda
}  // namespace fp8amp
