"""Usage mistakes that did nothing silently, and errors that did not say what is unsupported
(issue 23, items 10 and 11): each now raises or warns with the fix. Also what cannot be done to
O2 masters (share_memory, dtype changes), an optimizer of another model, the scaling hooks
registered twice (each state updated once a step) and an update by hand of a model the hooks
already update (warned)."""

import copy
import functools
import pickle
import warnings

import pytest
import torch
from torch import nn

import fp8amp


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _loss(model):
    return model(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).square().mean()


# ------------------------------------------------------------------------------------------ item 10


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_optimizer_passed_into_initialize_refuses_to_step(level):
    model = _model()
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, returned = fp8amp.initialize(model, passed, level, policy="all")
    _loss(model).backward()
    before = model[0].weight.dequantize()
    with pytest.raises(RuntimeError, match="initialize replaced this optimizer.*step and zero_grad that one"):
        passed.step()  # it used to run, leaving the Linear weights unchanged
    with pytest.raises(RuntimeError, match="initialize replaced this optimizer"):
        passed.zero_grad()  # the masters' grads would accumulate
    assert torch.equal(model[0].weight.dequantize(), before)
    returned.step()
    assert not torch.equal(model[0].weight.dequantize(), before)


def test_lr_scheduler_built_before_initialize_warns_once():
    model = _model()
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.StepLR(passed, step_size=1, gamma=0.5)  # bound to `passed`: no effect later
    with pytest.warns(UserWarning, match="lr scheduler was built on the optimizer passed in") as record:
        fp8amp.initialize(model, passed, "O2", policy="all")
    assert sum("lr scheduler" in str(w.message) for w in record) == 1


def test_no_warning_without_a_scheduler():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2", policy="all")


# ------------------------------------------------------------------------------------------ item 11


@pytest.mark.parametrize("how", ["trace", "script"])
def test_torchscript_is_refused_with_what_works(how):
    model = fp8amp.convert(_model(), policy="all")
    x = torch.randn(4, 16)
    compile_ = (lambda: torch.jit.trace(model, x)) if how == "trace" else (lambda: torch.jit.script(model))
    with pytest.raises(NotImplementedError, match="TorchScript .* is not supported.*torch.compile.*torch.export"):
        compile_()  # IndexError: unordered_map::at / a scripting error about list sizes, before


def test_export_works_as_the_message_says():
    model = fp8amp.convert(_model(), policy="all").eval()
    x = torch.randn(4, 16)
    assert torch.equal(torch.export.export(model, (x,)).module()(x), model(x))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_is_refused(layout):
    model = fp8amp.convert(_model(), policy="all")
    x = torch.randn(4, 16)
    x = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    with pytest.raises(ValueError, match="input must be a dense .* call .to_dense"):
        model(x)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_an_input_of_another_dtype_is_refused_by_the_layer(recipe, dtype):
    """The layer names itself, the input and the dtypes it takes (the cast op inside it did, before)."""
    model = fp8amp.convert(nn.Sequential(nn.Linear(128, 256)), policy="all", recipe=recipe)
    assert isinstance(model[0], fp8amp.Fp8Linear)
    with pytest.raises(ValueError, match=rf"Fp8Linear: the input x must be float32, bfloat16 or float16, got {dtype}"):
        model(torch.ones(4, 128).to(dtype))


def test_scaled_tensor_add_of_float64_and_int_as_torch():
    base = torch.randn(8)
    for other in (torch.randn(8, dtype=torch.float64), torch.arange(8, dtype=torch.int32)):
        s = fp8amp.ScaledTensor.from_tensor(base, fp8amp.FP16)
        expected = s.dequantize() + other.float()  # torch: float32.add_(float64 or int) keeps float32
        s.add_(other)  # named the internal scaled_accumulate, before
        assert torch.allclose(s.dequantize(), expected, rtol=2 ** -10, atol=0)
    with pytest.raises(TypeError, match="ScaledTensor.add_: other must be real"):
        fp8amp.ScaledTensor.from_tensor(base, fp8amp.FP16).add_(torch.randn(8, dtype=torch.complex64))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_pickle_round_trip_of_an_o1_o2_model(level):
    model = fp8amp.initialize(_model(), None, level, policy="all")[0]
    loaded = pickle.loads(pickle.dumps(model))  # AttributeError in torch's float8 unpickling, before
    x = torch.randn(4, 16)
    assert torch.equal(loaded(x), model(x))
    assert loaded[0].weight.fp8_copy[0].dtype == fp8amp.E4M3
    grad = fp8amp.ScaledTensor.from_tensor(torch.randn(4, 4), fp8amp.E4M3)
    assert torch.equal(pickle.loads(pickle.dumps(grad)).dequantize(), grad.dequantize())


@pytest.mark.parametrize("fmt", [fp8amp.E4M3, fp8amp.E5M2])
def test_pickle_round_trip_of_a_block_scaled_tensor(fmt):
    """The blockwise recipe's FP8 gradients pickle as the per-tensor ones do (an AttributeError
    in torch's float8 unpickling, before)."""
    grad = fp8amp.BlockScaledTensor.from_tensor(torch.randn(200, 300), fmt, torch.bfloat16)
    loaded = pickle.loads(pickle.dumps(grad))
    assert type(loaded) is fp8amp.BlockScaledTensor and loaded.dtype == torch.bfloat16
    assert loaded.codes.dtype == fmt and torch.equal(loaded.codes.view(torch.uint8), grad.codes.view(torch.uint8))
    assert torch.equal(loaded.scale_inv, grad.scale_inv)


def test_share_memory_of_masters_is_refused_not_a_crash():
    """It segfaulted (torch shared a wrapper subclass's storage); run in a child so a crash fails."""
    import subprocess
    import sys
    code = ("import torch, fp8amp\n"
            "m, _ = fp8amp.initialize(torch.nn.Sequential(torch.nn.Linear(16, 16)), None, 'O2', policy='all')\n"
            "try:\n    m.share_memory()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: fp8amp.MasterWeight: share_memory_() is not supported" in out.stdout


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.double()])
def test_dtype_changes_of_masters_are_refused(cast):
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(16, 16)), None, "O2", policy="all")
    with pytest.raises(ValueError, match="O1/O2 FP16 master of logical dtype torch.float32"):
        cast(model)
    model.to("cpu")  # a device move is fine
    assert isinstance(model[0].weight, fp8amp.ScaledTensor)
    model.state_dict()


def test_an_optimizer_of_another_model_is_warned_about():
    model_a, model_b = nn.Sequential(nn.Linear(16, 16)), nn.Sequential(nn.Linear(16, 16))
    with pytest.warns(UserWarning, match="none of them the model's, so the model will not train"):
        fp8amp.initialize(model_a, torch.optim.AdamW(model_b.parameters()), "O2", policy="all")


def _histories_after_steps(setup) -> list[torch.Tensor]:
    """The amax histories of a 2-layer MLP's delayed-scaling states after 4 steps whose inputs
    grow, with the model and optimizer that ``setup(model)`` returns."""
    torch.manual_seed(0)
    model, optimizer = setup(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    x = torch.randn(8, 32)
    for i in range(4):
        model(x * (i + 1)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [s.amax_history.clone() for s in fp8amp.amax_sync.delayed_states(model)]


def _converted_with_hooks(model, times=1, submodule=False):
    model = fp8amp.convert(model, policy="all")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(times):
        fp8amp.register_scaling_hooks(model, optimizer)
    if submodule:
        fp8amp.register_scaling_hooks(model[2], optimizer)
    return model, optimizer


def _initialized_then_hooks(model):
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    fp8amp.register_scaling_hooks(model, optimizer)
    return model, optimizer


@pytest.mark.parametrize("setup", [functools.partial(_converted_with_hooks, times=2),
                                   functools.partial(_converted_with_hooks, submodule=True)],
                         ids=["twice", "model and a layer of it"])
def test_scaling_hooks_registered_again_update_each_state_once_a_step(setup):
    """A second registration (of the model, or of a module inside it) on the same optimizer used to
    update the states twice a step: every other history entry 0, half the window."""
    once = _histories_after_steps(_converted_with_hooks)
    assert len(once) == 4 and all(h[1:5].gt(0).all() for h in once)
    for got, want in zip(_histories_after_steps(setup), once):
        assert torch.equal(got, want)


def test_register_scaling_hooks_after_initialize_changes_nothing():
    once = _histories_after_steps(
        lambda m: fp8amp.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-2), "O2", policy="all"))
    for got, want in zip(_histories_after_steps(_initialized_then_hooks), once):
        assert torch.equal(got, want)


def test_scaling_hook_and_update_arguments_are_checked():
    model = fp8amp.convert(nn.Sequential(nn.Linear(16, 16)), policy="all")
    with pytest.raises(TypeError, match="register_scaling_hooks: model must be an nn.Module, got int"):
        fp8amp.register_scaling_hooks(3, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="register_scaling_hooks: optimizer must be a torch.optim.Optimizer, got list"):
        fp8amp.register_scaling_hooks(model, [])
    with pytest.raises(TypeError, match="update_scaling: model must be an nn.Module, got NoneType"):
        fp8amp.update_scaling(None)


def test_update_scaling_by_hand_of_a_hooked_model_is_warned():
    """initialize's hooks already update after each step; an update by hand as well rolled every
    history twice a step with no word."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    for target in (model, model[2]):
        with pytest.warns(UserWarning, match="already updated after every optimizer.step"):
            fp8amp.update_scaling(target)
    plain = fp8amp.convert(nn.Sequential(nn.Linear(16, 16)), policy="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.update_scaling(plain)
        fp8amp.update_scaling(copy.deepcopy(model))  # a copy has no hooks


def test_functional_call_takes_the_masters_and_says_so_for_plain_weights():
    from torch.func import functional_call

    model = _model()
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    x = torch.randn(8, 16)
    assert torch.equal(functional_call(model, dict(model.named_parameters()), (x,)), model(x))
    plain = {name: p.detach().dequantize() if isinstance(p, fp8amp.ScaledTensor) else p.detach()
             for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"functional_call given a plain tensor.*named_parameters\(\)"):
        functional_call(model, plain, (x,))
