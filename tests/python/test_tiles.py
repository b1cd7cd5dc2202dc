"""Fine-grained scaling ops (fp8amp.ops.quantize_tiles / dequantize_tiles, docs/tiles.md) against
a plain torch reference: per-tile power-of-two scales, partial tiles, the outlier case that
per-tensor scaling loses, non-finite tiles, torch.compile, and the argument checks;
cast_transpose_tiles and scaled_accumulate_tiles against the compositions of those two that they
fuse. On a GPU the CUDA kernels must equal the CPU reference bit for bit."""

import pytest
import torch

import fp8amp
from fp8amp import ops

E4M3, E5M2 = fp8amp.E4M3, fp8amp.E5M2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def reference(x, fmt, tile):
    """Per tile: amax, scale = 2^floor(log2(fmax / amax)) (1 for zeros), codes = x * scale in fmt."""
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    m = x.float().reshape(rows, cols)
    tr, tc = tile
    gr, gc = -(-rows // tr), -(-cols // tc)
    padded = torch.zeros(gr * tr, gc * tc)
    padded[:rows, :cols] = m.abs()
    amax = padded.reshape(gr, tr, gc, tc).amax(dim=(1, 3))
    exponent = torch.floor(torch.log2(FMAX[fmt] / amax)).clamp(-126, 126)
    scale = torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))
    full = scale.repeat_interleave(tr, 0).repeat_interleave(tc, 1)[:rows, :cols]
    codes = (m * full).clamp(-FMAX[fmt], FMAX[fmt]).to(fmt)
    return codes.reshape(x.shape), 1 / scale


def sqnr_db(approx, exact):
    return (10 * torch.log10(exact.pow(2).sum() / (approx - exact).pow(2).sum())).item()


@pytest.mark.parametrize("shape, tile", [((4, 256), (1, 128)), ((3, 7, 300), (1, 128)), ((300, 260), (128, 128)),
                                         ((5, 1000), (1, 1000)), ((1, 3), (2, 2))])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_match_the_reference(shape, tile, fmt, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    codes, scale_inv = ops.quantize_tiles(x, fmt, tile)
    ref_codes, ref_scale_inv = reference(x, fmt, tile)
    assert codes.dtype == fmt and codes.shape == x.shape
    assert torch.equal(scale_inv, ref_scale_inv)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    back = ops.dequantize_tiles(codes, scale_inv, tile, torch.float32)
    rows = x.numel() // x.shape[-1]
    expanded = scale_inv.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, : x.shape[-1]]
    assert torch.equal(back, (codes.float().reshape(rows, -1) * expanded).reshape(x.shape))


def test_outlier_rows_keep_their_precision_with_tiles():
    """Rows of 3e4x outliers among regular rows: per-tensor E4M3 loses the regular rows' small
    values to the outliers' scale; rowwise and 1 x 128 tiles keep E4M3's ~30 dB on them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    x[::8] *= 3e4
    regular = torch.ones(64, dtype=torch.bool)
    regular[::8] = False
    codes, scale_inv, _ = ops.quantize_current(x, E4M3)
    per_tensor = ops.dequantize(codes, scale_inv, torch.float32)
    assert sqnr_db(per_tensor[regular], x[regular]) < 20
    for tile in [(1, 1024), (1, 128)]:
        codes, scale_inv = ops.quantize_tiles(x, E4M3, tile)
        back = ops.dequantize_tiles(codes, scale_inv, tile)
        assert sqnr_db(back[regular], x[regular]) >= 25, tile


def test_a_non_finite_tile_reads_nan_and_poisons_no_other():
    x = torch.randn(4, 256)
    x[1, 3] = float("inf")
    x[2, 200] = float("nan")
    codes, scale_inv = ops.quantize_tiles(x, E4M3, (1, 128))
    back = ops.dequantize_tiles(codes, scale_inv, (1, 128))
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[1, 0] = bad[2, 1] = True
    assert torch.isnan(scale_inv[bad]).all() and torch.isfinite(scale_inv[~bad]).all()
    assert torch.isnan(back[1, :128]).all() and torch.isnan(back[2, 128:]).all()
    good = torch.ones(4, 256, dtype=torch.bool)
    good[1, :128] = good[2, 128:] = False
    assert torch.isfinite(back[good]).all()


def test_compiles_fullgraph():
    x = torch.randn(6, 384)

    def roundtrip(t):
        codes, scale_inv = ops.quantize_tiles(t, E4M3, (1, 128))
        return ops.dequantize_tiles(codes, scale_inv, (1, 128))

    torch._dynamo.reset()
    assert torch.equal(torch.compile(roundtrip, fullgraph=True, backend="aot_eager")(x), roundtrip(x))


def test_arguments_are_checked():
    x = torch.randn(4, 256)
    with pytest.raises(TypeError, match=r"fp8amp.ops.quantize_tiles: tile must be a pair"):
        ops.quantize_tiles(x, E4M3, 128)
    with pytest.raises(ValueError, match="tile_rows and tile_cols must be positive"):
        ops.quantize_tiles(x, E4M3, (0, 128))
    with pytest.raises(ValueError, match="tile_rows and tile_cols must be positive"):
        torch.ops.fp8amp.quantize_tiles.default(x, E4M3, 1, 0)  # before anything divides by it
    with pytest.raises(ValueError, match="dtype must be one of"):
        ops.quantize_tiles(x, fp8amp.FP16, (1, 128))
    codes, scale_inv = ops.quantize_tiles(x, E4M3, (1, 128))
    with pytest.raises(ValueError, match=r"scale_inv must be float32 \[4, 1\]"):
        ops.dequantize_tiles(codes, scale_inv, (1, 256))
    with pytest.raises(ValueError, match="every tensor argument must be on one device"):
        ops.dequantize_tiles(codes, scale_inv.to("meta"), (1, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(1, 128), (128, 128), (1, 4096)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cuda_equals_cpu(tile, fmt):
    x = torch.randn(257, 4096, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 4, 4096)
    x[5, 7] = float("inf")
    cpu_codes, cpu_scale_inv = ops.quantize_tiles(x, fmt, tile)
    codes, scale_inv = ops.quantize_tiles(x.cuda(), fmt, tile)
    assert torch.equal(codes.cpu().view(torch.uint8), cpu_codes.view(torch.uint8))
    assert torch.equal(scale_inv.cpu().view(torch.int32), cpu_scale_inv.view(torch.int32))  # NaNs' bits too
    back = ops.dequantize_tiles(codes, scale_inv, tile, torch.bfloat16)
    cpu_back = ops.dequantize_tiles(cpu_codes, cpu_scale_inv, tile, torch.bfloat16)
    assert torch.equal(back.cpu().view(torch.int16), cpu_back.view(torch.int16))


def same_bits(a, b):
    """Bit-identical (NaNs included), of one dtype and shape."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(int_type), b.view(int_type))


def matrix(x):
    return x.reshape(x.numel() // x.shape[-1], x.shape[-1])


def wide_values(shape, dtype, seed):
    """Values over ~12 binades, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.02] = 0
    return x.to(dtype)


def assert_cast_transpose_tiles_composes(x, fmt, tile, tile_t=None):
    codes, scale_inv, codes_t, scale_inv_t = ops.cast_transpose_tiles(x, fmt, tile, tile_t=tile_t)
    ref_codes, ref_scale_inv = ops.quantize_tiles(x, fmt, tile)
    ref_codes_t, ref_scale_inv_t = ops.quantize_tiles(matrix(x).t().contiguous(), fmt, tile_t or tile)
    assert same_bits(codes, ref_codes) and same_bits(scale_inv, ref_scale_inv)
    assert same_bits(codes_t, ref_codes_t) and same_bits(scale_inv_t, ref_scale_inv_t)
    return codes, scale_inv, codes_t, scale_inv_t


@pytest.mark.parametrize("shape", [(300, 260), (3, 7, 130), (1, 5), (129, 1), (256, 128)])
@pytest.mark.parametrize("tile, tile_t", [((1, 128), None), ((128, 128), None), ("rowwise", None), ((2, 3), (5, 7))])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16), (E4M3, torch.float16)])
def test_cast_transpose_tiles_is_quantize_tiles_of_x_and_its_transpose(shape, tile, tile_t, fmt, dtype):
    x = wide_values(shape, dtype, seed=sum(shape))
    rows, cols = matrix(x).shape
    if tile == "rowwise":
        tile, tile_t = (1, cols), (1, rows)
    codes, scale_inv, codes_t, _ = assert_cast_transpose_tiles_composes(x, fmt, tile, tile_t)
    assert codes.shape == x.shape and codes_t.shape == (cols, rows) and codes_t.dtype == fmt
    assert scale_inv.shape == (-(-rows // tile[0]), -(-cols // tile[1]))


def test_cast_transpose_tiles_scale_layouts():
    """Against the torch reference: rowwise gives per-row scales and per-column ones for the
    transpose; 1 x 128 tiles of the transpose are 128-row pieces of x's columns; 128 x 128 blocks
    give the transpose the same blocks, transposed."""
    x = wide_values((256, 384), torch.float32, seed=3)
    codes, scale_inv, codes_t, scale_inv_t = ops.cast_transpose_tiles(x, E4M3, (1, 384), tile_t=(1, 256))
    assert torch.equal(scale_inv, reference(x, E4M3, (1, 384))[1]) and scale_inv.shape == (256, 1)
    assert torch.equal(scale_inv_t, reference(x.t(), E4M3, (1, 256))[1]) and scale_inv_t.shape == (384, 1)
    _, _, codes_t, scale_inv_t = ops.cast_transpose_tiles(x, E4M3, (1, 128))
    ref_codes_t, ref_scale_inv_t = reference(x.t().contiguous(), E4M3, (1, 128))
    assert torch.equal(scale_inv_t, ref_scale_inv_t) and scale_inv_t.shape == (384, 2)
    assert same_bits(codes_t, ref_codes_t)
    codes, scale_inv, codes_t, scale_inv_t = ops.cast_transpose_tiles(x, E4M3, (128, 128))
    assert torch.equal(scale_inv_t, scale_inv.t()) and same_bits(codes_t, codes.t().contiguous())


def test_cast_transpose_tiles_zero_and_non_finite_tiles():
    """A tile of zeros gets scale 1; an inf or a NaN poisons its tile in each copy (x's row tile,
    the transpose's column tile) and nothing else."""
    x = wide_values((256, 256), torch.bfloat16, seed=4)
    x[:, 128:] = 0
    x[5, 7] = float("inf")
    x[200, 3] = float("nan")
    codes, scale_inv, codes_t, scale_inv_t = assert_cast_transpose_tiles_composes(x, E4M3, (1, 128))
    assert (scale_inv[:, 1] == 1).all() and (scale_inv_t[128:] == 1).all()
    assert (codes.view(torch.uint8)[:, 128:] == 0).all()
    bad = torch.zeros(256, 2, dtype=torch.bool)
    bad[5, 0] = bad[200, 0] = True
    assert torch.isnan(scale_inv[bad]).all() and torch.isfinite(scale_inv[~bad]).all()
    bad_t = torch.zeros(256, 2, dtype=torch.bool)
    bad_t[7, 0] = bad_t[3, 1] = True
    assert torch.isnan(scale_inv_t[bad_t]).all() and torch.isfinite(scale_inv_t[~bad_t]).all()
    back_t = ops.dequantize_tiles(codes_t, scale_inv_t, (1, 128))
    assert torch.isnan(back_t[7, :128]).all() and torch.isfinite(back_t[7, 128:]).all()


def accumulate_reference(acc, acc_scale_inv, update, tile):
    """The composition scaled_accumulate_tiles fuses: dequantize, add in float32, quantize."""
    return ops.quantize_tiles(ops.dequantize_tiles(acc, acc_scale_inv, tile) + update.float(), acc.dtype, tile)


@pytest.mark.parametrize("shape, tile", [((300, 260), (128, 128)), ((3, 7, 130), (1, 128)), ((5, 9), (2, 4)),
                                         ((64, 96), (1, 96))])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.float32), (E5M2, torch.bfloat16), (E4M3, torch.float16)])
def test_scaled_accumulate_tiles_is_dequantize_add_quantize(shape, tile, fmt, dtype):
    acc, acc_scale_inv = ops.quantize_tiles(wide_values(shape, torch.float32, seed=1), fmt, tile)
    update = wide_values(shape, dtype, seed=2)
    codes, scale_inv = ops.scaled_accumulate_tiles(acc, acc_scale_inv, update, tile)
    ref_codes, ref_scale_inv = accumulate_reference(acc, acc_scale_inv, update, tile)
    assert same_bits(codes, ref_codes) and same_bits(scale_inv, ref_scale_inv)
    assert codes.dtype == fmt and scale_inv.shape == acc_scale_inv.shape
    # The sum within the format's rounding: the accumulator really accumulates.
    back = ops.dequantize_tiles(codes, scale_inv, tile)
    exact = ops.dequantize_tiles(acc, acc_scale_inv, tile) + update.float()
    assert sqnr_db(back, exact) > (25 if fmt == E4M3 else 18)


def test_scaled_accumulate_tiles_poisons_only_the_non_finite_tiles():
    acc, acc_scale_inv = ops.quantize_tiles(torch.randn(4, 512), E4M3, (1, 128))
    acc_scale_inv[0, 1] = float("nan")  # a tile poisoned by an earlier step stays poisoned
    update = torch.randn(4, 512)
    update[2, 300] = float("inf")
    update[3] = -ops.dequantize_tiles(acc, acc_scale_inv, (1, 128))[3]  # sums to zero: scale 1
    codes, scale_inv = ops.scaled_accumulate_tiles(acc, acc_scale_inv, update, (1, 128))
    ref_codes, ref_scale_inv = accumulate_reference(acc, acc_scale_inv, update, (1, 128))
    assert same_bits(codes, ref_codes) and same_bits(scale_inv, ref_scale_inv)
    bad = torch.zeros(4, 4, dtype=torch.bool)
    bad[0, 1] = bad[2, 2] = True
    assert torch.isnan(scale_inv[bad]).all() and torch.isfinite(scale_inv[~bad]).all()
    assert (scale_inv[3] == 1).all() and (codes[3].view(torch.uint8) == 0).all()


def test_new_tile_ops_compile_fullgraph():
    x, update = torch.randn(6, 384), torch.randn(6, 384)

    def step(t, u):
        codes, scale_inv, codes_t, scale_inv_t = ops.cast_transpose_tiles(t, E4M3, (1, 128))
        acc, acc_scale_inv = ops.scaled_accumulate_tiles(codes, scale_inv, u, (1, 128))
        return ops.dequantize_tiles(acc, acc_scale_inv, (1, 128)), ops.dequantize_tiles(codes_t, scale_inv_t, (1, 128))

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, update)
    assert all(torch.equal(a, b) for a, b in zip(compiled, step(x, update)))


def test_new_tile_ops_check_their_arguments():
    x = torch.randn(4, 256)
    with pytest.raises(TypeError, match=r"cast_transpose_tiles: tile_t must be a pair"):
        ops.cast_transpose_tiles(x, E4M3, (1, 128), tile_t=128)
    with pytest.raises(ValueError, match="tile_t's tile_rows and tile_cols must be positive"):
        ops.cast_transpose_tiles(x, E4M3, (1, 128), tile_t=(1, 0))
    with pytest.raises(ValueError, match="tile_rows and tile_cols must be positive"):
        ops.cast_transpose_tiles(x, E4M3, (-1, 128))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ops.cast_transpose_tiles(x, fp8amp.FP16, (1, 128))
    with pytest.raises(ValueError, match="x must be"):
        ops.cast_transpose_tiles(x.to(torch.int32), E4M3, (1, 128))
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        ops.cast_transpose_tiles(torch.tensor(1.0), E4M3, (1, 128))
    acc, acc_scale_inv = ops.quantize_tiles(x, E4M3, (1, 128))
    with pytest.raises(ValueError, match="acc must be float8_e4m3fn or float8_e5m2"):
        ops.scaled_accumulate_tiles(x, acc_scale_inv, x, (1, 128))
    with pytest.raises(ValueError, match="update must be"):
        ops.scaled_accumulate_tiles(acc, acc_scale_inv, acc, (1, 128))
    with pytest.raises(ValueError, match="acc and update must have the same shape"):
        ops.scaled_accumulate_tiles(acc, acc_scale_inv, x.reshape(8, 128), (1, 128))
    with pytest.raises(ValueError, match=r"acc_scale_inv must be float32 \[4, 1\]"):
        ops.scaled_accumulate_tiles(acc, acc_scale_inv, x, (1, 256))
    with pytest.raises(TypeError, match="tile must be a pair"):
        ops.scaled_accumulate_tiles(acc, acc_scale_inv, x, 128)
    with pytest.raises(ValueError, match="every tensor argument must be on one device"):
        ops.scaled_accumulate_tiles(acc, acc_scale_inv.to("meta"), x, (1, 128))


GPU_SHAPES = [(16384, 4096), (257, 4096), (300, 260), (1, 5), (129, 1000), (4096, 136)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("tile, tile_t", [((1, 128), None), ((128, 128), None), ("rowwise", None), ((1, 64), (1, 256)),
                                          ((1, 128), (1, 128 * 3)), ((1, 1 << 62), (1, 1 << 62)), ((1, 256), (1, 256)),
                                          ((3, 64), (32, 5))])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.bfloat16), (E5M2, torch.float32), (E4M3, torch.float16)])
def test_cast_transpose_tiles_cuda_equals_cpu(shape, tile, tile_t, fmt, dtype):
    """Every CUDA path against the reference: the one-pass kernel ((1, 128), (128, 128)), the
    two-pass kernels of one-row tiles, whose amax pass takes strips of 32 packs of columns where
    x's row tiles hold whole strips (rowwise, as its columns' length or the recipe's 1 << 62;
    (1, 256) tiles; (1, 128) tiles of float32) and regions otherwise ((1, 64) tiles with
    transposed tiles over 256 rows, several segments of a column; (1, 128) tiles of 16-bit types,
    with transposed ones over 384 rows), and tile_kernel ((3, 64) tiles; also where rows of x do
    not take 16-byte loads)."""
    if shape == (16384, 4096) and tile == (3, 64):
        pytest.skip("the big shape is for the fast kernels")
    x = wide_values(shape, dtype, seed=shape[0])
    x[shape[0] // 2, shape[1] // 3] = float("inf")
    x[-1, -1] = float("nan")
    if tile == "rowwise":
        tile, tile_t = (1, shape[1]), (1, shape[0])
    cpu = ops.cast_transpose_tiles(x, fmt, tile, tile_t=tile_t)
    cuda = ops.cast_transpose_tiles(x.cuda(), fmt, tile, tile_t=tile_t)
    for name, a, b in zip(("codes", "scale_inv", "codes_t", "scale_inv_t"), cuda, cpu):
        assert same_bits(a.cpu(), b), name
    codes, scale_inv = ops.quantize_tiles(x.cuda(), fmt, tile)
    assert same_bits(codes.cpu(), cpu[0]) and same_bits(scale_inv.cpu(), cpu[1])


@pytest.mark.gpu
def test_cast_transpose_tiles_cuda_misaligned_input():
    """x starting 2 bytes into its storage: the kernels' element-wise path (for the rowwise (1, 260)
    tiles tile_kernel, as 260 bf16 columns are no whole 16-byte packs either)."""
    x = wide_values((256 * 260 + 1,), torch.bfloat16, seed=9).cuda()[1:].view(256, 260)
    assert x.data_ptr() % 16 != 0
    for tile in [(1, 128), (128, 128), (1, 260)]:
        cpu = ops.cast_transpose_tiles(x.cpu(), E4M3, tile)
        cuda = ops.cast_transpose_tiles(x, E4M3, tile)
        assert all(same_bits(a.cpu(), b) for a, b in zip(cuda, cpu)), tile


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (300, 260), (1, 5)])
@pytest.mark.parametrize("tile", [(128, 128), (1, 128), (2, 3)])
@pytest.mark.parametrize("fmt, dtype", [(E4M3, torch.bfloat16), (E5M2, torch.float32), (E4M3, torch.float16)])
def test_scaled_accumulate_tiles_cuda_equals_cpu(shape, tile, fmt, dtype):
    acc, acc_scale_inv = ops.quantize_tiles(wide_values(shape, torch.float32, seed=5), fmt, tile)
    acc_scale_inv[0, 0] = float("nan")
    update = wide_values(shape, dtype, seed=6)
    update[-1, -1] = float("inf")
    cpu = ops.scaled_accumulate_tiles(acc, acc_scale_inv, update, tile)
    cuda = ops.scaled_accumulate_tiles(acc.cuda(), acc_scale_inv.cuda(), update.cuda(), tile)
    assert same_bits(cuda[0].cpu(), cpu[0]) and same_bits(cuda[1].cpu(), cpu[1])
