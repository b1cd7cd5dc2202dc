"""torch.ops.fp8amp.gemm / gemm_accumulate: the CPU reference against torch.matmul in float64 on the
dequantized operands (bit for bit: with power-of-two scales every product and every partial sum of
the float64 matmul is exact, so both sides round the same exact value), odd-but-legal shapes and
strided views, clear errors, the schemas and fake kernels; on a GPU, the cuBLASLt path against the
reference within the accumulation bound and against torch._scaled_mm."""

import math

import pytest
import torch

import fp8amp

ops = torch.ops.fp8amp
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bias_dtype(out_dtype):
    """cuBLASLt's FP8 bias type: the output's 16-bit type, bfloat16 for a float32 output."""
    return torch.float16 if out_dtype == torch.float16 else torch.bfloat16


def quantized(rows, cols, dtype, sigma, generator, device="cpu"):
    """N(0, sigma) data quantized with the power-of-two scale of its amax (docs/numerics.md#numerics)."""
    x = torch.randn(rows, cols, generator=generator) * sigma
    fmax = torch.finfo(dtype).max
    scale = 2.0 ** math.floor(math.log2(fmax / x.abs().max().item())) if x.numel() else 1.0
    q = (x * scale).clamp(-fmax, fmax).to(dtype)
    return q.to(device), torch.tensor([1.0 / scale], device=device)


def reference(a, b, sa, sb, out_dtype, bias=None, old=None):
    """The definition (fp8amp/gemm.h): exact in float64 with the bias, rounded to float32 and then
    to out_dtype; when accumulating, added to the old out and rounded again."""
    y = (a.cpu().double() * sa.cpu().double()) @ (b.cpu().double() * sb.cpu().double()).T
    if bias is not None:
        y = y + bias.cpu().double()
    y = y.float().to(out_dtype)
    if old is not None:
        y = (y.double() + old.cpu().double()).float().to(out_dtype)
    return y


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} elements differ"


@pytest.mark.parametrize("fa,fb", FORMATS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (7, 48, 64), (33, 272, 160)])
def test_cpu_matches_float64_matmul(fa, fb, out_dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    a, sa = quantized(m, k, fa, 1.0, g)
    b, sb = quantized(n, k, fb, 0.02, g)
    bias = torch.randn(n, generator=g).to(bias_dtype(out_dtype))
    assert_same_bits(ops.gemm(a, b, sa, sb, out_dtype), reference(a, b, sa, sb, out_dtype))
    assert_same_bits(ops.gemm(a, b, sa, sb, out_dtype, bias=bias, fast_accum=True),
                     reference(a, b, sa, sb, out_dtype, bias=bias))
    out = torch.randn(m, n, generator=g).to(out_dtype)
    expected = reference(a, b, sa, sb, out_dtype, bias=bias, old=out)
    ops.gemm_accumulate(a, b, sa, sb, out, bias=bias)
    assert_same_bits(out, expected)


def test_cpu_strided_views():
    """Row strides (multiples of 16) wider than the rows: slices of bigger tensors, and an
    accumulation into a column block of a wider output, whose other columns stay untouched."""
    g = torch.Generator().manual_seed(1)
    a_full, sa = quantized(5, 96, E4M3, 1.0, g)
    b_full, sb = quantized(64, 80, E5M2, 1.0, g)
    a, b = a_full[:, :32], b_full[16:48, 16:48]
    assert a.stride() == (96, 1) and b.stride() == (80, 1)
    assert_same_bits(ops.gemm(a, b, sa, sb, torch.float32), reference(a, b, sa, sb, torch.float32))
    wide = torch.randn(5, 64, generator=g)
    before = wide.clone()
    expected = reference(a, b, sa, sb, torch.float32, old=wide[:, 16:48])
    ops.gemm_accumulate(a, b, sa, sb, wide[:, 16:48])
    assert_same_bits(wide[:, 16:48], expected)
    assert_same_bits(wide[:, :16], before[:, :16])
    assert_same_bits(wide[:, 48:], before[:, 48:])


def test_empty_dimensions():
    sa = torch.tensor([float("nan")])
    sb = torch.ones(1)
    bias = torch.arange(16, dtype=torch.bfloat16)
    assert ops.gemm(torch.empty(0, 32, dtype=E4M3), torch.empty(16, 32, dtype=E4M3), sa, sb,
                    torch.bfloat16).shape == (0, 16)
    assert ops.gemm(torch.empty(3, 32, dtype=E4M3), torch.empty(0, 32, dtype=E4M3), sa, sb,
                    torch.bfloat16).shape == (3, 0)
    # K == 0: the empty sum is exactly 0, whatever the scales hold.
    y = ops.gemm(torch.empty(3, 0, dtype=E4M3), torch.empty(16, 0, dtype=E4M3), sa, sb, torch.bfloat16, bias=bias)
    assert_same_bits(y, bias.expand(3, 16))


@pytest.mark.parametrize(
    "a_shape,b_shape,fa,fb,kwargs,match",
    [
        ((4, 24), (16, 24), E4M3, E4M3, {}, r"K \(the columns of a and b\) must be a multiple of 16.*got K = 24"),
        ((4, 32), (24, 32), E4M3, E4M3, {}, r"N \(the rows of b\) must be a multiple of 16.*got N = 24"),
        ((4, 32), (16, 32), E5M2, E5M2, {}, "both float8_e5m2"),
        ((4, 32), (16, 32), torch.bfloat16, E4M3, {}, "a must be float8_e4m3fn or float8_e5m2"),
        ((2, 4, 32), (16, 32), E4M3, E4M3, {}, "a must be 2-D"),
        ((4, 32), (16, 48), E4M3, E4M3, {}, "must share K"),
        ((4, 32), (16, 32), E4M3, E4M3, dict(bias=torch.zeros(16)), "bias must be bfloat16 for a float32 out"),
        ((4, 32), (16, 32), E4M3, E4M3, dict(bias=torch.zeros(32, dtype=torch.bfloat16)), r"bias must be \[N\] = \[16\]"),
    ],
)
def test_errors_name_the_argument(a_shape, b_shape, fa, fb, kwargs, match):
    a = torch.zeros(a_shape).to(fa)
    b = torch.zeros(b_shape).to(fb)
    with pytest.raises(ValueError, match=match):
        ops.gemm(a, b, torch.ones(1), torch.ones(1), torch.float32, **kwargs)


def test_layout_errors():
    one = torch.ones(1)
    b = torch.zeros(16, 32).to(E4M3)
    with pytest.raises(ValueError, match="a must be row-major"):
        ops.gemm(torch.zeros(32, 16).to(E4M3).t(), b, one, one, torch.float32)
    with pytest.raises(ValueError, match="a must start at a 16-byte aligned address"):
        ops.gemm(torch.zeros(65 * 32).to(E4M3)[1:2049].view(64, 32)[:4], b, one, one, torch.float32)
    with pytest.raises(ValueError, match="a_scale_inv must be float32"):
        ops.gemm(torch.zeros(4, 32).to(E4M3), b, one.bfloat16(), one, torch.float32)
    # An element of a larger tensor, 4 bytes past its start: cuBLASLt refuses such a scale.
    with pytest.raises(ValueError, match=r"b_scale_inv must start at a 16-byte aligned address.*\.clone\(\)"):
        ops.gemm(torch.zeros(4, 32).to(E4M3), b, one, torch.ones(4)[1:2], torch.float32)
    with pytest.raises(ValueError, match="out must be float32, bfloat16 or float16"):
        ops.gemm(torch.zeros(4, 32).to(E4M3), b, one, one, E4M3)


def opcheck_args():
    g = torch.Generator().manual_seed(2)
    a, sa = quantized(7, 32, E4M3, 1.0, g)
    b, sb = quantized(16, 32, E5M2, 1.0, g)
    bias = torch.randn(16, generator=g).bfloat16()
    return {
        "gemm": (ops.gemm.default, (a, b, sa, sb, torch.bfloat16), dict(bias=bias)),
        "gemm_accumulate": (ops.gemm_accumulate.default, (a, b, sa, sb, torch.zeros(7, 16)), dict(bias=bias)),
    }


TEST_SCHEMA_FP8 = "torch's test_schema multiplies the inputs, which float8 tensors cannot do on CPU"


@pytest.mark.parametrize("name", ["gemm", "gemm_accumulate"])
@pytest.mark.parametrize(
    "test_util",
    [pytest.param("test_schema", marks=pytest.mark.xfail(strict=True, reason=TEST_SCHEMA_FP8)),
     "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"],
)
def test_opcheck(name, test_util):
    op, args, kwargs = opcheck_args()[name]
    torch.library.opcheck(op, args, kwargs, test_utils=test_util)


def test_compiled_linear_with_changing_shapes():
    """A Linear-like y = x·Wᵀ + b through torch.compile(fullgraph=True) on dynamic shapes."""

    def linear(x8, w8, sx, sw, bias):
        return ops.gemm(x8, w8, sx, sw, torch.bfloat16, bias=bias).float().relu()

    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(3)
    w, sw = quantized(32, 64, E4M3, 0.1, g)
    bias = torch.randn(32, generator=g).bfloat16()
    for tokens in (8, 13, 40):  # the second shape makes dynamo compile a dynamic-shape graph
        x, sx = quantized(tokens, 64, E4M3, 1.0, g)
        assert_same_bits(compiled(x, w, sx, sw, bias), linear(x, w, sx, sw, bias))


# ------------------------------------------------------------------------------------------------
# GPU: cuBLASLt. Its sums differ from the exact ones in order and in the tensor cores' accumulator,
# which keeps about 14 bits of a partial sum and is promoted to FP32 every few MMA instructions of
# k = 32 (never with fast accumulation). The bound, per element, with S = sa·sb·Σ|a_ik·b_jk|:
#   |gpu - ref| <= L·2^-13·S + K/32·2^-24·S + u·(|gpu| + |ref|) + 2^-23·(|out| + |bias|) (+ 2^-24 for fp16)
# L = ceil(K/32) with fast accumulation, else min(ceil(K/32), 4); u = unit roundoff of out_dtype;
# accumulating adds 2u·|product + bias|, the rounding of the result before it is added (gemm.h).

PROMOTION_INTERVAL = 4
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_within_accumulation_bound(got, ref, a, b, sa, sb, fast_accum, added=None, result=None, sides=1):
    """sides=2 when ref is another GPU result with its own accumulation error; added: |out| + |bias|
    when accumulating or with a bias; result: the product plus bias that accumulating rounds first."""
    k = a.shape[1]
    steps = math.ceil(k / 32) if fast_accum else min(math.ceil(k / 32), PROMOTION_INTERVAL)
    s = (a.cpu().double().abs() * sa.cpu().double()) @ (b.cpu().double().abs() * sb.cpu().double()).T
    u = UNIT_ROUNDOFF[ref.dtype]
    got, ref = got.cpu().double(), ref.cpu().double()
    bound = sides * (steps * 2.0**-13 + k / 32 * 2.0**-24) * s + u * (got.abs() + ref.abs())
    if added is not None:
        bound += 2.0**-23 * added.cpu().double()
    if result is not None:
        bound += 2 * u * result.cpu().double().abs()
    err = (got - ref).abs()
    ok = err <= bound + 2.0**-24
    assert bool(ok.all()), f"{int((~ok).sum())} elements beyond the bound; worst err/bound {float((err / bound).max())}"


def require_fp8_gemm() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 GEMM below compute capability 8.9")


def small_cuda_operands(seed: int):
    """(a, sa, b, sb): E4M3 operands of a 64 x 32 x 128 problem on the GPU (skips below sm_89)."""
    require_fp8_gemm()
    g = torch.Generator().manual_seed(seed)
    a, sa = quantized(64, 128, E4M3, 1.0, g, "cuda")
    b, sb = quantized(32, 128, E4M3, 0.1, g, "cuda")
    return a, sa, b, sb


@pytest.mark.gpu
@pytest.mark.parametrize("fa,fb", FORMATS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cuda_matches_reference(fa, fb, out_dtype, fast_accum):
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(NotImplementedError, match="compute capability 8.9"):
            ops.gemm(torch.zeros(16, 16, dtype=fa, device="cuda"), torch.zeros(16, 16, dtype=fb, device="cuda"),
                     torch.ones(1, device="cuda"), torch.ones(1, device="cuda"), out_dtype)
        return
    g = torch.Generator().manual_seed(4)
    for m, n, k in [(1, 16, 16), (97, 80, 320), (1000, 1008, 1024)]:
        a, sa = quantized(m, k, fa, 1.0, g, "cuda")
        b, sb = quantized(n, k, fb, 0.02, g, "cuda")
        bias = torch.randn(n, generator=g).to(bias_dtype(out_dtype)).cuda()
        out = torch.randn(m, n, generator=g).to(out_dtype).cuda()
        ref = reference(a, b, sa, sb, out_dtype, bias=bias, old=out)
        acc = out.clone()
        ops.gemm_accumulate(a, b, sa, sb, acc, bias=bias, fast_accum=fast_accum)
        assert_within_accumulation_bound(acc, ref, a, b, sa, sb, fast_accum,
                                         added=out.abs().double() + bias.abs().double(),
                                         result=reference(a, b, sa, sb, out_dtype, bias=bias))
        y = ops.gemm(a, b, sa, sb, out_dtype, fast_accum=fast_accum)
        assert_within_accumulation_bound(y, reference(a, b, sa, sb, out_dtype), a, b, sa, sb, fast_accum)


@pytest.mark.gpu
@pytest.mark.parametrize("fa,fb", FORMATS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cuda_against_scaled_mm(fa, fb, out_dtype, fast_accum):
    """The same cuBLASLt problem as torch._scaled_mm(a, b.t(), ...): the same result up to the
    accumulation order of whichever kernel each heuristic picks (usually bit for bit)."""
    require_fp8_gemm()
    g = torch.Generator().manual_seed(5)
    m, n, k = 256, 512, 1024
    a, sa = quantized(m, k, fa, 1.0, g, "cuda")
    b, sb = quantized(n, k, fb, 0.02, g, "cuda")
    # torch refuses a bias with a float32 output; cuBLASLt takes a bfloat16 one (tested above).
    bias = None if out_dtype == torch.float32 else torch.randn(n, generator=g).to(out_dtype).cuda()
    ours = ops.gemm(a, b, sa, sb, out_dtype, bias=bias, fast_accum=fast_accum)
    theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                              use_fast_accum=fast_accum)
    assert_within_accumulation_bound(ours, theirs, a, b, sa, sb, fast_accum, sides=2)


@pytest.mark.gpu
def test_cuda_scales_inside_a_larger_tensor():
    """Scales at 16-byte boundaries of one buffer work as separate tensors do; one 4 bytes further
    (cuBLASLt refuses every FP8 algorithm for it) is refused by name before any launch."""
    a, sa, b, sb = small_cuda_operands(8)
    separate = ops.gemm(a, b, sa, sb, torch.bfloat16)
    packed = torch.cat([sa, sb, sa, sa, sb, sb, sb, sb, sb])  # sb at elements 1, 4..8
    assert torch.equal(ops.gemm(a, b, packed[0:1], packed[4:5], torch.bfloat16), separate)
    both_sb = ops.gemm(a, b, sb, sb, torch.bfloat16)
    assert torch.equal(ops.gemm(a, b, packed[8:9], packed[4:5], torch.bfloat16), both_sb)
    for offset in (1, 5, 6, 7):
        with pytest.raises(ValueError, match="b_scale_inv must start at a 16-byte aligned address"):
            ops.gemm(a, b, sa, packed[offset:offset + 1], torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(ops.gemm(a, b, sa, packed[1:2].clone(), torch.bfloat16), separate)


@pytest.mark.gpu
def test_cuda_compiled_and_on_a_side_stream():
    a, sa, b, sb = small_cuda_operands(6)
    eager = ops.gemm(a, b, sa, sb, torch.bfloat16)
    compiled = torch.compile(lambda *t: ops.gemm(*t, torch.bfloat16), fullgraph=True)
    assert_same_bits(compiled(a, b, sa, sb), eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = ops.gemm(a, b, sa, sb, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    assert_same_bits(side, eager)


@pytest.fixture
def autotune():
    """Autotuning on for one test, off again after it (a process-wide setting)."""
    fp8amp.ops.set_gemm_autotune(True)
    yield
    fp8amp.ops.set_gemm_autotune(False)


def test_autotune_setting_and_its_errors():
    assert fp8amp.ops.gemm_autotune_enabled() is False  # the default
    fp8amp.ops.set_gemm_autotune(True)
    try:
        assert fp8amp.ops.gemm_autotune_enabled() is True
    finally:
        fp8amp.ops.set_gemm_autotune(False)
    assert fp8amp.ops.gemm_autotune_enabled() is False
    with pytest.raises(TypeError, match="fp8amp.ops.set_gemm_autotune: enabled must be a bool, got int"):
        fp8amp.ops.set_gemm_autotune(1)
    assert set(fp8amp.ops.gemm_autotune_stats()) == {"tuning", "tuned", "changed"}


def test_autotune_leaves_the_cpu_reference_alone(autotune):
    g = torch.Generator().manual_seed(8)
    a, sa = quantized(7, 48, E4M3, 1.0, g)
    b, sb = quantized(32, 48, E4M3, 0.1, g)
    assert_same_bits(ops.gemm(a, b, sa, sb, torch.float32), reference(a, b, sa, sb, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_cuda_autotune_every_call_within_the_bound_then_one_algorithm(autotune, accumulate):
    """With autotuning on, a new problem's calls run the heuristic's candidates in turn (each
    result within the accumulation bound of the reference, accumulating ones too), until it
    decides; from then on every call runs one algorithm: the same bits each time."""
    require_fp8_gemm()
    g = torch.Generator().manual_seed(9)
    m, n, k = 272, 528 + 16 * accumulate, 1024  # a problem no other test has tuned
    a, sa = quantized(m, k, E4M3, 1.0, g, "cuda")
    b, sb = quantized(n, k, E5M2, 0.02, g, "cuda")
    bias = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
    old = torch.randn(m, n, generator=g).to(torch.bfloat16).cuda()
    ref = reference(a, b, sa, sb, torch.bfloat16, bias=bias, old=old if accumulate else None)
    before = fp8amp.ops.gemm_autotune_stats()

    def call():
        if accumulate:
            out = old.clone()
            ops.gemm_accumulate(a, b, sa, sb, out, bias=bias)
            return out
        return ops.gemm(a, b, sa, sb, torch.bfloat16, bias=bias)

    added = bias.abs().double() + (old.abs().double() if accumulate else 0)
    result = reference(a, b, sa, sb, torch.bfloat16, bias=bias) if accumulate else None
    for _ in range(40):  # 8 candidates x 3 rounds at most, then decided
        got = call()
        torch.cuda.synchronize()  # the timings complete before the next call reads them
        assert_within_accumulation_bound(got, ref, a, b, sa, sb, False, added=added, result=result)
    after = fp8amp.ops.gemm_autotune_stats()
    assert after["tuned"] == before["tuned"] + 1 and after["tuning"] == before["tuning"]
    assert_same_bits(call(), call())


@pytest.mark.gpu
def test_cuda_autotune_under_graph_capture(autotune):
    """A problem still tuning when a CUDA graph captures it: the capture records the best choice so
    far, untimed (no event work during capture), and the replays are within the bound; eager calls
    afterwards finish the tuning."""
    require_fp8_gemm()
    g = torch.Generator().manual_seed(10)
    m, n, k = 208, 560, 768  # a problem no other test has tuned
    a, sa = quantized(m, k, E4M3, 1.0, g, "cuda")
    b, sb = quantized(n, k, E4M3, 0.02, g, "cuda")
    ref = reference(a, b, sa, sb, torch.bfloat16)
    ops.gemm(a, b, sa, sb, torch.bfloat16)  # the problem starts tuning
    torch.cuda.synchronize()
    tuning = fp8amp.ops.gemm_autotune_stats()["tuning"]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.gemm(a, b, sa, sb, torch.bfloat16)  # warm-up on the side stream, as torch recommends
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = ops.gemm(a, b, sa, sb, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert_within_accumulation_bound(out, ref, a, b, sa, sb, False)
    assert fp8amp.ops.gemm_autotune_stats()["tuning"] == tuning  # capture decided nothing
    for _ in range(30):
        ops.gemm(a, b, sa, sb, torch.bfloat16)
        torch.cuda.synchronize()
    assert fp8amp.ops.gemm_autotune_stats()["tuning"] == tuning - 1
