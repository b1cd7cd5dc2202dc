"""cast_transpose_rescaled: the transpose of a scaled FP16 tensor re-quantized with a new scale, in
one op. Bit for bit the path it replaced in Fp8Linear's backward (the scale product as a torch
mul, an amax scratch of zeros, then cast_transpose), under torch.compile too; errors that name
the argument; and on a GPU the CUDA kernel against the CPU reference."""

import math

import pytest
import torch

import fp8amp
from cast_reference import SCALED_FORMATS, all_bit_patterns, assert_bits_equal, bits
from fp8amp.linear import _transposed_copy

E4M3, FP16 = fp8amp.E4M3, fp8amp.FP16

# (scale_inv, scale): powers of two (a MasterWeight's), a pair whose float32 product rounds, one
# that overflows to inf, one that underflows to a subnormal product, and NaN.
SCALE_PAIRS = [(2.0**-8, 2.0**4), (2.0**-20, 2.0**9), (3.0, 1.0 / 3.0), (2.0**100, 2.0**100),
               (2.0**-100, 2.0**-40), (float("nan"), 1.0)]


def fp16_codes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random FP16 bit patterns (NaNs, infinities and subnormals among them) as [rows, cols]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (rows, cols), generator=g, dtype=torch.int32).to(torch.int16).view(FP16)


def scales(scale_inv: float, scale: float, device="cpu"):
    return (torch.tensor([scale_inv], dtype=torch.float32, device=device),
            torch.tensor([scale], dtype=torch.float32, device=device))


def old_path(codes, scale_inv, scale, dtype):
    """What _transposed_copy issued before the op: the product, a zeros amax, cast_transpose."""
    amax = torch.zeros(1, dtype=torch.float32, device=codes.device)
    _, transposed, _ = fp8amp.ops.cast_transpose(codes, scale_inv * scale, amax, dtype)
    return transposed


@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("pair", SCALE_PAIRS)
def test_every_fp16_code_equals_the_old_path(dtype, pair):
    codes = all_bit_patterns(FP16).view(256, 256)
    scale_inv, scale = scales(*pair)
    out_t = fp8amp.ops.cast_transpose_rescaled(codes, scale_inv, scale, dtype)
    assert out_t.dtype == dtype and out_t.shape == (256, 256)
    assert_bits_equal(out_t, old_path(codes, scale_inv, scale, dtype))


@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 16), (17, 48), (48, 17), (0, 8), (8, 0)])
def test_shapes_view_x_as_a_matrix(shape):
    codes = fp16_codes(math.prod(shape[:-1]), shape[-1]).reshape(shape)
    scale_inv, scale = scales(2.0**-6, 2.0**3)
    out_t = fp8amp.ops.cast_transpose_rescaled(codes, scale_inv, scale, E4M3)
    assert out_t.shape == (shape[-1], math.prod(shape[:-1]))
    assert_bits_equal(out_t, old_path(codes, scale_inv, scale, E4M3))


def test_makes_non_contiguous_input_contiguous():
    codes = fp16_codes(32, 16)
    scale_inv, scale = scales(2.0**-4, 2.0**2)
    assert_bits_equal(fp8amp.ops.cast_transpose_rescaled(codes.t(), scale_inv, scale, E4M3),
                      old_path(codes.t().contiguous(), scale_inv, scale, E4M3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_transposed_copy_is_the_masters_e4m3_copy_transposed(device):
    weight = torch.randn(768, 320, generator=torch.Generator().manual_seed(1)) * 3
    master = fp8amp.MasterWeight.from_tensor(weight.to(device))
    copy, _, _ = master.fp8_copy
    codes, scale_inv, copy_scale = master.fp8_operands()[3]
    assert_bits_equal(_transposed_copy(codes, scale_inv, copy_scale), copy.t().contiguous())


def test_compiled_fullgraph_equals_eager():
    def fn(codes, scale_inv, scale):
        return fp8amp.ops.cast_transpose_rescaled(codes * 1, scale_inv, scale, E4M3)

    codes = fp16_codes(64, 48, seed=2)
    args = (codes, *scales(2.0**-10, 2.0**5))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert_bits_equal(compiled(*args), fn(*args))


ERRORS = {
    "x float32": (lambda: (torch.randn(4, 8), *scales(1.0, 1.0), E4M3), ValueError, "x must hold float16 codes"),
    "x 0-d": (lambda: (torch.tensor(1.0, dtype=FP16), *scales(1.0, 1.0), E4M3), ValueError, "x must have at least 1"),
    "scale_inv [2]": (lambda: (fp16_codes(4, 8), torch.ones(2), torch.ones(1), E4M3), ValueError, "scale_inv"),
    "scale_inv float16": (lambda: (fp16_codes(4, 8), torch.ones(1, dtype=FP16), torch.ones(1), E4M3), ValueError,
                          "scale_inv must be float32"),
    "scale int32": (lambda: (fp16_codes(4, 8), torch.ones(1), torch.ones(1, dtype=torch.int32), E4M3), ValueError,
                    "scale must be float32"),
    "scale not a tensor": (lambda: (fp16_codes(4, 8), torch.ones(1), 2.0, E4M3), TypeError,
                           "scale must be a torch.Tensor"),
    "dtype bfloat16": (lambda: (fp16_codes(4, 8), *scales(1.0, 1.0), torch.bfloat16), ValueError, "dtype"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_arguments_are_named(name):
    make_args, error, needle = ERRORS[name]
    with pytest.raises(error, match=needle):
        fp8amp.ops.cast_transpose_rescaled(*make_args())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SCALED_FORMATS)
@pytest.mark.parametrize("pair", SCALE_PAIRS)
@pytest.mark.parametrize("shape", [(256, 256), (33, 65), (768, 3072), (1, 17)])
def test_cuda_equals_cpu(dtype, pair, shape):
    codes = all_bit_patterns(FP16).view(256, 256) if shape == (256, 256) else fp16_codes(*shape, seed=3)
    cpu = fp8amp.ops.cast_transpose_rescaled(codes, *scales(*pair), dtype)
    cuda = fp8amp.ops.cast_transpose_rescaled(codes.cuda(), *scales(*pair, device="cuda"), dtype)
    assert torch.equal(bits(cuda.cpu()), bits(cpu))
    assert torch.equal(bits(cuda), bits(old_path(codes.cuda(), *scales(*pair, device="cuda"), dtype)))
