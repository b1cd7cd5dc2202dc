"""The comm ops (fp8amp.ops.comm_quantize, comm_sum_shards; src/comm): bit for bit what the chains of
cast ops that the FP8 all-reduce ran before compute (compute_scale + multi_quantize; dequantize,
rank-order adds, division, amax + compute_scale + quantize), their non-finite rules, fake kernels,
clear errors; and on a GPU, CUDA against the CPU reference bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

import fp8amp
from cast_reference import assert_bits_equal
from fp8amp import ops

E4M3, E5M2 = fp8amp.E4M3, fp8amp.E5M2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
HIGH = (torch.float32, torch.bfloat16, torch.float16)


def metadata(t):
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset()


def gradients(sizes, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over many binades, as a bucket of different layers' gradients.
    return [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (1,), generator=g).item()).to(dtype).to(device)
            for n in sizes]


def chain_quantize(xs, amax, fmax, fmt, n_out):
    """The previous local work: compute_scale from (1, 1), then multi_quantize into views."""
    scale, scale_inv = torch.ones_like(amax), torch.ones_like(amax)
    ops.compute_scale(amax, scale, scale_inv, fmax)
    out = torch.zeros(n_out, dtype=torch.uint8).view(fmt)
    offset, outs = 0, []
    for x in xs:
        outs.append(out[offset:offset + x.numel()])
        offset += x.numel()
    ops.fast.multi_quantize(xs, outs, scale, amax.clone(), None, 0, 0, True)
    return out, torch.where(torch.isinf(amax).any(), torch.nan, scale_inv)


@pytest.mark.parametrize("dtype", HIGH, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("headroom", [1.0, 3.0])
def test_comm_quantize_equals_compute_scale_then_multi_quantize(dtype, fmt, headroom):
    sizes = (37, 1, 200, 0, 64)
    xs = gradients(sizes, dtype)
    amax = torch.stack([x.float().abs().max() if x.numel() else torch.tensor(0.0) for x in xs]) * 1.5  # other ranks
    out = torch.full((sum(sizes) + 5,), 0x55, dtype=torch.uint8).view(fmt)
    scale_inv = ops.comm_quantize(xs, amax, FMAX[fmt] / headroom, out)
    expected, expected_scale_inv = chain_quantize(xs, amax, FMAX[fmt] / headroom, fmt, sum(sizes) + 5)
    assert_bits_equal(out, expected)  # the padding zeroed
    assert_bits_equal(scale_inv, expected_scale_inv)


def test_comm_quantize_a_non_finite_amax_makes_every_scale_inv_nan():
    xs = gradients((8, 8), torch.float32)
    xs[1][3] = float("inf")
    amax = torch.tensor([xs[0].abs().max().item(), float("inf")])
    out = torch.empty(16, dtype=E4M3)
    scale_inv = ops.comm_quantize(xs, amax, 448.0, out)
    assert scale_inv.isnan().all()
    assert out.view(torch.uint8)[8 + 3] == 0x7F  # an inf is coded as NaN (docs/numerics.md#non-finite-values)


def chain_sum(codes, scale_inv, bounds, divisor, out_dtype):
    """The previous shard sum: dequantize each copy, add in rank order, divide (float32 tensors)."""
    rows, pieces = codes.shape[0], len(bounds) - 1
    per_row = scale_inv.numel() != pieces
    result = []
    for p in range(pieces):
        a, b = bounds[p], bounds[p + 1]
        acc = None
        for j in range(rows):
            s = scale_inv[j * pieces + p] if per_row else scale_inv[p]
            d = ops.dequantize(codes[j, a:b].contiguous(), s.reshape(1), torch.float32)
            acc = d if acc is None else acc + d
        result.append(acc / divisor)
    total = torch.cat(result)
    if out_dtype in (E4M3, E5M2):
        amaxes, codes_out, sinv = [], [], []
        for piece in result:
            amax, scale, si = torch.zeros(1), torch.ones(1), torch.ones(1)
            ops.amax(piece, amax)
            ops.compute_scale(amax, scale, si, FMAX[out_dtype])
            if not torch.isfinite(amax).all():  # the comm rule: a non-finite amax reads NaN
                scale.fill_(float("nan"))
            q, qsi = ops.quantize(piece, scale, torch.zeros(1), out_dtype)
            if not torch.isfinite(amax).all():
                qsi.fill_(float("nan"))
            amaxes.append(amax), codes_out.append(q), sinv.append(qsi)
        return torch.cat(codes_out), torch.cat(sinv), torch.cat(amaxes)
    return total.to(out_dtype)


def received(rows, cols, fmt, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x11  # no NaN codes (E4M3), no inf/NaN (E5M2 0x7C-0x7F: remapped below)
    if fmt == E5M2:
        codes[(codes & 0x7C) == 0x7C] = 0x22
    return codes.view(fmt).to(device)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("out_dtype", [*HIGH, E4M3, E5M2], ids=["fp32", "bf16", "fp16", "e4m3", "e5m2"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared", "per_row"])
def test_comm_sum_shards_equals_the_chain_of_ops(rows, out_dtype, per_row):
    fmt, cols, bounds = E4M3, 301, [3, 40, 41, 41, 250, 301]
    codes = received(rows, cols, fmt)
    pieces = len(bounds) - 1
    scale_inv = 2.0 ** torch.randint(-12, -2, (rows * pieces if per_row else pieces,)).float()
    out = torch.empty(bounds[-1] - bounds[0], dtype=out_dtype)
    got = ops.comm_sum_shards(codes, scale_inv, bounds, out, divisor=rows)
    expected = chain_sum(codes, scale_inv, bounds, float(rows), out_dtype)
    if out_dtype in (E4M3, E5M2):
        for g, e in zip((out, *got), expected):
            assert_bits_equal(g, e)
    else:
        assert got is None
        assert_bits_equal(out, expected)


def test_comm_sum_shards_within_float64_sum():
    """Against float64: the sum in float32 is within N float32 roundings of the exact one."""
    codes = received(3, 1000, E5M2, seed=3)
    scale_inv = torch.tensor([2.0 ** -5, 2.0 ** -9])
    out = torch.empty(1000)
    ops.comm_sum_shards(codes, scale_inv, [0, 500, 1000], out, divisor=3.0)
    exact = (codes.double() * torch.cat([torch.full((500,), 2.0 ** -5), torch.full((500,), 2.0 ** -9)]).double()).sum(0) / 3
    bound = 4 * 2.0 ** -24 * (codes.double().abs() * scale_inv.repeat_interleave(500).double()).sum(0)
    assert ((out.double() - exact).abs() <= bound).all()


def test_comm_sum_shards_nan_scale_reads_nan_and_zero_piece_is_zero():
    codes = received(2, 8, E4M3)
    codes[:, 4:] = torch.zeros(2, 4, dtype=torch.uint8).view(E4M3)
    out = torch.empty(8, dtype=E4M3)
    out_scale_inv, out_amax = ops.comm_sum_shards(codes, torch.tensor([float("nan"), 0.5]), [0, 4, 8], out)
    assert out.view(torch.uint8)[:4].eq(0x7F).all() and out_scale_inv[0].isnan() and out_amax[0].isnan()
    assert out.view(torch.uint8)[4:].eq(0).all() and out_scale_inv[1] == 1.0 and out_amax[1] == 0.0


def test_fake_kernels_match_the_real_ones():
    """torch.compile plans its buffers from the fake kernels: their outputs' metadata must be the
    real ones'."""
    xs = gradients((5, 7), torch.bfloat16)
    codes = received(2, 12, E4M3)
    for op, args in (
        (torch.ops.fp8amp.comm_quantize.default, (xs, torch.ones(2), 448.0, torch.empty(12, dtype=E4M3))),
        (torch.ops.fp8amp.comm_sum_shards.default, (codes, torch.ones(2), [0, 5, 12], 2.0, torch.empty(12))),
        (torch.ops.fp8amp.comm_sum_requantize.default,
         (codes, torch.ones(2), [0, 5, 12], 2.0, torch.empty(12, dtype=E5M2))),
    ):
        real = op(*args)
        with FakeTensorMode() as mode:
            fake = op(*tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args))
        real, fake = tree_flatten(real)[0], tree_flatten(fake)[0]  # comm_sum_shards returns None
        assert [metadata(t) for t in fake if t is not None] == [metadata(t) for t in real if t is not None], op


def test_errors_name_the_argument():
    codes = received(2, 6, E4M3)
    with pytest.raises(TypeError, match="bounds must be a list or tuple of ints"):
        ops.comm_sum_shards(codes, torch.ones(1), [0, 6.0], torch.empty(6))
    with pytest.raises(ValueError, match="bounds must be non-decreasing"):
        ops.comm_sum_shards(codes, torch.ones(2), [0, 4, 2], torch.empty(2))
    with pytest.raises(ValueError, match="out has unsupported dtype Double"):
        ops.comm_sum_shards(codes, torch.ones(1), [0, 6], torch.empty(6, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be float32, bfloat16 or float16 .the sum. or float8_e4m3fn"):
        ops.comm_sum_shards(codes, torch.ones(1), [0, 6], torch.empty(6, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must hold at least the 6 elements"):
        ops.comm_quantize([torch.ones(6)], torch.ones(1), 448.0, torch.empty(5, dtype=E4M3))
    with pytest.raises(ValueError, match="out must be float8_e4m3fn or float8_e5m2"):
        ops.comm_quantize([torch.ones(6)], torch.ones(1), 448.0, torch.empty(6, dtype=torch.float16))
    with pytest.raises(TypeError, match="fmax must be a float"):
        ops.comm_quantize([torch.ones(6)], torch.ones(1), "448", torch.empty(6, dtype=E4M3))


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HIGH, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_comm_quantize_cuda_equals_cpu(dtype, fmt):
    """Many tensors (over one launch's 128), odd sizes and offsets (unaligned vector accesses), one
    larger than a block's chunk, a zero-sized one, NaN and inf inside, a headroom fmax."""
    sizes = [1, 3, 0, 4097, 17] * 30 + [300_001]
    xs = gradients(sizes, dtype)
    xs[3][2] = float("nan")  # in a 4097-element gradient
    amax = torch.stack([x.float().abs().max() if x.numel() else torch.tensor(0.0) for x in xs])
    for a in (amax, amax.nan_to_num(nan=float("inf"))):
        cpu_out = torch.empty(sum(sizes) + 9, dtype=fmt)
        cpu_sinv = ops.comm_quantize(xs, a.nan_to_num(nan=0.0), FMAX[fmt] / 2, cpu_out)
        gpu_out = torch.empty(sum(sizes) + 9, dtype=fmt, device="cuda")
        gpu_sinv = ops.comm_quantize([x.cuda() for x in xs], a.nan_to_num(nan=0.0).cuda(), FMAX[fmt] / 2, gpu_out)
        assert_bits_equal(gpu_out.cpu(), cpu_out)
        assert_bits_equal(gpu_sinv.cpu(), cpu_sinv)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [*HIGH, E4M3, E5M2], ids=["fp32", "bf16", "fp16", "e4m3", "e5m2"])
@pytest.mark.parametrize("rows,cols", [(2, 1 << 20), (3, 300_007)])
def test_comm_sum_shards_cuda_equals_cpu(out_dtype, rows, cols):
    """Pieces over one launch's 128 and larger than a block's chunk, odd bounds, NaN codes in one
    piece, a zero piece, shared and per-row scales."""
    fmt = E4M3 if out_dtype != E5M2 else E5M2
    codes = received(rows, cols, fmt, seed=1)
    codes.view(torch.uint8)[1, 11] = 0x7F  # a NaN code
    codes.view(torch.uint8)[:, 200:300] = 0
    cuts = sorted(set(torch.randint(1, cols, (150,), generator=torch.Generator().manual_seed(2)).tolist()))
    bounds = [1, 100, 200, 300, *[c for c in cuts if c > 300], cols - 1]
    pieces = len(bounds) - 1
    for n_scales in (pieces, rows * pieces):
        scale_inv = 2.0 ** torch.randint(-12, 2, (n_scales,)).float()
        cpu_out = torch.empty(bounds[-1] - bounds[0], dtype=out_dtype)
        cpu_rest = ops.comm_sum_shards(codes, scale_inv, bounds, cpu_out, divisor=rows)
        gpu_out = torch.empty_like(cpu_out, device="cuda")
        gpu_rest = ops.comm_sum_shards(codes.cuda(), scale_inv.cuda(), bounds, gpu_out, divisor=rows)
        assert_bits_equal(gpu_out.cpu(), cpu_out)
        if cpu_rest is not None:
            for g, c in zip(gpu_rest, cpu_rest):
                assert_bits_equal(g.cpu(), c)
