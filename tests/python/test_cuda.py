"""Every op on CUDA against the CPU reference, bit for bit: the casts (quantize, cast_transpose,
cast_transpose_dbias, quantize_current, dequantize), amax (row runs of strided views included),
the multi-tensor ops and the scale updates. ScalingState over steps, torch.compile and host-sync
freedom on CUDA are in test_cuda_scaling_state.py. Marked gpu: skipped where
torch.cuda.is_available() is False."""

import math

import pytest
import torch

import fp8amp
from cast_reference import (
    HIGH_PRECISION,
    SCALED_FORMATS,
    all_bit_patterns,
    assert_all_same,
    assert_bits_equal,
    boundary_values,
    random_float32_bits,
)

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def on_both(fn, *tensors, **kwargs):
    """fn on CPU copies and on CUDA copies of the same tensors (lists of tensors too); returns
    (cpu_inputs, cpu_result, cuda_inputs, cuda_result), all on the CPU. The callers' tensors
    are never written."""

    def to(device, value):
        if isinstance(value, (list, tuple)):
            return [to(device, v) for v in value]
        return value.to(device, copy=True) if isinstance(value, torch.Tensor) else value

    results = []
    for device in ("cpu", CUDA):
        inputs = [to(device, t) for t in tensors]
        result = fn(*inputs, **{k: to(device, v) for k, v in kwargs.items()})
        results += [to("cpu", inputs), to("cpu", result)]
    return results


def check_cuda_equals_cpu(fn, *tensors, **kwargs):
    cpu_inputs, cpu_result, cuda_inputs, cuda_result = on_both(fn, *tensors, **kwargs)
    assert_all_same(cpu_result, cuda_result)
    assert_all_same(cpu_inputs, cuda_inputs)  # buffers the op wrote (amax, scales, counters)


def quantize_with(x, scale, amax, dtype, counter=None, steps=0, margin=0, pow2=True):
    return fp8amp.ops.quantize(x, scale, amax, dtype, warmup_counter=counter, warmup_steps=steps, margin=margin,
                           pow2_scale=pow2)


def cast_transpose_with(x, scale, amax, dtype, counter=None, steps=0, margin=0, pow2=True):
    return fp8amp.ops.cast_transpose(x, scale, amax, dtype, warmup_counter=counter, warmup_steps=steps, margin=margin,
                                 pow2_scale=pow2)


def cast_transpose_dbias_with(x, scale, amax, dtype, counter=None, steps=0, margin=0, pow2=True):
    return fp8amp.ops.cast_transpose_dbias(x, scale, amax, dtype, warmup_counter=counter, warmup_steps=steps,
                                       margin=margin, pow2_scale=pow2)


SCALES = [1.0, 2.0**-9, 2.0**12, 0.3]


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_every_16bit_pattern(in_dtype, dtype, scale):
    x = all_bit_patterns(in_dtype)
    check_cuda_equals_cpu(quantize_with, x, torch.tensor([scale]), torch.zeros(1, 4), dtype)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_quantize_every_16bit_pattern_current_scaling(in_dtype, dtype):
    x = all_bit_patterns(in_dtype)
    x = x[x.float().isfinite()]  # a finite amax, so the warm-up scale comes from it
    counter = torch.zeros(1, dtype=torch.int32)
    for pow2 in (True, False):
        check_cuda_equals_cpu(quantize_with, x, torch.ones(1), torch.zeros(1, 4), dtype, counter, 4, 1, pow2)


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_random_float32(dtype, scale):
    g = torch.Generator().manual_seed(3)
    n = (1 << 20) + 7
    normal = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    for x in (normal, random_float32_bits(n, g), boundary_values(dtype)):
        check_cuda_equals_cpu(quantize_with, x, torch.tensor([scale]), torch.zeros(1), dtype)
        check_cuda_equals_cpu(quantize_with, x[1:], torch.tensor([scale]), torch.zeros(1), dtype)  # misaligned


ODD_SHAPES = [(), (1,), (0,), (0, 7), (3,), (17, 33), (3, 1, 5, 1, 7), (1000, 37), (4097, 3), (5, 70001)]


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_quantize_odd_shapes(shape, in_dtype):
    x = (torch.randn(shape) * 1e3).to(in_dtype)
    counter = torch.zeros(1, dtype=torch.int32)
    for dtype in SCALED_FORMATS:
        check_cuda_equals_cpu(quantize_with, x, torch.tensor([2.0]), torch.zeros(1, 3), dtype)
        check_cuda_equals_cpu(quantize_with, x, torch.tensor([2.0]), torch.zeros(1, 3), dtype, counter, 2)


CT_SHAPES = [(1, 1), (7,), (1, 4096), (4096, 1), (64, 64), (65, 129), (192, 320), (2, 3, 130), (4097, 1003),
             (3, 1, 4, 9), (31, 16), (16, 31), (1024, 8)]


@pytest.mark.parametrize("shape", CT_SHAPES)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose(shape, in_dtype, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 500).to(in_dtype)
    x.view(-1)[x.numel() // 2] = float("inf")
    check_cuda_equals_cpu(cast_transpose_with, x, torch.tensor([0.75]), torch.zeros(1, 2), dtype)
    counter = torch.zeros(1, dtype=torch.int32)
    check_cuda_equals_cpu(cast_transpose_with, x.clamp(-1e4, 1e4), torch.ones(1), torch.zeros(1, 2), dtype, counter,
                          3)


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("special", [None, float("inf"), float("nan")])
def test_quantize_current(in_dtype, dtype, special):
    x = (torch.randn(1031, 67) * 50).to(in_dtype)
    if special is not None:
        x[700, 3] = special
    for margin in (0, 1):
        for nan_if_nonfinite in (False, True):
            check_cuda_equals_cpu(fp8amp.ops.quantize_current, x, dtype, margin=margin, nan_if_nonfinite=nan_if_nonfinite)


def test_cast_transpose_misaligned_rows():
    base = torch.randn(129 * 64 + 1, dtype=torch.bfloat16)
    x = base[1:].view(129, 64)  # 2-byte offset: no 16-byte packs
    check_cuda_equals_cpu(cast_transpose_with, x, torch.tensor([4.0]), torch.zeros(1), fp8amp.E4M3)


# cast_transpose_dbias: tails of rows and columns around the 256-row bands and the 128-byte column
# tiles, many bands (3000 rows: 12), one row or column, empty matrices.
DBIAS_SHAPES = [(1, 1), (7,), (255, 63), (256, 64), (257, 65), (3000, 72), (513, 1031), (2, 3, 130), (4097, 3),
                (31, 16), (1, 4096), (0, 5), (5, 0), (2, 0, 3)]


def wide_range(shape, in_dtype, seed):
    """randn scaled by 2^e, e random per element: float32 / bfloat16 from the subnormals up to 2^40
    (every float32 sum is then rounded somewhere), float16 within its range."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-26, 13) if in_dtype == torch.float16 else (-140, 40)
    return (torch.randn(shape, generator=g) * torch.exp2(torch.randint(low, high, shape, generator=g).float())).to(
        in_dtype)


def matrix(x):
    return x.view(math.prod(x.shape[:-1]), x.shape[-1])


@pytest.mark.parametrize("shape", DBIAS_SHAPES)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose_dbias(shape, in_dtype, dtype):
    x = wide_range(shape, in_dtype, sum(shape) + len(shape))
    finite = x.clone()
    m = matrix(x)
    if m.numel():  # +inf and -inf, each alone in its column
        m[m.shape[0] // 2, 0] = float("inf")
        m[-1, -1] = -float("inf") if m.shape[1] > 1 else float("inf")
    check_cuda_equals_cpu(cast_transpose_dbias_with, x, torch.tensor([0.75]), torch.zeros(1, 2), dtype)
    counter = torch.zeros(1, dtype=torch.int32)
    for pow2, margin in ((True, 0), (False, 1)):  # current scaling (warm-up), then delayed
        check_cuda_equals_cpu(cast_transpose_dbias_with, finite, torch.ones(1), torch.zeros(1, 2), dtype, counter, 3,
                              margin, pow2)
        check_cuda_equals_cpu(cast_transpose_dbias_with, finite, torch.tensor([2.0**-7]), torch.zeros(1, 2), dtype,
                              torch.tensor([3], dtype=torch.int32), 3, margin, pow2)


def test_cast_transpose_dbias_equals_cast_transpose_on_cuda():
    x = wide_range((3000, 72), torch.bfloat16, 1).to(CUDA)
    amax_t, amax_d = torch.zeros(1, 2, device=CUDA), torch.zeros(1, 2, device=CUDA)
    scale = torch.tensor([0.75], device=CUDA)
    expected = fp8amp.ops.cast_transpose(x, scale, amax_t, fp8amp.E4M3)
    *got, dbias = fp8amp.ops.cast_transpose_dbias(x, scale, amax_d, fp8amp.E4M3)
    for a, b in zip(got, expected, strict=True):
        assert_bits_equal(a, b)
    assert_bits_equal(amax_d, amax_t)
    assert dbias.device.type == CUDA and dbias.dtype == torch.float32 and dbias.shape == (72,)


def with_nans(shape, in_dtype, seed):
    """x with a NaN alone in column 0 (in the second band when there is one), +inf and -inf in
    column 1 (their sum: NaN), +inf in column 2 and a NaN in the last row's last column."""
    x = wide_range(shape, in_dtype, seed)
    m = matrix(x)
    rows, cols = m.shape
    m[min(300, rows - 1), 0] = float("nan")
    m[0, 1], m[rows - 1, 1] = float("inf"), -float("inf")
    m[rows // 2, 2] = float("inf")
    m[rows - 1, cols - 1] = -float("nan")
    return x


NAN_SHAPES = [(2, 5), (257, 65), (3000, 72), (513, 1031), (2, 3, 130)]


@pytest.mark.parametrize("shape", NAN_SHAPES)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose_dbias_with_nan_and_inf(shape, in_dtype, dtype):
    x = with_nans(shape, in_dtype, sum(shape))
    for counter, steps in ((None, 0), (torch.zeros(1, dtype=torch.int32), 2)):  # delayed; warm-up (NaN amax)
        cpu_inputs, cpu_result, cuda_inputs, cuda_result = on_both(
            cast_transpose_dbias_with, x, torch.tensor([0.5]), torch.zeros(1, 2), dtype, counter, steps)
        assert_all_same(cpu_result, cuda_result)  # dbias too: a NaN sum is the canonical NaN on both
        assert_all_same(cpu_inputs, cuda_inputs)  # amax (NaN), counter
        nan = torch.zeros(shape[-1], dtype=torch.bool)
        nan[[0, 1, shape[-1] - 1]] = True
        assert torch.equal(cuda_result[3].isnan(), nan)
        assert cuda_result[3][2].item() == float("inf")


def test_cast_transpose_dbias_misaligned_rows():
    base = torch.randn(129 * 64 + 1, dtype=torch.bfloat16)
    x = base[1:].view(129, 64)  # 2-byte offset: no 16-byte packs
    check_cuda_equals_cpu(cast_transpose_dbias_with, x, torch.tensor([4.0]), torch.zeros(1), fp8amp.E4M3)
    x = (torch.randn(300 * 40 + 1) * 100)[1:].view(300, 40)  # float32, 4-byte offset
    check_cuda_equals_cpu(cast_transpose_dbias_with, x, torch.tensor([4.0]), torch.zeros(1), fp8amp.E5M2)


def test_cast_transpose_dbias_subnormal_sums_are_exact():
    # Multiples of 2^-149 whose every partial sum stays subnormal: exact (no flush to zero) on both.
    g = torch.Generator().manual_seed(11)
    k = torch.randint(-1000, 1000, (3000, 33), generator=g)
    x = k.float() * 2.0**-149
    check_cuda_equals_cpu(cast_transpose_dbias_with, x, torch.ones(1), torch.zeros(1), fp8amp.E4M3)
    dbias = cast_transpose_dbias_with(x.to(CUDA), torch.ones(1, device=CUDA), torch.zeros(1, device=CUDA),
                                      fp8amp.E4M3)[3]
    assert_bits_equal(dbias.cpu(), k.sum(0).float() * 2.0**-149)


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION)
def test_dequantize_every_code(dtype, out_dtype):
    x = all_bit_patterns(dtype)
    for scale_inv in (1.0, 2.0**-5, 2.0**7, 0.3, 1e-30, 1e30):
        check_cuda_equals_cpu(fp8amp.ops.dequantize, x, torch.tensor([scale_inv]), out_dtype)
        check_cuda_equals_cpu(fp8amp.ops.dequantize, x[1:], torch.tensor([scale_inv]), out_dtype)


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_dequantize_odd_shapes(shape):
    x = torch.randn(shape).to(fp8amp.E5M2)
    for out_dtype in HIGH_PRECISION:
        check_cuda_equals_cpu(fp8amp.ops.dequantize, x, torch.tensor([0.125]), out_dtype)


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_amax_of_row_runs(in_dtype):
    """Strided views read in place (fp8amp's row-runs kernel): q, k, v of a (B, T, 3, H, D) output at
    the 1B GPT's width and odd ones, a slice of columns with a misaligned start; a NaN outside the
    view is not seen, one inside it is."""
    g = torch.Generator().manual_seed(6)
    qkv = (torch.randn(2, 1024, 3, 16, 128, generator=g) * 10).to(in_dtype)
    qkv[1, 5, 2, 3, 7] = float("nan")  # inside v only
    odd = (torch.randn(37, 1003, generator=g) * 10).to(in_dtype)
    odd[:, 1000:] = float("nan")
    odd[20, 500] = -7e3
    views = {"q": lambda t: t[:, :, 0].transpose(1, 2), "k": lambda t: t[:, :, 1].transpose(1, 2),
             "v": lambda t: t[:, :, 2].transpose(1, 2)}
    for name, view in views.items():
        cpu, cuda = torch.zeros(1), torch.zeros(1, device=CUDA)
        x = view(qkv)
        fp8amp.ops.amax(x, cpu)
        fp8amp.ops.amax(view(qkv.to(CUDA)), cuda)
        assert_bits_equal(cuda.cpu(), cpu)
        assert cpu.isnan().item() == (name == "v"), name
    for view in (lambda t: t[:, 1:1000], lambda t: t[3:, :999], lambda t: t[::2, 5:6]):
        cpu, cuda = torch.zeros(1), torch.zeros(1, device=CUDA)
        fp8amp.ops.amax(view(odd), cpu)
        fp8amp.ops.amax(view(odd.to(CUDA)), cuda)
        assert_bits_equal(cuda.cpu(), cpu)
        assert cpu.isfinite().item()
    for x in (qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2), odd[3:, :999]):  # the functional one
        assert_bits_equal(fp8amp.ops.amax_of(x.to(CUDA)).cpu(), fp8amp.ops.amax_of(x))


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_amax(in_dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3_000_001, generator=g) * 10).to(in_dtype)
    x[2_345_678] = -7e3
    check_cuda_equals_cpu(fp8amp.ops.amax, x, torch.tensor([5.0, 9e9]))
    check_cuda_equals_cpu(fp8amp.ops.amax, x, torch.tensor([8e3]))
    x[17] = float("nan")
    check_cuda_equals_cpu(fp8amp.ops.amax, x, torch.tensor([5.0]))
    check_cuda_equals_cpu(fp8amp.ops.amax, x, torch.zeros(1), warmup_counter=torch.tensor([2], dtype=torch.int32),
                          warmup_steps=2)
    check_cuda_equals_cpu(fp8amp.ops.amax, x, torch.zeros(1), warmup_counter=torch.tensor([1], dtype=torch.int32),
                          warmup_steps=2)


def many_tensors(n, in_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 5000, (n,), generator=g).tolist()
    sizes[0], sizes[n // 2], sizes[-1] = 0, 70_001, 1
    xs = [(torch.randn(s, generator=g) * 10 ** (i % 7 - 3)).to(in_dtype) for i, s in enumerate(sizes)]
    xs[3][0] = float("nan")
    xs[4][1] = float("inf")
    xs[5] = xs[5][1:]  # misaligned
    return xs


def dequantize_into_one_buffer(codes, scale_inv, buf):
    """multi_dequantize into consecutive views of ``buf`` from element 1 on: odd offsets, which the
    kernel's word packs must handle; the elements around them must stay untouched."""
    outs, offset = [], 1
    for c in codes:
        outs.append(buf[offset:offset + c.numel()])
        offset += c.numel()
    fp8amp.ops.multi_dequantize(codes, scale_inv, buf.dtype, outs=outs)
    return buf


@pytest.mark.parametrize("n", [50, 130])  # 130: more than one launch (64 tensors each)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_multi_tensor_ops(n, in_dtype):
    xs = many_tensors(n, in_dtype, n)
    g = torch.Generator().manual_seed(n + 1)
    scale = torch.exp2(torch.randint(-10, 10, (n,), generator=g).float())
    counter = torch.randint(0, 8, (n,), generator=g, dtype=torch.int32)
    for dtype in SCALED_FORMATS:
        history = torch.rand(n, 4, generator=g) * 100
        check_cuda_equals_cpu(fp8amp.ops.multi_quantize, xs, scale, history, dtype)
        check_cuda_equals_cpu(fp8amp.ops.multi_quantize, xs, scale, history, dtype, warmup_counter=counter,
                              warmup_steps=4, margin=1, pow2_scale=dtype != fp8amp.E5M2)
        codes = [x.float().to(dtype) for x in xs]
        for out_dtype in HIGH_PRECISION:
            check_cuda_equals_cpu(fp8amp.ops.multi_dequantize, codes, scale, out_dtype)
            buf = torch.full((sum(c.numel() for c in codes) + 2,), 5.0, dtype=out_dtype)
            check_cuda_equals_cpu(dequantize_into_one_buffer, codes, scale, buf)
    check_cuda_equals_cpu(fp8amp.ops.multi_amax, xs, torch.rand(n, 2, generator=g))
    check_cuda_equals_cpu(fp8amp.ops.multi_amax, xs, torch.zeros(n))
    for dtype in (fp8amp.E4M3, fp8amp.E5M2):
        check_cuda_equals_cpu(fp8amp.ops.multi_amax, [x.float().to(dtype) for x in xs], torch.zeros(n))


def random_histories(n, h, seed):
    g = torch.Generator().manual_seed(seed)
    history = torch.rand(n, h, generator=g) * torch.exp2(torch.randint(-130, 130, (n, 1), generator=g).float())
    history[::7, 0] = float("nan")
    history[3::11, 0] = float("inf")
    history[5::13] = 0.0
    history[6::17, 1:] = 0.0
    return history


@pytest.mark.parametrize("pow2,margin", [(True, 0), (True, 3), (False, 0), (False, 2)])
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_scale_updates(pow2, margin, dtype):
    n, h = 1000, 16
    fmax = fp8amp.format_max(dtype)
    g = torch.Generator().manual_seed(margin)
    scale = torch.exp2(torch.randint(-5, 5, (n,), generator=g).float())
    scale_inv = 1 / scale
    counter = torch.randint(0, h + 1, (n,), generator=g, dtype=torch.int32)
    history = random_histories(n, h, margin)
    check_cuda_equals_cpu(fp8amp.ops.compute_scale, history, scale, scale_inv, fmax, margin=margin, pow2_scale=pow2)
    check_cuda_equals_cpu(fp8amp.ops.update_delayed_scaling, history, scale, scale_inv, counter, fmax, margin=margin,
                          pow2_scale=pow2)


def test_multi_update_delayed_scaling():
    """150 one-tensor states and a few wider ones (three launches of up to 64), histories with NaN
    and inf, several steps: CUDA equals the CPU bit for bit."""
    g = torch.Generator().manual_seed(4)
    hists = [torch.rand(1 + (i % 7 == 0) * 2, 1 + i % 17, generator=g) * 10.0 ** (i % 9 - 4) for i in range(150)]
    hists[5][0, 0], hists[77][0, 0] = float("nan"), float("inf")
    scales = [torch.full((h.shape[0],), 2.0) for h in hists]
    scale_invs = [torch.full((h.shape[0],), 0.5) for h in hists]
    counters = [torch.randint(0, 20, (h.shape[0],), generator=g, dtype=torch.int32) for h in hists]
    cpu = [[t.clone() for t in ts] for ts in (hists, scales, scale_invs, counters)]
    cuda = [[t.to(CUDA) for t in ts] for ts in (hists, scales, scale_invs, counters)]
    for _ in range(3):
        fp8amp.ops.multi_update_delayed_scaling(*cpu, 57344.0, margin=1)
        fp8amp.ops.multi_update_delayed_scaling(*cuda, 57344.0, margin=1)
        for a_list, b_list in zip(cpu, cuda):
            assert_all_same(a_list, [b.cpu() for b in b_list])
