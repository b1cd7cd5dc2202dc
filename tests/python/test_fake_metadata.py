"""Every op with a fake (Meta) kernel: its outputs' metadata (shape, strides, dtype, storage
offset) equal the real CPU kernel's, over a sweep of shapes and dtypes, and an op that writes its
arguments in place leaves their metadata alone under fake tensors too. torch.compile plans its
buffers from the fake results, so a mismatch here is a wrong result there (docs/compile.md)."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

import fp8amp

ops = torch.ops.fp8amp
E4M3, E5M2, FP16 = fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16
HIGH = (torch.float32, torch.bfloat16, torch.float16)
# Shapes viewed as matrices [rows, cols]: 3-D, odd row counts, one row, wide and tall.
X_SHAPES = ((1, 16), (3, 5, 16), (17, 48), (2, 3, 4, 32), (48, 1536), (1536, 48))


def metadata(t):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset())


def assert_same_metadata(op, args, kwargs=None):
    """Runs ``op`` on real tensors and on fake copies of them; compares every output and argument."""
    kwargs = kwargs or {}
    real_args = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)
    real = op(*real_args, **tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, kwargs))
    with FakeTensorMode() as mode:
        fake_args, fake_kwargs = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a,
                                          (args, kwargs))
        fake = op(*fake_args, **fake_kwargs)
    real_out, _ = tree_flatten(real)
    fake_out, _ = tree_flatten(fake)
    assert len(real_out) == len(fake_out)
    for i, (r, f) in enumerate(zip(real_out, fake_out)):
        if isinstance(r, torch.Tensor):
            assert metadata(f) == metadata(r), f"{op}: output {i}: fake {metadata(f)} != real {metadata(r)}"
    for i, (r, f) in enumerate(zip(tree_flatten(real_args)[0], tree_flatten(fake_args)[0])):
        if isinstance(r, torch.Tensor):
            assert metadata(f) == metadata(r), f"{op}: argument {i}: fake {metadata(f)} != real {metadata(r)}"


def randn(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def scaling_kwargs(history=4):
    return dict(warmup_counter=torch.zeros(1, dtype=torch.int32), warmup_steps=history)


@pytest.mark.parametrize("shape", X_SHAPES)
@pytest.mark.parametrize("x_dtype", HIGH)
@pytest.mark.parametrize("fmt", (E4M3, E5M2, FP16))
def test_quantizing_ops(shape, x_dtype, fmt):
    x = randn(shape, x_dtype)
    scaled = (x, torch.ones(1), torch.zeros(1, 4), fmt)
    assert_same_metadata(ops.quantize.default, scaled, scaling_kwargs())
    assert_same_metadata(ops.cast_transpose.default, scaled, scaling_kwargs())
    assert_same_metadata(ops.cast_transpose_dbias.default, scaled, scaling_kwargs())
    assert_same_metadata(ops.quantize_current.default, (x, fmt), dict(margin=0, nan_if_nonfinite=True))
    assert_same_metadata(ops.amax.default, (x, torch.zeros(1, 4)), scaling_kwargs())


@pytest.mark.parametrize("shape", X_SHAPES)
@pytest.mark.parametrize("fmt", (E4M3, E5M2, FP16))
def test_cast_transpose_rescaled(shape, fmt):
    assert_same_metadata(ops.cast_transpose_rescaled.default,
                         (randn(shape).to(FP16), torch.full((1,), 0.5), torch.full((1,), 4.0), fmt))


@pytest.mark.parametrize("shape", X_SHAPES)
@pytest.mark.parametrize("out_dtype", HIGH)
def test_dequantize(shape, out_dtype):
    assert_same_metadata(ops.dequantize.default, (randn(shape).to(FP16), torch.ones(1), out_dtype))


@pytest.mark.parametrize("x_dtype", HIGH)
def test_multi_ops(x_dtype):
    xs = [randn(s, x_dtype, seed=i) for i, s in enumerate(X_SHAPES)]
    n = len(xs)
    assert_same_metadata(ops.multi_amax.default, (xs, torch.zeros(n, 3)))
    outs = [torch.empty_like(x, dtype=FP16) for x in xs]
    assert_same_metadata(ops.multi_quantize.default, (xs, outs, torch.ones(n), torch.zeros(n, 3)))
    codes = [x.to(FP16) for x in xs]
    assert_same_metadata(ops.multi_dequantize.default, (codes, torch.ones(n), [torch.empty_like(x) for x in xs]))


@pytest.mark.parametrize("n, history", [(1, 1), (3, 16), (7, 5)])
def test_scale_updates(n, history):
    amax = torch.rand(n, history)
    assert_same_metadata(ops.compute_scale.default, (amax, torch.ones(n), torch.ones(n), 448.0))
    state = (amax, torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.int32), 448.0)
    assert_same_metadata(ops.update_delayed_scaling.default, state)
    assert_same_metadata(ops.multi_update_delayed_scaling.default,
                         tuple([t] * 1 if isinstance(t, torch.Tensor) else t for t in state))


# (M, K, N): odd multiples of 16 for M, non-powers of two, a wide output (the LM-head shape, smaller).
GEMM_SHAPES = ((16, 16, 16), (48, 1536, 256), (16 * 7, 96, 32 * 5), (16, 32, 4096))


@pytest.mark.parametrize("m, k, n", GEMM_SHAPES)
@pytest.mark.parametrize("out_dtype", HIGH)
@pytest.mark.parametrize("bias", (False, True))
def test_gemm(m, k, n, out_dtype, bias):
    a, b = randn((m, k)).to(E4M3), randn((n, k), seed=1).to(E4M3)
    bias_t = randn((n,), fp8amp.ops.bias_dtype(out_dtype), seed=2) if bias else None
    args = (a, b, torch.ones(1), torch.full((1,), 0.5))
    assert_same_metadata(ops.gemm.default, (*args, out_dtype, bias_t, True))
    assert_same_metadata(ops.gemm_accumulate.default, (*args, torch.zeros(m, n, dtype=out_dtype), bias_t, False))


@pytest.mark.parametrize("shape, src_dtype", list(itertools.product(((8, 16), (3, 5, 32)), (torch.float32, FP16))))
def test_scaled_accumulate(shape, src_dtype):
    dst = randn(shape).to(FP16)
    src = randn(shape, seed=1).to(src_dtype)
    src_scale_inv = torch.tensor([2.0]) if src_dtype == FP16 else None
    assert_same_metadata(ops.scaled_accumulate.default, (dst, torch.tensor([0.5]), src, src_scale_inv, 1.0,
                                                         torch.zeros(1)))


@pytest.mark.parametrize("shapes", [((16,),), ((3, 5), (128,), (7, 1, 9))])
def test_adam_step(shapes):
    params = [randn(s, seed=i) for i, s in enumerate(shapes)]
    grads = [randn(s, seed=10 + i) for i, s in enumerate(shapes)]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    nones = [[None] * len(params) for _ in range(12)]  # the per-param optional lists
    assert_same_metadata(ops.adam_step.default, (params, grads, *states, *nones),
                         dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
                              maximize=False, step=1))


@pytest.mark.parametrize("shape", X_SHAPES + ((0, 128),))
@pytest.mark.parametrize("tile", ((1, 128), (128, 128), (1, 5), (7, 3)))
@pytest.mark.parametrize("fmt", (E4M3, E5M2))
def test_tile_ops(shape, tile, fmt):
    x = randn(shape)
    assert_same_metadata(ops.quantize_tiles.default, (x, fmt, *tile))
    codes, scale_inv = ops.quantize_tiles.default(x, fmt, *tile)
    assert_same_metadata(ops.dequantize_tiles.default, (codes, scale_inv, *tile, torch.bfloat16))


@pytest.mark.parametrize("shape", X_SHAPES + ((0, 64),))
@pytest.mark.parametrize("fmt", (E4M3, E5M2))
def test_mx_ops(shape, fmt):
    x = randn(shape)
    assert_same_metadata(ops.quantize_mx.default, (x, fmt))
    assert_same_metadata(ops.cast_transpose_mx.default, (x, fmt))
    codes, scales = ops.quantize_mx.default(x, fmt)
    assert_same_metadata(ops.dequantize_mx.default, (codes, scales, torch.bfloat16))
    if len(shape) == 2 and shape[1] % 32 == 0 and fmt == E4M3:
        b, b_scales = ops.quantize_mx.default(randn((16, shape[1]), seed=3), E4M3)
        assert_same_metadata(ops.gemm_mx.default, (codes, scales, b, b_scales, torch.float32, None))
