"""fp8amp.ScaledTensor (CPU): the per-tensor-scaled torch.Tensor subclass (docs/o1_o2.md#optimization-levels, docs/numerics.md#numerics)."""

import copy
import io

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp8amp
from cast_reference import assert_bits_equal, scaled_example as make
from fp8amp.dequantized_view import DequantizedView
from fp8amp.master_weight import MasterWeight
from fp8amp.scaled_tensor import ScaledTensor

FORMATS = [fp8amp.FP16, fp8amp.E4M3, fp8amp.E5M2]


def reference_quantize(x, fmt, margin=0):
    """What from_tensor must do: amax -> pow2 compute_scale -> quantize, with the cast ops."""
    amax = torch.zeros(1)
    scale, scale_inv = torch.ones(1), torch.ones(1)
    fp8amp.ops.amax(x, amax)
    fp8amp.ops.compute_scale(amax, scale, scale_inv, fp8amp.format_max(fmt), margin=margin)
    return fp8amp.ops.quantize(x, scale, amax, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 2])
def test_round_trip_matches_cast_ops(fmt, margin):
    x = torch.randn(8, 16) * 7
    s = ScaledTensor.from_tensor(x, fmt, margin=margin)
    data, scale_inv = reference_quantize(x, fmt, margin)
    assert s.storage_format == fmt and s._data.dtype == fmt and s._data.is_contiguous()
    assert_bits_equal(s._data, data)
    assert_bits_equal(s._scale_inv, scale_inv)
    assert s._scale_inv.shape == (1,)
    for dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        out = s.dequantize(dtype)
        assert type(out) is torch.Tensor
        assert_bits_equal(out, fp8amp.ops.dequantize(data, scale_inv, dtype or torch.float32))
    assert_bits_equal(s.to_tensor(), s.dequantize())


def test_float64_in_and_out():
    """A float64 source is rounded to float32 first (logical dtype float32) and dequantize(float64)
    gives the float32 values exactly, for per-tensor and block-scaled tensors alike; an integer
    source is refused by name."""
    from fp8amp.block_scaled_tensor import BlockScaledTensor
    x = torch.randn(256, 128, dtype=torch.float64)
    for make_one in (lambda t: ScaledTensor.from_tensor(t, fp8amp.E4M3), BlockScaledTensor.from_tensor):
        t, ref = make_one(x), make_one(x.float())
        assert t.dtype == torch.float32
        assert_bits_equal(t.dequantize(), ref.dequantize())
        out = t.dequantize(torch.float64)
        assert out.dtype == torch.float64 and torch.equal(out, t.dequantize(torch.float32).double())
    with pytest.raises(ValueError, match="BlockScaledTensor.from_tensor: x must be a real floating-point"):
        BlockScaledTensor.from_tensor(torch.ones(128, 128, dtype=torch.int32))


def test_pow2_scale_and_metadata():
    x = torch.full((4, 8), 10.0)
    s = ScaledTensor.from_tensor(x, fp8amp.E4M3)  # amax 10, fmax 448 -> scale 32 (docs/numerics.md#numerics)
    assert s._scale_inv.item() == 1 / 32
    assert isinstance(s, torch.Tensor) and isinstance(s, ScaledTensor)
    assert s.dtype == torch.float32 and s.shape == x.shape and s.stride() == x.stride()
    assert s.device == x.device and s.numel() == 32 and s.dim() == 2
    assert ScaledTensor.from_tensor(x.bfloat16(), fp8amp.E4M3).dtype == torch.bfloat16
    assert ScaledTensor.from_tensor(x, fp8amp.E4M3, orig_dtype=torch.float16).dtype == torch.float16
    assert ScaledTensor.from_tensor(torch.zeros(3), fp8amp.E5M2)._scale_inv.item() == 1.0  # amax 0: scale 1


def test_constructor_checks():
    data = torch.zeros(4, dtype=fp8amp.E4M3)
    with pytest.raises(ValueError, match="data.dtype"):
        ScaledTensor(torch.zeros(4), torch.ones(1))
    with pytest.raises(ValueError, match="scale_inv"):
        ScaledTensor(data, torch.ones(2))
    with pytest.raises(ValueError, match="dtype"):
        ScaledTensor(data, torch.ones(1), torch.float64)
    with pytest.raises(ValueError, match="contiguous"):
        ScaledTensor(torch.zeros(4, 4, dtype=fp8amp.FP16).t(), torch.ones(1))
    with pytest.raises(ValueError, match="dtype"):
        ScaledTensor.from_tensor(torch.randn(4), torch.bfloat16)


def test_printing():
    x, s = make(fp8amp.E5M2, shape=(3,))
    r = repr(s)
    assert r.startswith("ScaledTensor(tensor(") and "float8_e5m2" in r and "scale_inv=" in r
    assert str(s) == r
    assert repr(s.dequantize()) in r
    assert "ScaledTensor(tensor(" in repr(ScaledTensor.from_tensor(torch.tensor(3.0), fp8amp.E4M3))


def test_printing_fake_and_meta_reads_no_value():
    # torch.compile (Inductor) prints graph inputs: a fake ScaledTensor must print, not fail on .item().
    s = ScaledTensor.from_tensor(torch.randn(4, 8), fp8amp.E4M3)
    with FakeTensorMode() as mode:
        r = repr(mode.from_tensor(s))
    assert r.startswith("ScaledTensor(FakeTensor(") and "scale_inv=FakeTensor(" in r
    assert "scale_inv=tensor(..., device='meta'" in repr(s.to("meta"))


def test_float_and_to():
    x, s = make(fp8amp.E4M3)
    real = s.dequantize()
    f = s.float()  # logical dtype already float32: aten::to returns the tensor itself
    assert f is s and torch.equal(f.dequantize(), real)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        out = s.to(dtype)
        assert type(out) is torch.Tensor and out.dtype == dtype
        assert torch.equal(out, real.to(dtype))
    assert type(s.double()) is torch.Tensor and type(s.half()) is torch.Tensor
    b = ScaledTensor.from_tensor(x.bfloat16(), fp8amp.E4M3)
    assert type(b.float()) is torch.Tensor and torch.equal(b.float(), b.dequantize().float())


def test_arithmetic_fallback_equals_dequantized():
    x, s = make(fp8amp.E4M3)
    y, t = make(fp8amp.FP16, seed=1)
    a, b = s.dequantize(), t.dequantize()
    cases = [
        (s + t, a + b), (s * 2, a * 2), (s - y, a - y), (s @ t.T, a @ b.T), (s.sum(), a.sum()),
        (torch.norm(s), torch.norm(a)), (torch.linalg.vector_norm(s, 2.0), torch.linalg.vector_norm(a, 2.0)),
        (s > 0, a > 0), (s == t, a == b), (s.isinf(), a.isinf()), (s.isnan(), a.isnan()),
        (s.abs().max(), a.abs().max()), (torch.nn.functional.relu(s), a.relu()),
    ]
    for got, want in cases:
        assert type(got) is torch.Tensor
        assert torch.equal(got, want)
    assert torch.allclose(s, a) and torch.equal(s, a)
    # Views with no codes view: DequantizedViews, whose reads are the dequantized values'
    # (dequantized_view.py); of a tensor requiring grad, in grad mode, plain copies.
    for got, want in ((s.t(), a.t()), (s[:, 1:3], a[:, 1:3]), (s[::2], a[::2])):
        assert type(got) is DequantizedView and torch.equal(got, want) and torch.equal(got + 1, want + 1)
        assert type(got + 1) is torch.Tensor and got.shape == want.shape and got.stride() == want.stride()
    master = torch.nn.Parameter(s.clone())
    assert type(master.t()) is torch.Tensor and torch.equal(master.t(), a.t())
    with torch.no_grad():
        assert type(master.t()) is DequantizedView


def test_detach_clone_to_device_keep_subclass():
    x, s = make(fp8amp.FP16)
    for out in (s.detach(), s.clone(), s.to("cpu", copy=True), s.to(device="cpu", copy=True), s.view(-1),
                s.reshape(4, 32), copy.deepcopy(s)):
        assert type(out) is ScaledTensor and out.storage_format == fp8amp.FP16
        assert torch.equal(out.dequantize().flatten(), s.dequantize().flatten())
    assert s.cpu() is s and s.to("cpu") is s
    c = s.clone()
    assert c._data.data_ptr() != s._data.data_ptr() and c._scale_inv.data_ptr() != s._scale_inv.data_ptr()
    d = s.detach()
    assert d._data.data_ptr() == s._data.data_ptr()
    expected = c.dequantize() * 2
    d.mul_(2.0)  # detach is a view: the base sees it
    assert torch.equal(s.dequantize(), expected)


def test_detach_and_alias_are_views_of_every_inner_tensor():
    """detach (autograd's, of every new gradient) and alias build the wrapper without __new__'s
    checks: the same type, logical dtype and shape over views of each inner tensor (the master's
    E4M3 copy included), and a row view stays one."""
    grad = ScaledTensor.from_tensor(torch.randn(8, 16), fp8amp.E4M3, orig_dtype=torch.bfloat16)
    master = MasterWeight.from_tensor(torch.randn(8, 16))
    for s in (grad, master, master[2:4]):
        for out in (s.detach(), torch.ops.aten.alias.default(s)):
            assert type(out) is type(s) and out is not s
            assert (out.dtype, out.shape, out.stride(), out.requires_grad) == (s.dtype, s.shape, s.stride(), False)
            inner = ["_data", "_scale_inv"] + (["_fp8", "_fp8_scale", "_fp8_scale_inv"] if type(s) is MasterWeight else [])
            for name in inner:
                mine, theirs = getattr(out, name), getattr(s, name)
                assert mine is not theirs and mine.data_ptr() == theirs.data_ptr() and mine.dtype == theirs.dtype
            assert out._base_rows is s._base_rows
    assert master[2:4].detach()._base_rows is master


@pytest.mark.parametrize("fmt", FORMATS)
def test_mul_div_touch_only_scale_inv(fmt):
    x, s = make(fmt)
    data0, si0 = s._data.clone(), s._scale_inv.clone()
    ptr = s._data.data_ptr()
    assert s.mul_(4) is s
    assert_bits_equal(s._data, data0)
    assert s._data.data_ptr() == ptr
    assert_bits_equal(s._scale_inv, si0 * 4)
    s.div_(0.5)
    assert_bits_equal(s._scale_inv, si0 * 8)
    s.mul_(torch.tensor(0.25))  # a 0-dim tensor: the clip coefficient of clip_grad_norm_
    s.div_(torch.tensor(4.0))
    assert_bits_equal(s._scale_inv, si0 / 2)
    assert_bits_equal(s._data, data0)
    s.mul_(3.0)  # not a power of two: one float32 rounding of scale_inv
    assert_bits_equal(s._scale_inv, si0 / 2 * 3.0)
    assert torch.allclose(s.dequantize(), fp8amp.ops.dequantize(data0, si0, torch.float32) * 1.5, rtol=1e-6)
    before = s.dequantize(torch.float32)
    factors = torch.linspace(0.5, 2.0, 16).expand(8, 16)
    s.mul_(factors)  # elementwise: a data pass, the product re-quantized with a fresh scale
    step = 2.0 ** -10 if s.storage_format == fp8amp.FP16 else 2.0 ** -3
    torch.testing.assert_close(s.dequantize(torch.float32), before * factors, rtol=step, atol=0)


def test_foreach_mul_and_zero():
    _, s = make(fp8amp.E4M3)
    p = torch.randn(3)
    si, p0 = s._scale_inv.clone(), p.clone()
    torch._foreach_mul_([s, p], 0.5)
    assert_bits_equal(s._scale_inv, si * 0.5)
    assert torch.equal(p, p0 * 0.5)
    torch._foreach_div_([s], torch.tensor(0.5))
    assert_bits_equal(s._scale_inv, si)
    torch._foreach_zero_([s])
    assert torch.equal(s.dequantize(), torch.zeros(8, 16))


@pytest.mark.parametrize("other", [0.5, torch.tensor(0.5), [0.5, 0.25, 2.0, 0.5, 4.0, 0.125]])
def test_foreach_mul_batches_plain_tensors_and_scales(other):
    """clip_grad_norm_(foreach=True) scales every gradient through _foreach_mul_, which now sends
    the plain tensors to the aten op in one call and, by one scalar, the ScaledTensors' scale_inv
    in one foreach call: the values must be what multiplying one tensor at a time gives (how many
    launches that takes shows on the GPU, in profile_train.py)."""
    torch.manual_seed(0)
    scaled = [ScaledTensor.from_tensor(torch.randn(8, 16) * 10, fmt) for fmt in (fp8amp.E4M3, fp8amp.FP16)]
    plain = [torch.randn(5), torch.randn(3, 3), torch.randn(7), torch.randn(2)]
    tensors = [plain[0], scaled[0], plain[1], plain[2], scaled[1], plain[3]]
    factors = other if isinstance(other, list) else [other] * len(tensors)
    want = [(t.dequantize() if isinstance(t, ScaledTensor) else t.clone()) * float(f) for t, f in zip(tensors, factors)]
    scale_invs = [s._scale_inv.clone() for s in scaled]
    torch._foreach_mul_(tensors, other)
    for t, w in zip(tensors, want):
        assert torch.equal(t.dequantize() if isinstance(t, ScaledTensor) else t, w)
    for s, si, f in zip(scaled, scale_invs, [factors[1], factors[4]]):
        assert_bits_equal(s._scale_inv, si * float(f))  # only the scale moves


def test_foreach_norm_equals_one_tensor_at_a_time():
    """_foreach_norm of ScaledTensors takes them in groups (one multi_norm_tiles call per code
    dtype for the 2-norm): each norm bit for bit what vector_norm of that tensor alone gives, in
    the list's order, plain tensors in between."""
    torch.manual_seed(1)
    xs = [ScaledTensor.from_tensor(torch.randn(*shape) * 10.0**k, fmt)
          for shape, k, fmt in [((8, 16), 0, fp8amp.E4M3), ((100,), -3, fp8amp.E4M3), ((400,), 2, fp8amp.E4M3),
                                ((5, 5), 1, fp8amp.FP16), ((33,), 0, fp8amp.E5M2), ((7,), 0, fp8amp.E4M3)]]
    tensors = [xs[0], torch.randn(6), *xs[1:4], torch.randn(2, 2), *xs[4:]]
    for ord in (2, 1, float("inf")):
        got = torch._foreach_norm(tensors, ord)
        want = [torch.linalg.vector_norm(t, ord) for t in tensors]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert type(g) is torch.Tensor and g.dtype == torch.float32
            assert_bits_equal(g, w)
    got = torch._foreach_norm(tensors, 2, torch.float64)
    assert all(g.dtype == torch.float64 for g in got)


def test_zero_():
    _, s = make(fp8amp.E5M2)
    s.mul_(float("inf"))
    assert s.zero_() is s
    assert torch.equal(s.dequantize(), torch.zeros(8, 16)) and s._scale_inv.item() == 1.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_from_plain_requantizes(fmt):
    _, s = make(fmt)
    y = torch.randn(8, 16) * 1000
    ptr = s._data.data_ptr()
    assert s.copy_(y) is s
    data, scale_inv = reference_quantize(y, fmt)
    assert_bits_equal(s._data, data)
    assert_bits_equal(s._scale_inv, scale_inv)
    assert s._data.data_ptr() == ptr
    s.copy_(y.double())  # other dtypes go through the logical dtype
    assert_bits_equal(s._data, data)
    s.copy_(torch.tensor(2.0))  # broadcast
    assert torch.equal(s.dequantize(), torch.full((8, 16), 2.0))


def test_copy_between_scaled_tensors():
    _, s = make(fp8amp.E4M3)
    _, t = make(fp8amp.E4M3, seed=5, mult=100)
    s.copy_(t)  # same format: codes and scale, bit for bit
    assert_bits_equal(s._data, t._data)
    assert_bits_equal(s._scale_inv, t._scale_inv)
    _, h = make(fp8amp.FP16, seed=6)
    s.copy_(h)  # another format: re-quantizes the real values
    data, scale_inv = reference_quantize(h.dequantize(), fp8amp.E4M3)
    assert_bits_equal(s._data, data)
    assert_bits_equal(s._scale_inv, scale_inv)
    plain = torch.empty(8, 16)
    assert plain.copy_(t) is plain and type(plain) is torch.Tensor
    assert torch.equal(plain, t.dequantize())


@pytest.mark.parametrize("weights_only", [True, False])
def test_save_load_round_trip(weights_only):
    _, s = make(fp8amp.E4M3)
    s.mul_(3.0)  # a non-power-of-two scale_inv survives too
    b = ScaledTensor.from_tensor(torch.randn(5, dtype=torch.bfloat16), fp8amp.FP16)
    buf = io.BytesIO()
    torch.save({"s": s, "b": b}, buf)
    buf.seek(0)
    out = torch.load(buf, weights_only=weights_only)
    for got, want in ((out["s"], s), (out["b"], b)):
        assert type(got) is ScaledTensor and got.dtype == want.dtype and got.shape == want.shape
        assert_bits_equal(got._data, want._data)
        assert_bits_equal(got._scale_inv, want._scale_inv)
    blocks = fp8amp.BlockScaledTensor.from_tensor(torch.randn(200, 256), fp8amp.E5M2, torch.bfloat16)
    buf = io.BytesIO()
    torch.save({"g": blocks}, buf)  # weights_only=True refused it (not an allowed global), before
    buf.seek(0)
    got = torch.load(buf, weights_only=weights_only)["g"]
    assert type(got) is fp8amp.BlockScaledTensor and got.dtype == torch.bfloat16
    assert_bits_equal(got.codes, blocks.codes)
    assert_bits_equal(got.scale_inv, blocks.scale_inv)


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm(foreach):
    p = torch.nn.Parameter(torch.randn(8, 16))
    g = torch.randn(8, 16) * 10
    p.grad = ScaledTensor.from_tensor(g, fp8amp.E4M3)
    data0, real = p.grad._data.clone(), p.grad.dequantize()
    total = torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=foreach)
    # the float64 norm of the real values within the float32 sums of 16 squares (multi_norm_tiles)
    torch.testing.assert_close(total, torch.linalg.vector_norm(real.double()).float(), rtol=2.0**-21, atol=0)
    assert type(p.grad) is ScaledTensor
    assert_bits_equal(p.grad._data, data0)  # only the scale changed
    assert torch.allclose(torch.linalg.vector_norm(p.grad.dequantize()), torch.tensor(1.0), rtol=1e-5)


def test_parameter_and_module():
    m = torch.nn.Linear(16, 8)
    w = m.weight.detach().clone()
    m.weight = torch.nn.Parameter(ScaledTensor.from_tensor(w, fp8amp.FP16))
    assert type(m.weight) is ScaledTensor and m.weight.requires_grad
    x = torch.randn(2, 16)
    assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight.dequantize(), m.bias))
    plain = torch.nn.Linear(16, 8)
    plain.load_state_dict(m.state_dict())  # param.copy_(ScaledTensor) dequantizes
    assert torch.equal(plain.weight, m.weight.dequantize())


@pytest.mark.parametrize("fmt", [fp8amp.FP16, fp8amp.E4M3])
def test_compile_aot_eager_fullgraph(fmt):
    _, s = make(fmt)
    torch._dynamo.reset()
    f = torch.compile(lambda t: t.float() * 2, backend="aot_eager", fullgraph=True)
    out = f(s)
    assert type(out) is torch.Tensor
    assert_bits_equal(out, s.dequantize() * 2)


def test_grad_scaler_unscale():
    p = torch.nn.Parameter(torch.randn(8, 16))
    q = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p, q], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    p.grad = ScaledTensor.from_tensor(torch.randn(8, 16) * 1024, fp8amp.E4M3)
    q.grad = torch.randn(4) * 1024
    data0, si0, q0 = p.grad._data.clone(), p.grad._scale_inv.clone(), q.grad.clone()
    scaler.scale(torch.ones(()))  # initializes the scale, as scaler.scale(loss) would
    scaler.unscale_(opt)
    assert type(p.grad) is ScaledTensor
    assert_bits_equal(p.grad._data, data0)
    assert_bits_equal(p.grad._scale_inv, si0 / 1024)
    assert torch.equal(q.grad, q0 / 1024)
    assert scaler._found_inf_per_device(opt)[torch.device("cpu")].item() == 0.0

    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    g = torch.ones(8, 16)
    g[3, 5] = float("nan")
    p.grad = ScaledTensor.from_tensor(g, fp8amp.FP16)
    q.grad = torch.randn(4)
    scaler2.scale(torch.ones(()))
    scaler2.unscale_(opt)
    assert scaler2._found_inf_per_device(opt)[torch.device("cpu")].item() == 1.0


@pytest.mark.parametrize("ord", [2, 1, 3.0, float("inf"), -float("inf"), 0])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float16])
def test_norms_from_the_codes(ord, fmt):
    """vector_norm and _foreach_norm of ScaledTensors equal the norms of their real values: those are
    the codes times a power of two, which commutes exactly with sums, squares, sqrt and max. The
    2-norm (multi_norm_tiles: float32 sums of 16 squares, then float64) is within 2^-21 of the
    float64 norm (a plain tensor's is torch's float32 one, exactly). Other orders go through
    float32 pow (|x|^p per element, then the root), whose results for x and for x * 2^k may differ
    by an ulp or two each: a relative difference of a few 2^-23 in a sum of positive terms and its
    root, bounded here by 2^-16."""
    torch.manual_seed(0)
    xs = [ScaledTensor.from_tensor(torch.randn(33, 17) * 100, fmt), torch.randn(5),
          ScaledTensor.from_tensor(torch.randn(64) * 1e-3, fmt)]
    reals = [x.dequantize() if isinstance(x, ScaledTensor) else x for x in xs]
    def want(r, x):
        if ord == 2 and isinstance(x, ScaledTensor):
            return torch.linalg.vector_norm(r.double(), ord).float()
        return torch.linalg.vector_norm(r, ord)

    def same(got, want):
        if ord == 2:
            return torch.allclose(got, want, rtol=2.0 ** -21, atol=0)
        if ord in (0, 1, float("inf"), -float("inf")):
            return torch.equal(got, want)
        return torch.allclose(got, want, rtol=2.0 ** -16, atol=0)

    for x, r in zip(xs, reals):
        assert same(torch.linalg.vector_norm(x, ord), want(r, x))
    for got, x, r in zip(torch._foreach_norm(xs, ord), xs, reals):
        assert type(got) is torch.Tensor and same(got, want(r, x))
    nan = ScaledTensor.from_tensor(torch.ones(4), fmt)
    nan._scale_inv.fill_(float("nan"))
    assert torch.isnan(torch.linalg.vector_norm(nan, ord)) or ord == 0


def test_fp8_copy_travels_and_stays_current():
    """A MasterWeight's E4M3 copy survives save/load, detach, clone and views, and every write
    re-casts it (it always equals a fresh cast of the real values)."""
    torch.manual_seed(0)
    x = MasterWeight.from_tensor(torch.randn(32, 16))

    def current(t):
        fresh = ScaledTensor.from_tensor(t.dequantize(), torch.float8_e4m3fn)
        codes, scale, scale_inv = t.fp8_copy
        return (torch.equal(codes.view(torch.uint8), fresh._data.view(torch.uint8))
                and torch.equal(scale_inv, fresh._scale_inv) and torch.equal(scale * scale_inv, torch.ones(1)))

    assert current(x)
    buf = io.BytesIO()
    torch.save(x, buf)
    buf.seek(0)
    y = torch.load(buf, weights_only=True)
    assert current(y) and torch.equal(y.fp8_copy[0].view(torch.uint8), x.fp8_copy[0].view(torch.uint8))
    assert x.detach().fp8_copy[0].data_ptr() == x.fp8_copy[0].data_ptr()
    assert x.clone().fp8_copy[0].data_ptr() != x.fp8_copy[0].data_ptr() and current(x.clone())
    assert x.view(16, 32).fp8_copy[0].shape == (16, 32)
    for write in (lambda t: t.copy_(torch.randn(32, 16) * 7), lambda t: t.mul_(0.37), lambda t: t.div_(3),
                  lambda t: t.add_(torch.randn(32, 16)), lambda t: t.zero_()):
        with torch.no_grad():
            write(x)
        assert current(x)
    assert x.drop_fp8_copy().fp8_copy is None
    assert current(x.attach_fp8_copy())


def test_master_weight_keeps_its_type():
    """What detach, clone, views, row views, device moves, new_zeros, torch.save and compile's
    flattening make of a MasterWeight is a MasterWeight (the copy mapped with the codes); a dtype
    change or arithmetic gives a plain tensor, as for any ScaledTensor."""
    x = MasterWeight.from_tensor(torch.randn(32, 16))
    derived = [x.detach(), x.clone(), x.view(16, 32), x[8:16], x.split(8)[1], x.to("cpu"), x.new_zeros(4, 16),
               torch.nn.Parameter(x)]
    buf = io.BytesIO()
    torch.save(x, buf)
    buf.seek(0)
    derived.append(torch.load(buf, weights_only=True))
    names, ctx = x.__tensor_flatten__()
    derived.append(type(x).__tensor_unflatten__({n: getattr(x, n) for n in names}, ctx, x.shape, x.stride()))
    assert all(type(t) is MasterWeight for t in derived), [type(t).__name__ for t in derived]
    assert x[8:16].fp8_copy[0].data_ptr() == x.fp8_copy[0][8].data_ptr()  # a row view of the copy too
    assert derived[6].fp8_copy is None  # zeros: FSDP2's padding, no copy made for them
    assert type(x.double()) is torch.Tensor and type(x * 2) is torch.Tensor
    assert torch.equal(derived[-1].fp8_copy[0].view(torch.uint8), x.fp8_copy[0].view(torch.uint8))


def test_master_weight_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="MasterWeight.from_tensor: dtype must be torch.float16"):
        MasterWeight.from_tensor(torch.randn(4, 4), fp8amp.E4M3)
    codes, scale_inv = torch.zeros(4, 4, dtype=fp8amp.E4M3), torch.ones(1)
    with pytest.raises(ValueError, match="MasterWeight: data must hold float16 codes"):
        MasterWeight(codes, scale_inv)
    with pytest.raises(ValueError, match="fp8_copy codes must be float8_e4m3fn"):
        MasterWeight(torch.zeros(4, 4, dtype=torch.float16), scale_inv,
                     fp8_copy=(torch.zeros(2, 2, dtype=fp8amp.E4M3), scale_inv, scale_inv))


@pytest.mark.parametrize("fmt", [fp8amp.E4M3, fp8amp.FP16])
def test_tolist_and_numpy_give_the_real_values(fmt):
    """torch refuses tolist() and numpy() of any tensor subclass; these give the dequantized values
    (not the codes), with numpy()'s rule for tensors that require grad."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
    scaled = fp8amp.ScaledTensor.from_tensor(x, fmt)
    real = scaled.dequantize()
    assert scaled.tolist() == real.tolist() and scaled.tolist() != scaled.codes.float().tolist()
    assert torch.equal(torch.from_numpy(scaled.numpy()), real)
    block = fp8amp.BlockScaledTensor.from_tensor(torch.randn(128, 256))
    assert block.tolist() == block.dequantize().tolist()
    assert torch.equal(torch.from_numpy(block.numpy()), block.dequantize())
    param = torch.nn.Parameter(fp8amp.ScaledTensor.from_tensor(x, fmt), requires_grad=True)
    assert param.tolist() == real.tolist()
    with pytest.raises(RuntimeError, match=r"numpy\(\) on a tensor that requires grad"):
        param.numpy()
    assert torch.equal(torch.from_numpy(param.numpy(force=True)), real)
    assert torch.equal(torch.from_numpy(param.detach().numpy()), real)
