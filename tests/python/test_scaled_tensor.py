"""fp8amp.ScaledTensor (CPU): the per-tensor-scaled torch.Tensor subclass (docs/o1_o2.md#optimization-levels, docs/numerics.md#numerics)."""

import copy
import io
import pickle

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp8amp
from cast_reference import assert_bits_equal
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


def make(fmt=fp8amp.E4M3, shape=(8, 16), seed=0, mult=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * mult
    return x, ScaledTensor.from_tensor(x, fmt)


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


@pytest.mark.parametrize("op", [lambda s: s.t_(), lambda s: s.unsqueeze_(0), lambda s: s.resize_(4, 4),
                                lambda s: s.transpose_(0, 1), lambda s: torch.add(torch.ones(8), 1, out=s)])
@pytest.mark.parametrize("block_scaled", [False, True], ids=["ScaledTensor", "BlockScaledTensor"])
def test_in_place_metadata_ops_raise(op, block_scaled):
    s = fp8amp.BlockScaledTensor.from_tensor(torch.randn(256, 256)) if block_scaled else make(fp8amp.E4M3)[1]
    data0, si0 = s.codes.clone(), s.scale_inv.clone()
    with pytest.raises(NotImplementedError, match=r"ScaledTensor: .*aten\..*its shape .*is its codes'|are its codes'"):
        op(s)
    assert_bits_equal(s.codes, data0)
    assert_bits_equal(s.scale_inv, si0)


IN_PLACE_VALUE_OPS = {
    "add_ of a scalar": lambda t: t.add_(1),
    "sub_": lambda t: t.sub_(0.5),
    "clamp_": lambda t: t.clamp_(-1, 1),
    "lerp_": lambda t: t.lerp_(torch.ones(8, 16), 0.5),
    "add out=": lambda t: torch.add(t.detach().clone() if isinstance(t, ScaledTensor) else t.clone(), 1, out=t),
    "div_ floor": lambda t: t.div_(2.0, rounding_mode="floor"),
    "nan_to_num_": lambda t: t.nan_to_num_(),
    "masked_fill_": lambda t: t.masked_fill_(torch.arange(16) % 3 == 0, 0.5),
    "x[mask] = v": lambda t: t.__setitem__(torch.arange(8) % 2 == 0, -1.0),
    "abs_": lambda t: t.abs_(),
    "_foreach_clamp_max_": lambda t: torch._foreach_clamp_max_([t], 0.25),
    "clamp_ of rows": lambda t: t[2:6].clamp_(0, 0.5),
}


@pytest.mark.parametrize("fmt", [fp8amp.FP16, fp8amp.E4M3])
@pytest.mark.parametrize("op", IN_PLACE_VALUE_OPS, ids=list(IN_PLACE_VALUE_OPS))
def test_in_place_ops_compute_on_the_real_values_and_requantize(op, fmt):
    """An in-place op with no handler of its own runs on the real values in float32 and writes
    the result back as copy_ does (a fresh current scale), the same as the op on a plain tensor
    up to one rounding into the format; it raised NotImplementedError before."""
    _, s = make(fmt)
    want = s.dequantize().clone()
    IN_PLACE_VALUE_OPS[op](want)
    returned = IN_PLACE_VALUE_OPS[op](s)
    assert returned is None or isinstance(returned, (ScaledTensor, list))
    step = 2.0 ** -10 if fmt == fp8amp.FP16 else 2.0 ** -3
    torch.testing.assert_close(s.dequantize(), want, rtol=step, atol=want.abs().max().item() * step * 2 ** -6)


def test_clip_grad_value_and_init_on_o2_masters_and_fp8_grads():
    """torch.nn.utils.clip_grad_value_ (foreach and not) over FP8 gradients and torch.nn.init over
    O2 masters: they raised NotImplementedError (clamp_, normal_)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")
    for foreach in (True, False):
        model(torch.randn(8, 32)).pow(2).sum().backward()
        assert isinstance(model[0].weight.grad, ScaledTensor)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01, foreach=foreach)
        for p in model.parameters():
            grad = p.grad.dequantize() if isinstance(p.grad, ScaledTensor) else p.grad
            assert grad.abs().max() <= 0.01 and grad.abs().max() > 0.005
        model.zero_grad()
    with torch.no_grad():
        torch.nn.init.normal_(model[0].weight, std=0.02)
    assert type(model[0].weight) is MasterWeight and 0.015 < model[0].weight.dequantize().std() < 0.025


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


ROW_WRITES = {
    "slice mul_": lambda t: t[0:2].mul_(2),
    "slice div_ by a tensor": lambda t: t[1:3].div_(torch.tensor(4.0)),
    "slice zero_": lambda t: t[2:5].zero_(),
    "slice add_": lambda t: t[0:2].add_(torch.ones(2, 16)),
    "slice add_ alpha": lambda t: t[0:2].add_(torch.ones(2, 16), alpha=3),
    "slice fill_": lambda t: t[3:4].fill_(-2.5),
    "split mul_": lambda t: t.split(4)[1].mul_(3),
    "chunk mul_": lambda t: t.chunk(2)[1].mul_(0.5),
    "narrow mul_": lambda t: t.narrow(0, 1, 2).mul_(2),
    "rows of a reshape mul_": lambda t: t.view(16, 8)[0:4].mul_(3),
    "x[i] copy_": lambda t: t[1].copy_(torch.ones(16)),
    "x[-1] zero_": lambda t: t[-1].zero_(),
    "x[i] = v": lambda t: t.__setitem__(2, 5.0),
    "x[a:b] = v": lambda t: t.__setitem__(slice(2, 4), 5.0),
    "x.data[i] = v": lambda t: t.data.__setitem__(6, -1.0),
    "x.detach()[a:b] mul_": lambda t: t.detach()[0:2].mul_(2),
    "unbind mul_": lambda t: t.unbind(0)[1].mul_(2),
    "_foreach_mul_ of rows": lambda t: torch._foreach_mul_([t[0:2], t[4:6]], 2.0),
    "fill_ of all": lambda t: t.fill_(0.75),
}


@pytest.mark.parametrize("fmt", [fp8amp.FP16, fp8amp.E4M3])
@pytest.mark.parametrize("write", ROW_WRITES, ids=list(ROW_WRITES))
def test_in_place_ops_through_row_views_reach_the_tensor_and_spare_the_other_rows(write, fmt):
    """The rows of a row view share the tensor's one scale: an in-place op on them writes their
    new values as copy_ does (they scaled, zeroed or re-scaled the shared scale_inv, changing every
    other row too; x[i] was a dequantized copy and x[i] = v was lost)."""
    x, s = make(fmt)
    want = s.dequantize().clone()
    ROW_WRITES[write](want)
    ROW_WRITES[write](s)
    got = s.dequantize()
    step = 2.0 ** -10 if fmt == fp8amp.FP16 else 2.0 ** -3  # the format's relative rounding, on a new scale
    torch.testing.assert_close(got, want, rtol=step, atol=want.abs().max().item() * step * 2 ** -6)


def test_row_writes_into_an_o2_master_reach_the_fp8_layer():
    """x[i] = v on an O2 master weight (an FP16 ScaledTensor): the layer's next forward computes
    with it (the master's E4M3 copy is refreshed)."""
    torch.manual_seed(0)
    model, _ = fp8amp.initialize(torch.nn.Sequential(torch.nn.Linear(32, 64)),
                                 torch.optim.AdamW(torch.nn.Sequential(torch.nn.Linear(32, 64)).parameters()),
                                 "O2", policy="all")
    weight = model[0].weight
    with torch.no_grad():
        weight[5] = 0.0
        weight[7:9].zero_()
        weight[3].copy_(torch.full((32,), 0.5))
    y = model(torch.ones(4, 32))
    bias = model[0].bias.detach()
    # (the bias is added in the GEMM's output precision)
    torch.testing.assert_close(y[:, 5], bias[5].expand(4), rtol=2 ** -8, atol=0)
    torch.testing.assert_close(y[:, 7:9], bias[7:9].expand(4, 2), rtol=2 ** -8, atol=0)
    torch.testing.assert_close(y[:, 3], (16.0 + bias[3]).expand(4), rtol=2 ** -3, atol=0)


def test_as_strided_keeps_a_contiguous_view_scaled():
    """FSDP2 makes its gathered parameter with as_strided: a contiguous view from the first element
    stays a ScaledTensor over the same codes; any other striding dequantizes (a plain tensor)."""
    x = torch.randn(6, 4)
    st = ScaledTensor.from_tensor(x, fp8amp.E4M3)
    head = torch.as_strided(st, (4, 4), (4, 1))
    assert isinstance(head, ScaledTensor) and head._data.data_ptr() == st._data.data_ptr()
    assert torch.equal(head.dequantize(), st.dequantize()[:4])
    strided = torch.as_strided(st, (2, 4), (8, 1))
    assert type(strided) is torch.Tensor and torch.equal(strided, st.dequantize()[0:4:2])
    shifted = torch.as_strided(st, (2, 4), (4, 1), 4)
    assert type(shifted) is torch.Tensor and torch.equal(shifted, st.dequantize()[1:3])


def test_row_views_share_codes_and_scale():
    """Slices, split, chunk and narrow along dim 0 (step 1) are ScaledTensor views; writing into
    one re-quantizes the whole tensor with a fresh scale, the other rows' values kept; new_zeros
    keeps the scale."""
    x, s = make(fp8amp.FP16)
    rows = s[1:3]
    assert type(rows) is ScaledTensor and rows._data.data_ptr() == s._data[1:3].data_ptr()
    assert rows._scale_inv is s._scale_inv and torch.equal(rows.dequantize(), s.dequantize()[1:3])
    for part, want in ((s.split(2)[1], s.dequantize()[2:4]), (s.chunk(4)[3], s.dequantize()[6:8]),
                       (s.narrow(0, 1, 2), s.dequantize()[1:3])):
        assert type(part) is ScaledTensor and torch.equal(part.dequantize(), want)
    before = s.dequantize().clone()
    new = torch.full((2, s.shape[1]), 3.0)
    rows.copy_(new)  # the amax stays in the other rows: their values are kept exactly
    after = s.dequantize()
    assert torch.equal(after[1:3], new) and torch.equal(after[0], before[0]) and torch.equal(after[3:], before[3:])
    assert torch.equal(rows.dequantize(), new)  # the view sees the re-quantized codes and scale
    big = torch.full((1, s.shape[1]), 2.0 ** 20)  # above FP16's range at the old scale: the scale moves
    s.narrow(0, 7, 1).copy_(big)
    assert torch.equal(s.dequantize()[7:], big) and torch.allclose(s.dequantize()[:7], after[:7], rtol=2 ** -10, atol=1e-3)
    zeros = s.new_zeros((5, s.shape[1]))
    assert type(zeros) is ScaledTensor and zeros.storage_format == fp8amp.FP16
    assert torch.equal(zeros._scale_inv, s._scale_inv) and zeros._scale_inv is not s._scale_inv
    assert not zeros.dequantize().any()


def test_data_assignment_writes_the_values():
    """``p.data = x`` (vector_to_parameters, older training code) writes x's values into an O1/O2
    master, its E4M3 copy following; torch's own setter replaced only the wrapper's empty storage,
    so the values stayed, silently. A shape change is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")
    weight = model[0].weight
    weight.data = torch.full((64, 32), 0.25)
    assert type(weight) is MasterWeight and torch.equal(weight.dequantize(), torch.full((64, 32), 0.25))
    y = model[0](torch.ones(2, 32))
    torch.testing.assert_close(y, (8.0 + model[0].bias.detach()).expand(2, 64), rtol=2 ** -8, atol=0)
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vector * 2, model.parameters())
    doubled = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.testing.assert_close(doubled, vector * 2, rtol=2 ** -10, atol=0)
    with pytest.raises(ValueError, match=r"MasterWeight: .data = x writes x's values into this tensor, which keeps its "
                                         r"shape \[64, 32\]; got x of shape \[32, 64\]"):
        weight.data = torch.zeros(32, 64)
    with pytest.raises(TypeError, match="ScaledTensor: .data must be set to a tensor, got float"):
        make()[1].data = 1.0
    blocks = fp8amp.BlockScaledTensor.from_tensor(torch.randn(256, 128))
    blocks.data = torch.ones(256, 128)
    assert torch.equal(blocks.dequantize(), torch.ones(256, 128))


@pytest.mark.parametrize("kind", ["ScaledTensor FP16", "ScaledTensor E4M3", "BlockScaledTensor"])
@pytest.mark.parametrize("index, value", [((slice(None), 3), 0.0), ((slice(None), slice(0, 5)), 1.5),
                                          (torch.tensor([0, 5]), 2.0), ((..., -1), torch.tensor(0.5)),
                                          (1, 0.25), (slice(2, 4), -1.0)],
                         ids=["column", "columns", "index tensor", "ellipsis", "row", "rows"])
def test_item_assignment_of_any_index_reaches_the_tensor(kind, index, value):
    """x[index] = v writes into the tensor for every index (a column, a mask, a block-scaled
    tensor's rows: those views are copies, and the assignment was lost)."""
    g = torch.Generator().manual_seed(3)
    if kind == "BlockScaledTensor":
        t, step = fp8amp.BlockScaledTensor.from_tensor(torch.randn(256, 256, generator=g)), 2.0 ** -3
    else:
        fmt = fp8amp.FP16 if kind.endswith("FP16") else fp8amp.E4M3
        t = ScaledTensor.from_tensor(torch.randn(8, 256, generator=g), fmt)
        step = 2.0 ** (-10 if fmt == fp8amp.FP16 else -3)
    want = t.dequantize(torch.float32).clone()
    want[index] = value
    t[index] = value
    tolerance = want.abs().max().item() * step * 2 ** -6
    torch.testing.assert_close(t.dequantize(torch.float32), want, rtol=step, atol=tolerance)


def test_item_assignment_of_a_master_needs_no_grad_as_for_a_parameter():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64))
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")
    with pytest.raises(RuntimeError, match=r"MasterWeight: x\[index\] = value on a tensor that requires grad .* "
                                           r"under torch.no_grad\(\)"):
        model[0].weight[:, 0] = 0.0
    with torch.no_grad():
        model[0].weight[:, 0] = 0.0
    assert not model[0].weight.dequantize()[:, 0].any() and model[0].weight.dequantize()[:, 1].all()


VIEW_WRITES = {
    "column slice zero_": lambda t: t[:, 0:4].zero_(),
    "transpose mul_": lambda t: t.t().mul_(2),
    "row of a transpose fill_": lambda t: t.t()[3].fill_(0.5),
    "column select add_": lambda t: t.select(1, 5).add_(1.0),
    "diagonal zero_": lambda t: t.diagonal().zero_(),
    "column unbind mul_": lambda t: t.unbind(1)[3].mul_(0.5),
    "column split clamp_": lambda t: t.split(64, dim=1)[1].clamp_(-0.1, 0.1),
    "step slice copy_": lambda t: t[::2].copy_(torch.ones_like(t[::2])),
    "rows of a block-scaled tensor mul_": lambda t: t[0:2].mul_(2),
    "two columns in one foreach": lambda t: torch._foreach_mul_([t[:, 0], t[:, 1]], 0.5),
}


@pytest.mark.parametrize("kind", ["ScaledTensor E4M3", "BlockScaledTensor"])
@pytest.mark.parametrize("write", VIEW_WRITES, ids=list(VIEW_WRITES))
def test_in_place_ops_through_other_views_reach_the_tensor(write, kind):
    """Views with no codes view (a transpose, a column slice, any view of a block-scaled tensor)
    are DequantizedViews: an in-place op through one writes into the tensor (it wrote into a
    dequantized copy, and was lost)."""
    g = torch.Generator().manual_seed(4)
    if kind == "BlockScaledTensor":
        t = fp8amp.BlockScaledTensor.from_tensor(torch.randn(256, 256, generator=g))
    else:
        t = ScaledTensor.from_tensor(torch.randn(8, 256, generator=g), fp8amp.E4M3)
    want = t.dequantize(torch.float32).clone()
    VIEW_WRITES[write](want)
    VIEW_WRITES[write](t)  # not a tensor that requires grad: in grad mode too
    step = 2.0 ** -3
    torch.testing.assert_close(t.dequantize(torch.float32), want, rtol=step, atol=want.abs().max().item() * step * 2 ** -6)


def test_dequantized_views_follow_their_tensor_and_read_as_plain_tensors():
    """A DequantizedView reads its tensor's current values; reads give plain tensors; tolist,
    numpy, pickle and deepcopy give its values; an FP8 gradient's column zeroed in grad mode and a
    master's under no_grad reach them."""
    x, s = make(fp8amp.FP16)
    view = s[:, 2]
    s.copy_(torch.ones(8, 16))
    assert type(view) is DequantizedView and view.tolist() == [1.0] * 8 and view.numpy().shape == (8,)
    assert type(view * 2) is torch.Tensor and torch.equal(view * 2, torch.full((8,), 2.0))
    for copied in (pickle.loads(pickle.dumps(view)), copy.deepcopy(view)):
        assert type(copied) is torch.Tensor and torch.equal(copied, torch.ones(8))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64))
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")
    model(torch.randn(4, 32)).sum().backward()
    grad = model[0].weight.grad
    assert isinstance(grad, ScaledTensor)
    grad[:, 0].zero_()
    assert not grad.dequantize()[:, 0].any() and grad.dequantize()[:, 1].any()
    with torch.no_grad():
        model[0].weight.t()[1].zero_()  # column 1 of the master
    assert not model[0].weight.dequantize()[:, 1].any() and model[0].weight.dequantize()[:, 2].all()


def test_dequantized_views_made_in_eager_code_work_in_compiled_functions():
    """A view made outside compiled code and passed in: read with its tensor's current values, and
    an in-place op through it (under no_grad, as on a master) reaches the tensor."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    s = ScaledTensor.from_tensor(torch.randn(16, 32, generator=g), fp8amp.FP16)
    view = s.t()
    assert type(view) is DequantizedView
    x = torch.randn(4, 32, generator=g)
    matmul = torch.compile(lambda a, b: a @ b, backend="aot_eager")
    torch.testing.assert_close(matmul(x, view), x @ s.dequantize(torch.float32).t())
    s.copy_(torch.full((16, 32), 0.5))
    torch.testing.assert_close(matmul(x, view), x @ torch.full((32, 16), 0.5))

    @torch.compile(backend="aot_eager")
    def double(v):
        v.mul_(2)

    with torch.no_grad():
        double(view)
    assert torch.equal(s.dequantize(torch.float32), torch.ones(16, 32))
