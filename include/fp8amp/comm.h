// Comm op family: the local work of an FP8 gradient all-reduce or reduce-scatter
// (docs/distributed.md#fp8-communication-kernels), the passes around the collectives. Every op
// runs on the device of its tensors (CPU reference or CUDA kernel) and never syncs with the host.
#pragma once

#include <cstdint>
#include <vector>

#include "fp8amp/tensor.h"

namespace fp8amp {

// Quantizes a bucket of gradients straight into one flat send buffer, each with its own
// power-of-two scale from an amax that every rank shares (the MAX over the ranks).
// - xs:        T contiguous tensors of one high-precision dtype (float32, bfloat16, float16).
// - amax:      float32 [T], read: the amax of tensor i over every rank.
// - fmax:      the largest magnitude a code may take (the format's max, or less to leave headroom
//              for FP8 partial sums); positive and finite.
// - out:       E4M3 or E5M2, contiguous, at least sum(numel) elements: tensor i's codes at offset
//              numel(x_0) + ... + numel(x_{i-1}); the elements after the last tensor are zeroed
//              (a send buffer's padding then carries defined bytes).
// - scale_inv: float32 [T], written.
// Per tensor, scale = numerics::scale_from_amax(amax[i], fmax, margin 0, pow2) with the fallback 1
// (amax 0 or non-finite), out = encode(x * scale) (saturating, NaN -> the NaN code), and
// scale_inv[i] = 1 / scale, except that a non-finite amax anywhere in the bucket makes every
// scale_inv NaN (0x7FC00000): whatever is decoded with them reads NaN, so every rank skips the
// step together. On CUDA one launch (a few for more than 128 tensors).
void comm_quantize(const std::vector<TensorView>& xs, const TensorView& amax, float fmax, const TensorView& out,
                   const TensorView& scale_inv, Stream stream);

// The fused pass after an all-to-all of FP8 shards: sums the N received copies of a shard in
// float32 and writes the result, in high precision or requantized.
// - codes:     E4M3 or E5M2, contiguous [N, L]: row j = rank j's codes of the shard.
// - scale_inv: float32, contiguous, P elements (shared by every row) or N * P (row j's piece p at
//              j * P + p).
// - bounds:    P + 1 non-decreasing column offsets in [0, L]: piece p = columns [bounds[p],
//              bounds[p + 1]), each with its own scale_inv (and, requantized, its own new scale).
// - divisor:   positive; the sum is divided by it (the world size for a mean, 1 for a sum).
// - out:       contiguous, bounds[P] - bounds[0] elements: column c goes to out[c - bounds[0]].
//   * float32, bfloat16 or float16: out = round(v);
//   * E4M3 or E5M2: out_scale_inv and out_amax (float32 [P], written) are required; per piece,
//     out_amax[p] = max |v| over its columns (NaN above everything, 0 when empty), the new scale is
//     the pow2 rule from it with out's format max, 1 for an amax of 0, NaN for a non-finite one
//     (the piece then reads NaN: codes the NaN code, scale_inv NaN), out = encode(v * scale) and
//     out_scale_inv[p] = 1 / scale.
// Per column c of piece p, in float32, each operation rounded once (no fma):
//   v = fl(fl(... fl(d_0 + d_1) ... + d_{N-1}) / divisor),  d_j = fl(decode(codes[j, c]) * s_j),
//   s_j = scale_inv[p] or scale_inv[j * P + p]: the sum in rank order.
void comm_sum_shards(const TensorView& codes, const TensorView& scale_inv, const std::vector<int64_t>& bounds,
                     float divisor, const TensorView& out, const TensorView* out_scale_inv,
                     const TensorView* out_amax, Stream stream);

}  // namespace fp8amp
