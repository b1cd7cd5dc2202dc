"""The FP8 GEMM with tile scales (fp8amp.ops.gemm_tiles, docs/tiles.md): on the CPU against a plain
torch reference (dequantize_tiles, then a float64 matmul) on odd-but-legal shapes with partial
tiles, the outlier rows that per-tensor scaling loses, bias, torch.compile and the argument
checks. On a GPU every tiling pair, format pair and output dtype must match the CPU reference
within a bound derived from FP32 accumulation, or raise a clear NotImplementedError; each is
also compared with torch._scaled_mm given the same scales where torch offers that mode."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp8amp
from fp8amp import ops

E4M3, E5M2 = fp8amp.E4M3, fp8amp.E5M2
PAIRS = {"1x128 x 128x128": ((1, 128), (128, 128)), "1x128 x 1x128": ((1, 128), (1, 128)),
         "128x128 x 1x128": ((128, 128), (1, 128)), "rowwise x rowwise": ("row", "row")}
FORMATS = {"e4m3 x e4m3": (E4M3, E4M3), "e5m2 x e4m3": (E5M2, E4M3)}
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def tile_of(tile, k):
    return (1, k) if tile == "row" else tile


def operands(m, n, k, pair, formats, seed=0, device="cpu"):
    """x [M, K] and w [N, K] with a spread of magnitudes along K, quantized with the pair's tiles."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]
    w = torch.randn(n, k, generator=g) * 0.05
    a_tile, b_tile = tile_of(pair[0], k), tile_of(pair[1], k)
    a, sa = ops.quantize_tiles(x.to(device), formats[0], a_tile)
    b, sb = ops.quantize_tiles(w.to(device), formats[1], b_tile)
    return a, sa, a_tile, b, sb, b_tile


def dequantized_product(a, sa, a_tile, b, sb, b_tile):
    """The plain torch reference: each operand dequantized (exact in float32), multiplied in float64."""
    da = ops.dequantize_tiles(a.cpu(), sa.cpu(), a_tile).double()
    db = ops.dequantize_tiles(b.cpu(), sb.cpu(), b_tile).double()
    return da @ db.T, da.abs() @ db.abs().T


def sqnr_db(approx, exact):
    return (10 * torch.log10(exact.double().pow(2).sum() / (approx.double() - exact.double()).pow(2).sum())).item()


@pytest.mark.parametrize("shape", [(130, 144, 272), (1, 16, 16), (129, 256, 128)])
@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("formats", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_matches_the_dequantized_product(shape, pair, formats, out_dtype):
    a, sa, a_tile, b, sb, b_tile = operands(*shape, pair, formats)
    out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=out_dtype)
    assert out.shape == (shape[0], shape[1]) and out.dtype == out_dtype
    exact, abs_sum = dequantized_product(a, sa, a_tile, b, sb, b_tile)
    # The reference rounds the (nearly) exact sum once, through float32: within one rounding of
    # out's dtype and float32's of the exact value, plus float64's error on the sum of |terms|.
    u = UNIT_ROUNDOFF[out_dtype]
    bound = (u + 2.0**-24) * exact.abs() + 1e-13 * abs_sum + (2.0**-24 if out_dtype == torch.float16 else 0.0)
    assert ((out.double() - exact).abs() <= bound).all()


def test_each_k_block_and_row_block_has_its_own_scale():
    """Scales that differ per K-block and per 128-row block of the weight: dequantizing with any
    other assignment of scales gives another product."""
    a, sa, a_tile, b, sb, b_tile = operands(3, 256, 384, PAIRS["1x128 x 128x128"], FORMATS["e4m3 x e4m3"])
    sb = sb * torch.tensor([[1.0, 2.0**-3, 2.0**5], [2.0**7, 1.0, 2.0**-2]])
    out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=torch.float32)
    exact, _ = dequantized_product(a, sa, a_tile, b, sb, b_tile)
    assert torch.allclose(out.double(), exact, rtol=1e-6, atol=1e-9 * exact.abs().max().item())
    swapped, _ = dequantized_product(a, sa, a_tile, b, sb.flip(1), b_tile)
    assert not torch.allclose(out.double(), swapped, rtol=1e-3)


def test_rowwise_beside_a_tile_when_k_is_one_block():
    a, sa, _, b, sb, _ = operands(3, 32, 64, ((1, 128), (1, 64)), FORMATS["e4m3 x e4m3"])
    out = ops.gemm_tiles(a, sa, (1, 128), b, sb, (1, 64), out_dtype=torch.float32)
    exact, _ = dequantized_product(a, sa, (1, 128), b, sb, (1, 64))
    assert torch.allclose(out.double(), exact, rtol=2.0**-23, atol=1e-12)


def test_outlier_rows_keep_their_precision():
    """Rows of 3e4x outliers in a Linear's input: the regular rows of y = x·Wᵀ keep >= 25 dB with
    1 x 128 activation tiles and 128 x 128 weight blocks (and rowwise), per-tensor falls below 20 dB."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    x[::8] *= 3e4
    w = torch.randn(256, 1024, generator=g) * 0.02
    regular = torch.ones(64, dtype=torch.bool)
    regular[::8] = False
    exact = x.double() @ w.double().T

    xa, xs, _ = ops.quantize_current(x, E4M3)
    wb, ws, _ = ops.quantize_current(w, E4M3)
    per_tensor = ops.gemm(xa, wb, xs, ws, out_dtype=torch.float32)
    assert sqnr_db(per_tensor[regular], exact[regular]) < 20
    for pair in [PAIRS["1x128 x 128x128"], PAIRS["rowwise x rowwise"]]:
        a_tile, b_tile = tile_of(pair[0], 1024), tile_of(pair[1], 1024)
        a, sa = ops.quantize_tiles(x, E4M3, a_tile)
        b, sb = ops.quantize_tiles(w, E4M3, b_tile)
        out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=torch.float32)
        assert sqnr_db(out[regular], exact[regular]) >= 25, pair


@pytest.mark.parametrize("out_dtype, bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                   (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
def test_bias(out_dtype, bias_dtype):
    a, sa, a_tile, b, sb, b_tile = operands(7, 32, 256, PAIRS["1x128 x 1x128"], FORMATS["e4m3 x e4m3"])
    bias = torch.randn(32, generator=torch.Generator().manual_seed(3)).to(bias_dtype)
    out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=out_dtype, bias=bias)
    exact, abs_sum = dequantized_product(a, sa, a_tile, b, sb, b_tile)
    want = exact + bias.double()
    u = UNIT_ROUNDOFF[out_dtype]
    # The product and the bias each rounded, then their sum: relative to the addends, not to a sum
    # that may cancel (an unseeded bias failed the bound relative to the sum once in a while).
    bound = 2 * u * (exact.abs() + bias.double().abs()) + 1e-12 * abs_sum + 2.0**-24
    assert ((out.double() - want).abs() <= bound).all()


def test_empty_shapes():
    a, sa, a_tile, b, sb, b_tile = operands(0, 16, 128, PAIRS["1x128 x 128x128"], FORMATS["e4m3 x e4m3"])
    assert ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile).shape == (0, 16)
    a, sa = ops.quantize_tiles(torch.zeros(3, 0), E4M3, (1, 128))
    b, sb = ops.quantize_tiles(torch.zeros(16, 0), E4M3, (128, 128))
    bias = torch.arange(16, dtype=torch.bfloat16)
    assert torch.equal(ops.gemm_tiles(a, sa, (1, 128), b, sb, (128, 128), bias=bias), bias.expand(3, 16))


def test_compiles_fullgraph():
    x, w = torch.randn(6, 384), torch.randn(32, 384)

    def linear(t, weight):
        a, sa = ops.quantize_tiles(t, E4M3, (1, 128))
        b, sb = ops.quantize_tiles(weight, E4M3, (128, 128))
        return ops.gemm_tiles(a, sa, (1, 128), b, sb, (128, 128), out_dtype=torch.float32)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(linear, fullgraph=True, backend="aot_eager")(x, w), linear(x, w))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_fake_kernel_gives_the_real_metadata(out_dtype):
    """torch.compile plans buffers from the Meta kernel's result: it must equal the real one's."""
    a, sa, a_tile, b, sb, b_tile = operands(5, 48, 256, PAIRS["1x128 x 128x128"], FORMATS["e4m3 x e4m3"])
    real = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=out_dtype)
    with FakeTensorMode() as mode:
        fake = ops.gemm_tiles(*(mode.from_tensor(t) for t in (a, sa)), a_tile,
                              *(mode.from_tensor(t) for t in (b, sb)), b_tile, out_dtype=out_dtype)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_output_shares_no_memory_with_inputs():
    a, sa, a_tile, b, sb, b_tile = operands(4, 16, 128, PAIRS["1x128 x 1x128"], FORMATS["e4m3 x e4m3"])
    out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile)
    storages = {t.untyped_storage().data_ptr() for t in (a, sa, b, sb)}
    assert out.untyped_storage().data_ptr() not in storages


def test_arguments_are_checked():
    a, sa, a_tile, b, sb, b_tile = operands(4, 16, 256, PAIRS["1x128 x 128x128"], FORMATS["e4m3 x e4m3"])
    with pytest.raises(TypeError, match=r"fp8amp.ops.gemm_tiles: a_tile must be a pair"):
        ops.gemm_tiles(a, sa, 128, b, sb, b_tile)
    with pytest.raises(TypeError, match=r"b_tile\[1\] must be an int"):
        ops.gemm_tiles(a, sa, a_tile, b, sb, (128, 128.0))
    with pytest.raises(ValueError, match=r"a_tile must be \(1, 128\), \(128, 128\) or rowwise \(1, c\) with c >= K"):
        ops.gemm_tiles(a, sa, (1, 64), b, sb, b_tile)
    with pytest.raises(ValueError, match=r"a_tile \(128, 128\) with b_tile \(128, 128\) is not a pair"):
        ops.gemm_tiles(a, sa, (128, 128), b, sb, b_tile)
    with pytest.raises(ValueError, match=r"a_tile rowwise with b_tile \(128, 128\) is not a pair"):
        ops.gemm_tiles(a, sa[:, :1].contiguous(), (1, 256), b, sb, b_tile)
    with pytest.raises(ValueError, match=r"b_scale_inv must be float32 \[1, 2\]"):
        ops.gemm_tiles(a, sa, a_tile, b, sb.T.contiguous(), b_tile)
    with pytest.raises(ValueError, match="a_scale_inv must be float32"):
        ops.gemm_tiles(a, sa.half(), a_tile, b, sb, b_tile)
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=E4M3)
    with pytest.raises(ValueError, match="a must be float8_e4m3fn or float8_e5m2"):
        ops.gemm_tiles(a.float(), sa, a_tile, b, sb, b_tile)
    with pytest.raises(ValueError, match="a and b are both float8_e5m2"):
        ops.gemm_tiles(a.view(torch.uint8).view(E5M2), sa, a_tile, b.view(torch.uint8).view(E5M2), sb, b_tile)
    with pytest.raises(ValueError, match="bias must be torch.float16 for out_dtype torch.float16"):
        ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=torch.float16, bias=torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[16\]"):
        ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=torch.float32, bias=torch.zeros(1))
    with pytest.raises(ValueError, match=r"bias must be \[N\] = \[16\]"):
        ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, bias=torch.zeros(8, dtype=torch.bfloat16))
    odd_a, odd_sa = ops.quantize_tiles(torch.randn(4, 24), E4M3, (1, 128))
    odd_b, odd_sb = ops.quantize_tiles(torch.randn(16, 24), E4M3, (128, 128))
    with pytest.raises(ValueError, match="K .* must be a multiple of 16"):
        ops.gemm_tiles(odd_a, odd_sa, (1, 128), odd_b, odd_sb, (128, 128))
    with pytest.raises(ValueError, match="every tensor argument must be on one device"):
        ops.gemm_tiles(a, sa.to("meta"), a_tile, b, sb, b_tile)


# ---- GPU: every combination against the CPU reference, and against torch._scaled_mm ----

# Partial tiles in every direction; M = 130 and 1 also check the refusal of (1, 128) scales of a with
# M % 4 != 0 (the other pairs run).
GPU_SHAPES = [(256, 512, 384), (132, 144, 272), (4, 16, 128), (2048, 1024, 4096), (130, 144, 272), (1, 16, 128)]


def accumulation_bound(k, abs_sum):
    """|gpu - exact| of FP32 accumulation (tests/cpp/test_gemm_cuda.cu's model): the tensor cores
    keep about 14 bits of a partial sum for at most 4 MMAs of k = 32 before it is promoted to FP32
    (every 128-wide block with tile scales), then FP32 sums of K / 32 parts."""
    steps = min(math.ceil(k / 32), 4)
    return (steps * 2.0**-13 + k / 32 * 2.0**-24) * abs_sum


def scaled_mm_scales(sa, sb, pair, pad):
    """Our row-major scales in the layouts torch._scaled_mm takes for (a, b.t()) with that pair:
    1 x 128 scales rows-major, 128 x 128 blocks K-block-major with rows padded to a multiple of 4
    (pad, what newer torch asks) or not (older torch); rowwise as they are."""
    def blocks(s):
        if not pad:
            return s
        kb = s.shape[1]
        padded = s.new_zeros(s.shape[0], -(-kb // 4) * 4)
        padded[:, :kb] = s
        return padded[:, :kb]

    a = sa.T.contiguous().T if pair[0] == (1, 128) else blocks(sa) if pair[0] == (128, 128) else sa
    b = sb.T.contiguous() if pair[1] == (1, 128) else blocks(sb).T  # torch reads scale_b as [K blocks, N]
    return a, b


def compare_with_scaled_mm(a, sa, b, sb, pair, out_dtype, out):
    """How torch._scaled_mm with the same scales compares: bit-identical, its max difference, or why
    it does not offer the mode."""
    why = ""
    for pad in (True, False):
        try:
            theirs = torch._scaled_mm(a, b.T, *scaled_mm_scales(sa, sb, pair, pad), out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            why = str(e).splitlines()[0][:120]
            continue
        if torch.equal(theirs, out):
            return "torch._scaled_mm bit-identical"
        return f"torch._scaled_mm max diff {(theirs.double() - out.double()).abs().max().item():.3g}"
    return f"torch._scaled_mm does not offer it ({why})"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("pair", PAIRS.values(), ids=PAIRS.keys())
@pytest.mark.parametrize("formats", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_cuda_matches_the_reference_or_says_it_cannot(shape, pair, formats, out_dtype):
    m, n, k = shape
    a, sa, a_tile, b, sb, b_tile = operands(m, n, k, pair, formats, seed=m + n + k, device="cuda")
    name = f"gemm_tiles {pair} {formats} -> {out_dtype} at {shape}"
    try:
        out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=out_dtype)
    except NotImplementedError as e:
        assert "cuBLASLt" in str(e), e
        if pair[0] == (1, 128) and m % 4:
            assert "multiple of 4" in str(e), e
        print(f"{name}: not supported: {e}")
        return
    torch.cuda.synchronize()
    cpu = ops.gemm_tiles(a.cpu(), sa.cpu(), a_tile, b.cpu(), sb.cpu(), b_tile, out_dtype=out_dtype)
    exact, abs_sum = dequantized_product(a, sa, a_tile, b, sb, b_tile)
    got, ref = out.cpu().double(), cpu.double()
    u = UNIT_ROUNDOFF[out_dtype]
    bound = accumulation_bound(k, abs_sum) + u * (got.abs() + ref.abs()) + (2.0**-24 if out_dtype == torch.float16 else 0)
    err = (got - ref).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    # SQNR floor: the bound relative to the result's size, for these operands ~40 dB at K = 4096.
    floor = -10 * math.log10((bound.pow(2).sum() / exact.pow(2).sum()).item()) - 3
    snr = sqnr_db(got, exact)
    line = f"{name}: supported, worst err/bound {worst:.3f}, SQNR {snr:.1f} dB (floor {floor:.1f})"
    line += "; " + compare_with_scaled_mm(a, sa, b, sb, (a_tile, b_tile), out_dtype, out)
    print(line)
    assert (err <= bound).all(), line
    assert snr >= floor, line


@pytest.mark.gpu
def test_cuda_bias_and_empty_sum():
    a, sa, a_tile, b, sb, b_tile = operands(36, 64, 256, PAIRS["1x128 x 128x128"], FORMATS["e4m3 x e4m3"],
                                            device="cuda")
    bias = torch.randn(64, device="cuda").bfloat16()
    try:
        out = ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, bias=bias)
    except NotImplementedError as e:
        pytest.skip(f"not supported here: {e}")
    cpu = ops.gemm_tiles(a.cpu(), sa.cpu(), a_tile, b.cpu(), sb.cpu(), b_tile, bias=bias.cpu())
    exact, abs_sum = dequantized_product(a, sa, a_tile, b, sb, b_tile)
    bound = accumulation_bound(256, abs_sum) + 2.0**-8 * (out.cpu().double().abs() + cpu.double().abs())
    assert ((out.cpu().double() - cpu.double()).abs() <= bound).all()
    a0, sa0 = ops.quantize_tiles(torch.zeros(3, 0, device="cuda"), E4M3, (1, 128))
    b0, sb0 = ops.quantize_tiles(torch.zeros(64, 0, device="cuda"), E4M3, (128, 128))
    assert torch.equal(ops.gemm_tiles(a0, sa0, (1, 128), b0, sb0, (128, 128), bias=bias), bias.expand(3, 64))


@pytest.mark.gpu
def test_cuda_refuses_clearly_off_hopper():
    if torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("Hopper takes the tile scale modes")
    a, sa, a_tile, b, sb, b_tile = operands(16, 16, 128, PAIRS["1x128 x 128x128"], FORMATS["e4m3 x e4m3"],
                                            device="cuda")
    with pytest.raises(NotImplementedError, match="on Hopper"):
        ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [PAIRS["1x128 x 128x128"], PAIRS["1x128 x 1x128"]], ids=["blockwise", "1x128"])
def test_cuda_autotune_every_call_within_the_bound_then_one_algorithm(pair):
    """GEMM autotuning covers the tile-scaled GEMM too: a new problem's calls run the heuristic's
    candidates in turn, each within the accumulation bound of the exact product, until it decides
    (one more tuned problem); from then on every call gives the same bits."""
    m, n, k = 528, 272 + 16 * (pair[1] == (1, 128)), 1024  # problems no other test has tuned
    a, sa, a_tile, b, sb, b_tile = operands(m, n, k, pair, FORMATS["e4m3 x e4m3"], seed=5, device="cuda")
    exact, abs_sum = dequantized_product(a, sa, a_tile, b, sb, b_tile)
    bound = accumulation_bound(k, abs_sum) + 2.0**-8 * exact.abs()
    fp8amp.ops.set_gemm_autotune(True)
    try:
        before = fp8amp.ops.gemm_autotune_stats()

        def call():
            return ops.gemm_tiles(a, sa, a_tile, b, sb, b_tile, out_dtype=torch.bfloat16)

        for _ in range(40):  # 8 candidates x 3 rounds at most, then decided
            got = call()
            torch.cuda.synchronize()  # the timings complete before the next call reads them
            assert ((got.cpu().double() - exact).abs() <= bound + 2.0**-8 * got.cpu().double().abs()).all()
        after = fp8amp.ops.gemm_autotune_stats()
        assert after["tuned"] == before["tuned"] + 1 and after["tuning"] == before["tuning"]
        assert torch.equal(call(), call())
    finally:
        fp8amp.ops.set_gemm_autotune(False)
