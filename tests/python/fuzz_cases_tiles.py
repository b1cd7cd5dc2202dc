"""The tile-scaled ops' cases of the public-API fuzz (fuzz_cases.py, docs/hardening.md):
quantize_tiles / dequantize_tiles against a per-tile loop over the power-of-two scale rule,
cast_transpose_tiles / scaled_accumulate_tiles against the compositions they fuse, and
multi_norm_tiles against the float64 norm of the real values; every value kind, odd and empty
shapes, partial tiles, and the refusals of bad dtypes, tiles, shapes and devices."""

from __future__ import annotations

import itertools
import math

import torch

import fp8amp
from fp8amp import ops
from cast_reference import assert_quantized, torch_amax
from fuzz_cases import BAD_DTYPES, E4M3, E5M2, FP16, HIGH, KINDS, SHAPES, current_scale, values


def tile_cases():
    """quantize_tiles / dequantize_tiles: every kind of value, odd and empty shapes, partial tiles,
    against a per-tile loop over pow2_scale; bad dtypes and tiles must be refused."""
    for dtype, kind, shape, tile, fmt in itertools.product(HIGH, KINDS, SHAPES[:6], ((1, 16), (1, 5), (2, 3)),
                                                           (E4M3, E5M2)):
        x = values(kind, shape, dtype)

        def quantize(x=x, fmt=fmt, tile=tile):
            codes, scale_inv = ops.quantize_tiles(x, fmt, tile)
            return x, codes, scale_inv, ops.dequantize_tiles(codes, scale_inv, tile)

        def check(r, fmt=fmt, tile=tile):
            x, codes, scale_inv, back = r
            cols = x.shape[-1]
            m = x.float().reshape(math.prod(x.shape[:-1]), cols)
            grid = (-(-m.shape[0] // tile[0]), -(-cols // tile[1]))
            assert codes.shape == x.shape and tuple(scale_inv.shape) == grid, (codes.shape, scale_inv.shape)
            fmax = fp8amp.format_max(fmt)
            for i, j in itertools.product(range(grid[0]), range(grid[1])):
                block = m[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]]
                amax = torch_amax(block)
                finite = bool(amax.isfinite().all())
                scale = current_scale(amax, fmax) if finite else torch.ones(1)
                got = codes.reshape(m.shape)[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]]
                assert_quantized(got, block * scale.reshape(()), fmt)
                assert (scale_inv[i, j].isnan() if not finite else scale_inv[i, j] == 1 / scale.reshape(())), \
                    (i, j, scale_inv[i, j], amax)
            if x.numel():
                full = scale_inv.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[: m.shape[0], :cols]
                expected = (codes.float().reshape(m.shape) * full).reshape(x.shape)
                torch.testing.assert_close(back, expected, rtol=0, atol=0, equal_nan=True)

        name = f"{dtype}-{kind}-{shape}-{tile}-{fmt}"
        yield f"quantize_tiles {name}", quantize, (None if shape == () else check), ("x",)
    x = torch.randn(4, 16)
    for dtype in BAD_DTYPES:
        yield f"quantize_tiles x {dtype}", lambda dtype=dtype: ops.quantize_tiles(x.to(dtype), E4M3, (1, 16)), None, ("x",)
    yield "quantize_tiles dtype float16", lambda: ops.quantize_tiles(x, FP16, (1, 16)), None, ("dtype",)
    for tile in ((0, 16), (1, -1), (1,), 16, (1.0, 16)):
        yield f"quantize_tiles tile {tile}", lambda tile=tile: ops.quantize_tiles(x, E4M3, tile), None, ("tile",)
    codes, scale_inv = ops.quantize_tiles(x, E4M3, (1, 16))
    yield "dequantize_tiles scale_inv of other tiles", lambda: ops.dequantize_tiles(codes, scale_inv, (2, 16)), \
        None, ("scale_inv",)
    yield "dequantize_tiles codes float32", lambda: ops.dequantize_tiles(x, scale_inv, (1, 16)), None, ("x",)
    yield "dequantize_tiles meta scale_inv", lambda: ops.dequantize_tiles(codes, scale_inv.to("meta"), (1, 16)), \
        None, ("scale_inv",)
    yield from fused_tile_cases()
    yield from norm_tile_cases()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fused_tile_cases():
    """cast_transpose_tiles and scaled_accumulate_tiles: every kind of value, odd and empty shapes,
    partial tiles, against the quantize_tiles / dequantize_tiles compositions they fuse; bad
    dtypes, tiles, shapes and devices must be refused."""
    for dtype, kind, shape, (tile, fmt) in itertools.product(HIGH, KINDS, SHAPES[:6],
                                                             (((1, 16), E4M3), ((2, 3), E5M2))):
        x = values(kind, shape, dtype)

        def cast_transpose(x=x, fmt=fmt, tile=tile):
            return x, ops.cast_transpose_tiles(x, fmt, tile, tile_t=tile[::-1])

        def check_cast_transpose(r, fmt=fmt, tile=tile):
            x, got = r
            m = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
            want = (*ops.quantize_tiles(x, fmt, tile), *ops.quantize_tiles(m.t().contiguous(), fmt, tile[::-1]))
            for name, a, b in zip(("codes", "scale_inv", "codes_t", "scale_inv_t"), got, want):
                assert same_bits(a, b), (name, a.shape, b.shape)

        def accumulate(update=x, fmt=fmt, tile=tile):
            if update.dim() == 0:
                acc, acc_scale_inv = torch.zeros((), dtype=fmt), torch.ones(1, 1)
            else:
                acc, acc_scale_inv = ops.quantize_tiles(values("normal", update.shape), fmt, tile)
            return acc, acc_scale_inv, update, ops.scaled_accumulate_tiles(acc, acc_scale_inv, update, tile)

        def check_accumulate(r, tile=tile):
            acc, acc_scale_inv, update, (codes, scale_inv) = r
            sums = ops.dequantize_tiles(acc, acc_scale_inv, tile) + update.float()
            want_codes, want_scale_inv = ops.quantize_tiles(sums, acc.dtype, tile)
            assert same_bits(codes, want_codes) and same_bits(scale_inv, want_scale_inv), (codes, want_codes)

        name = f"{dtype}-{kind}-{shape}-{tile}-{fmt}"
        yield f"cast_transpose_tiles {name}", cast_transpose, (None if shape == () else check_cast_transpose), ("x",)
        yield f"scaled_accumulate_tiles {name}", accumulate, (None if shape == () else check_accumulate), ("acc",)
    x = torch.randn(4, 16)
    for dtype in BAD_DTYPES:
        yield f"cast_transpose_tiles x {dtype}", \
            lambda dtype=dtype: ops.cast_transpose_tiles(x.to(dtype), E4M3, (1, 16)), None, ("x",)
    yield "cast_transpose_tiles dtype float16", lambda: ops.cast_transpose_tiles(x, FP16, (1, 16)), None, ("dtype",)
    for tile in ((0, 16), (1, -1), (1,), 16, (1.0, 16)):
        yield f"cast_transpose_tiles tile_t {tile}", \
            lambda tile=tile: ops.cast_transpose_tiles(x, E4M3, (1, 16), tile_t=tile), None, ("tile_t",)
    acc, acc_scale_inv = ops.quantize_tiles(x, E4M3, (1, 16))
    for dtype in BAD_DTYPES:
        yield f"scaled_accumulate_tiles update {dtype}", \
            lambda dtype=dtype: ops.scaled_accumulate_tiles(acc, acc_scale_inv, x.to(dtype), (1, 16)), None, ("update",)
    yield "scaled_accumulate_tiles acc float32", lambda: ops.scaled_accumulate_tiles(x, acc_scale_inv, x, (1, 16)), \
        None, ("acc",)
    yield "scaled_accumulate_tiles acc_scale_inv of other tiles", \
        lambda: ops.scaled_accumulate_tiles(acc, acc_scale_inv, x, (2, 16)), None, ("acc_scale_inv",)
    yield "scaled_accumulate_tiles update of another shape", \
        lambda: ops.scaled_accumulate_tiles(acc, acc_scale_inv, x.reshape(16, 4), (1, 16)), None, ("update",)
    yield "scaled_accumulate_tiles meta acc_scale_inv", \
        lambda: ops.scaled_accumulate_tiles(acc, acc_scale_inv.to("meta"), x, (1, 16)), None, ("acc_scale_inv",)
    for tile in ((0, 16), (1,), (1.0, 16)):
        yield f"scaled_accumulate_tiles tile {tile}", \
            lambda tile=tile: ops.scaled_accumulate_tiles(acc, acc_scale_inv, x, tile), None, ("tile",)


def norm_tile_cases():
    """multi_norm_tiles: codes of every kind of value (NaN, inf, huge and tiny ones as the FP8
    formats hold them), odd and empty shapes, partial tiles and one scale, against the float64 norm
    of the real values; bad dtypes, scale counts, tiles and devices must be refused."""
    for kind, shape, tile, fmt in itertools.product(KINDS, SHAPES[:6], (None, (2, 3), (1, 16)), (E4M3, E5M2)):
        codes = values(kind, shape).to(fmt)
        rows, cols = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        count = 1 if tile is None else -(-rows // tile[0]) * -(-cols // tile[1])
        scale_inv = torch.exp2(torch.arange(count, dtype=torch.float32) % 7 - 3)

        def norm(codes=codes, scale_inv=scale_inv, tile=tile):
            return codes, scale_inv, ops.multi_norm_tiles([codes, codes], [scale_inv, scale_inv], tile)

        def check(r, tile=tile, rows=rows, cols=cols):
            codes, scale_inv, got = r
            m = codes.double().reshape(rows, cols)
            if tile is None:
                real = m * scale_inv.double()
            else:
                grid = scale_inv.double().reshape(-(-rows // tile[0]), -(-cols // tile[1]))
                real = m * grid.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[:, :cols]
            want = torch.linalg.vector_norm(real).float().expand(2)
            assert got.dtype == torch.float32 and got.shape == (2,), (got.dtype, got.shape)
            torch.testing.assert_close(got, want, rtol=2.0**-21, atol=0, equal_nan=True)

        yield f"multi_norm_tiles {kind}-{shape}-{tile}-{fmt}", norm, (None if shape == () else check), ("xs",)
    codes, one = torch.randn(4, 16).to(E4M3), torch.ones(1)
    for dtype in BAD_DTYPES[:-1]:
        yield f"multi_norm_tiles xs {dtype}", \
            lambda dtype=dtype: ops.multi_norm_tiles([codes.float().to(dtype)], [one]), None, ("xs",)
    yield "multi_norm_tiles xs of two formats", lambda: ops.multi_norm_tiles([codes, codes.to(E5M2)], [one, one]), \
        None, ("xs",)
    yield "multi_norm_tiles scale_invs of other tiles", lambda: ops.multi_norm_tiles([codes], [one], (2, 16)), \
        None, ("scale_invs",)
    yield "multi_norm_tiles scale_invs float16", lambda: ops.multi_norm_tiles([codes], [one.half()]), None, \
        ("scale_invs",)
    yield "multi_norm_tiles one scale_inv for two", lambda: ops.multi_norm_tiles([codes, codes], [one]), None, \
        ("scale_invs",)
    yield "multi_norm_tiles meta scale_inv", lambda: ops.multi_norm_tiles([codes], [one.to("meta")]), None, \
        ("scale_invs",)
    yield "multi_norm_tiles no xs", lambda: ops.multi_norm_tiles([], []), None, ("xs",)
    for tile in ((0, 16), (1,), (1.0, 16)):
        yield f"multi_norm_tiles tile {tile}", lambda tile=tile: ops.multi_norm_tiles([codes], [one], tile), None, \
            ("tile",)
