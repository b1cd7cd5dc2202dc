"""The MXFP8 ops' cases of the public-API fuzz (fuzz_cases.py, docs/hardening.md): quantize_mx,
dequantize_mx and cast_transpose_mx over every value kind, odd and empty shapes and both formats,
against test_mx.py's torch reference of the E8M0 rule (finite blocks bit for bit, non-finite
blocks NaN), and gemm_mx's refusals: bad dtypes, shapes, K not whole blocks, foreign devices."""

from __future__ import annotations

import itertools
import math

import torch

import fp8amp
from fp8amp import ops
from test_mx import reference_mx, same_bits

E4M3, E5M2, FP16 = fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16


def mx_cases(values, kinds, shapes, high, bad_dtypes):
    """The cases, drawing inputs from fuzz_cases' ``values(kind, shape, dtype)``."""
    for dtype, kind, shape, fmt in itertools.product(high, kinds, shapes, (E4M3, E5M2)):
        x = values(kind, shape, dtype)

        def quantize(x=x, fmt=fmt):
            codes, scales = ops.quantize_mx(x, fmt)
            return x, codes, scales, ops.dequantize_mx(codes, scales), ops.cast_transpose_mx(x, fmt)

        def check(r, fmt=fmt):
            x, codes, scales, back, fused = r
            rows = math.prod(x.shape[:-1])
            assert codes.shape == x.shape and tuple(scales.shape) == (rows, -(-x.shape[-1] // 32)), scales.shape
            m = x.reshape(rows, x.shape[-1])
            want = (codes, scales, *ops.quantize_mx(m.t().contiguous(), fmt))
            assert all(same_bits(a, b) for a, b in zip(fused, want)), "cast_transpose_mx != quantize_mx of each copy"
            if x.numel() == 0:
                return
            ref_codes, ref_scales = reference_mx(x, fmt)
            assert torch.equal(scales, ref_scales), "E8M0 scales differ from the reference"
            finite = (scales != 0xFF).repeat_interleave(32, 1)[:, : x.shape[-1]].reshape(x.shape)
            assert torch.equal(codes.view(torch.uint8)[finite], ref_codes[finite]), "codes differ from the reference"
            assert bool(back[~finite].isnan().all()), "a non-finite block does not read NaN"

        name = f"{dtype}-{kind}-{shape}-{fmt}"
        yield f"quantize_mx {name}", quantize, (None if shape == () else check), ("x",)
    x = torch.randn(4, 64)
    for dtype in bad_dtypes:
        yield f"quantize_mx x {dtype}", lambda dtype=dtype: ops.quantize_mx(x.to(dtype)), None, ("x",)
    yield "quantize_mx dtype float16", lambda: ops.quantize_mx(x, FP16), None, ("dtype",)
    yield "cast_transpose_mx dtype float32", lambda: ops.cast_transpose_mx(x, torch.float32), None, ("dtype",)
    codes, scales = ops.quantize_mx(x)
    yield "dequantize_mx scales float32", lambda: ops.dequantize_mx(codes, scales.float()), None, ("scales",)
    yield "dequantize_mx scales of other blocks", lambda: ops.dequantize_mx(codes, scales[:, :1]), None, ("scales",)
    yield "dequantize_mx codes float32", lambda: ops.dequantize_mx(x, scales), None, ("x",)
    yield "dequantize_mx meta scales", lambda: ops.dequantize_mx(codes, scales.to("meta")), None, ("scales",)
    b, b_scales = ops.quantize_mx(torch.randn(16, 64))
    e5m2, _ = ops.quantize_mx(x, E5M2)
    b5, _ = ops.quantize_mx(torch.randn(16, 64), E5M2)
    bad_gemms = {
        "K not whole blocks": ((codes[:, :48], scales[:, :1], b[:, :48], b_scales[:, :1]), {}, "K"),
        "a_scales float32": ((codes, scales.float(), b, b_scales), {}, "a_scales"),
        "b_scales of other blocks": ((codes, scales, b, b_scales[:, :1]), {}, "b_scales"),
        "e5m2 x e5m2": ((e5m2, scales, b5, b_scales), {}, "e5m2"),
        "b float32": ((codes, scales, torch.randn(16, 64), b_scales), {}, "b"),
        "bias float16 for float32": ((codes, scales, b, b_scales), {"out_dtype": torch.float32,
                                                                    "bias": torch.zeros(16, dtype=torch.float16)},
                                     "bias"),
        "meta b": ((codes, scales, b.to("meta"), b_scales), {}, "b"),
    }
    for name, (args, kwargs, arg) in bad_gemms.items():
        yield f"gemm_mx {name}", lambda args=args, kwargs=kwargs: ops.gemm_mx(*args, **kwargs), None, (arg,)

    def gemm():
        return ops.gemm_mx(codes, scales, b, b_scales, out_dtype=torch.float32)

    def check_gemm(out):
        want = ops.dequantize_mx(codes, scales).double() @ ops.dequantize_mx(b, b_scales).double().t()
        assert torch.equal(out, want.float()), "gemm_mx differs from the dequantized product"

    yield "gemm_mx float32", gemm, check_gemm, ()
