"""fp8amp.ops.scaled_accumulate (dequantize-add-requantize, docs/architecture.md#fp8linear-dataflow) against a plain torch
model of its semantics, its special cases, its schema / fake kernel under opcheck and torch.compile,
and (marked gpu) CUDA against CPU bit for bit. Its bad-input errors are cases of test_errors.py."""

import math
import zlib

import pytest
import torch

import fp8amp
from cast_reference import (
    HIGH_PRECISION,
    NAN_CODE,
    SCALED_FORMATS,
    all_bit_patterns,
    assert_bits_equal,
    assert_quantized,
    assert_same_float,
    bits,
)
from fp8amp.ops import scaled_accumulate

ops = torch.ops.fp8amp
E4M3, E5M2, FP16 = fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16
# (src dtype, scaled?): high-precision sources, then scaled ones (with src_scale_inv).
SOURCES = [(d, False) for d in HIGH_PRECISION] + [(d, True) for d in SCALED_FORMATS]


def model(dst, dst_scale_inv, src, src_scale_inv, alpha, margin, pow2_scale):
    """The op's semantics in plain torch float32 / Python float64: returns (sums, amax, scale,
    scale_inv), each a float32 tensor ([n], [1], [1], [1])."""
    a = dst.float().flatten() * dst_scale_inv.reshape(())
    v = src.float().flatten()
    if src_scale_inv is not None:
        v = v * src_scale_inv.reshape(())
    s = a + torch.tensor(alpha, dtype=torch.float32) * v  # two separate float32 ops: no fma
    amax = s.abs().max().reshape(1) if s.numel() else torch.zeros(1)  # max propagates NaN
    fmax = torch.tensor(fp8amp.format_max(dst.dtype), dtype=torch.float32)
    a_val = amax.item()
    if not math.isfinite(a_val):
        scale = torch.tensor([math.nan])
        scale_inv = torch.tensor([math.nan])
    elif a_val == 0.0:
        scale, scale_inv = torch.ones(1), torch.ones(1)
    elif pow2_scale:
        q = (fmax / amax).item()  # float32 quotient
        e = (math.frexp(q)[1] - 1 if math.isfinite(q) else 128) - margin
        e = max(-126, min(126, e))
        scale, scale_inv = torch.tensor([2.0**e]), torch.tensor([2.0**-e])
    else:
        scale = (fmax / amax) * torch.tensor(2.0**-margin)
        finfo = torch.finfo(torch.float32)
        scale = scale.clamp(finfo.smallest_normal, finfo.max)
        scale_inv = torch.ones(1) / scale
    return s, amax, scale, scale_inv


def random_codes(dtype, n, g):
    """n random finite codes of a scaled format."""
    pool = all_bit_patterns(dtype)
    pool = pool[pool.float().isfinite()]
    return pool[torch.randint(0, pool.numel(), (n,), generator=g)]


def random_values(dtype, n, g):
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 8, (n,), generator=g).float())
    return x.to(dtype)


def make_src(dtype, scaled, n, g):
    return random_codes(dtype, n, g) if scaled else random_values(dtype, n, g)


def check_against_model(dst, dst_scale_inv, src, src_scale_inv=None, alpha=1.0, margin=0, pow2_scale=True):
    """Runs the op (in place on dst and dst_scale_inv) and checks every output against the model;
    returns (amax, the model's float32 sums)."""
    dst0, si0 = dst.clone(), dst_scale_inv.clone()
    s, amax_ref, scale, scale_inv = model(dst0, si0, src, src_scale_inv, alpha, margin, pow2_scale)
    amax = scaled_accumulate(dst, dst_scale_inv, src, src_scale_inv, alpha=alpha, margin=margin,
                             pow2_scale=pow2_scale)
    assert amax.shape == (1,) and amax.dtype == torch.float32 and amax.device == dst.device
    assert_same_float(amax, amax_ref)
    assert_same_float(dst_scale_inv, scale_inv)
    assert_quantized(dst.flatten(), s * scale.reshape(()), dst.dtype)
    return amax, s


@pytest.mark.parametrize("dst_dtype", SCALED_FORMATS)
@pytest.mark.parametrize("src_dtype,scaled", SOURCES)
@pytest.mark.parametrize("alpha", [1.0, 0.25, -1.5, 0.1])
def test_against_torch_model(dst_dtype, src_dtype, scaled, alpha):
    g = torch.Generator().manual_seed(zlib.crc32(f"{dst_dtype} {src_dtype} {scaled} {alpha}".encode()))
    n = 5003
    dst = random_codes(dst_dtype, n, g)
    src = make_src(src_dtype, scaled, n, g)
    src_scale_inv = torch.tensor([0.375]) if scaled else None
    for dst_si, margin, pow2 in ((2.0**-6, 0, True), (0.3, 2, True), (3.0, 1, False), (2.0**-20, 0, False)):
        check_against_model(dst.clone(), torch.tensor([dst_si]), src, src_scale_inv, alpha, margin, pow2)


def test_hand_derived_e4m3():
    # Codes 8, -8, 0, 448 with scale_inv 1/8 are reals 1, -1, 0, 56; + [3, 0.5, -0, 1] -> 4, -0.5, 0, 57.
    dst = torch.tensor([0x50, 0xD0, 0x00, 0x7E], dtype=torch.uint8).view(E4M3)
    scale_inv = torch.tensor([0.125])
    amax = scaled_accumulate(dst, scale_inv, torch.tensor([3.0, 0.5, -0.0, 1.0]))
    assert amax.item() == 57.0
    assert scale_inv.item() == 0.25  # 448 / 57 = 7.86 -> scale 4
    assert bits(dst).tolist() == [0x58, 0xC0, 0x00, 0x76]  # 16, -2, 0, 228 -> 224


def test_dst_shape_may_differ_from_src():
    dst = torch.zeros(4, 6, dtype=E5M2)
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    check_against_model(dst, torch.ones(1), src)
    assert dst.shape == (4, 6)


def test_non_contiguous_src_is_read_as_its_values():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(16, 12, generator=g)[:, ::2].t()
    dst = torch.zeros(6, 16, dtype=E4M3)
    check_against_model(dst, torch.ones(1), src.contiguous())
    dst2 = torch.zeros(6, 16, dtype=E4M3)
    scaled_accumulate(dst2, torch.ones(1), src)
    assert_bits_equal(dst2, dst)


@pytest.mark.parametrize("dst_dtype", SCALED_FORMATS)
@pytest.mark.parametrize("special", [math.inf, -math.inf, math.nan])
def test_non_finite_src_makes_everything_nan(dst_dtype, special):
    src = torch.tensor([1.0, 2.0, special, 4.0])
    dst = torch.zeros(4, dtype=dst_dtype)
    scale_inv = torch.ones(1)
    amax, _ = check_against_model(dst, scale_inv, src)
    assert math.isnan(scale_inv.item())
    assert (bits(dst) == NAN_CODE[dst_dtype]).all()
    if math.isnan(special):
        assert math.isnan(amax.item())
    else:
        assert amax.item() == math.inf
    # Accumulating into the NaN accumulator keeps it NaN.
    scaled_accumulate(dst, scale_inv, torch.ones(4))
    assert math.isnan(scale_inv.item())
    assert dst.float().isnan().all()


def test_overflowing_sum_and_zero_alpha_times_inf():
    dst = torch.full((3,), 448.0).to(E4M3)
    scale_inv = torch.tensor([1e36])
    amax, _ = check_against_model(dst, scale_inv, torch.tensor([3e38, 1.0, 1.0]))  # 448e36 overflows
    assert math.isinf(amax.item()) and math.isnan(scale_inv.item())
    dst = torch.ones(2).to(E4M3)
    scale_inv = torch.ones(1)
    check_against_model(dst, scale_inv, torch.tensor([1.0, math.inf]), alpha=0.0)  # 0 * inf = NaN
    assert math.isnan(scale_inv.item())


def test_nan_scale_inv_on_entry_stays_nan():
    dst = torch.ones(5).to(E4M3)
    scale_inv = torch.tensor([math.nan])
    amax = scaled_accumulate(dst, scale_inv, torch.ones(5))
    assert math.isnan(amax.item()) and math.isnan(scale_inv.item())


@pytest.mark.parametrize("dst_dtype", SCALED_FORMATS)
def test_all_zero_and_empty(dst_dtype):
    dst = torch.tensor([0.0, -0.0, 0.0]).to(dst_dtype)
    scale_inv = torch.tensor([0.5])
    amax, _ = check_against_model(dst, scale_inv, torch.tensor([-0.0, -0.0, 0.0]))
    assert amax.item() == 0.0 and scale_inv.item() == 1.0
    assert (dst.float() == 0).all()
    empty = torch.empty(0, 3, dtype=dst_dtype)
    scale_inv = torch.tensor([math.nan])
    amax = scaled_accumulate(empty, scale_inv, torch.empty(0))
    assert_bits_equal(amax, torch.zeros(1))
    assert_bits_equal(scale_inv, torch.ones(1))


def test_src_may_be_dst():
    dst = torch.tensor([1.0, 0.5, -3.0]).to(E4M3)
    scale_inv = torch.tensor([0.125])
    reference = dst.clone()
    check_against_model(reference, scale_inv.clone(), dst.clone(), scale_inv.clone())
    scaled_accumulate(dst, scale_inv, dst, scale_inv)
    assert_bits_equal(dst, reference)
    assert scale_inv.item() == 2.0**-9  # sums 0.25, 0.125, -0.75: 448 / 0.75 = 597 -> scale 2^9


def test_micro_batch_accumulation_tracks_the_exact_sum():
    """Four bf16 micro-batch gradients averaged into an E4M3 accumulator: bit-exact against the
    model at every step, and within the sum of each step's rounding errors of the exact mean."""
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(64, 48, generator=g).to(torch.bfloat16) * 10.0**k for k in (-2, -1, -2, -3)]
    dst = torch.zeros(64, 48, dtype=E4M3)
    scale_inv = torch.ones(1)
    exact = torch.zeros(64 * 48, dtype=torch.float64)
    bound = torch.zeros(64 * 48, dtype=torch.float64)
    for grad in grads:
        _, s = check_against_model(dst, scale_inv, grad, alpha=0.25)
        exact += grad.double().flatten() * 0.25
        # The terms are exact (E4M3 codes times a power of two; bf16 times 1/4). The float32 sum
        # rounds once (2^-24 relative), then E4M3 rounds it to half an ulp: at most 2^-4 of |s| for
        # normals, and half the subnormal step 2^-9 of the new scale_inv otherwise.
        bound += s.double().abs() * (2.0**-24 + 2.0**-4) + 2.0**-10 * scale_inv.double()
    err = (dst.double().flatten() * scale_inv.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item()}, bound there {bound[err.argmax()].item()}"
    assert err.max() > 0  # the test can fail: E4M3 does round


# ------------------------------------------------------------------------------------------------
# Errors: bad inputs are cases of test_errors.py; here the CPU/CUDA mix.

def e4m3(n=4):
    return torch.zeros(n, dtype=E4M3)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["dst_scale_inv", "src", "src_scale_inv"])
def test_cpu_cuda_mix_is_refused(which):
    args = dict(dst=e4m3().cuda(), dst_scale_inv=torch.ones(1, device="cuda"), src=e4m3().cuda(),
                src_scale_inv=torch.ones(1, device="cuda"))
    args[which] = args[which].cpu()
    with pytest.raises(ValueError, match=f"{which} and dst must be on the same device"):
        scaled_accumulate(**args)


# ------------------------------------------------------------------------------------------------
# Schema, fake kernel, torch.compile.

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_cases():
    # test_schema compares tensors with ops float8 lacks on CPU: the samples use FP16 codes.
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(8, 16, generator=g).to(FP16)
    return {
        "float32 src": (dst, torch.tensor([0.5]), torch.randn(8, 16, generator=g), None, 0.5, torch.zeros(1)),
        "scaled src": (dst, torch.tensor([0.5]), torch.randn(128, generator=g).to(FP16), torch.tensor([2.0]), -1.0,
                       torch.zeros(1)),
    }


@pytest.mark.parametrize("case", list(opcheck_cases()))
@pytest.mark.parametrize("test_util", OPCHECK_UTILS)
def test_opcheck(case, test_util):
    args = opcheck_cases()[case]
    torch.library.opcheck(ops.scaled_accumulate.default, args, dict(margin=1, pow2_scale=False),
                          test_utils=test_util)


def accumulate_step(dst, dst_scale_inv, grads, src8, src8_scale_inv):
    """Micro-batch accumulation as the front end will run it: high-precision grads, then a scaled one."""
    amaxes = [scaled_accumulate(dst, dst_scale_inv, g, alpha=0.5) for g in grads]
    amaxes.append(scaled_accumulate(dst, dst_scale_inv, src8, src8_scale_inv, margin=1))
    return amaxes


@pytest.mark.parametrize("dst_dtype", [E4M3, FP16])
def test_compiled_equals_eager(dst_dtype):
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(24, 16, generator=g).to(torch.bfloat16), torch.randn(24, 16, generator=g) * 3]
    src8 = torch.randn(24, 16, generator=g).to(E5M2)
    src8_scale_inv = torch.tensor([0.25])
    compiled = torch.compile(accumulate_step, backend="aot_eager", fullgraph=True)
    dst_e, dst_c = torch.zeros(24, 16, dtype=dst_dtype), torch.zeros(24, 16, dtype=dst_dtype)
    si_e, si_c = torch.ones(1), torch.ones(1)
    for _ in range(2):
        eager = accumulate_step(dst_e, si_e, grads, src8, src8_scale_inv)
        got = compiled(dst_c, si_c, grads, src8, src8_scale_inv)
        for a, b in zip(eager, got):
            assert_bits_equal(b, a)
        assert_bits_equal(dst_c, dst_e)
        assert_bits_equal(si_c, si_e)


def test_compiled_with_changing_shapes():
    compiled = torch.compile(scaled_accumulate, backend="aot_eager", fullgraph=True)
    for rows in (8, 12, 20):
        dst = torch.zeros(rows, 16, dtype=FP16)
        scale_inv = torch.ones(1)
        src = torch.randn(rows, 16)
        amax = compiled(dst, scale_inv, src)
        ref_dst, ref_si = torch.zeros(rows, 16, dtype=FP16), torch.ones(1)
        assert_bits_equal(amax, scaled_accumulate(ref_dst, ref_si, src))
        assert_bits_equal(dst, ref_dst)
        assert_bits_equal(scale_inv, ref_si)


# ------------------------------------------------------------------------------------------------
# CUDA against CPU, bit for bit.

def run_on(device, dst, dst_scale_inv, src, src_scale_inv, offset=0, **kwargs):
    """The op on copies on `device`; dst and src are taken from element `offset` of the copied
    buffers, so their starts keep the buffers' misalignment. Returns (dst, dst_scale_inv, amax)."""
    dst = dst.to(device, copy=True)[offset:]
    src = src.to(device, copy=True)[offset:]
    dst_scale_inv = dst_scale_inv.to(device, copy=True)
    if src_scale_inv is not None:
        src_scale_inv = src_scale_inv.to(device, copy=True)
    amax = scaled_accumulate(dst, dst_scale_inv, src, src_scale_inv, **kwargs)
    return [t.cpu() for t in (dst, dst_scale_inv, amax)]


@pytest.mark.gpu
@pytest.mark.parametrize("dst_dtype", SCALED_FORMATS)
@pytest.mark.parametrize("src_dtype,scaled", SOURCES)
@pytest.mark.parametrize("n,offset", [(1, 0), (33, 1), (4099, 3), (1 << 20, 0), ((1 << 20) + 5, 7)])
def test_cuda_equals_cpu(dst_dtype, src_dtype, scaled, n, offset):
    g = torch.Generator().manual_seed(n + offset)
    # Views at an element offset into a larger buffer: misaligned starts for the vector loads.
    dst_buffer = random_codes(dst_dtype, n + offset, g)
    src_buffer = make_src(src_dtype, scaled, n + offset, g)
    src_scale_inv = torch.tensor([0.75]) if scaled else None
    for kwargs in (dict(alpha=1.0), dict(alpha=-0.3, margin=2, pow2_scale=False)):
        for dst_si in (2.0**-7, 0.3):
            args = (dst_buffer, torch.tensor([dst_si]), src_buffer, src_scale_inv)
            cpu = run_on("cpu", *args, offset=offset, **kwargs)
            cuda = run_on("cuda", *args, offset=offset, **kwargs)
            for a, b in zip(cpu, cuda):
                assert_bits_equal(b, a)
            src = src_buffer[offset:]
            model_dst, model_si = dst_buffer[offset:].clone(), torch.tensor([dst_si])
            check_against_model(model_dst, model_si, src, src_scale_inv, **kwargs)
            assert_bits_equal(cuda[0], model_dst)


@pytest.mark.gpu
def test_cuda_non_finite_and_empty():
    for src in (torch.tensor([1.0, math.inf, 2.0]), torch.tensor([math.nan, 0.0, 1.0]), torch.empty(0)):
        dst = torch.zeros(src.numel(), dtype=E4M3)
        cpu = run_on("cpu", dst, torch.ones(1), src, None)
        cuda = run_on("cuda", dst, torch.ones(1), src, None)
        for a, b in zip(cpu, cuda):
            assert_bits_equal(b, a)


@pytest.mark.gpu
def test_cuda_does_not_sync_and_compiles():
    dst = torch.zeros(1000, dtype=E4M3, device="cuda")
    scale_inv = torch.ones(1, device="cuda")
    src = torch.randn(1000, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaled_accumulate(dst, scale_inv, src)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    compiled = torch.compile(scaled_accumulate, backend="aot_eager", fullgraph=True)
    dst2, si2 = torch.zeros(1000, dtype=E4M3, device="cuda"), torch.ones(1, device="cuda")
    amax = compiled(dst2, si2, src)
    ref = scaled_accumulate(torch.zeros(1000, dtype=E4M3, device="cuda"), torch.ones(1, device="cuda"), src)
    assert_bits_equal(amax.cpu(), ref.cpu())


@pytest.mark.gpu
def test_cuda_on_another_stream():
    src = torch.randn(1 << 20, device="cuda")
    expected = scaled_accumulate(torch.zeros(1 << 20, dtype=E4M3, device="cuda"), torch.ones(1, device="cuda"), src)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dst, scale_inv = torch.zeros(1 << 20, dtype=E4M3, device="cuda"), torch.ones(1, device="cuda")
        amax = scaled_accumulate(dst, scale_inv, src)
    torch.cuda.current_stream().wait_stream(stream)
    assert_bits_equal(amax.cpu(), expected.cpu())
