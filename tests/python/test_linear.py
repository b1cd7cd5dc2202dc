"""Fp8Linear and convert(): accuracy against an fp32 nn.Linear, scaling state, state dicts,
autocast, torch.compile, activation checkpointing, errors; on CPU (emulation) and GPU."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8amp

# SQNR floors. Round to nearest with m mantissa bits has a relative error uniform in
# +-2^-(m+1): an SQNR of 4.77 + 6.02 (m + 1) dB per operand, 28.8 dB for E4M3 (m = 3) and
# 22.8 dB for E5M2 (m = 2). A product of two quantized operands adds both noises (-3 dB):
# ~25.8 dB forward (E4M3 x E4M3), ~21.8 dB for dgrad and wgrad (E5M2 x E4M3). The floors sit
# 3 dB under those predictions to absorb the spread of random data, and no lower.
FORWARD_SQNR_DB = 22.8
BACKWARD_SQNR_DB = 18.8

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    actual, reference = actual.detach().double(), reference.detach().double()
    noise = (actual - reference).pow(2).sum()
    return math.inf if noise == 0 else 10 * math.log10(reference.pow(2).sum() / noise)


def pair(in_features=64, out_features=48, bias=True, device="cpu", seed=0):
    torch.manual_seed(seed)
    reference = nn.Linear(in_features, out_features, bias=bias, device=device)
    fp8 = fp8amp.Fp8Linear.from_linear(copy.deepcopy(reference))
    return fp8, reference


def run(module, x, grad_out):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(grad_out)
    return y, x.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead_shape", [(256,), (4, 37), (2, 3, 5)])
def test_forward_and_grads_against_fp32(device, bias, lead_shape):
    fp8, ref = pair(bias=bias, device=device)
    x = torch.randn(*lead_shape, 64, device=device)
    grad_out = torch.randn(*lead_shape, 48, device=device)
    y, dx = run(fp8, x, grad_out)
    y_ref, dx_ref = run(ref, x, grad_out)
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    assert sqnr_db(y, y_ref) > FORWARD_SQNR_DB
    assert sqnr_db(dx, dx_ref) > BACKWARD_SQNR_DB
    assert sqnr_db(fp8.weight.grad, ref.weight.grad) > BACKWARD_SQNR_DB
    if bias:  # the bias gradient is a high-precision sum
        torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)


def test_quantization_error_is_really_there():
    # The floors above must be able to fail: FP8 is measurably worse than fp32.
    fp8, ref = pair()
    x = torch.randn(64, 64)
    assert sqnr_db(fp8(x), ref(x)) < 40


def test_delayed_scaling_state_after_steps():
    history_len = 4
    fp8 = fp8amp.Fp8Linear.from_linear(nn.Linear(64, 48), fp8amp.ScalingRecipe(history_len=history_len))
    amaxes = []
    for step in range(6):
        x = torch.randn(32, 64) * (step + 1)
        amaxes.append(x.abs().max().item())
        fp8(x).backward(torch.randn(32, 48))
        assert fp8.input_scaling.amax_history[0, 0].item() == amaxes[-1]
        fp8amp.update_scaling(fp8)
    state = fp8.input_scaling
    assert state.counter.tolist() == [history_len]
    assert state.amax_history[0].tolist() == [0.0] + amaxes[-1 : -history_len : -1]
    window_max = max(amaxes[-history_len:])
    assert state.scale.item() == 2.0 ** math.floor(math.log2(448.0 / window_max))
    assert fp8.grad_output_scaling.counter.tolist() == [history_len]


def test_state_dict_round_trip_keeps_warmup():
    fp8, _ = pair()
    for _ in range(3):
        fp8(torch.randn(16, 64)).sum().backward()
        fp8amp.update_scaling(fp8)
    sd = fp8.state_dict()
    assert {"weight", "bias", "input_scaling.counter", "grad_output_scaling.amax_history"} <= set(sd)
    fresh, _ = pair(seed=1)
    fresh.load_state_dict(sd)
    assert fresh.input_scaling.counter.tolist() == [3]
    assert torch.equal(fresh.input_scaling.amax_history, fp8.input_scaling.amax_history)
    assert torch.equal(fresh.weight, fp8.weight)


def test_plain_linear_checkpoint_loads_strictly_under_fresh_scaling_if_missing():
    fp8, ref = pair()
    plain = nn.Linear(64, 48).state_dict()
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*input_scaling.amax_history"):
        fp8.load_state_dict(plain, strict=True)  # the scaling state is not silently fresh
    missing = fp8.load_state_dict(plain, strict=False).missing_keys
    assert {"input_scaling.counter", "grad_output_scaling.scale"} <= set(missing)
    fp8.input_scaling.counter.fill_(5)
    with fp8amp.fresh_scaling_if_missing():
        assert fp8.load_state_dict(plain, strict=True).missing_keys == []
    assert fp8.input_scaling.counter.tolist() == [0]  # the warm-up restarts
    assert torch.equal(fp8.weight, plain["weight"])
    with fp8amp.fresh_scaling_if_missing(), pytest.raises(RuntimeError, match="Missing key.*bias"):
        fp8.load_state_dict({"weight": plain["weight"]}, strict=True)  # other keys stay strict


def test_convert_swaps_filters_and_keeps_parameters():
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 17)), nn.Linear(17, 16)
    )
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fp8amp.convert(model, module_filter_fn=lambda mod, fqn: fqn != "2.0", optimizer=optimizer)
    assert isinstance(model[0], fp8amp.Fp8Linear)
    assert type(model[2][0]) is nn.Linear  # filtered out by name
    assert type(model[2][1]) is nn.Linear  # 17 outputs: not a multiple of 16
    assert type(model[3]) is nn.Linear  # 17 inputs
    assert list(model.parameters()) == params  # same objects: the optimizer still owns them
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()  # the hook convert() added rolls the scaling histories
    assert model[0].input_scaling.counter.tolist() == [1]


def test_convert_a_bare_linear_and_bad_arguments():
    assert isinstance(fp8amp.convert(nn.Linear(32, 32)), fp8amp.Fp8Linear)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fp8amp.convert("model")
    with pytest.raises(TypeError, match="optimizer"):
        fp8amp.convert(nn.Linear(32, 32), optimizer=object())
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8amp.Fp8Linear(17, 32)
    with pytest.raises(ValueError, match="in_features"):
        fp8amp.Fp8Linear(32, 32)(torch.randn(4, 16))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_output_dtype(device):
    fp8, ref = pair(device=device)
    x = torch.randn(32, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = fp8(x)
        y_ref = ref(x)
    assert y.dtype == torch.bfloat16 == y_ref.dtype
    assert sqnr_db(y.float(), y_ref.float()) > FORWARD_SQNR_DB


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("how", ["to_meta", "device_context"])
def test_a_model_on_the_meta_device_infers_shapes_as_nn_linear(level, recipe, how):
    """Shape inference on meta (model sizes, FSDP2's meta init): autocast's query of the meta
    device raised torch's "unknown device type for autocast"; the fp8amp ops have meta kernels."""
    def build():
        model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
        if level == "fp8":
            return fp8amp.convert(model, policy="all", recipe=recipe)
        return fp8amp.initialize(model, opt_level=level, policy="all", recipe=recipe)[0]
    if how == "to_meta":
        model, x = build().to("meta"), torch.randn(2, 8, 128, device="meta", requires_grad=True)
    else:
        with torch.device("meta"):
            model, x = build(), torch.randn(2, 8, 128, requires_grad=True)
    assert isinstance(model[0], fp8amp.Fp8Linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # no autocast on meta: nn.Linear keeps x's dtype
        y = model(x)
    assert y.is_meta and y.shape == (2, 8, 128) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.is_meta and x.grad.shape == x.shape and model[0].weight.grad.shape == (256, 128)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("lead_shape", [(16,), (7,), (2, 5), (3, 16)])
def test_the_output_is_no_view(recipe, lead_shape):
    """As nn.Linear's: FSDP2 warns of a module that returns a view (an in-place op on it would skip
    the module's pre-backward hook), and a 3-D input or padded rows made one."""
    torch.manual_seed(0)
    layer = fp8amp.Fp8Linear(128, 256, recipe=recipe)
    x = torch.randn(*lead_shape, 128, requires_grad=True)
    y = layer(x)
    assert y.shape == (*lead_shape, 256) and not y._is_view()
    y.square().sum().backward()
    reference = x.detach() @ layer.weight.detach().t() + layer.bias.detach()
    assert torch.allclose(y.detach(), reference, rtol=0.15, atol=0.5)
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()


def test_activation_checkpointing_gives_the_same_gradients():
    fp8, _ = pair()
    twin = copy.deepcopy(fp8)
    x = torch.randn(32, 64)
    g = torch.randn(32, 48)
    y, dx = run(fp8, x, g)
    x2 = x.clone().requires_grad_()
    checkpoint(twin, x2, use_reentrant=False).backward(g)
    assert torch.equal(dx, x2.grad)
    assert torch.equal(fp8.weight.grad, twin.weight.grad)


def test_compile_matches_eager():
    fp8, _ = pair()
    twin = copy.deepcopy(fp8)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    for step in range(3):
        x = torch.randn(32, 64)
        g = torch.randn(32, 48)
        y, dx = run(fp8, x, g)
        y_c, dx_c = run(compiled, x, g)
        assert torch.equal(y, y_c) and torch.equal(dx, dx_c)
        fp8amp.update_scaling(fp8)
        fp8amp.update_scaling(twin)
    assert torch.equal(fp8.weight.grad, twin.weight.grad)
    for name, buf in fp8.named_buffers():
        assert torch.equal(buf, dict(twin.named_buffers())[name]), name


@pytest.mark.gpu
def test_cuda_matches_cpu_emulation():
    fp8_cpu, _ = pair()
    fp8_gpu = copy.deepcopy(fp8_cpu).cuda()
    x = torch.randn(64, 64)
    g = torch.randn(64, 48)
    y, dx = run(fp8_cpu, x, g)
    y_g, dx_g = run(fp8_gpu, x.cuda(), g.cuda())
    # Same quantized operands; only the GEMM's summation order (and fast accumulation) differ.
    assert sqnr_db(y_g.cpu(), y) > 40 and sqnr_db(dx_g.cpu(), dx) > 40
    assert torch.equal(fp8_gpu.input_scaling.amax_history.cpu(), fp8_cpu.input_scaling.amax_history)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_forwards_outside_training_leave_the_scaling_history_alone(mode):
    """A validation batch 100x larger must not coarsen the next training step's input scale."""
    torch.manual_seed(0)
    layer = fp8amp.Fp8Linear(32, 16, recipe=fp8amp.ScalingRecipe(history_len=2))
    x = torch.randn(48, 32)
    layer(x).sum().backward()
    layer.update_scaling()
    history = layer.input_scaling.amax_history.clone()
    big = 100 * x
    if mode == "eval":
        layer.eval()
        y = layer(big)
        layer.train()
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            y = layer(big)
    assert torch.equal(layer.input_scaling.amax_history, history)
    # The batch itself was cast with a scale that fits it (warm-up: its own amax), not saturated.
    reference = torch.nn.functional.linear(big, layer.weight.detach(), layer.bias.detach())
    assert ((y - reference).norm() / reference.norm()).item() < 0.1


def test_recording_outside_training_is_an_option():
    layer = fp8amp.Fp8Linear(32, 16)
    layer.record_amax_outside_training = True
    layer.eval()
    layer(torch.full((16, 32), 3.0))
    assert layer.input_scaling.amax_history[0, 0].item() == 3.0


def _second_order(model, x):
    """Each way to differentiate through a layer twice, by name."""
    f = lambda xi: model(xi).pow(2).sum()
    v = torch.randn_like(x)

    def input_grad_of_input_grad():
        xi = x.clone().requires_grad_()
        (grad_x,) = torch.autograd.grad(f(xi), xi, create_graph=True)
        return torch.autograd.grad(grad_x.sum(), xi)

    def gradient_penalty():
        xi = x.clone().requires_grad_()
        (grad_x,) = torch.autograd.grad(f(xi), xi, create_graph=True)
        grad_x.norm().backward()

    return {"hessian": lambda: torch.autograd.functional.hessian(f, x[0]),
            "hvp": lambda: torch.autograd.functional.hvp(f, x, v),
            "jvp": lambda: torch.autograd.functional.jvp(model, x, v),
            "create_graph": input_grad_of_input_grad, "gradient_penalty": gradient_penalty}


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("how", ["hessian", "hvp", "jvp", "create_graph", "gradient_penalty"])
def test_double_backward_is_refused(level, recipe, how):
    """Double backward raises, never returns 0: hessian, hvp and jvp (the double-backward trick)
    gave exactly 0 through an Fp8Linear, and a gradient penalty a weight gradient of 0 (its
    backward was once_differentiable, which detached the input gradient)."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128))
    if level == "fp8":
        fp8amp.convert(model, policy="all", recipe=recipe)
    else:
        model, _ = fp8amp.initialize(model, opt_level=level, policy="all", recipe=recipe)
    assert isinstance(model[2], fp8amp.Fp8Linear)
    with pytest.raises(NotImplementedError, match=r"Fp8Linear: double backward .*module_filter_fn.*unconvert"):
        _second_order(model, torch.randn(4, 128))[how]()
    model(torch.randn(4, 128)).sum().backward()  # first order still works after the refusal


def _transforms(model, x):
    """Each torch.func transform (and torch.autograd.functional's vectorize=True), by name."""
    from torch.func import functional_call, grad, jacfwd, jacrev, vmap
    params = {k: v.detach() for k, v in model.named_parameters()}

    def vmap_over_autograd_grad():  # the forward outside the transform: its backward is batched
        xi = x.clone().requires_grad_()
        y = model(xi)
        return vmap(lambda v: torch.autograd.grad(y, xi, v, retain_graph=True))(torch.randn(3, *y.shape))

    return {"vmap": lambda: vmap(model)(x),
            "grad": lambda: grad(lambda xi: model(xi).sum())(x),
            "jacrev": lambda: jacrev(model)(x[0]),
            "jacfwd": lambda: jacfwd(model)(x[0]),
            "functional_call_in_grad": lambda: grad(lambda p: functional_call(model, p, (x,)).sum())(params),
            "jacobian_vectorize": lambda: torch.autograd.functional.jacobian(model, x[0], vectorize=True),
            "vmap_over_autograd_grad": vmap_over_autograd_grad}


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("how", ["vmap", "grad", "jacrev", "jacfwd", "functional_call_in_grad", "jacobian_vectorize",
                                 "vmap_over_autograd_grad"])
def test_torch_func_transforms_are_refused_clearly(level, recipe, how):
    """torch's own errors named autograd.Function internals ("must override the setup_context
    staticmethod", "Batching rule not implemented for fp8amp::..."), or at O1/O2 the master check
    (the transform wraps the weight), which told to pass the model's own parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128))
    if level == "fp8":
        fp8amp.convert(model, policy="all", recipe=recipe)
    else:
        model, _ = fp8amp.initialize(model, opt_level=level, policy="all", recipe=recipe)
    with pytest.raises(NotImplementedError, match=r"Fp8Linear: torch.func transforms .*vectorize=False.*module_filter_fn"):
        _transforms(model, torch.randn(4, 128))[how]()
    x = torch.randn(4, 128)
    assert torch.autograd.functional.jacobian(model, x[0]).shape == (128, 128)  # vectorize=False works
    model(x).sum().backward()

