"""fp8amp.ops.multi_norm_tiles: the 2-norms of tile-scaled tensors from their codes (what
clip_grad_norm_ of FP8 gradients runs), against the float64 norm of the real values, and its CUDA
kernel against the CPU reference."""

import pytest
import torch

import fp8amp
from fp8amp import ops
from fp8amp.formats import E4M3, E5M2

FORMATS = [E4M3, E5M2, torch.float16]


def real_values(codes, scale_inv, tile):
    """codes * scale_inv[tile] in float64, codes viewed as [rows, cols]; tile None: one scale."""
    x = codes.double().reshape(-1, codes.shape[-1])
    if tile is None:
        return x * scale_inv.double().reshape(())
    tr, tc = tile
    grid = scale_inv.double().reshape(-(-x.shape[0] // tr), -(-x.shape[1] // tc))
    return x * grid.repeat_interleave(tr, 0)[: x.shape[0]].repeat_interleave(tc, 1)[:, : x.shape[1]]


def norm_reference(codes, scale_inv, tile):
    return torch.linalg.vector_norm(real_values(codes, scale_inv, tile)).float()


def codes_of(shape, fmt, generator, spread=4.0):
    """Codes of values spread over 2^+-spread, as a cast would give them."""
    x = torch.randn(*shape, generator=generator) * torch.exp2((torch.rand(*shape, generator=generator) - 0.5) * 2 * spread)
    return x.to(fmt)


def scales_for(codes, tile, generator, pow2=True):
    rows, cols = codes.reshape(-1, codes.shape[-1]).shape if codes.dim() else (1, 1)
    count = 1 if tile is None else -(-rows // tile[0]) * -(-cols // tile[1])
    if pow2:
        return torch.exp2(torch.randint(-20, 20, (count,), generator=generator).float())
    return torch.rand(count, generator=generator) * 1e3 + 1e-3


SHAPES_TILES = [((256, 384), (128, 128)), ((300, 260), (128, 128)), ((3, 7, 300), (1, 128)), ((37, 45), (7, 9)),
                ((64, 100), (64, 1)), ((513,), None), ((17, 33), None), ((5, 16), (1, 16)), ((1, 1), (3, 3))]


@pytest.mark.parametrize("shape, tile", SHAPES_TILES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_norms_are_the_float64_norms_of_the_real_values(shape, tile, fmt):
    """Within the float32 sums of 16-byte packs (at most 16 squares): 2^-21 relative of the float64
    norm of the real values."""
    g = torch.Generator().manual_seed(0)
    xs = [codes_of(shape, fmt, g) for _ in range(3)]
    scale_invs = [scales_for(x, tile, g) for x in xs]
    got = ops.multi_norm_tiles(xs, scale_invs, tile)
    assert got.dtype == torch.float32 and got.shape == (3,)
    want = torch.stack([norm_reference(x, s, tile) for x, s in zip(xs, scale_invs)])
    torch.testing.assert_close(got, want, rtol=2.0**-21, atol=0)


def test_any_scales_and_scale_shapes():
    """Scales need not be powers of two; scale_invs may be [grid] or any shape of that many elements."""
    g = torch.Generator().manual_seed(1)
    x = codes_of((300, 260), E4M3, g)
    s = scales_for(x, (128, 128), g, pow2=False)
    want = norm_reference(x, s, (128, 128))
    for scale_inv in (s, s.reshape(3, 3), s.reshape(9, 1)):
        torch.testing.assert_close(ops.multi_norm_tiles([x], [scale_inv], (128, 128))[0], want, rtol=2.0**-21, atol=0)


def test_zeros_empty_and_non_finite_tensors():
    """Zeros give 0; a tensor of no elements 0 (its scale_inv unread); a NaN code or a NaN / inf
    scale_inv in one tensor or tile makes that tensor's norm NaN / inf and no other's; a norm
    above float32's range is inf, while the sums themselves (float64) never overflow."""
    g = torch.Generator().manual_seed(2)
    good = codes_of((130, 140), E4M3, g)
    nan_code = good.clone()
    nan_code[5, 7] = float("nan")
    one = torch.ones(1)
    xs = [torch.zeros(40, 50, dtype=E4M3), torch.zeros(0, 16, dtype=E4M3), nan_code, good, good, good]
    tile_scales = torch.ones(2, 2)
    inf_tile = tile_scales.clone()
    inf_tile[1, 0] = float("inf")
    nan_tile = tile_scales.clone()
    nan_tile[0, 1] = float("nan")
    got = ops.multi_norm_tiles(xs, [torch.ones(1, 1), torch.ones(1, 1), tile_scales, inf_tile, nan_tile, tile_scales],
                               (128, 128))
    assert got[0] == 0 and got[1] == 0 and got[2].isnan() and got[3] == float("inf") and got[4].isnan()
    torch.testing.assert_close(got[5], norm_reference(good, one, None), rtol=2.0**-21, atol=0)
    big = torch.full((64, 64), 448.0).to(E4M3)
    assert ops.multi_norm_tiles([big], [torch.tensor([2.0**120])])[0] == float("inf")
    assert ops.multi_norm_tiles([big], [torch.tensor([2.0**100])])[0] == torch.tensor(448.0 * 64 * 2.0**100)


def test_arguments_are_checked():
    x = torch.zeros(4, 8, dtype=E4M3)
    one = torch.ones(1)
    cases = [
        (lambda: ops.multi_norm_tiles(x, [one]), TypeError, "xs"),
        (lambda: ops.multi_norm_tiles([x], [1.0]), TypeError, r"scale_invs\[0\]"),
        (lambda: ops.multi_norm_tiles([x], [one], (0, 4)), ValueError, "tile_rows and tile_cols must be positive"),
        (lambda: ops.multi_norm_tiles([x], [one], 4), TypeError, "tile"),
        (lambda: ops.multi_norm_tiles([x, x], [one]), ValueError, "scale_invs must hold as many tensors as xs"),
        (lambda: ops.multi_norm_tiles([x.float()], [one]), ValueError, "xs"),
        (lambda: ops.multi_norm_tiles([x, x.to(E5M2)], [one, one]), ValueError, "xs must share one dtype"),
        (lambda: ops.multi_norm_tiles([x], [torch.ones(2)]), ValueError, r"scale_invs\[0\] must hold 1 float32"),
        (lambda: ops.multi_norm_tiles([x], [torch.ones(1, dtype=torch.float64)]), ValueError, r"scale_invs\[0\]"),
        (lambda: ops.multi_norm_tiles([x], [one], (2, 4)), ValueError, r"scale_invs\[0\] must hold 4 float32 \(one per 2 x 4 tile"),
        (lambda: ops.multi_norm_tiles([torch.zeros((), dtype=E4M3)], [one]), ValueError, "at least 1 dimension"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
    for call in (lambda: ops.multi_norm_tiles([], []), lambda: torch.ops.fp8amp.multi_norm_tiles([], [one], 1, 1)):
        with pytest.raises(ValueError, match="xs must hold at least one tensor"):
            call()


def test_foreach_norm_of_mixed_dtypes_is_one_call(monkeypatch):
    """torch._foreach_norm over ScaledTensors of float32 and bfloat16 logical dtypes with one code
    dtype: one multi_norm_tiles call, each norm in its tensor's dtype, equal to its own norm."""
    g = torch.Generator().manual_seed(11)
    xs = [fp8amp.ScaledTensor.from_tensor(torch.randn(33, 48, generator=g), E4M3, orig_dtype=dtype)
          for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)]
    calls = []
    real_op = ops.multi_norm_tiles
    monkeypatch.setattr(ops, "multi_norm_tiles", lambda *a, **k: calls.append(len(a[0])) or real_op(*a, **k))
    norms = torch._foreach_norm(xs)
    assert calls == [4]
    for x, norm in zip(xs, norms):
        assert norm.dtype == x.dtype
        want = norm_reference(x.codes, x.scale_inv, None).to(x.dtype)
        assert torch.equal(norm, want)


def test_compiles_fullgraph_and_fake_shapes():
    x = torch.zeros(4, 8, dtype=E4M3)
    fn = torch.compile(lambda a, b, s: ops.multi_norm_tiles([a, b], [s, s]), fullgraph=True, backend="eager")
    out = fn(x, x[:2], torch.ones(1))
    assert out.shape == (2,) and torch.equal(out, torch.zeros(2))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, tile", SHAPES_TILES + [((4096, 4096), (128, 128)), ((2, 70000), (1, 128)),
                                                        ((100, 20000), None), ((3, 40000), (2, 30000))])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_equals_cpu(shape, tile, fmt):
    """Many work items a tensor (column chunks, row chunks), partial packs, tiles across packs: the
    same pack sums as the CPU's, added in another order in float64, so the same float32 up to an
    ulp; and the same bits from run to run."""
    g = torch.Generator().manual_seed(3)
    xs = [codes_of(shape, fmt, g) for _ in range(2)]
    scale_invs = [scales_for(x, tile, g) for x in xs]
    cpu = ops.multi_norm_tiles(xs, scale_invs, tile)
    cuda = ops.multi_norm_tiles([x.cuda() for x in xs], [s.cuda() for s in scale_invs], tile)
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=2.0**-23, atol=0)
    assert torch.equal(ops.multi_norm_tiles([x.cuda() for x in xs], [s.cuda() for s in scale_invs], tile), cuda)


@pytest.mark.gpu
def test_cuda_many_tensors_misaligned_and_non_finite():
    """More tensors than one launch takes, codes at odd addresses (element loads), an empty tensor
    and a NaN in one: each norm what the CPU gives, the NaN in its own tensor only."""
    g = torch.Generator().manual_seed(4)
    flat = codes_of((50000,), E4M3, g)
    xs = [flat[i : i + 97 * (i + 1)].reshape(i + 1, 97) for i in range(1, 120, 2)] + [flat[:0].reshape(0, 5)]
    xs[7] = xs[7].clone()
    xs[7][0, 3] = float("nan")
    scale_invs = [scales_for(x, None, g) for x in xs]
    cpu = ops.multi_norm_tiles(xs, scale_invs)
    cuda = ops.multi_norm_tiles([x.cuda() for x in xs], [s.cuda() for s in scale_invs]).cpu()
    assert torch.equal(cuda.isnan(), cpu.isnan()) and cpu.isnan().sum() == 1
    torch.testing.assert_close(cuda.nan_to_num(), cpu.nan_to_num(), rtol=2.0**-23, atol=0)


@pytest.mark.gpu
def test_clip_grad_norm_of_fp8_gradients_on_cuda():
    """clip_grad_norm_ over per-tensor and block-scaled FP8 gradients and plain ones, on the GPU:
    the total is the norm of the real values."""
    g = torch.Generator().manual_seed(5)
    grads = [fp8amp.ScaledTensor.from_tensor(torch.randn(256, 384, generator=g).cuda(), E4M3),
             fp8amp.BlockScaledTensor.from_tensor(torch.randn(384, 256, generator=g).cuda()),
             torch.randn(100, generator=g).cuda()]
    params = [torch.nn.Parameter(torch.zeros(t.shape, device="cuda")) for t in grads]
    for p, grad in zip(params, grads):
        p.grad = grad
    reals = [t.dequantize() if hasattr(t, "dequantize") else t for t in grads]
    want = torch.linalg.vector_norm(torch.cat([r.double().flatten() for r in reals])).float()
    total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    torch.testing.assert_close(total, want, rtol=2.0**-21, atol=0)
