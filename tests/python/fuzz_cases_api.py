"""The public-API fuzz's cases (test_fuzz.py, run by fuzz_cases.py) of the modules and of the API
around them: Fp8Linear and ScaledTensor over odd inputs; then convert, initialize, unconvert,
conversion_report, the optimizer, recipes, save_activations_in_fp8 and the distributed helpers'
arguments, each refused with an error naming the argument or giving the right result, and a
refused call leaving what it was given as it was.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

import fp8amp
from cast_reference import bits, torch_amax
from fuzz_cases import FORMATS, FP16, KINDS, SHAPES, close, current_scale, raises_only, values


def _linear(seed=0, n_in=32, n_out=16):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def _fp8_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Error bound of an FP8 forward: E4M3 inputs and weights (relative 2^-4 each, after scaling),
    and the bias in bfloat16 (cuBLASLt's FP8 bias type for a float32 output)."""
    return (x.abs().double() @ w.abs().double().t()) * 2.0 ** -2 + b.abs().double() * 2.0 ** -8 + 1e-6


def module_cases():
    for level, kind, shape in itertools.product(("fp8", "O1", "O2"), KINDS, ((4, 32), (2, 3, 32), (0, 32), (1, 32))):
        x = values(kind, shape)

        def forward(level=level, x=x):
            ref = _linear()
            model = (fp8amp.convert(nn.Sequential(_linear()), policy="all") if level == "fp8"
                     else fp8amp.initialize(nn.Sequential(_linear()), None, level, policy="all")[0])
            return ref, x, model(x)

        def check(r):
            ref, x, y = r
            expected = F.linear(x.double(), ref.weight.double(), ref.bias.double())
            assert y.shape == expected.shape
            bad = ~expected.isfinite()
            assert bool(y[bad].isnan().all() | (y[bad] == expected[bad]).all()), "non-finite outputs differ"
            ok = ~bad
            assert bool(((y.double() - expected).abs()[ok] <= _fp8_bound(x, ref.weight, ref.bias)[ok]).all()), "error bound"

        yield f"Fp8Linear {level} input {kind} {shape}", forward, check, ()
    for level in ("fp8", "O1", "O2"):
        model = lambda level=level: (fp8amp.convert(nn.Sequential(_linear()), policy="all") if level == "fp8"
                                     else fp8amp.initialize(nn.Sequential(_linear()), None, level, policy="all")[0])
        yield f"Fp8Linear {level} in_features mismatch", lambda m=model: m()(torch.randn(4, 16)), None, ("in_features",)
        yield f"Fp8Linear {level} float64 input", lambda m=model: m()(torch.randn(4, 32, dtype=torch.float64)), None, ("x",)
        yield f"Fp8Linear {level} int input", lambda m=model: m()(torch.ones(4, 32, dtype=torch.int32)), None, ("x",)
        yield f"Fp8Linear {level} meta input", lambda m=model: m()(torch.randn(4, 32, device="meta")), None, ("on meta",)
        yield f"Fp8Linear {level} sparse input", lambda m=model: m()(torch.randn(4, 32).to_sparse()), None, ("dense",)
    for fmt, kind, shape in itertools.product(FORMATS, KINDS, SHAPES[:6]):
        x = values(kind, shape)

        def from_tensor(fmt=fmt, x=x):
            return x, fp8amp.ScaledTensor.from_tensor(x, fmt).dequantize()

        def check(r, fmt=fmt):
            x, real = r
            if not bool(x.isfinite().all()):
                assert real.isnan().all()  # docs/numerics.md#non-finite-values
                return
            scale = current_scale(torch_amax(x), fp8amp.format_max(fmt))
            scale = scale.reshape(())
            expected = (x * scale).clamp(-fp8amp.format_max(fmt), fp8amp.format_max(fmt)).to(fmt).float() / scale
            assert torch.equal(bits(real), bits(expected)), "values differ"

        yield f"ScaledTensor.from_tensor {fmt} {kind} {shape}", from_tensor, check, ()

        def copy(fmt=fmt, x=x, shape=shape):
            s = fp8amp.ScaledTensor.from_tensor(torch.ones(shape), fmt)
            s.copy_(x)
            return x, s.dequantize()

        yield f"ScaledTensor.copy_ {fmt} {kind} {shape}", copy, check, ()
    s = lambda: fp8amp.ScaledTensor.from_tensor(torch.ones(4), FP16)  # noqa: E731
    yield "ScaledTensor.from_tensor dtype bfloat16", lambda: fp8amp.ScaledTensor.from_tensor(torch.ones(4),
                                                                                             torch.bfloat16), None, ("dtype",)
    yield "ScaledTensor.from_tensor complex", lambda: fp8amp.ScaledTensor.from_tensor(torch.ones(4, dtype=torch.complex64)), \
        None, ("real",)
    yield "ScaledTensor.add_ complex", lambda: s().add_(torch.ones(4, dtype=torch.complex64)), None, ("real",)
    yield "ScaledTensor.add_ meta", lambda: s().add_(torch.ones(4, device="meta")), None, ("device",)
    yield "ScaledTensor.sub_", lambda: s().sub_(torch.full((4,), 0.25)).dequantize(), \
        lambda r: close(r, torch.full((4,), 0.75), 0), ()
    yield "ScaledTensor.t_", lambda: s().t_(), None, ("t_",)
    yield "ScaledTensor.add_ float64", lambda: s().add_(torch.full((4,), 0.5, dtype=torch.float64)).dequantize(), \
        lambda r: close(r, torch.full((4,), 1.5), 0), ()
    net = lambda: nn.Sequential(_linear(), nn.ReLU(), _linear(1, 16, 32))  # noqa: E731
    yield "initialize model not a module", lambda: fp8amp.initialize(object(), None, "O1"), None, ("model",)
    yield "initialize opt_level O3", lambda: fp8amp.initialize(net(), None, "O3"), None, ("opt_level",)
    yield "initialize SGD", lambda: fp8amp.initialize(net(), torch.optim.SGD(net().parameters(), lr=0.1), "O1"), None, \
        ("optimizer",)
    yield "initialize weight_grad fp16", lambda: fp8amp.initialize(net(), None, "O1", weight_grad="fp16"), None, \
        ("weight_grad",)
    yield "convert policy unknown", lambda: fp8amp.convert(net(), policy="some"), None, ("policy",)
    for level in ("O1", "O2"):
        def train(level=level):
            model = net()
            model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, policy="all")
            before = [p.float().clone() if not isinstance(p, fp8amp.ScaledTensor) else p.dequantize() for p in
                      model.parameters()]
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            after = [p.float() if not isinstance(p, fp8amp.ScaledTensor) else p.dequantize() for p in model.parameters()]
            return before, after

        def moved(r):
            assert all(bool(a.isfinite().all()) and not torch.equal(a, b) for a, b in zip(*r)), "a param did not train"

        yield f"initialize {level} one training step", train, moved, ()
        yield f"initialize {level} odd Linear stays", lambda level=level: type(fp8amp.initialize(
            nn.Sequential(nn.Linear(10, 7)), None, level, policy="all")[0][0]).__name__, \
            lambda name: (name == "Linear") or raises_only(name), ()


def _o2(seed=0):
    """A small model through initialize("O2") with its optimizer, after one training step."""
    torch.manual_seed(seed)
    model = nn.Sequential(_linear(seed), nn.ReLU(), _linear(seed + 1, 16, 32))
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    return model, opt


def _refused(call):
    """(the ValueError's message, or None if call did not raise): for cases that also check what a
    refused call left behind."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def api_cases():
    net = lambda: nn.Sequential(_linear(), nn.ReLU(), _linear(1, 16, 32))  # noqa: E731
    params = lambda: net().parameters()  # noqa: E731
    yield "conversion_report not a module", lambda: fp8amp.conversion_report("model"), None, ("model",)
    yield "conversion_report plain model", lambda: fp8amp.conversion_report(net()), \
        lambda r: r is None or raises_only(r), ()
    for name, kwargs in (("kind", dict(kind="fancy")), ("grad_format", dict(grad_format=torch.float16)),
                         ("history_len", dict(history_len=0)), ("margin", dict(margin=True)),
                         ("pow2_scale", dict(pow2_scale="yes"))):
        yield f"Recipe {name} {kwargs[name]!r}", lambda kwargs=kwargs: fp8amp.Recipe(**kwargs), None, (name,)
    yield "format_max float32", lambda: fp8amp.format_max(torch.float32), None, ("dtype",)
    yield "save_activations_in_fp8 fmt float16", lambda: fp8amp.save_activations_in_fp8(torch.float16), None, ("fmt",)
    yield "save_activations_in_fp8 compiled_graphs str", \
        lambda: fp8amp.save_activations_in_fp8(compiled_graphs="no"), None, ("compiled_graphs",)
    for name, kwargs in (("lr", dict(lr=-1.0)), ("lr", dict(lr=torch.tensor(1e-3))), ("betas", dict(betas=None)),
                         ("betas", dict(betas=(1.0, 0.9))), ("eps", dict(eps=float("nan"))),
                         ("state_dtypes", dict(state_dtypes="O3")), ("amsgrad", dict(amsgrad=True))):
        yield f"optim.AdamW {kwargs}", lambda kwargs=kwargs: fp8amp.optim.AdamW(params(), **kwargs), None, (name,)
    yield "optim.AdamW int param", lambda: fp8amp.optim.AdamW([torch.zeros(3, dtype=torch.int32)]), None, ("params",)
    yield "initialize_optimizer SGD", lambda: fp8amp.initialize_optimizer(
        net(), torch.optim.SGD(params(), lr=0.1)), None, ("optimizer",)

    def load_garbage():
        return fp8amp.optim.AdamW(params()).load_state_dict({"exp_avg": 1})

    yield "optim load_state_dict not a state dict", load_garbage, None, ("state_dict",)

    def load_other_shapes():
        (_, opt), (_, other) = _o2(0), _o2(1)
        saved = other.state_dict()
        first = next(iter(saved["state"]))
        saved["state"][first]["exp_avg"] = torch.zeros(7)
        before = {k: v.clone() for k, v in opt.state[next(iter(opt.state))].items()}
        return _refused(lambda: opt.load_state_dict(saved)), before, opt.state[next(iter(opt.state))]

    def refused_and_kept(r):
        message, before, after = r
        assert message is not None and "exp_avg" in message, f"not refused: {message}"
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the state"

    yield "optim load_state_dict moment of another shape", load_other_shapes, refused_and_kept, ()

    def unconvert_other_optimizer():
        (model, _), (_, other) = _o2(0), _o2(1)
        return _refused(lambda: fp8amp.unconvert(model, other)), model

    def refused_model_kept(r):
        message, model = r
        assert message is not None and "optimizer" in message, f"not refused: {message}"
        assert isinstance(model[0], fp8amp.Fp8Linear), "a refused unconvert changed the model"

    yield "unconvert another model's optimizer", unconvert_other_optimizer, refused_model_kept, ()

    def unconvert_plain_optimizer_over_masters():
        model, _ = _o2(0)
        return _refused(lambda: fp8amp.unconvert(model, torch.optim.SGD(model.parameters(), lr=0.1))), model

    yield "unconvert torch optimizer over masters", unconvert_plain_optimizer_over_masters, refused_model_kept, ()

    def unconvert_values():
        model, opt = _o2(0)
        masters = [model[i].weight.dequantize() for i in (0, 2)]
        m = opt.state[model[0].weight]["exp_avg"]
        m_real = m.float() * opt.state[model[0].weight]["exp_avg_scale_inv"]
        model, plain = fp8amp.unconvert(model, opt)
        return model, plain, masters, m_real

    def unconverted(r):
        model, plain, masters, m_real = r
        assert [type(model[i]) for i in (0, 2)] == [nn.Linear, nn.Linear], "not nn.Linear again"
        assert all(torch.equal(model[i].weight.detach(), w) for i, w in zip((0, 2), masters)), "weights differ"
        assert type(plain) is torch.optim.AdamW, type(plain).__name__
        assert torch.equal(plain.state[model[0].weight]["exp_avg"], m_real), "exp_avg not its real values"

    yield "unconvert O2 model and optimizer", unconvert_values, unconverted, ()

    for case, name, call in (
            ("float64", "dtype", lambda: fp8amp.Fp8Linear(32, 16, dtype=torch.float64)),
            ("int32", "dtype", lambda: fp8amp.Fp8Linear(32, 16, dtype=torch.int32)),
            ("float in_features", "in_features", lambda: fp8amp.Fp8Linear(32.0, 16)),
            ("from_linear float64", "dtype",
             lambda: fp8amp.Fp8Linear.from_linear(nn.Linear(32, 16, dtype=torch.float64)))):
        yield f"Fp8Linear {case}", call, None, (name,)

    def convert_float64():
        model = nn.Sequential(nn.Linear(32, 16, dtype=torch.float64), _linear(1, 16, 32))
        fp8amp.convert(model, policy="all")
        return model

    def float64_kept(model):
        assert [type(m) for m in model] == [nn.Linear, fp8amp.Fp8Linear], [type(m).__name__ for m in model]
        assert "float64" in fp8amp.conversion_report(model).decisions[0].reason

    yield "convert keeps a float64 Linear", convert_float64, float64_kept, ()

    def initialize_float64():
        model = nn.Sequential(_linear(), nn.Linear(16, 32, dtype=torch.float64))
        optimizer = torch.optim.AdamW(model.parameters())
        return _refused(lambda: fp8amp.initialize(model, optimizer, "O2", policy="all")), model

    def refused_unconverted(r):
        message, model = r
        assert message is not None and "param" in message, f"not refused: {message}"
        assert type(model[0]) is nn.Linear, "a refused initialize converted the model"

    yield "initialize optimizer over a float64 param", initialize_float64, refused_unconverted, ()
    block = fp8amp.BlockScaledTensor.from_tensor
    yield "BlockScaledTensor.from_tensor 1-D", lambda: block(torch.ones(256)), None, ("x",)
    yield "BlockScaledTensor.from_tensor fmt float16", lambda: block(torch.ones(128, 128), torch.float16), None, \
        ("fmt",)
    yield "BlockScaledTensor.from_tensor dtype int32", lambda: block(torch.ones(128, 128), dtype=torch.int32), None, \
        ("dtype",)

    from fp8amp import amax_sync, distributed, fsdp

    states = lambda: amax_sync.delayed_states(_o2()[0])  # noqa: E731
    for name in ("start_amax_reduction", "end_step", "reduce_amaxes"):
        function = getattr(amax_sync, name)
        yield f"amax_sync.{name} None", lambda f=function: f(None), None, ("states",)
        yield f"amax_sync.{name} modules", lambda f=function: f([nn.Linear(2, 2)]), None, ("states",)
        yield f"amax_sync.{name} states", lambda f=function: f(states()), lambda r: r in (0, None) or raises_only(r), ()
    yield "amax_sync.start_amax_reduction step_bound str", lambda: amax_sync.start_amax_reduction(
        states(), step_bound="yes"), None, ("step_bound",)
    yield "amax_sync.set_amax_reduction enabled str", lambda: amax_sync.set_amax_reduction(
        net(), enabled="no"), None, ("enabled",)
    for name, kwargs in (("fmt", dict(fmt=torch.float16)), ("method", dict(method="x")),
                         ("pipeline_chunks", dict(pipeline_chunks=0)), ("process_group", dict(process_group="g")),
                         ("scales_per_chunk", dict(scales_per_chunk="yes"))):
        yield f"FP8CommState {kwargs}", lambda kwargs=kwargs: distributed.FP8CommState(**kwargs), None, (name,)
    yield "all_reduce_grads bucket_cap_mb 0", lambda: distributed.all_reduce_grads(
        net(), bucket_cap_mb=0), None, ("bucket_cap_mb",)
    yield "wire_bytes dtype int8", lambda: distributed.wire_bytes([5], 2, "native", torch.int8), None, ("dtype",)
    yield "wire_bytes scales_per_chunk 1", lambda: distributed.wire_bytes([5], 2, "native", scales_per_chunk=1), None, \
        ("scales_per_chunk",)
    yield "wire_bytes all_reduce bfloat16", lambda: distributed.wire_bytes([1000], 2, "all_reduce", torch.bfloat16), \
        lambda r: r == 2000 or raises_only(r), ()
    yield "Fp8AllGatherWeight int32", lambda: fsdp.Fp8AllGatherWeight(torch.zeros(4, dtype=torch.int32)), None, \
        ("tensor",)
    yield "fp8_reduce_scatter divisor 0", lambda: fsdp.fp8_reduce_scatter(torch.zeros(4), torch.zeros(8), divisor=0), \
        None, ("divisor",)
    yield "fp8_reduce_scatter input list", lambda: fsdp.fp8_reduce_scatter(torch.zeros(4), [0.0] * 8), None, ("input",)
    yield "enable_fp8_reduce_scatter fmt float16", lambda: fsdp.enable_fp8_reduce_scatter(net(), torch.float16), \
        None, ("fmt",)
