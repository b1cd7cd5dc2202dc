"""The tile-scaled ops' cases of the public-API fuzz (fuzz_cases.py, docs/hardening.md):
quantize_tiles / dequantize_tiles against a per-tile loop over the power-of-two scale rule, and
cast_transpose_tiles / scaled_accumulate_tiles against the compositions they fuse; every value
kind, odd and empty shapes, partial tiles, and the refusals of bad dtypes, tiles, shapes and
devices."""

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
