"""The cast ops on CPU (the reference implementation) against torch's own casts, bit for bit."""

import math

import pytest
import torch

import fp8amp
from cast_reference import (
    HIGH_PRECISION,
    NAN_CODE,
    SCALED_FORMATS,
    all_bit_patterns,
    assert_bits_equal,
    assert_dequantized,
    assert_quantized,
    assert_same_float,
    bits,
    boundary_values,
    fresh_scaling,
    random_float32_bits,
    scaled,
    torch_amax,
)

# Scales: 1, powers of two that move values into the subnormals and to saturation, and
# non-powers of two (TE's rule) whose products round.
SCALES = [1.0, 2.0**-9, 2.0**12, 0.3, 7.0]


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_boundary_values(dtype, scale):
    x = boundary_values(dtype)
    scale_t, amax = fresh_scaling(scale)
    out, scale_inv = fp8amp.ops.quantize(x, scale_t, amax, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert_quantized(out, scaled(x, scale_t), dtype)
    assert_bits_equal(scale_inv, 1.0 / scale_t)
    assert amax.isnan().item()  # boundary_values holds NaNs


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_every_16bit_input(dtype, in_dtype, scale):
    x = all_bit_patterns(in_dtype)
    scale_t, amax = fresh_scaling(scale)
    out, _ = fp8amp.ops.quantize(x, scale_t, amax, dtype)
    assert_quantized(out, scaled(x, scale_t), dtype)


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_random_float32(dtype, scale):
    g = torch.Generator().manual_seed(1)
    normal = torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-30, 30, (50_000,), generator=g).float())
    for x in (normal, random_float32_bits(50_000, g)):
        scale_t, amax = fresh_scaling(scale)
        out, _ = fp8amp.ops.quantize(x, scale_t, amax, dtype)
        assert_quantized(out, scaled(x, scale_t), dtype)
        assert_same_float(amax, torch_amax(x))


@pytest.mark.parametrize(
    "shape",
    [(), (1,), (0,), (0, 5), (2, 1, 3, 1, 5, 7), (3, 1, 1, 1, 1, 1, 1, 2), (17, 33), (1000, 37),
     (3, 0),
     (2, 0, 3)],
)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_quantize_shapes(shape, in_dtype):
    x = (torch.randn(shape) * 100).to(in_dtype)
    scale_t, amax = fresh_scaling(2.0)
    out, scale_inv = fp8amp.ops.quantize(x, scale_t, amax, fp8amp.E4M3)
    assert out.shape == x.shape and out.dtype == fp8amp.E4M3
    assert_quantized(out, scaled(x, scale_t), fp8amp.E4M3)
    assert_bits_equal(scale_inv, torch.tensor([0.5]))
    assert_bits_equal(amax, torch_amax(x))


def test_quantize_makes_non_contiguous_input_contiguous():
    x = torch.randn(16, 24)[:, 1::3].t()
    assert not x.is_contiguous()
    scale_t, amax = fresh_scaling(4.0)
    out, _ = fp8amp.ops.quantize(x, scale_t, amax, fp8amp.E5M2)
    assert_quantized(out, scaled(x, scale_t), fp8amp.E5M2)


def test_quantize_delayed_uses_given_scale_and_folds_amax():
    x = torch.tensor([1.5, -3.0, 0.25])
    scale = torch.tensor([8.0])
    history = torch.tensor([[2.0, 100.0, 7.0]])
    out, scale_inv = fp8amp.ops.quantize(x, scale, history, fp8amp.E4M3, warmup_counter=torch.tensor([4], dtype=torch.int32),
                                     warmup_steps=4)
    assert_quantized(out, scaled(x, scale), fp8amp.E4M3)
    assert_bits_equal(scale_inv, torch.tensor([0.125]))
    assert_bits_equal(history, torch.tensor([[3.0, 100.0, 7.0]]))  # only column 0 takes the amax


def test_quantize_current_scaling_while_warming_up():
    # amax 10 -> scale 32 (docs/numerics.md#numerics); the slot's earlier amax of the step counts too.
    counter = torch.tensor([0], dtype=torch.int32)
    x = torch.tensor([10.0, -2.0])
    history = torch.zeros(1, 4)
    out, scale_inv = fp8amp.ops.quantize(x, torch.ones(1), history, fp8amp.E4M3, warmup_counter=counter, warmup_steps=4)
    assert_bits_equal(scale_inv, torch.tensor([1 / 32]))
    assert_quantized(out, scaled(x, torch.tensor([32.0])), fp8amp.E4M3)
    history[0, 0] = 1e4  # a larger amax seen earlier in this step: scale 1/32
    out, scale_inv = fp8amp.ops.quantize(x, torch.ones(1), history, fp8amp.E4M3, warmup_counter=counter, warmup_steps=4)
    assert_bits_equal(scale_inv, torch.tensor([32.0]))
    assert_quantized(out, scaled(x, torch.tensor([1 / 32])), fp8amp.E4M3)


@pytest.mark.parametrize("amax_now", [0.0, float("nan"), float("inf")])
def test_quantize_warm_up_keeps_given_scale_without_a_usable_amax(amax_now):
    x = torch.tensor([amax_now, 0.0, -0.0])
    counter = torch.tensor([0], dtype=torch.int32)
    history = torch.zeros(1, 2)
    out, scale_inv = fp8amp.ops.quantize(x, torch.tensor([4.0]), history, fp8amp.E4M3, warmup_counter=counter,
                                     warmup_steps=2)
    assert_bits_equal(scale_inv, torch.tensor([0.25]))
    assert_quantized(out, scaled(x, torch.tensor([4.0])), fp8amp.E4M3)


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (7,), (5, 3), (64, 64), (65, 129), (2, 3, 17), (3, 1, 4, 9),
     (0, 5),  # out_t [5, 0]
     (5, 0)],
)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose_layout(shape, in_dtype, dtype):
    x = (torch.randn(shape) * 300).to(in_dtype)
    scale, amax = fresh_scaling(0.5)
    out, out_t, scale_inv = fp8amp.ops.cast_transpose(x, scale, amax, dtype)
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    assert out.shape == x.shape and out_t.shape == (cols, rows)
    assert out.dtype == out_t.dtype == dtype and out_t.is_contiguous()
    assert_quantized(out, scaled(x, scale), dtype)
    assert_bits_equal(out_t, out.reshape(rows, cols).t().contiguous())
    assert_bits_equal(scale_inv, torch.tensor([2.0]))
    assert_bits_equal(amax, torch_amax(x))


def test_cast_transpose_of_zero_columns_is_zero_by_rows():
    x = torch.empty(4, 0).contiguous()
    out_t = torch.ops.fp8amp.cast_transpose.default(x, torch.ones(1), torch.zeros(1), fp8amp.E4M3)[1]
    assert out_t.shape == (0, 4)


def test_cast_transpose_equals_quantize_with_warm_up():
    x = torch.randn(33, 70) * 7
    for counter in (0, 3):
        kwargs = dict(warmup_counter=torch.tensor([counter], dtype=torch.int32), warmup_steps=3)
        history_q, history_t = torch.zeros(1, 3), torch.zeros(1, 3)
        out_q, scale_inv_q = fp8amp.ops.quantize(x, torch.tensor([4.0]), history_q, fp8amp.E4M3, **kwargs)
        out, out_t, scale_inv = fp8amp.ops.cast_transpose(x, torch.tensor([4.0]), history_t, fp8amp.E4M3, **kwargs)
        assert_bits_equal(out, out_q)
        assert_bits_equal(out_t, out_q.t().contiguous())
        assert_bits_equal(scale_inv, scale_inv_q)
        assert_bits_equal(history_t, history_q)


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("scale_inv", [1.0, 2.0**-5, 2.0**7, 0.3, 1e-30, 1e30])
def test_dequantize_every_code(dtype, out_dtype, scale_inv):
    x = all_bit_patterns(dtype)
    scale_inv_t = torch.tensor([scale_inv], dtype=torch.float32)
    out = fp8amp.ops.dequantize(x, scale_inv_t, out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape
    assert_dequantized(out, x, scale_inv_t, out_dtype)


@pytest.mark.parametrize("shape", [(), (0,), (3, 1, 5, 1, 2), (31, 17)])
def test_dequantize_shapes(shape):
    x = torch.randn(shape).to(fp8amp.E5M2)
    out = fp8amp.ops.dequantize(x, torch.tensor([0.125]), torch.bfloat16)
    assert out.shape == x.shape
    assert_dequantized(out, x, torch.tensor([0.125]), torch.bfloat16)


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_quantize_dequantize_round_trip_of_every_code(dtype):
    codes = all_bit_patterns(dtype)
    x = codes.float()
    out, scale_inv = fp8amp.ops.quantize(x, torch.ones(1), torch.zeros(1), dtype)
    finite = x.isfinite()
    assert_bits_equal(out[finite], codes[finite])
    assert (bits(out[x.isnan()]) == NAN_CODE[dtype]).all()
    back = fp8amp.ops.dequantize(out, scale_inv, torch.float32)
    assert_bits_equal(back[finite], x[finite])


def test_amax_accumulates_max_of_magnitudes():
    amax = torch.tensor([3.0])
    fp8amp.ops.amax(torch.tensor([-2.0, 1.0]), amax)
    assert_bits_equal(amax, torch.tensor([3.0]))
    fp8amp.ops.amax(torch.tensor([[0.5, -5.0]], dtype=torch.bfloat16), amax)
    assert_bits_equal(amax, torch.tensor([5.0]))
    fp8amp.ops.amax(torch.tensor([-float("inf")], dtype=torch.float16), amax)
    assert_bits_equal(amax, torch.tensor([float("inf")]))
    fp8amp.ops.amax(torch.tensor([float("nan"), 1.0]), amax)
    assert amax.isnan().item()
    fp8amp.ops.amax(torch.tensor([1e9]), amax)  # NaN stays
    assert amax.isnan().item()


def test_amax_of_zeros_and_empty_keeps_value():
    amax = torch.tensor([0.0])
    fp8amp.ops.amax(torch.tensor([0.0, -0.0]), amax)
    fp8amp.ops.amax(torch.empty(0), amax)
    assert_bits_equal(amax, torch.tensor([0.0]))


def test_amax_writes_column_zero_of_a_history():
    history = torch.tensor([[1.0, 50.0, 60.0]])
    fp8amp.ops.amax(torch.tensor([-7.0, 2.0]), history)
    assert_bits_equal(history, torch.tensor([[7.0, 50.0, 60.0]]))


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_amax_random(in_dtype):
    x = (torch.randn(1001, 7) * 1e3).to(in_dtype)
    x[500, 3] = -1e4
    amax = torch.zeros(1)
    fp8amp.ops.amax(x, amax)
    assert_bits_equal(amax, torch_amax(x))


def strided_views(in_dtype):
    """{name: (view, whether its elements are row runs)}: the layouts amax reads in place and others."""
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(2, 16, 3, 4, 8, generator=g) * 100).to(in_dtype)  # (B, T, q/k/v, H, D)
    m = (torch.randn(9, 13, generator=g) * 100).to(in_dtype)
    return {
        "q": (qkv[:, :, 0].transpose(1, 2), True), "k": (qkv[:, :, 1].transpose(1, 2), True),
        "permutation": (qkv.permute(4, 1, 0, 3, 2), True), "columns": (m[:, 2:7], True),
        "every other column": (m[:, ::2], False), "every other row": (m[::2], True),
        "rows and columns": (m[::3, ::2], False), "broadcast": (m[:1].expand(4, 13), False),
        "a column, size-1 dims": (m[:, 3:4].t()[None], True), "every other element": (m.view(-1)[::2], True),
        "empty": (m[:, :0], True),
    }


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_amax_of_strided_views(in_dtype):
    """Row runs are read in place (the raw op takes them; a NaN or a larger value outside the view
    is not seen); other layouts through a contiguous copy (the raw op refuses them)."""
    for name, (x, runs) in strided_views(in_dtype).items():
        assert fp8amp.ops._args.has_row_runs(x) == runs, name
        expected = torch_amax(x.contiguous()) if x.numel() else torch.zeros(1)
        amax = torch.zeros(1)
        fp8amp.ops.amax(x, amax)
        assert_bits_equal(amax, expected)
        raw = torch.zeros(1)
        if runs:
            torch.ops.fp8amp.amax(x, raw)
            assert_bits_equal(raw, expected)
        else:
            with pytest.raises(ValueError, match="amax: x must be contiguous, a permutation of a contiguous tensor"):
                torch.ops.fp8amp.amax(x, raw)
    m = torch.full((6, 10), float("nan"), dtype=in_dtype)
    m[:, 3:8] = torch.arange(30, dtype=torch.float32).reshape(6, 5).to(in_dtype)
    amax = torch.zeros(1)
    fp8amp.ops.amax(m[:, 3:8], amax)
    assert_bits_equal(amax, torch.tensor([29.0]))


def test_has_row_runs_agrees_with_the_core():
    """The wrapper's layout test (Python, traced by Dynamo) and the core's (C++) over random views:
    permutations, slices, steps and size-1 dims of a 4-D tensor; the core refuses what it rejects."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 6, 5, 8, generator=g)
    seen = set()
    for _ in range(400):
        v = base.permute(*torch.randperm(4, generator=g).tolist())
        for d in range(4):
            n = v.shape[d]
            start = int(torch.randint(0, n, (1,), generator=g))
            stop = int(torch.randint(start + 1, n + 1, (1,), generator=g))
            step = 1 if torch.rand(1, generator=g) < 0.7 else 2
            v = v.narrow(d, start, stop - start)[(slice(None),) * d + (slice(None, None, step),)]
        runs = fp8amp.ops._args.has_row_runs(v)
        seen.add(runs)
        amax = torch.zeros(1)
        if runs:
            torch.ops.fp8amp.amax(v, amax)
            assert_bits_equal(amax, torch_amax(v.contiguous()))
        else:
            with pytest.raises(ValueError, match="x must be contiguous, a permutation"):
                torch.ops.fp8amp.amax(v, amax)
    assert seen == {True, False}


def test_amax_with_warmup_counter_only_while_warming_up():
    amax = torch.zeros(1)
    x = torch.tensor([2.0])
    fp8amp.ops.amax(x, amax, warmup_counter=torch.tensor([3], dtype=torch.int32), warmup_steps=3)
    assert_bits_equal(amax, torch.zeros(1))
    fp8amp.ops.amax(x, amax, warmup_counter=torch.tensor([2], dtype=torch.int32), warmup_steps=3)
    assert_bits_equal(amax, torch.tensor([2.0]))


def multi_inputs(in_dtype, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5,), (0,), (3, 4), (1,), (2, 3, 5), (130,), (9, 1)] * (n // 7 + 1)
    xs = [(torch.randn(s, generator=g) * 10 ** (i % 5)).to(in_dtype) for i, s in enumerate(shapes[:n])]
    xs[2][1, 1] = float("nan")
    return xs


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_multi_quantize_equals_single(in_dtype, dtype):
    xs = multi_inputs(in_dtype)
    n = len(xs)
    scale = torch.exp2(torch.arange(n, dtype=torch.float32) - 3)
    history = torch.rand(n, 3) * 100
    counter = torch.tensor([0, 5, 1, 9, 0, 2, 8], dtype=torch.int32)
    kwargs = dict(warmup_steps=4, margin=1, pow2_scale=dtype != fp8amp.E5M2)
    multi_history = history.clone()
    outs, scale_inv = fp8amp.ops.multi_quantize(xs, scale, multi_history, dtype, warmup_counter=counter, **kwargs)
    assert scale_inv.shape == (n,)
    for i, x in enumerate(xs):
        h = history[i : i + 1].clone()
        out, si = fp8amp.ops.quantize(x, scale[i : i + 1], h, dtype, warmup_counter=counter[i : i + 1], **kwargs)
        assert_bits_equal(outs[i], out)
        assert_bits_equal(scale_inv[i : i + 1], si)
        assert_same_float(multi_history[i], h[0])


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION)
def test_multi_dequantize_equals_single(dtype, out_dtype):
    xs = [x.to(dtype) for x in multi_inputs(torch.float32)]
    scale_inv = torch.tensor([1.0, 0.5, 3.0, 2.0**-20, 2.0**20, 0.1, 7.0])
    outs = fp8amp.ops.multi_dequantize(xs, scale_inv, out_dtype)
    for i, x in enumerate(xs):
        assert_bits_equal(outs[i], fp8amp.ops.dequantize(x, scale_inv[i : i + 1], out_dtype))


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("out_dtype", HIGH_PRECISION)
def test_multi_dequantize_into_views_of_one_buffer(dtype, out_dtype):
    """``outs`` given: the same bits as new outputs, written in place into views of one buffer
    (with gaps between them, left untouched), and returned."""
    xs = [x.to(dtype) for x in multi_inputs(torch.float32)]
    scale_inv = torch.tensor([1.0, 0.5, 3.0, 2.0**-20, 2.0**20, 0.1, 7.0])
    buf = torch.full((sum(x.numel() + 1 for x in xs),), 5.0, dtype=out_dtype)
    views, offset = [], 0
    for x in xs:
        views.append(buf[offset:offset + x.numel()].view(x.shape))
        offset += x.numel() + 1
    outs = fp8amp.ops.multi_dequantize(xs, scale_inv, out_dtype, outs=tuple(views))
    assert outs == views
    for out, expected in zip(outs, fp8amp.ops.multi_dequantize(xs, scale_inv, out_dtype)):
        assert out.data_ptr() in {v.data_ptr() for v in views}
        assert_bits_equal(out, expected)
    gaps = torch.tensor([sum(x.numel() + 1 for x in xs[:i + 1]) - 1 for i in range(len(xs))])
    assert_bits_equal(buf[gaps], torch.full((len(xs),), 5.0, dtype=out_dtype))


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_multi_amax_equals_single(in_dtype):
    xs = multi_inputs(in_dtype)
    history = torch.rand(len(xs), 2) * 50
    multi_history = history.clone()
    fp8amp.ops.multi_amax(xs, multi_history)
    for i, x in enumerate(xs):
        h = history[i : i + 1].clone()
        fp8amp.ops.amax(x, h)
        assert_same_float(multi_history[i], h[0])
    flat = torch.zeros(len(xs))  # a [n] buffer works too
    fp8amp.ops.multi_amax(xs, flat)
    assert_same_float(flat, torch.cat([torch_amax(x) for x in xs]))


@pytest.mark.parametrize("dtype", [fp8amp.E4M3, fp8amp.E5M2])
def test_multi_amax_of_codes_is_the_amax_of_their_values(dtype):
    """FP8 codes: every bit pattern (NaN codes and E5M2's infinities in one tensor, finite ones in
    another, an empty one), the amax of the codes' values; times a power-of-two scale_inv that is
    the amax of the dequantized tensor, as the FP8 all-reduce uses it."""
    every = all_bit_patterns(dtype)
    finite = every.view(torch.uint8)[every.float().isfinite()].view(dtype)
    xs = [every, finite, finite[:0], finite.view(torch.uint8).flip(0)[100:137].view(dtype)]
    amax = torch.zeros(len(xs))
    fp8amp.ops.multi_amax(xs, amax)
    assert_same_float(amax, torch.cat([torch_amax(x) for x in xs]))
    scale_inv = torch.tensor([2.0**-11])
    assert_same_float(amax[1:2] * scale_inv, torch_amax(fp8amp.ops.dequantize(finite, scale_inv, torch.float32)))


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_amax_of_returns_what_amax_accumulates_into_a_zero(in_dtype):
    """The functional amax (the one compiled graphs call): a new float32 [1], NaN propagated, 0 for
    an empty x, strided views (q of a qkv output, a transpose) as their values."""
    qkv = (torch.randn(2, 8, 3, 4, 16, generator=torch.Generator().manual_seed(3)) * 100).to(in_dtype)
    for x in (*multi_inputs(in_dtype), qkv[:, :, 0].transpose(1, 2), qkv.flatten(0, 1)[:, 0, 0].t()):
        got = fp8amp.ops.amax_of(x)
        assert got.shape == (1,) and got.dtype == torch.float32
        assert_same_float(got, torch_amax(x))
    with pytest.raises(TypeError, match="x"):
        fp8amp.ops.amax_of([1.0])


@pytest.mark.parametrize("dtype", [fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16])
@pytest.mark.parametrize("special", ["none", "zeros", "inf", "nan", "empty"])
@pytest.mark.parametrize("margin", [0, 2])
def test_quantize_current_is_amax_compute_scale_quantize(dtype, special, margin):
    """quantize_current: the codes, amax and scale_inv of amax into a zero, compute_scale from
    (1, 1) and quantize with that scale, bit for bit; with nan_if_nonfinite, scale_inv is torch's
    NaN for an inf or NaN amax."""
    torch.manual_seed(3)
    x = torch.randn(37, 29) * 40
    if special == "zeros":
        x.zero_()
    elif special == "inf":
        x[5, 7] = -float("inf")
    elif special == "nan":
        x[36, 28] = float("nan")
    elif special == "empty":
        x = x[:0]
    for in_dtype in (torch.float32, torch.bfloat16, torch.float16):
        xi = x.to(in_dtype)
        amax, scale, scale_inv = torch.zeros(1), torch.ones(1), torch.ones(1)
        fp8amp.ops.amax(xi, amax)
        fp8amp.ops.compute_scale(amax, scale, scale_inv, fp8amp.format_max(dtype), margin=margin)
        want, want_scale_inv = fp8amp.ops.quantize(xi, scale, amax.clone(), dtype)
        for nan_if_nonfinite in (False, True):
            out, got_scale_inv, got_amax = fp8amp.ops.quantize_current(xi, dtype, margin=margin,
                                                                   nan_if_nonfinite=nan_if_nonfinite)
            assert_bits_equal(out, want)
            assert_bits_equal(got_amax, amax)
            if nan_if_nonfinite and not torch.isfinite(amax).all():
                assert_bits_equal(got_scale_inv, torch.tensor([float("nan")]))
            else:
                assert_bits_equal(got_scale_inv, want_scale_inv)
