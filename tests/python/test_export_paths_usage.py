"""Taking a converted and trained model to other runtimes and formats, as users do (CPU): TorchScript
and the TorchScript-based ONNX exporter (refused, naming fp8amp.unconvert, whose model they take),
torch.export with its decompositions, save / load and Inductor, the whole model and optimizer saved
and resumed in a fresh process, state dicts loaded with weights_only and through safetensors, and
deep copies of a model and its optimizer trained apart."""

import copy
import io
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import fp8amp
from tiny_mlp import regression_batches, tiny_mlp


def trained(level):
    """The tiny MLP converted at ``level`` ("fp8": convert, else initialize) after three AdamW steps."""
    model = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level == "fp8":
        model = fp8amp.convert(model, policy="all", optimizer=opt)
    else:
        model, opt = fp8amp.initialize(model, opt, level, policy="all")
    train(model, opt, regression_batches(3))
    return model, opt


def train(model, opt, batches):
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


X = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_onnx_export_is_refused_naming_the_unconverted_model(level):
    model, _ = trained(level)
    with pytest.raises(NotImplementedError, match=r"torch.onnx.export cannot export .*"
                                                  r"torch.onnx.export\(fp8amp.unconvert\(copy.deepcopy\(model\)\)"):
        torch.onnx.export(model.eval(), (X,), io.BytesIO(), dynamo=False)  # named TorchScript and torch.export


@pytest.mark.parametrize("level", ["fp8", "O2"])
@pytest.mark.parametrize("how", ["trace", "script"])
def test_torchscript_names_unconvert_and_its_model_scripts(level, how):
    model, opt = trained(level)
    model.eval()
    to_script = (lambda m: torch.jit.trace(m, X)) if how == "trace" else torch.jit.script
    with pytest.raises(NotImplementedError, match=r"TorchScript .* not supported.*fp8amp.unconvert\(copy.deepcopy"):
        to_script(model)
    with warnings.catch_warnings():  # O2: that an fp8amp optimizer would not train the copy's new weights
        warnings.simplefilter("ignore", UserWarning)
        served = fp8amp.unconvert(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(to_script(served)(X), served(X))
        assert rel(served(X), model(X)) < 0.1
    reference, reference_opt = trained(level)
    reference.eval()
    with torch.no_grad():
        reference(X)  # the eval forward above, which updates the weights' amax histories
    model.train()
    reference.train()
    assert train(model, opt, regression_batches(6)[3:]) == train(reference, reference_opt, regression_batches(6)[3:])


def test_every_op_taking_tensors_registers_the_not_implemented_autograd_kernel():
    # The bindings list the ops again for the Autograd key: an op added without it would fall
    # back to torch's default (None gradients with a warning) without a word.
    for name in dir(torch.ops.fp8amp):
        packet = getattr(torch.ops.fp8amp, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            takes_tensors = any("Tensor" in str(a.type) for a in op._schema.arguments)
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd") == takes_tensors, op.name()


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_a_backward_through_an_exported_program_raises_instead_of_giving_no_gradients(level):
    # The exported program keeps the FP8 ops but not Fp8Linear's autograd Function: the backward
    # gave every weight a None gradient with only torch's warning, so the optimizer trained nothing.
    model, _ = trained(level)
    module = torch.export.export(model.eval(), (X,)).module()
    loss = module(X).square().sum()
    with pytest.raises(RuntimeError, match=r"derivative for fp8amp::\w+ is not implemented"):
        loss.backward()
    with torch.no_grad():  # the inference it is for still runs
        assert torch.equal(module(X), copy.deepcopy(model)(X))


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_export_decompositions_save_load_and_inductor_give_the_eager_output(level):
    model, _ = trained(level)
    model.eval()
    exported = torch.export.export(model, (X,))
    eager = copy.deepcopy(model)  # the exported module updates the buffers it shares with model
    with torch.no_grad():
        expected = eager(X)
        assert torch.equal(exported.module()(X), expected)
        buffer = io.BytesIO()
        torch.export.save(exported.run_decompositions(), buffer)
        buffer.seek(0)
        loaded = torch.export.load(buffer).module()
        assert torch.equal(loaded(X), eager(X))
        assert rel(torch.compile(loaded, backend="inductor")(X), eager(X)) < 1e-2


def test_whole_model_and_optimizer_resume_in_a_fresh_process_bit_for_bit(tmp_path):
    model, opt = trained("O2")
    torch.save((model, opt), tmp_path / "whole.pt")
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch
        from test_export_paths_usage import regression_batches, train
        model, opt = torch.load({str(tmp_path / "whole.pt")!r}, weights_only=False)
        print(repr(train(model, opt, regression_batches(6)[3:])))
        torch.save(model.state_dict(), {str(tmp_path / "after.pt")!r})
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    assert eval(out.strip().splitlines()[-1]) == train(model, opt, regression_batches(6)[3:])
    after = torch.load(tmp_path / "after.pt", weights_only=True)
    assert all(torch.equal(after[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_state_dicts_load_with_weights_only_and_through_safetensors(tmp_path, level):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, opt = trained(level)
    for name, obj in [("sd", model.state_dict()), ("vars", model.state_dict(keep_vars=True)),
                      ("params", dict(model.named_parameters()))]:
        torch.save(obj, tmp_path / f"{name}.pt")
        loaded = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert loaded.keys() == obj.keys()
        assert all(type(loaded[k]) is type(v) and torch.equal(loaded[k], v) for k, v in obj.items())
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh, fresh_opt = trained(level)
    fresh_opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    safetensors_torch.save_model(model, tmp_path / "model.safetensors")
    assert safetensors_torch.load_model(fresh, tmp_path / "model.safetensors") == (set(), [])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    batches = regression_batches(6)[3:]
    assert train(fresh, fresh_opt, batches) == train(model, opt, batches)


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_deep_copies_of_a_model_and_its_optimizer_train_apart(level):
    gen = torch.Generator().manual_seed(7)
    other = [(3 * torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)) for _ in range(4)]
    mine = regression_batches(7)[3:]
    expected_mine, expected_other = train(*trained(level), mine), train(*trained(level), other)
    model, opt = trained(level)
    copied, copied_opt = copy.deepcopy((model, opt))
    got_mine, got_other = [], []
    for a, b in zip(mine, other):  # interleaved: a shared buffer or hook would show
        got_mine += train(model, opt, [a])
        got_other += train(copied, copied_opt, [b])
    assert (got_mine, got_other) == (expected_mine, expected_other)
