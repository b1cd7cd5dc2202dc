"""Writes into fp8amp's tensor subclasses (CPU): in-place ops on ScaledTensor and BlockScaledTensor,
through row views and other views (DequantizedView), ``.data =`` and item assignment
(docs/hardening.md#the-rules-by-kind-of-input)."""

import copy
import io
import pickle

import pytest
import torch

import fp8amp
from cast_reference import assert_bits_equal, scaled_example as make
from fp8amp.block_scaled_tensor import BlockScaledTensor
from fp8amp.dequantized_view import DequantizedView
from fp8amp.master_weight import MasterWeight
from fp8amp.scaled_tensor import ScaledTensor


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


def test_a_row_view_unpickled_apart_from_its_base_is_a_tensor_of_its_own():
    """pickle copies the view's and the base's codes apart (torch.save keeps them shared): a write
    into the unpickled view looked for its rows in the base copy by the pointers' difference and
    raised or wrote elsewhere; now it is a standalone tensor, and torch.save still keeps the view."""
    x = fp8amp.ScaledTensor.from_tensor(torch.randn(6, 5), fp8amp.E4M3)
    view = x[2:4]
    expected = view.dequantize() * 2
    z = pickle.loads(pickle.dumps(view))
    z.mul_(2.0)
    assert torch.equal(z.dequantize(), expected)
    buffer = io.BytesIO()
    torch.save({"x": x, "view": x[2:4]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded["view"].mul_(2.0)  # still a view: the write reaches the loaded base
    assert torch.equal(loaded["x"].dequantize()[2:4], loaded["view"].dequantize())


def test_an_out_of_place_sum_with_a_block_scaled_tensor_is_exact_and_promotes():
    """x + y was stored back in FP8 (the accumulation path; y + x was exact) and kept x's dtype;
    now both orders give the exact plain sum with torch's promotion. add_ still accumulates in FP8."""
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x = BlockScaledTensor.from_tensor(a)
    real, other = x.dequantize(), BlockScaledTensor.from_tensor(b).dequantize()
    for total in (x + other, other + x):
        assert type(total) is torch.Tensor and torch.equal(total, real + other)
    assert torch.equal(x + real.double(), real.double() * 2)
    assert (BlockScaledTensor.from_tensor(a.bfloat16()) + b).dtype == torch.float32
    x.add_(other)
    assert type(x) is BlockScaledTensor and not torch.equal(x.dequantize(), real + other)  # requantized
    torch.testing.assert_close(x.dequantize(), real + other, atol=0.5, rtol=2 ** -3)


def scaled_sources() -> dict:
    """Sources whose real values bfloat16, their logical dtype, cannot hold: FP16 codes, and 128 x 128
    blocks whose scales a factor of 1 + 2^-4 + 2^-9 made other than powers of two."""
    torch.manual_seed(0)
    fp16 = ScaledTensor.from_tensor(torch.randn(128, 256), torch.float16, orig_dtype=torch.bfloat16)
    blocks = fp8amp.BlockScaledTensor.from_tensor(torch.randn(128, 256), dtype=torch.bfloat16)
    blocks.mul_(1 + 2**-4 + 2**-9)  # a code of mantissa 1 becomes the FP16 example below
    return {"ScaledTensor": fp16, "BlockScaledTensor": blocks}


@pytest.mark.parametrize("write", ["from_tensor", "copy_"])
@pytest.mark.parametrize("dst", ["ScaledTensor", "BlockScaledTensor"])
@pytest.mark.parametrize("src", ["ScaledTensor", "BlockScaledTensor"])
def test_a_scaled_source_is_rounded_once_into_another_scaled_tensor(write, dst, src):
    """Read in its logical dtype (bfloat16), a source was rounded twice: to bfloat16, then into the
    destination's format (1 + 2^-4 + 2^-9 in FP16 codes became 1.0 in E4M3, not 1.125). Its real
    values are read in float32 (exact for codes times a scale), so the result equals a cast of them."""
    source = scaled_sources()[src]
    real = source.dequantize(torch.float32)
    assert not torch.equal(real, real.bfloat16().float())  # bfloat16 would round them
    kind = {"ScaledTensor": lambda x: ScaledTensor.from_tensor(x, fp8amp.E4M3),
            "BlockScaledTensor": lambda x: fp8amp.BlockScaledTensor.from_tensor(x)}[dst]
    if write == "from_tensor":
        out = kind(source)
        assert out.dtype == torch.bfloat16  # the source's logical dtype
    else:
        out = kind(torch.zeros(128, 256))
        out.copy_(source)
    assert_bits_equal(out.codes, kind(real).codes)
    assert_bits_equal(out.scale_inv, kind(real).scale_inv)


def test_an_fp16_value_bfloat16_cannot_hold_is_rounded_once_into_e4m3():
    value = 1 + 2**-4 + 2**-9  # bfloat16: 1 + 2^-4, a tie E4M3 rounds down; E4M3 of the value: 1.125
    src = ScaledTensor.from_tensor(torch.full((4, 4), value), torch.float16, orig_dtype=torch.bfloat16)
    assert ScaledTensor.from_tensor(src, fp8amp.E4M3).dequantize(torch.float32)[0, 0].item() == 1.125
