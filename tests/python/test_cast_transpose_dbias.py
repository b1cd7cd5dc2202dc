"""cast_transpose_dbias on CPU (the reference implementation): cast_transpose's outputs bit for bit,
plus the column sums in the documented order (src/cast/cast_kernels.h, "Column sums")."""

import math

import numpy as np
import pytest
import torch

import fp8amp
from cast_reference import HIGH_PRECISION, SCALED_FORMATS, assert_bits_equal, assert_same_float, bits, fresh_scaling

# cast_transpose_dbias: cast_transpose's outputs plus the column sums, in the order of
# src/cast/cast_kernels.h ("Column sums").
BAND_ROWS, TILE_ROWS, TILES, GROUP_ROWS = 256, 128, 2, 4
GROUPS = TILE_ROWS // GROUP_ROWS


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as the [M, N] matrix the op sees (N may be 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def documented_band_sums(x: torch.Tensor, group_rows=None) -> np.ndarray:
    """The band sums of x ([..., N], viewed as [M, N]) in numpy float32, float32 [bands, N], in the
    documented order: bands of 256 rows; in a band, group g holds rows k * 128 + g * 4 + i (k in
    0..1, then i in 0..3), added from +0; the band adds its groups in order from +0.
    ``group_rows(g)`` may replace a group's band-relative rows (another order, to show that the
    test data tells orders apart)."""
    if group_rows is None:
        group_rows = lambda g: [k * TILE_ROWS + g * GROUP_ROWS + i for k in range(TILES) for i in range(GROUP_ROWS)]
    a = as_matrix(x.float()).numpy()
    rows, cols = a.shape
    bands = np.zeros((-(-rows // BAND_ROWS), cols), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(bands.shape[0]):
            band = np.zeros(cols, dtype=np.float32)
            for g in range(GROUPS):
                group = np.zeros(cols, dtype=np.float32)
                for r in group_rows(g):
                    if b * BAND_ROWS + r < rows:
                        group = group + a[b * BAND_ROWS + r]
                band = band + group
            bands[b] = band
    return bands


def documented_column_sums(x: torch.Tensor, group_rows=None) -> torch.Tensor:
    """dbias in the documented order: the band sums added in band order, from +0 (numpy float32)."""
    bands = documented_band_sums(x, group_rows)
    dbias = np.zeros(bands.shape[1], dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for band in bands:
            dbias = dbias + band
    assert dbias.dtype == np.float32
    return torch.from_numpy(dbias)


def sequential_column_sums(x: torch.Tensor) -> torch.Tensor:
    a = as_matrix(x.float()).numpy()
    total = np.zeros(a.shape[1], dtype=np.float32)
    for row in a:
        total = total + row
    return torch.from_numpy(total)


def assert_column_sums_close(dbias: torch.Tensor, x: torch.Tensor) -> None:
    """dbias against the exact (float64) column sums of x, within the float32 rounding error of a
    summation tree as deep as the documented one: 8 adds per group, 32 per band, one per band."""
    x2 = as_matrix(x.double())
    rows, cols = x2.shape
    assert dbias.dtype == torch.float32 and dbias.shape == (cols,)
    depth = TILES * GROUP_ROWS + GROUPS + -(-rows // BAND_ROWS)
    bound = (depth + 1) * 2.0**-24 * x2.abs().sum(0)
    err = (dbias.double() - x2.sum(0)).abs()
    assert (err <= bound).all(), f"column sums off: err {err.max().item()}, bound {bound.min().item()}"


CTD_SHAPES = [(1, 1), (7,), (3, 5), (300, 40), (517, 33), (2, 3, 7), (3, 1, 4, 9), (256, 8), (513, 3),
              (0, 8),  # no rows: dbias [8] of zeros
              (7, 0)]  # no columns: dbias []


@pytest.mark.parametrize("shape", CTD_SHAPES)
@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose_dbias_equals_cast_transpose(shape, in_dtype, dtype):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    x = (torch.randn(shape, generator=g) * 300).to(in_dtype)
    history = torch.rand(1, 3, generator=g) * 100  # folded into, like cast_transpose's
    history_ct, history_ctd = history.clone(), history.clone()
    out, out_t, scale_inv = fp8amp.ops.cast_transpose(x, torch.tensor([0.5]), history_ct, dtype)
    out_d, out_t_d, scale_inv_d, dbias = fp8amp.ops.cast_transpose_dbias(x, torch.tensor([0.5]), history_ctd, dtype)
    assert_bits_equal(out_d, out)
    assert_bits_equal(out_t_d, out_t)
    assert_bits_equal(scale_inv_d, scale_inv)
    assert_bits_equal(history_ctd, history_ct)
    cols = shape[-1]
    assert dbias.shape == (cols,) and dbias.dtype == torch.float32 and dbias.device == x.device
    assert_column_sums_close(dbias, x)
    assert_bits_equal(dbias, documented_column_sums(x))


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose_dbias_equals_cast_transpose_with_warm_up(in_dtype, dtype):
    x = (torch.randn(300, 70, generator=torch.Generator().manual_seed(2)) * 7).to(in_dtype)
    for counter, margin, pow2 in ((0, 0, True), (0, 1, False), (3, 0, True)):  # current, current, delayed
        kwargs = dict(warmup_counter=torch.tensor([counter], dtype=torch.int32), warmup_steps=3, margin=margin,
                      pow2_scale=pow2)
        history_t, history_d = torch.zeros(1, 3), torch.zeros(1, 3)
        history_t[0, 0] = history_d[0, 0] = 50.0  # an amax seen earlier in the step: current scaling uses it
        expected = fp8amp.ops.cast_transpose(x, torch.tensor([4.0]), history_t, dtype, **kwargs)
        *got, dbias = fp8amp.ops.cast_transpose_dbias(x, torch.tensor([4.0]), history_d, dtype, **kwargs)
        for a, b in zip(got, expected, strict=True):
            assert_bits_equal(a, b)
        assert_bits_equal(history_d, history_t)
        assert_bits_equal(dbias, documented_column_sums(x))
        assert kwargs["warmup_counter"].item() == counter  # the op only reads the counter


def test_cast_transpose_dbias_makes_non_contiguous_input_contiguous():
    x = torch.randn(40, 600)[:, 1::2].t()  # [300, 40], not contiguous
    assert not x.is_contiguous()
    *outs, dbias = fp8amp.ops.cast_transpose_dbias(x, torch.tensor([2.0]), torch.zeros(1), fp8amp.E5M2)
    expected = fp8amp.ops.cast_transpose(x.contiguous(), torch.tensor([2.0]), torch.zeros(1), fp8amp.E5M2)
    for a, b in zip(outs, expected, strict=True):
        assert_bits_equal(a, b)
    assert_bits_equal(dbias, documented_column_sums(x.contiguous()))
    assert_column_sums_close(dbias, x)


def test_cast_transpose_dbias_op_equals_wrapper():
    x = torch.randn(257, 9, dtype=torch.bfloat16)
    amax_w, amax_op = torch.zeros(1, 2), torch.zeros(1, 2)
    wrapped = fp8amp.ops.cast_transpose_dbias(x, torch.ones(1), amax_w, fp8amp.E4M3)
    raw = torch.ops.fp8amp.cast_transpose_dbias.default(x, torch.ones(1), amax_op, fp8amp.E4M3)
    assert isinstance(raw, tuple) and len(raw) == 4
    for a, b in zip(raw, wrapped, strict=True):
        assert_bits_equal(a, b)
    assert_bits_equal(amax_op, amax_w)


@pytest.mark.parametrize("cols", [1, 8, 33])
def test_cast_transpose_dbias_of_no_rows_is_positive_zeros(cols):
    for shape in ((0, cols), (2, 0, cols)):
        x = torch.empty(shape)
        amax = torch.full((1, 2), 3.0)
        out, out_t, scale_inv, dbias = fp8amp.ops.cast_transpose_dbias(x, torch.tensor([4.0]), amax, fp8amp.E4M3)
        assert out.shape == shape and out_t.shape == (cols, 0)
        assert_bits_equal(dbias, torch.zeros(cols))  # +0, bit for bit
        assert_bits_equal(scale_inv, torch.tensor([0.25]))
        assert_bits_equal(amax, torch.full((1, 2), 3.0))


def test_cast_transpose_dbias_of_no_columns():
    out, out_t, scale_inv, dbias = fp8amp.ops.cast_transpose_dbias(torch.empty(7, 0), torch.ones(1), torch.zeros(1),
                                                                fp8amp.E5M2)
    assert out.shape == (7, 0) and out_t.shape == (0, 7) and dbias.shape == (0,) and dbias.dtype == torch.float32


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
def test_cast_transpose_dbias_sums_start_from_positive_zero(in_dtype):
    # Every sum starts from +0, so a column of -0.0 (or of values that cancel) sums to +0.
    x = torch.full((600, 3), -0.0, dtype=in_dtype)
    x[:, 1] = torch.tensor([1.0, -1.0], dtype=in_dtype).repeat(300)
    x[0, 2] = -2.0
    dbias = fp8amp.ops.cast_transpose_dbias(x, torch.ones(1), torch.zeros(1), fp8amp.E4M3)[3]
    assert_bits_equal(dbias, torch.tensor([0.0, 0.0, -2.0]))


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
def test_cast_transpose_dbias_nan_and_inf_stay_in_their_columns(in_dtype, dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(517, 7, generator=g) * 10).to(in_dtype)
    x[300, 1] = float("nan")  # in the second band
    x[516, 2] = float("inf")  # the last row
    x[0, 3] = -float("inf")
    x[5, 4], x[400, 4] = float("inf"), -float("inf")  # inf - inf: NaN
    x[7, 5], x[8, 5] = float("inf"), float("inf")
    scale, amax = fresh_scaling(1.0)
    out, out_t, scale_inv, dbias = fp8amp.ops.cast_transpose_dbias(x, scale, amax, dtype)
    nan = torch.tensor([False, True, False, False, True, False, False])
    assert torch.equal(dbias.isnan(), nan), dbias
    assert dbias[2].item() == float("inf") and dbias[3].item() == -float("inf") and dbias[5].item() == float("inf")
    finite = torch.tensor([0, 6])
    assert dbias[finite].isfinite().all()
    assert_column_sums_close(dbias[finite], x[:, finite])
    assert_same_float(dbias, documented_column_sums(x))
    assert amax.isnan().item()
    scale_t, amax_t = fresh_scaling(1.0)
    expected = fp8amp.ops.cast_transpose(x, scale_t, amax_t, dtype)
    for a, b in zip((out, out_t, scale_inv), expected, strict=True):
        assert_bits_equal(a, b)
    assert_bits_equal(amax, amax_t)


@pytest.mark.parametrize("in_dtype", HIGH_PRECISION)
@pytest.mark.parametrize("rows", [1100, 600, 256, 129, 3])
def test_cast_transpose_dbias_adds_in_the_documented_order(in_dtype, rows):
    g = torch.Generator().manual_seed(rows)
    low, high = (-20, 20) if in_dtype != torch.float16 else (-20, 12)  # float16: stay below 65504
    x = (torch.rand(rows, 16, generator=g) - 0.5) * torch.exp2(torch.randint(low, high, (rows, 16), generator=g).float())
    x = x.to(in_dtype)
    expected = documented_column_sums(x)
    # The data tells the documented order from nearby ones: a kernel adding in any of them fails.
    if rows > 8:  # row by row; groups of 8 consecutive rows
        assert not torch.equal(bits(expected), bits(sequential_column_sums(x)))
        consecutive = documented_column_sums(x, lambda g: range(g * 8, g * 8 + 8))
        assert not torch.equal(bits(expected), bits(consecutive))
    if rows >= BAND_ROWS:  # a group's rows i, then k (rather than k, then i)
        swapped = documented_column_sums(
            x, lambda g: [k * TILE_ROWS + g * GROUP_ROWS + i for i in range(GROUP_ROWS) for k in range(TILES)])
        assert not torch.equal(bits(expected), bits(swapped))
    if rows > 3 * BAND_ROWS:  # the bands added pairwise
        bands = torch.from_numpy(documented_band_sums(x))
        while bands.shape[0] > 1:
            pairs = bands[: bands.shape[0] // 2 * 2].view(-1, 2, bands.shape[1])
            bands = torch.cat([pairs[:, 0] + pairs[:, 1], bands[bands.shape[0] // 2 * 2:]])
        assert not torch.equal(bits(expected), bits(bands[0]))
    dbias = fp8amp.ops.cast_transpose_dbias(x, torch.ones(1), torch.zeros(1), fp8amp.E4M3)[3]
    assert_bits_equal(dbias, expected, expected)
    # The 3-D view of the same matrix sums the same way.
    if rows % 3 == 0:
        dbias_3d = fp8amp.ops.cast_transpose_dbias(x.view(3, rows // 3, 16), torch.ones(1), torch.zeros(1), fp8amp.E5M2)[3]
        assert_bits_equal(dbias_3d, expected)


def test_cast_transpose_dbias_subnormal_sums_are_exact():
    # Multiples of 2^-149 whose every partial sum stays subnormal add exactly: no flush to zero.
    k = torch.randint(-1000, 1000, (3000, 33), generator=torch.Generator().manual_seed(11))
    x = k.float() * 2.0**-149
    dbias = fp8amp.ops.cast_transpose_dbias(x, torch.ones(1), torch.zeros(1), fp8amp.E4M3)[3]
    assert_bits_equal(dbias, k.sum(0).float() * 2.0**-149)
    assert dbias.ne(0).any()


def test_scaling_state_cast_transpose_dbias_equals_cast_transpose():
    recipe = fp8amp.ScalingRecipe(history_len=3, margin=1)
    state_t, state_d = fp8amp.ScalingState(2, fp8amp.E5M2, recipe), fp8amp.ScalingState(2, fp8amp.E5M2, recipe)
    g = torch.Generator().manual_seed(9)
    for step in range(6):  # warm-up, then delayed scaling
        x = (torch.randn(300, 24, generator=g) * 10.0 ** (step % 3)).to(torch.bfloat16)
        expected = state_t.cast_transpose(x, 1)
        *got, dbias = state_d.cast_transpose_dbias(x, 1)
        for a, b in zip(got, expected, strict=True):
            assert_bits_equal(a, b)
        assert_bits_equal(dbias, documented_column_sums(x))
        for name, value in state_t.named_buffers():
            assert_bits_equal(getattr(state_d, name), value)
        state_t.update()
        state_d.update()
    assert state_d.counter[1].item() == 3
