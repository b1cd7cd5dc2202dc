"""Independent references and inputs for the cast tests: torch's own casts, after clamping.

torch's eager float -> float8 / float16 casts round to nearest even but do not saturate, so
``(x * scale).clamp(-fmax, fmax).to(dtype)`` is what a saturating cast must give (docs/numerics.md#numerics),
except for NaN and infinities, which fp8amp always encodes as the positive NaN code 0x7F (FP16:
0x7FFF): those positions are compared separately.
"""

from __future__ import annotations

import torch

import fp8amp

SCALED_FORMATS = (fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16)
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
NAN_CODE = {fp8amp.E4M3: 0x7F, fp8amp.E5M2: 0x7F, fp8amp.FP16: 0x7FFF}

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t``, as an integer tensor of the same element size."""
    return t.view(_BITS_DTYPE[t.element_size()])


def all_bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 1- or 2-byte dtype, NaNs and infinities included (flat)."""
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def random_float32_bits(n: int, generator: torch.Generator) -> torch.Tensor:
    """n float32 values with uniformly random bit patterns: every exponent, subnormals, NaNs, infs."""
    return torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=generator).to(torch.int32).view(
        torch.float32
    )


def boundary_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 inputs at the rounding and saturation edges of a scaled format (scale 1).

    Every finite value of the format, the midpoints between neighbours (ties to even) and the
    float32 values just beside those midpoints, values around and far beyond fmax, underflow to
    zero, float32 subnormals, zeros, infinities and NaNs of both signs; all with both signs.
    """
    values = all_bit_patterns(dtype).float()
    finite = values[values.isfinite() & (values >= 0)].unique()
    mids = (finite[:-1].double() + finite[1:].double()).div(2).float()  # exact: few mantissa bits
    fmax = fp8amp.format_max(dtype)
    tiny = finite[1].item()  # smallest positive subnormal of the format
    f32 = torch.finfo(torch.float32)
    edges = torch.tensor(
        [fmax, fmax * (1 + 2.0**-12), fmax * 1.0625, fmax * 1.125, 2 * fmax, 1e30, f32.max, float("inf"),
         tiny / 2, tiny * 0.5000001, tiny * 0.4999999, tiny * 1.5, f32.smallest_normal, 1e-45, 0.0],
        dtype=torch.float32,
    )
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    positive = torch.cat([finite, mids, up, down, edges])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([positive, -positive, nans, -nans])


def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale in float32 (scale a float32 [1] tensor), as the core computes it."""
    return x.float() * scale.float().reshape(())


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor | None = None) -> None:
    """Bitwise equality, reporting the first mismatches (with their inputs if given)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    diff = (bits(actual) != bits(expected)).flatten().nonzero().flatten()
    if diff.numel():
        shown = diff[:8]
        a = bits(actual).flatten()[shown].tolist()
        e = bits(expected).flatten()[shown].tolist()
        where = "" if inputs is None else f", inputs {inputs.flatten()[shown].tolist()}"
        raise AssertionError(f"{diff.numel()} of {actual.numel()} differ: at {shown.tolist()} got bits {a}, "
                             f"expected {e}{where}")


def assert_all_same(a, b):
    """Nested lists / tuples of tensors equal bit for bit, NaN payloads included."""
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_all_same(u, v)
    elif isinstance(a, torch.Tensor):
        assert_bits_equal(b, a)
    else:
        assert a == b


def assert_quantized(out: torch.Tensor, x_scaled: torch.Tensor, dtype: torch.dtype) -> None:
    """out must be torch's cast of clamp(x_scaled, +-fmax), and NAN_CODE where x_scaled is NaN or infinite."""
    fmax = fp8amp.format_max(dtype)
    nan = x_scaled.isnan() | x_scaled.isinf()
    expected = x_scaled.clamp(-fmax, fmax).to(dtype)
    expected = torch.where(nan, torch.full_like(bits(expected), NAN_CODE[dtype]), bits(expected)).view(dtype)
    assert_bits_equal(out, expected, x_scaled)


def assert_dequantized(out: torch.Tensor, x: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
    """out must be torch's (x.float() * scale_inv).to(dtype); NaN wherever that is NaN."""
    expected = (x.float() * scale_inv.reshape(())).to(dtype)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan), "NaN positions differ"
    assert_bits_equal(out[~nan], expected[~nan], x.float()[~nan])


def torch_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as float32 [1], NaN if x holds one, 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros(1)
    return x.float().abs().max().reshape(1)


def assert_same_float(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Float tensors equal bit for bit, except that any NaN matches any NaN."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan), f"NaN positions differ: {actual} vs {expected}"
    assert_bits_equal(actual[~nan], expected[~nan])


def scaled_example(fmt=fp8amp.E4M3, shape=(8, 16), seed=0, mult=3.0):
    """A seeded normal tensor ``x`` (times ``mult``) and ``fp8amp.ScaledTensor.from_tensor(x, fmt)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * mult
    return x, fp8amp.ScaledTensor.from_tensor(x, fmt)


def fresh_scaling(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 [1] ``scale`` and a zeroed amax buffer: a cast's scaling arguments."""
    return torch.tensor([scale], dtype=torch.float32), torch.zeros(1)
