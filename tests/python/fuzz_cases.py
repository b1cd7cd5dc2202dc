"""The cases of the public-API fuzz (test_fuzz.py), and the child process that runs them.

A case is (name, call, check, names): ``call()`` runs the API; ``check(result)`` asserts it equals
an independent reference (an AssertionError is a silent wrong result), or is None when the input
is invalid and must be refused. An exception is a *clear error* when it is a TypeError /
ValueError / NotImplementedError / RuntimeError whose message names one of ``names`` (the
argument), else *unclear*. Run as a program, it runs cases [start, end) and prints one JSON line
as each case starts and one with its outcome, so the parent can name a case that crashed it.
The tile ops' cases are in fuzz_cases_tiles.py, the MXFP8 ops' in fuzz_cases_mx.py, the modules'
and the rest of the public API's (convert, initialize, unconvert, the optimizer, recipes, the
distributed helpers) in fuzz_cases_api.py.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import zlib

import torch

import fp8amp
from fp8amp import ops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cast_reference import assert_dequantized, assert_quantized, bits, torch_amax  # noqa: E402

E4M3, E5M2, FP16 = fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16
FORMATS = (E4M3, E5M2, FP16)
HIGH = (torch.float32, torch.bfloat16, torch.float16)
BAD_DTYPES = (torch.float64, torch.int32, torch.bool, torch.complex64, E4M3)
CLEAR = (TypeError, ValueError, NotImplementedError, RuntimeError)
SHAPES = ((4, 16), (0,), (0, 16), (), (1,), (3, 2, 16), (1 << 16,))


def values(kind: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Inputs of one kind: normal, with a NaN, with an inf, huge or tiny magnitudes."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{shape}".encode()))
    x = torch.randn(shape, generator=g)
    if kind == "huge":
        x = x * 1e30
    elif kind == "tiny":
        x = x * 1e-40
    elif x.numel() and kind in ("nan", "inf", "-inf"):
        x.view(-1)[x.numel() // 2] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind]
    return x.to(dtype)


KINDS = ("normal", "nan", "inf", "-inf", "huge", "tiny")


# ------------------------------------------------------------------------------------------ references


def pow2_scale(amax: torch.Tensor, fmax: float, margin: int = 0) -> torch.Tensor:
    """The pow2 rule from the bits of fl32(fmax / amax), exponent clamped to [-126, 126]."""
    q = torch.tensor([fmax], dtype=torch.float32) / amax.float().reshape(1)
    exponent = ((q.view(torch.int32) >> 23) & 0xFF) - 127 - margin
    return torch.ldexp(torch.ones(1), exponent.clamp(-126, 126).float())


def current_scale(amax: torch.Tensor, fmax: float, margin: int = 0) -> torch.Tensor:
    if not bool(amax.isfinite().all()) or amax.item() == 0:
        return torch.ones(1)
    return pow2_scale(amax, fmax, margin)


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float = 0.0) -> None:
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN positions differ"
    ok = ~expected.isnan()
    assert torch.equal(actual[ok].isinf(), expected[ok].isinf()), "inf positions differ"
    fin = ok & expected.isfinite()
    err = (actual[fin] - expected[fin]).abs()
    assert bool((err <= atol + rtol * expected[fin].abs()).all()), f"max error {err.max().item() if err.numel() else 0}"


def raises_only(result) -> None:
    raise AssertionError(f"invalid input accepted, returned {type(result).__name__}")


# ------------------------------------------------------------------------------------------ the op cases


def cast_cases():
    for dtype, kind, shape, fmt in itertools.product(HIGH, KINDS, SHAPES[:6], FORMATS):
        name = f"{dtype}-{kind}-{shape}-{fmt}"
        x = values(kind, shape, dtype)

        def quantize(x=x, fmt=fmt):
            scale, amax = torch.tensor([4.0]), torch.tensor([0.5])
            out, scale_inv = ops.quantize(x, scale, amax, fmt)
            return x, scale, amax, out, scale_inv

        def check_quantize(r, fmt=fmt):
            x, scale, amax, out, scale_inv = r
            assert_quantized(out, x.float() * 4.0, fmt)
            assert scale_inv.item() == 0.25
            expected = torch.maximum(torch.tensor([0.5]), torch_amax(x)) if x.numel() else torch.tensor([0.5])
            if expected.isnan().any():
                assert amax.isnan().all()
            else:
                assert torch.equal(amax, expected), (amax, expected)

        yield f"quantize {name}", quantize, check_quantize, ()
        for nan_if in (False, True):
            def current(x=x, fmt=fmt, nan_if=nan_if):
                return x, ops.quantize_current(x, fmt, nan_if_nonfinite=nan_if)

            def check_current(r, fmt=fmt, nan_if=nan_if):
                x, (out, scale_inv, amax) = r
                ref_amax = torch_amax(x)
                assert torch.equal(amax.isnan(), ref_amax.isnan()) and (amax.isnan().all() or torch.equal(amax, ref_amax))
                scale = current_scale(ref_amax, fp8amp.format_max(fmt))
                assert_quantized(out, x.float() * scale.reshape(()), fmt)
                if nan_if and not bool(ref_amax.isfinite().all()):
                    assert scale_inv.isnan().all()
                else:
                    assert torch.equal(scale_inv, 1 / scale)

            yield f"quantize_current nan_if_nonfinite={nan_if} {name}", current, check_current, ()
        if dtype == torch.float32:
            def round_trip(x=x, fmt=fmt):
                codes = ops.quantize(x, torch.ones(1), torch.zeros(1), fmt)[0]
                return codes, ops.dequantize(codes, torch.tensor([0.5]), torch.float32)

            yield (f"dequantize {name}", round_trip,
                   lambda r: assert_dequantized(r[1], r[0], torch.tensor([0.5]), torch.float32), ())

            def amax_op(x=x):
                buf = torch.zeros(1)
                ops.amax(x, buf)
                return x, buf

            yield f"amax {name}", amax_op, lambda r: close(r[1], torch_amax(r[0]), 0), ()
    for kind, fmt in itertools.product(("normal", "nan", "inf"), FORMATS):  # large: 2^22 elements
        x = values(kind, (1 << 22,))
        yield (f"quantize_current large {kind} {fmt}", lambda x=x, fmt=fmt: (x, ops.quantize_current(x, fmt)),
               lambda r, fmt=fmt: assert_quantized(r[1][0], r[0] * current_scale(torch_amax(r[0]), fp8amp.format_max(fmt)),
                                                   fmt), ())
    for dtype, kind, fmt in itertools.product(HIGH, KINDS, FORMATS):
        x = values(kind, (33, 16), dtype)

        def ct(x=x, fmt=fmt):
            return x, ops.cast_transpose_dbias(x, torch.ones(1), torch.zeros(1), fmt)

        def check_ct(r, fmt=fmt):
            x, (out, out_t, scale_inv, dbias) = r
            assert_quantized(out, x.float(), fmt)
            assert torch.equal(bits(out_t), bits(out).t())
            exact = x.double().sum(0)
            assert torch.equal(dbias.isnan(), exact.isnan()) and torch.equal(dbias.isinf(), exact.isinf())
            fin = exact.isfinite()
            bound = x.double().abs().sum(0) * 2.0 ** -20  # float32 sums of 33 rows, in a fixed order
            assert bool(((dbias.double() - exact).abs()[fin] <= bound[fin]).all()), "dbias"

        yield f"cast_transpose_dbias {dtype}-{kind}-{fmt}", ct, check_ct, ()
    for bad, fmt in itertools.product(BAD_DTYPES, FORMATS):
        x = torch.ones(4, 16).to(bad)
        yield f"quantize x {bad} {fmt}", lambda x=x, f=fmt: ops.quantize(x, torch.ones(1), torch.zeros(1), f), None, ("x",)
        yield f"quantize_current x {bad} {fmt}", lambda x=x, f=fmt: ops.quantize_current(x, f), None, ("x",)
    for bad in BAD_DTYPES:
        x = torch.ones(4, 16).to(bad)
        yield f"amax x {bad}", lambda x=x: ops.amax(x, torch.zeros(1)), None, ("x",)
        if bad not in FORMATS:
            yield f"quantize dtype {bad}", lambda b=bad: ops.quantize(torch.ones(4), torch.ones(1), torch.zeros(1), b), \
                None, ("dtype",)
            yield f"dequantize x {bad}", lambda x=x: ops.dequantize(x, torch.ones(1), torch.float32), None, ("x",)
    for arg, bad in itertools.product(("scale", "amax"), (torch.ones(2), torch.ones(0), torch.ones(1).half(),
                                                         torch.ones(1, 8)[:, ::2], torch.ones(1, dtype=torch.int32))):
        def wrong_scaling(arg=arg, bad=bad):
            kw = {"scale": torch.ones(1), "amax": torch.zeros(1), arg: bad}
            return ops.quantize(torch.randn(8), kw["scale"], kw["amax"], E4M3)

        if not (arg == "amax" and bad.shape == (2,)):  # a 1-D amax of any length is one history
            yield f"quantize {arg} {tuple(bad.shape)} {bad.dtype}", wrong_scaling, None, (arg,)


def scaling_cases():
    for kind, h in itertools.product(("normal", "nan", "inf", "zero"), (1, 4)):
        hist = torch.rand(2, h) * 100
        if kind == "zero":
            hist.zero_()
        elif kind != "normal":
            hist[1, 0] = math.nan if kind == "nan" else math.inf

        def update(hist=hist):
            state = [hist.clone(), torch.full((2,), 2.0), torch.full((2,), 0.5), torch.tensor([0, 5], dtype=torch.int32)]
            ops.update_delayed_scaling(*state, 448.0)
            return state

        def check_update(r, hist=hist, h=h):
            new_hist, scale, scale_inv, counter = r
            for i in range(2):
                row = hist[i].clone()
                bad = not bool(row[0].isfinite())
                if bad:
                    row[0] = 0
                peak = row.max()
                exp_scale = torch.tensor([2.0]) if peak.item() == 0 else pow2_scale(peak.reshape(1), 448.0)
                assert scale[i].item() == exp_scale.item() and scale_inv[i].item() == 1 / exp_scale.item()
                recorded = bool(hist[i, 0] > 0)  # an amax of 0 (nothing recorded) leaves the warm-up
                assert counter[i].item() == (0 if bad else min([0, 5][i] + recorded, h))
                assert torch.equal(new_hist[i], torch.cat([torch.zeros(1), row[:-1]]))

        yield f"update_delayed_scaling {kind} H={h}", update, check_update, ()

        def compute(hist=hist):
            scale, scale_inv = torch.full((2,), 2.0), torch.full((2,), 0.5)
            ops.compute_scale(hist, scale, scale_inv, 448.0)
            return scale

        def check_compute(scale, hist=hist):
            for i in range(2):
                a = hist[i, 0].reshape(1)
                expected = 2.0 if (not bool(a.isfinite()) or a.item() == 0) else pow2_scale(a, 448.0).item()
                assert scale[i].item() == expected

        yield f"compute_scale {kind} H={h}", compute, check_compute, ()
    good = [torch.zeros(1, 4), torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.int32)]
    names = ("amax_history", "scale", "scale_inv", "counter")
    for i, bad in itertools.product(range(4), (torch.zeros(2, 4), torch.zeros(1, dtype=torch.float64),
                                               torch.zeros(1, dtype=torch.int32), torch.zeros(4)[::2])):
        args = list(good)
        args[i] = bad
        if bad.dtype == good[i].dtype and bad.shape == good[i].shape:
            continue
        # A history of 2 rows is named with the state it no longer matches.
        yield f"update_delayed_scaling {names[i]} {tuple(bad.shape)} {bad.dtype}", \
            lambda a=args: ops.update_delayed_scaling(*[t.clone() for t in a], 448.0), None, (names[i], "2 element")
    yield "update_delayed_scaling fmax 0", lambda: ops.update_delayed_scaling(*good, 0.0), None, ("fmax",)
    yield "update_delayed_scaling fmax inf", lambda: ops.update_delayed_scaling(*good, math.inf), None, ("fmax",)
    yield "compute_scale margin 200", lambda: ops.compute_scale(torch.ones(1), torch.ones(1), torch.ones(1), 448.0,
                                                                margin=200), None, ("margin",)


def gemm_cases():
    for fa, fb, out_dtype, m, kind in itertools.product((E4M3, E5M2), (E4M3, E5M2), HIGH, (0, 1, 5), KINDS[:3]):
        a32, b32 = values(kind, (m, 32)), values("normal", (16, 32))

        def gemm(fa=fa, fb=fb, out_dtype=out_dtype, a32=a32, b32=b32):
            a, b = a32.to(fa), b32.to(fb)
            sa, sb = torch.tensor([0.5]), torch.tensor([2.0])
            bias = torch.randn(16).to(ops.bias_dtype(out_dtype))
            return a, b, bias, ops.gemm(a, b, sa, sb, out_dtype=out_dtype, bias=bias)

        def check(r, out_dtype=out_dtype):
            a, b, bias, out = r
            ref = (a.double() * 0.5) @ (b.double() * 2.0).t() + bias.double()
            rtol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[out_dtype]
            close(out, ref, rtol, atol=1e-6)

        names = ("a", "b") if (fa, fb) == (E5M2, E5M2) else ()
        yield f"gemm {fa}x{fb}->{out_dtype} M={m} {kind}", gemm, (None if names else check), names
    e4 = torch.randn(16, 32).to(E4M3)
    for bad_k in (8, 24):
        x = torch.randn(16, bad_k).to(E4M3)
        yield f"gemm K={bad_k}", lambda x=x: ops.gemm(x, x, torch.ones(1), torch.ones(1), out_dtype=torch.float32), None, ("K",)
    yield "gemm a float32", lambda: ops.gemm(e4.float(), e4, torch.ones(1), torch.ones(1), out_dtype=torch.float32), None, ("a",)
    yield "gemm out_dtype int32", lambda: ops.gemm(e4, e4, torch.ones(1), torch.ones(1), out_dtype=torch.int32), None, ("out_dtype",)
    yield "gemm a_scale_inv [2]", lambda: ops.gemm(e4, e4, torch.ones(2), torch.ones(1), out_dtype=torch.float32), None, ("a_scale_inv",)
    yield "gemm bias wrong dtype", lambda: ops.gemm(e4, e4, torch.ones(1), torch.ones(1), out_dtype=torch.float16,
                                                    bias=torch.ones(16)), None, ("bias",)

    def accumulate():
        out = torch.ones(16, 16)
        ops.gemm_accumulate(e4, e4, torch.ones(1), torch.ones(1), out)
        return out

    yield "gemm_accumulate", accumulate, lambda out: close(out, 1 + e4.double() @ e4.double().t(), 1e-6, 1e-6), ()


def accumulate_adam_cases():
    for fmt, src_kind, src_dtype, alpha in itertools.product(FORMATS, KINDS[:3], HIGH, (1.0, 0.5)):
        src = values(src_kind, (64,), src_dtype)

        def acc(fmt=fmt, src=src, alpha=alpha):
            dst, dst_si = ops.quantize_current(torch.randn(64, generator=torch.Generator().manual_seed(2)), fmt)[:2]
            before = dst.float() * dst_si
            ops.scaled_accumulate(dst, dst_si, src, alpha=alpha)
            return before, dst.float() * dst_si

        def check(r, src=src, alpha=alpha, fmt=fmt):
            before, after = r
            exact = before.double() + alpha * src.double()
            if not bool(exact.isfinite().all()):
                assert after.isnan().all()
            else:
                mantissa = {E4M3: 3, E5M2: 2, FP16: 10}[fmt]
                close(after, exact, 2.0 ** -mantissa, atol=exact.abs().max().item() * 2.0 ** -14)

        yield f"scaled_accumulate {fmt} src {src_dtype} {src_kind} alpha={alpha}", acc, check, ()
    yield "scaled_accumulate src float64", lambda: ops.scaled_accumulate(torch.zeros(4, dtype=E4M3), torch.ones(1),
                                                                         torch.ones(4, dtype=torch.float64)), None, ("src",)
    yield "scaled_accumulate src numel", lambda: ops.scaled_accumulate(torch.zeros(4, dtype=E4M3), torch.ones(1),
                                                                       torch.ones(5)), None, ("src",)
    for kind, wd, shape in itertools.product(("normal", "nan", "inf"), (0.0, 0.1), ((8,), (0,), (3, 5))):
        g = values(kind, shape)

        def adam(g=g, wd=wd, shape=shape):
            p, m, v = torch.linspace(-1, 1, math.prod(shape)).reshape(shape), torch.zeros(shape), torch.zeros(shape)
            found = torch.zeros(1)
            ops.adam_step([p], [g], [m], [v], lr=0.1, weight_decay=wd, step=1, found_inf=found)
            return p, found

        def check(r, g=g, wd=wd, shape=shape):
            p, found = r
            p0 = torch.linspace(-1, 1, math.prod(shape)).reshape(shape).double()
            if not bool(g.isfinite().all()):
                assert found.item() == 1 and torch.equal(p, p0.float())
                return
            m, v = 0.1 * g.double(), 0.001 * g.double() ** 2
            ref = p0 * (1 - 0.1 * wd) - 0.1 / 0.1 * m / (v.sqrt() / math.sqrt(0.001) + 1e-8)
            close(p, ref, 1e-5, 1e-6)

        yield f"adam_step grad {kind} wd={wd} {shape}", adam, check, ()
    p = torch.ones(4)
    for arg, bad in (("grads", torch.ones(5)), ("exp_avgs", torch.ones(4, dtype=torch.float64)),
                     ("params", torch.ones(4, dtype=torch.float64)), ("exp_avg_sq", torch.ones(4).half())):
        def wrong(arg=arg, bad=bad):
            lists = {"params": [p.clone()], "grads": [torch.ones(4)], "exp_avgs": [torch.zeros(4)],
                     "exp_avg_sqs": [torch.zeros(4)], arg.rstrip("s") + "s": [bad]}
            return ops.adam_step(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"], lr=0.1, step=1)

        yield f"adam_step {arg} {tuple(bad.shape)} {bad.dtype}", wrong, None, (arg,)
    yield "adam_step lr nan", lambda: ops.adam_step([p], [p], [p.clone()], [p.clone()], lr=math.nan, step=1), None, ("lr",)
    yield "adam_step empty", lambda: ops.adam_step([], [], [], [], lr=0.1, step=1), None, ("params",)
    for bad in (torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.int64)):
        yield (f"adam_step step_counts {tuple(bad.shape)} {bad.dtype}",
               lambda bad=bad: ops.adam_step([p.clone()], [p], [torch.zeros(4)], [torch.zeros(4)], lr=0.1, step=1,
                                             step_counts=[bad]), None, ("step_counts",))
    yield ("adam_step step_counts length", lambda: ops.adam_step([p.clone()], [p], [torch.zeros(4)], [torch.zeros(4)],
                                                                 lr=0.1, step=1, step_counts=[None, None]),
           None, ("step_counts",))


def meta_and_alias_cases():
    """A meta tensor among real ones (every tensor argument of each op), and written arguments
    sharing memory with another argument."""
    x, one, amax = torch.randn(16, 16), torch.ones(1), torch.zeros(1, 4)
    e4 = x.to(E4M3)
    calls = {
        "quantize": (ops.quantize, (x, one, amax, E4M3), ("x", "scale", "amax")),
        "cast_transpose": (ops.cast_transpose, (x, one, amax, E4M3), ("x", "scale", "amax")),
        "dequantize": (ops.dequantize, (e4, one, torch.float32), ("x", "scale_inv")),
        "amax": (ops.amax, (x, amax), ("x", "amax")),
        "gemm": (lambda *t: ops.gemm(*t, out_dtype=torch.float32), (e4, e4, one, one),
                 ("a", "b", "a_scale_inv", "b_scale_inv")),
        "gemm_accumulate": (ops.gemm_accumulate, (e4, e4, one, one, torch.zeros(16, 16)),
                            ("a", "b", "a_scale_inv", "b_scale_inv", "out")),
        "compute_scale": (ops.compute_scale, (amax, one, one.clone(), 448.0), ("amax", "scale", "scale_inv")),
        "update_delayed_scaling": (ops.update_delayed_scaling, (amax, one, one.clone(), torch.zeros(1, dtype=torch.int32),
                                                                448.0), ("amax_history", "scale", "scale_inv", "counter")),
        "scaled_accumulate": (ops.scaled_accumulate, (x.half(), one, x), ("dst", "dst_scale_inv", "src")),
    }
    for op, (fn, args, arg_names) in calls.items():
        for i, name in enumerate(arg_names):
            moved = [a.clone().to("meta") if j == i else (a.clone() if isinstance(a, torch.Tensor) else a)
                     for j, a in enumerate(args)]
            yield f"{op} {name} on meta", lambda fn=fn, a=moved: fn(*a), None, (name,)
    buf = torch.zeros(40)
    s = torch.ones(1)
    c = torch.zeros(1, dtype=torch.int32)
    aliases = [
        ("quantize amax in x", lambda: ops.quantize(buf[:16], one, buf[2:3], E4M3), ("amax",)),
        ("quantize scale is amax", lambda: ops.quantize(buf[:16], s, s, E4M3), ("amax",)),
        ("amax buffer in x", lambda: ops.amax(buf[:16], buf[15:16]), ("amax",)),
        ("multi_amax amax in xs[1]", lambda: ops.multi_amax([buf[:8], buf[8:16]], buf[9:11]), ("amax",)),
        ("cast_transpose amax in x", lambda: ops.cast_transpose(buf[:16].view(4, 4), one, buf[0:1], E4M3), ("amax",)),
        ("compute_scale scale is scale_inv", lambda: ops.compute_scale(one, s, s, 448.0), ("scale_inv",)),
        ("update_delayed_scaling scale is scale_inv", lambda: ops.update_delayed_scaling(torch.zeros(1, 4), s, s, c, 448.0),
         ("scale_inv",)),
        ("update_delayed_scaling scale in history", lambda: ops.update_delayed_scaling(buf[:4].view(1, 4), buf[2:3],
                                                                                        torch.ones(1), c, 448.0), ("scale",)),
        ("adam_step exp_avg is exp_avg_sq", lambda: ops.adam_step([torch.ones(4)], [torch.ones(4)], [buf[:4]], [buf[:4]],
                                                                  lr=0.1, step=1), ("exp_avg",)),
        ("adam_step grad in param", lambda: ops.adam_step([buf[:8]], [buf[4:12]], [torch.zeros(8)], [torch.zeros(8)],
                                                          lr=0.1, step=1), ("grads",)),
        ("scaled_accumulate src part of dst", lambda: ops.scaled_accumulate(
            buf[:8].view(torch.float16), one, buf[4:12].view(torch.float16)), ("src",)),
    ]
    storage = torch.zeros(16 * 16 + 16)
    a_in_out = storage.view(torch.uint8)[:256].view(E4M3).view(16, 16)
    aliases.append(("gemm_accumulate out over a",
                    lambda: ops.gemm_accumulate(a_in_out, e4, one, one, storage[:256].view(16, 16)), ("out",)))
    for name, call, arg in aliases:
        yield f"alias: {name}", call, None, arg


# ------------------------------------------------------------------------------------------ the modules


def all_cases() -> list:
    from fuzz_cases_api import api_cases, module_cases  # noqa: E402 (beside this file, on sys.path above)
    from fuzz_cases_mx import mx_cases  # noqa: E402
    from fuzz_cases_tiles import tile_cases  # noqa: E402

    def mx():
        return mx_cases(values, KINDS, SHAPES[:6], HIGH, BAD_DTYPES)

    return [c for gen in (cast_cases, scaling_cases, gemm_cases, accumulate_adam_cases, meta_and_alias_cases,
                          tile_cases, module_cases, api_cases, mx) for c in gen()]


def outcome(case) -> tuple[str, str]:
    name, call, check, names = case
    try:
        result = call()
    except CLEAR + (AssertionError, IndexError, KeyError, AttributeError) as e:
        message = str(e)
        if isinstance(e, CLEAR) and any(n in message for n in names) and names:
            return "clear", message[:200]
        return "unclear", f"{type(e).__name__}: {message[:300]}"
    if check is None:
        return "wrong", f"invalid input accepted (returned {type(result).__name__})"
    try:
        check(result)
    except AssertionError as e:
        return "wrong", str(e)[:300]
    return "correct", ""


def main(start: int, end: int) -> None:
    torch.manual_seed(0)
    cases = all_cases()
    for i in range(start, min(end, len(cases))):
        print(json.dumps({"start": i, "name": cases[i][0]}), flush=True)
        kind, detail = outcome(cases[i])
        print(json.dumps({"index": i, "name": cases[i][0], "outcome": kind, "detail": detail}), flush=True)
    print(json.dumps({"total": len(cases)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
