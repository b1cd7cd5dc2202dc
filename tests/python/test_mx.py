"""The MXFP8 ops (docs/tiles.md#mxfp8): quantize_mx, cast_transpose_mx and dequantize_mx against a
plain torch reference of OCP MX's rule, the E8M0 codes exactly, zero and non-finite blocks,
partial blocks, the argument checks, gemm_mx's CPU reference against the dequantized product,
the fake kernels under torch.compile, and (GPU) CUDA against the CPU bit for bit and gemm_mx's
refusal below Blackwell."""

from __future__ import annotations

import pytest
import torch

import fp8amp
from fp8amp import ops

E4M3, E5M2 = fp8amp.E4M3, fp8amp.E5M2
EMAX = {E4M3: 8, E5M2: 15}
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def reference_mx(x: torch.Tensor, fmt: torch.dtype):
    """(codes, scales) of fp8amp's MX rule in plain torch: per 1 x 32 block of each row, X = 2^e with
    e = floor(log2 amax) - emax (from frexp: exact), plus one where amax / 2^e > fmax (nothing
    saturates), clamped below at 2^-127; zeros X = 1; non-finite code 255."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    rows, cols = x2.shape
    padded = torch.nn.functional.pad(x2, (0, (-cols) % 32))  # zeros change no amax
    blocks = padded.view(rows, -1, 32)
    amax = blocks.abs().amax(-1)
    finite, nonzero = torch.isfinite(amax), amax > 0
    exponent = torch.frexp(torch.where(finite & nonzero, amax, torch.ones_like(amax))).exponent - 1
    e = exponent - EMAX[fmt]
    e = torch.where(torch.where(finite & nonzero, amax, 0) * torch.exp2(-e.float()) > FMAX[fmt], e + 1, e)
    e = e.clamp(min=-127)
    codes = torch.where(finite, torch.where(nonzero, e + 127, 127), 255).to(torch.uint8)
    scale = torch.where(finite & nonzero, torch.exp2(-e.float()), torch.ones_like(amax))
    q = (blocks * scale[..., None]).clamp(-FMAX[fmt], FMAX[fmt]).to(fmt).view(torch.uint8)
    return q.view(rows, -1)[:, :cols].reshape(x.shape), codes


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(int_type), b.view(int_type))


def wide_values(shape, dtype, seed):
    """Values over ~12 binades, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.02] = 0
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(64, 96), (3, 5, 70), (1, 5), (33, 1), (7, 32)])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16), (E4M3, torch.float16)])
def test_quantize_mx_matches_the_torch_reference(shape, fmt, dtype):
    x = wide_values(shape, dtype, seed=sum(shape))
    codes, scales = ops.quantize_mx(x, fmt)
    ref_codes, ref_scales = reference_mx(x, fmt)
    assert codes.dtype == fmt and codes.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (x.numel() // shape[-1], (shape[-1] + 31) // 32)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes)
    # dequantize is decode times 2^(code - 127), rounded once to the output dtype.
    blocks = scales.repeat_interleave(32, 1)[:, : shape[-1]].reshape(shape)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = (codes.float() * torch.exp2(blocks.float() - 127)).to(out_dtype)
        assert same_bits(ops.dequantize_mx(codes, scales, out_dtype), want)


def test_scales_are_e8m0_exactly():
    # One row; block b holds 1.5 * 2^(b - 10): floor(log2) = b - 10, code = b - 10 - 8 + 127.
    x = torch.cat([torch.full((32,), 1.5 * 2.0 ** (b - 10)) for b in range(20)]).view(1, -1)
    _, scales = ops.quantize_mx(x, E4M3)
    assert scales.tolist() == [[b - 10 - 8 + 127 for b in range(20)]]
    _, scales = ops.quantize_mx(x, E5M2)
    assert scales.tolist() == [[b - 10 - 15 + 127 for b in range(20)]]
    assert torch.equal(ops.e8m0_to_float(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))[:4],
                       torch.tensor([2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]))


def test_the_scale_rounds_up_so_that_nothing_saturates():
    # amax 500 > 448 * 2^0: X = 2 (code 128; OCP MX's floor rule gives X = 1 and clips 500 to 448);
    # 500 / 2 = 250 rounds to E4M3's 256, 1.0 / 2 is exact. amax 448 exactly keeps X = 1.
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 500.0, 1.0
    x[1, 0] = 448.0
    codes, scales = ops.quantize_mx(x, E4M3)
    assert scales[:, 0].tolist() == [128, 127]
    assert codes.float()[0, :2].tolist() == [256.0, 0.5] and codes.float()[1, 0] == 448.0
    assert ops.dequantize_mx(codes, scales)[0, :2].tolist() == [512.0, 1.0]


def test_zero_and_non_finite_blocks_poison_no_other():
    x = wide_values((4, 128), torch.float32, seed=3)
    x[0, :32] = 0
    x[1, 40] = float("inf")
    x[2, 100] = float("nan")
    x[3, 64:96] = 2.0 ** -140  # below 2^-119: the exponent clamps to -127 and the elements flush to 0
    codes, scales = ops.quantize_mx(x, E4M3)
    assert scales[0, 0] == 127 and scales[1, 1] == 255 and scales[2, 3] == 255 and scales[3, 2] == 0
    back = ops.dequantize_mx(codes, scales)
    assert torch.isnan(back[1, 32:64]).all() and torch.isnan(back[2, 96:128]).all()
    assert torch.isnan(back).sum() == 64
    assert (back[0, :32] == 0).all() and (back[3, 64:96] == 0).all()
    clean = x.clone()
    clean[1, 40] = clean[2, 100] = 0
    clean_codes, clean_scales = ops.quantize_mx(clean, E4M3)
    keep = scales != 255
    assert torch.equal(scales[keep], clean_scales[keep])
    assert torch.equal(codes.view(torch.uint8)[keep.repeat_interleave(32, 1)],
                       clean_codes.view(torch.uint8)[keep.repeat_interleave(32, 1)])


@pytest.mark.parametrize("shape", [(64, 96), (40, 72), (3, 5, 33), (1, 1)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_transpose_mx_is_quantize_mx_of_x_and_its_transpose(shape, fmt):
    x = wide_values(shape, torch.bfloat16, seed=7)
    codes, scales, codes_t, scales_t = ops.cast_transpose_mx(x, fmt)
    ref = ops.quantize_mx(x, fmt)
    ref_t = ops.quantize_mx(x.reshape(-1, shape[-1]).t().contiguous(), fmt)
    assert same_bits(codes, ref[0]) and torch.equal(scales, ref[1])
    assert same_bits(codes_t, ref_t[0]) and torch.equal(scales_t, ref_t[1])
    rows = x.numel() // shape[-1]
    assert codes_t.shape == (shape[-1], rows) and scales_t.shape == (shape[-1], (rows + 31) // 32)


def test_arguments_are_checked():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ops.quantize_mx(x, fp8amp.FP16)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16, got int32"):
        ops.quantize_mx(torch.zeros(4, 64, dtype=torch.int32), E4M3)
    codes, scales = ops.quantize_mx(x, E4M3)
    with pytest.raises(ValueError, match=r"scales must be uint8, got float32"):
        ops.dequantize_mx(codes, scales.float())
    with pytest.raises(ValueError, match=r"scales must be uint8 \[4, 2\]"):
        ops.dequantize_mx(codes, scales[:, :1])
    with pytest.raises(TypeError, match="scales must be a torch.uint8 tensor"):
        ops.e8m0_to_float(scales.float())
    b_codes, b_scales = ops.quantize_mx(torch.randn(16, 64), E4M3)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.gemm_mx(codes[:, :48], scales[:, :1], b_codes[:, :48], b_scales[:, :1])
    with pytest.raises(ValueError, match=r"b_scales must be uint8 \[16, 2\]"):
        ops.gemm_mx(codes, scales, b_codes, b_scales[:, :1])
    e5 = ops.quantize_mx(x, E5M2)[0]
    with pytest.raises(ValueError, match="e5m2"):
        ops.gemm_mx(e5, scales, ops.quantize_mx(torch.randn(16, 64), E5M2)[0], b_scales)


@pytest.mark.parametrize("m, n, k", [(5, 16, 64), (64, 48, 160)])
@pytest.mark.parametrize("a_fmt, b_fmt", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_gemm_mx_is_the_dequantized_product(m, n, k, a_fmt, b_fmt):
    a, a_scales = ops.quantize_mx(wide_values((m, k), torch.float32, seed=m), a_fmt)
    b, b_scales = ops.quantize_mx(wide_values((n, k), torch.float32, seed=n), b_fmt)
    bias = torch.randn(n).to(torch.bfloat16)
    out = ops.gemm_mx(a, a_scales, b, b_scales, out_dtype=torch.float32, bias=bias)
    product = ops.dequantize_mx(a, a_scales).double() @ ops.dequantize_mx(b, b_scales).double().t()
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # Exact block sums in double, rounded once to float32: the float32 rounding of the exact product.
    assert torch.equal(out, (product + bias.double()).float())
    assert torch.equal(ops.gemm_mx(a, a_scales, b, b_scales), product.float().to(torch.bfloat16))


def test_mx_ops_compile_fullgraph():
    x = torch.randn(64, 96)
    w = torch.randn(32, 96)

    def forward(t, weight):
        codes, scales, codes_t, scales_t = ops.cast_transpose_mx(t, E4M3)
        w_codes, w_scales = ops.quantize_mx(weight, E4M3)
        return ops.gemm_mx(codes, scales, w_codes, w_scales, out_dtype=torch.float32), \
            ops.dequantize_mx(codes_t, scales_t)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(x, w)
    eager = forward(x, w)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))


@pytest.mark.gpu
# (48, 384) and (272, 136): whole 16-byte packs with a half region of rows, and of columns
@pytest.mark.parametrize("shape", [(256, 512), (300, 260), (3, 7, 130), (1, 5), (129, 33), (48, 384), (272, 136)])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16), (E4M3, torch.float16)])
def test_mx_casts_cuda_equal_cpu(shape, fmt, dtype):
    x = wide_values(shape, dtype, seed=11)
    x.view(-1)[x.numel() // 2] = float("nan")  # one NaN block
    cpu = ops.cast_transpose_mx(x, fmt)
    cuda = ops.cast_transpose_mx(x.cuda(), fmt)
    for name, a, b in zip(("codes", "scales", "codes_t", "scales_t"), cuda, cpu):
        assert same_bits(a.cpu(), b), name
    codes, scales = ops.quantize_mx(x.cuda(), fmt)
    assert same_bits(codes.cpu(), cpu[0]) and torch.equal(scales.cpu(), cpu[1])
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert same_bits(ops.dequantize_mx(codes, scales, out_dtype).cpu(), ops.dequantize_mx(cpu[0], cpu[1], out_dtype))


@pytest.mark.gpu
def test_gemm_mx_on_cuda_needs_blackwell():
    """Below sm_100 the op refuses before any work; on Blackwell it must match the CPU reference
    within FP32 accumulation (this test has never run on one)."""
    a, a_scales = ops.quantize_mx(torch.randn(128, 256), E4M3)
    b, b_scales = ops.quantize_mx(torch.randn(64, 256), E4M3)
    major, minor = torch.cuda.get_device_capability()
    args = (a.cuda(), a_scales.cuda(), b.cuda(), b_scales.cuda())
    if major < 10:
        with pytest.raises(NotImplementedError, match=rf"needs a Blackwell GPU \(sm_100\+\); this GPU is sm_{major}{minor}"):
            ops.gemm_mx(*args, out_dtype=torch.float32)
        return
    out = ops.gemm_mx(*args, out_dtype=torch.float32).cpu()
    want = ops.gemm_mx(a, a_scales, b, b_scales, out_dtype=torch.float32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
