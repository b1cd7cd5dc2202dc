"""Fine-grained scaling ops (fp8amp.ops.quantize_tiles / dequantize_tiles, docs/tiles.md) against
a plain torch reference: per-tile power-of-two scales, partial tiles, the outlier case that
per-tensor scaling loses, non-finite tiles, torch.compile, and the argument checks. On a GPU the
CUDA kernels must equal the CPU reference bit for bit."""

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
