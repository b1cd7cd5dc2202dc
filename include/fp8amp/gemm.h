// FP8 GEMM op family (docs/numerics.md#numerics "GEMMs"): cuBLASLt on CUDA, a reference on CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fp8amp/tensor.h"

namespace fp8amp {

// Workspace the CUDA path is meant to get (cuBLASLt's recommendation for Hopper). Less, or
// none, is legal: cuBLASLt then chooses among fewer kernels (no split-K, for one).
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

struct GemmOptions {
  // out += result (beta = 1) instead of out = result.
  bool accumulate = false;
  // cuBLASLt's FP8 fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM): the tensor cores'
  // partial sums are not promoted to full FP32 along K. Faster, less accurate; docs/numerics.md#numerics allows
  // it for the forward GEMM only. The CPU reference ignores it.
  bool fast_accum = false;
  // Device memory cuBLASLt may use for this call. The core never allocates device memory: the
  // caller owns it (the torch binding takes kGemmWorkspaceBytes from the caching allocator on
  // the op's stream), and must not use it concurrently on another stream. CPU ignores it.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The "TN" GEMM that cuBLASLt runs in FP8 (both operands K-major), in torch terms:
//
//   out = (a.float() * a_scale_inv) @ (b.float() * b_scale_inv).T  (+ bias)  (+ out if accumulate)
//
// a:     [M, K] E4M3 or E5M2, row-major (inner stride 1; row stride lda >= K)
// b:     [N, K] E4M3 or E5M2, row-major (row stride ldb >= K); E5M2 x E5M2 is refused
// a_scale_inv, b_scale_inv: float32, one element each (per-tensor scaling), on a's device
// bias:  optional [N], contiguous; bfloat16 for bfloat16 or float32 out, float16 for float16 out
// out:   [M, N] float32, bfloat16 or float16, row-major (row stride ldo >= N); it must not share
//        memory with a, b, the scales or bias (a ValueError names both)
//
// This is y = x·Wᵀ of a Linear with x [M, K] and W [N, K]; its dgrad (dY·W) and wgrad (dYᵀ·X)
// take the pre-transposed operands that the fused cast+transpose produces.
//
// Shape rules of cuBLASLt FP8, enforced on every device so the CPU says what the GPU would:
// K, N, lda, ldb and ldo multiples of 16, and a, b, out and bias 16-byte aligned. M is free.
// M == 0 or N == 0 is a no-op. K == 0 (with M, N > 0) is the empty sum, 0 whatever the scales
// hold: out = bias or 0, plus out if accumulating.
//
// Numerics: the CPU reference takes the exact product sum (double accumulation of the exact
// products of the decoded FP8 values), times a_scale_inv * b_scale_inv, plus bias, and rounds it
// to out's dtype (through float32). When accumulating, that rounded result is added to out and
// rounded again: two roundings, as cuBLASLt's FP8 epilogue does with a 16-bit out (measured;
// with a float32 out the extra rounding is at float32 level). CUDA sums in the tensor cores'
// precision and order (partial sums never promoted to FP32 under fast_accum) and is checked
// against the reference within bounds that follow from that.
void gemm(const TensorView& a, const TensorView& b, const TensorView& a_scale_inv, const TensorView& b_scale_inv,
          const TensorView* bias, const TensorView& out, const GemmOptions& options, Stream stream);

// ---- The GEMM with tile scales (docs/tiles.md, "The GEMM with tile scales") ----
//
// The same TN GEMM, with one scale per tile of each operand instead of one per tensor: a [M, K]
// and b [N, K] as above, a_scale_inv and b_scale_inv float32 in the layout quantize_tiles
// (tiles.h) writes, row-major [ceil(rows / tile_rows), ceil(K / tile_cols)]. Each operand's
// tiling is one of
//   (1, 128)    a scale per row and 128-wide block of K (DeepSeek-V3's activation tiles),
//   (128, 128)  a scale per 128 x 128 block (its weight blocks),
//   (1, c), c >= K, c != 128   rowwise: a scale per row over all of K,
// and the pair one of (1, 128) x (128, 128), (1, 128) x (1, 128), (128, 128) x (1, 128) or rowwise x
// rowwise: the pairs cuBLASLt offers (VEC128_32F, BLK128x128_32F, OUTER_VEC_32F). With K <= 128 a
// rowwise operand beside a tiled one counts as (1, 128) (the same scales). Other tilings and
// pairs: ValueError naming them and the accepted ones, on every device.
//
//   out[m, n] = sum over the K-blocks kb of  a_scale_inv[m / a_tile_rows, kb] * b_scale_inv[n / b_tile_rows, kb]
//                                           * sum over k in kb of a[m, k] * b[n, k]     (+ bias[n])
//
// with K-blocks 128 wide (the last one possibly partial) for the tiled pairs and one block of all
// of K for rowwise. K, N, leading dims, alignment, bias and out follow gemm's rules; M is free;
// M == 0 or N == 0 is a no-op and K == 0 gives out = bias or 0. There is no accumulate and no fast
// accumulation (cuBLASLt's tile-scaled kernels promote every block to FP32).
//
// Numerics: the CPU reference takes each block's exact product sum (double, as gemm's), scales it
// by the block's two scale_invs and sums the blocks in order of k, in double; adds bias and rounds
// once to out's dtype (through float32). CUDA sums in the tensor cores' precision with FP32
// accumulation across blocks, checked against the reference within a bound that follows from it.
//
// CUDA: cuBLASLt's scale modes, which it offers for FP8 on Hopper (compute capability 9.x) only;
// other GPUs, problems cuBLASLt has no kernel for, and (1, 128) scales of a with M % 4 != 0 (their
// layout's runs would not be 16-byte aligned) get NotImplementedError naming them. The
// scales are first copied into the layouts cuBLASLt reads (gemm_tiles_scale_bytes of the
// workspace); the rest of the workspace goes to cuBLASLt.
struct GemmTilesOptions {
  // Device memory for the call, the caller's as for gemm: gemm_tiles_scale_bytes(...) bytes for the
  // copies of the scales, the rest (kGemmWorkspaceBytes meant) for cuBLASLt. CPU ignores it.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of the workspace the CUDA path of gemm_tiles uses for its copies of the scales (ValueError
// for tilings it does not accept).
size_t gemm_tiles_scale_bytes(int64_t m, int64_t n, int64_t k, int64_t a_tile_rows, int64_t a_tile_cols,
                              int64_t b_tile_rows, int64_t b_tile_cols);

void gemm_tiles(const TensorView& a, const TensorView& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
                const TensorView& b, const TensorView& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
                const TensorView* bias, const TensorView& out, const GemmTilesOptions& options, Stream stream);

// ---- The MXFP8 GEMM (docs/tiles.md#mxfp8) ----
//
// The same TN GEMM with OCP MX block scales: a [M, K] and b [N, K] (E4M3 x E4M3, E4M3 x E5M2 or
// E5M2 x E4M3 codes, K-major) each with uint8 E8M0 scales [rows, K / 32] as quantize_mx (tiles.h)
// writes them, one per 1 x 32 block along K. K must be a multiple of 32; N, bias and out follow
// gemm's rules; M is free. The CPU reference is gemm_tiles' with 32-wide K-blocks: each block's
// exact product sum times 2^(ea - 127) * 2^(eb - 127), blocks added in double, rounded once (a NaN
// code, 0xFF, makes its block's products NaN).
//
// CUDA: cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 on both operands, which it offers on
// Blackwell (compute capability 10.0 and newer); every other GPU gets NotImplementedError before
// any work is queued. The scales are first copied into the 128 x 4 tiled layout cuBLASLt reads
// (gemm_mx_scale_bytes of the workspace).
size_t gemm_mx_scale_bytes(int64_t m, int64_t n, int64_t k);

void gemm_mx(const TensorView& a, const TensorView& a_scales, const TensorView& b, const TensorView& b_scales,
             const TensorView* bias, const TensorView& out, const GemmTilesOptions& options, Stream stream);

// Autotuning of the CUDA paths' cuBLASLt algorithm (gemm, gemm_tiles and gemm_mx alike;
// process-wide, off by default). Off, a problem
// (device, shape, leading dims, dtypes, bias, flags, alignments, workspace) runs the first
// algorithm of cuBLASLt's heuristic. On, each problem first seen while it is on has its first 24
// calls spread over the heuristic's first 8 algorithms (3 calls each), each call timed with CUDA
// events on its own stream and read back when done (no host synchronization), then keeps the
// fastest (the heuristic's first unless another is 1 % faster) for the rest of the process.
// Every algorithm computes the same GEMM, but their sums differ in order, so results can differ
// in the last bits between algorithms and, as timing decides, between processes: like
// torch.backends.cudnn.benchmark. Calls during CUDA graph capture are never timed.
void set_gemm_autotune(bool enabled);
bool gemm_autotune();

struct GemmAutotuneStats {
  int64_t tuning = 0;   // problems whose candidates are still being timed
  int64_t tuned = 0;    // problems whose algorithm is decided
  int64_t changed = 0;  // of those, how many run another algorithm than the heuristic's first
};
GemmAutotuneStats gemm_autotune_stats();

}  // namespace fp8amp
