"""The code of README.md and docs/{o1_o2,numerics,compile,hardening,integrations}.md as users copy
it, on tiny CPU models: each snippet runs and does what the text around it says. Tests that name
a fix say what was wrong before it."""

import copy
import io
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp


def mlp(seed=0, width=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 64), nn.GELU(), nn.Linear(64, width))


def batches(n, width=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, width, generator=g), torch.randn(16, width, generator=g)) for _ in range(n)]


def test_the_readme_loop_trains_at_o2_as_plain_torch_does():
    """README "Usage": initialize, a scheduler built after it, autocast, clip_grad_norm_(foreach=True)."""
    losses = {}
    for level in ("plain", "O2"):
        model = mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if level == "O2":
            model, optimizer = fp8amp.initialize(model, optimizer, opt_level="O2")
            assert isinstance(optimizer, fp8amp.optim.AdamW) and isinstance(model[0], fp8amp.Fp8Linear)
            assert isinstance(model[0].weight, fp8amp.ScaledTensor)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
        losses[level] = []
        for x, y in batches(20):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses[level].append(loss.item())
    plain, o2 = torch.tensor(losses["plain"]), torch.tensor(losses["O2"])
    assert o2[-1] < o2[0]
    assert ((o2 - plain).abs() / plain).max() < 0.1


def test_the_readme_convert_bullets():
    """Non-multiples of 16 and float64 stay nn.Linear, said in conversion_report; a blockwise /
    mxfp8 layer off its multiple stays too; update_scaling by hand beside the hooks warns."""
    model = nn.Sequential(nn.Linear(24, 32), nn.Linear(32, 32).double(), nn.Linear(32, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    fp8amp.convert(model, module_filter_fn=lambda mod, fqn: True, recipe="tensorwise", optimizer=optimizer)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, fp8amp.Fp8Linear]
    report = str(fp8amp.conversion_report(model))
    assert "not multiples of 16" in report and "float64" in report
    model[2](torch.randn(2, 3, 32)).sum().backward()  # any leading batch dimensions
    optimizer.step()
    with pytest.warns(UserWarning, match="already updated after every optimizer.step"):
        fp8amp.update_scaling(model)
    for recipe, width, multiple in (("blockwise", 64, "128"), ("mxfp8", 48, "32")):
        model = fp8amp.convert(nn.Sequential(nn.Linear(width, width)), recipe=recipe)
        assert type(model[0]) is nn.Linear
        assert f"not multiples of {multiple}" in str(fp8amp.conversion_report(model))


def test_initialize_refuses_what_o1_o2_md_says_it_refuses():
    model = mlp()
    with pytest.raises(ValueError, match="torch.optim.Adam, torch.optim.AdamW.*SGD"):
        fp8amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    with pytest.raises(ValueError, match="opt_level.*'O3'.*fully_shard"):
        fp8amp.initialize(mlp(), None, "O3")
    with pytest.raises(ValueError, match="master_rounding.*optimizer is None"):
        fp8amp.initialize(mlp(), None, "O2", master_rounding="stochastic")


def test_the_scaling_reset_snippet_of_numerics_md_restarts_the_warm_up():
    model = fp8amp.initialize(mlp(), None, "O2")[0]
    for x, _ in batches(2):
        model(x).sum().backward()
        fp8amp.update_scaling(model)
    states = [m for m in model.modules() if isinstance(m, fp8amp.ScalingState)]
    assert len(states) == 6 and any(int(s.counter) > 0 for s in states)
    for m in model.modules():
        if isinstance(m, fp8amp.ScalingState):
            m.reset()
    assert all(int(s.counter) == 0 and not s.amax_history.any() for s in states)


def test_checkpoints_load_across_converted_and_plain_models_as_o1_o2_md_says():
    plain = mlp()
    model = copy.deepcopy(plain)
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    state = model.state_dict()
    result = mlp().load_state_dict(state, strict=False)
    assert not result.missing_keys and all("_scaling." in k for k in result.unexpected_keys)
    converted = fp8amp.initialize(mlp(seed=5), None, "O2")[0]
    with pytest.raises(RuntimeError, match="Missing key"):
        converted.load_state_dict(plain.state_dict())
    with fp8amp.fresh_scaling_if_missing():
        converted.load_state_dict(plain.state_dict())
    torch.testing.assert_close(converted[0].weight.float(), plain[0].weight, rtol=2**-11, atol=0)


def small_update_run(rounding, steps=12, resume_at=None):
    """numerics.md's case: weights near 1 fine-tuned at lr 2e-5, which round-to-nearest freezes."""
    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 64, bias=False))
        with torch.no_grad():
            net[0].weight.normal_(1.0, 0.01)
        options = {} if rounding is None else {"master_rounding": rounding}
        return fp8amp.initialize(net, torch.optim.AdamW(net.parameters(), lr=2e-5, weight_decay=0.0), "O2",
                                 **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net, opt = build()
    start = net[0].weight.detach().float().clone()
    for i, (x, _) in enumerate(batches(steps, width=64)):
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i == resume_at:
            buffer = io.BytesIO()
            torch.save((net.state_dict(), opt.state_dict()), buffer)
            buffer.seek(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                net, opt = build()
            net_state, opt_state = torch.load(buffer, weights_only=False)
            net.load_state_dict(net_state)
            opt.load_state_dict(opt_state)
    return net[0].weight.detach().float(), start, [str(w.message) for w in caught], opt


def test_stochastic_rounding_keeps_small_updates_and_repeats_as_numerics_md_says():
    nearest, start, warned, _ = small_update_run(None)
    assert torch.equal(nearest, start)  # frozen: every update below half an FP16 unit
    assert any("master_rounding='stochastic'" in w for w in warned)
    stochastic, start, warned, opt = small_update_run("stochastic")
    assert (stochastic != start).float().mean() > 0.1 and not any("cannot change" in w for w in warned)
    saved = opt.state_dict()["param_groups"][0]
    # initialize seeds a torch optimizer's group from its first param's name (numerics.md)
    assert (saved["master_rounding"], saved["rounding_seed"]) == ("stochastic", zlib.crc32(b"0.weight"))
    assert torch.equal(small_update_run("stochastic")[0], stochastic)  # a run repeats bit for bit
    assert torch.equal(small_update_run("stochastic", resume_at=5)[0], stochastic)  # and a resumed one
    with pytest.raises(ValueError, match="master_rounding must be one of 'nearest', 'stochastic'; got 'Stochastic'"):
        fp8amp.optim.AdamW(nn.Linear(16, 16).parameters(), master_rounding="Stochastic")


def test_the_lightning_plugins_take_master_rounding():
    lightning_plugins = pytest.importorskip("fp8amp.integrations.lightning")
    for plugin in (lightning_plugins.Fp8ampPrecision, lightning_plugins.Fp8ampFabricPrecision):
        with pytest.raises(ValueError, match=f"{plugin.__name__}: master_rounding must be one of"):
            plugin("O2", master_rounding="up")
    precision = lightning_plugins.Fp8ampFabricPrecision("O2", master_rounding="stochastic")
    model = precision.convert_module(mlp())
    optimizer = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    assert isinstance(optimizer, fp8amp.optim.AdamW) and optimizer.param_groups[0]["master_rounding"] == "stochastic"


def test_the_ema_snippet_of_hardening_md_does_not_warn_about_an_optimizer():
    """`ema = fp8amp.unconvert(copy.deepcopy(model))` warned that "an fp8amp optimizer built on the
    model still holds the old masters": no optimizer holds the copy's masters (the one initialize
    returned holds the model's), so the warning sent the user after a problem they did not have."""
    model = mlp()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ema = fp8amp.unconvert(copy.deepcopy(model))
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - 0.999)
    assert type(ema[0]) is nn.Linear and ema[0].weight.dtype == torch.float32
    # the model the optimizer steps still warns, as does one converted without an optimizer yet
    with pytest.warns(UserWarning, match="still holds the old masters"):
        fp8amp.unconvert(model)
    with pytest.warns(UserWarning, match="still holds the old masters"):
        fp8amp.unconvert(fp8amp.initialize(mlp(), None, "O2")[0])


def test_unconvert_gives_a_plain_optimizer_without_fp8amp_rounding_keys():
    """unconvert's torch AdamW kept master_rounding / rounding_seed in its param groups (it dropped
    only state_dtypes), so a later initialize of it with no master_rounding rounded those groups
    stochastically while its defaults said "nearest", contrary to "nearest: what a torch optimizer
    passed in gets by default"."""
    model = mlp()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2",
                                         master_rounding="stochastic")
    model, plain = fp8amp.unconvert(model, optimizer)
    assert type(plain) is torch.optim.AdamW
    assert not {"state_dtypes", "master_rounding", "rounding_seed"} & set(plain.param_groups[0])
    model, again = fp8amp.initialize(model, plain, "O2")
    assert [g["master_rounding"] for g in again.param_groups] == [again.defaults["master_rounding"]] == ["nearest"]


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_initialize_optimizer_does_not_offer_none(optimizer):
    """initialize_optimizer(model, optimizer, opt_level), "the optimizer half of initialize", refused
    None and SGD with initialize's message, which lists "(or None)" among what it accepts."""
    model = fp8amp.initialize(mlp(), None, "O2")[0]
    if optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"initialize_optimizer: optimizer must be one of torch.optim.Adam, "
                                         r"torch.optim.AdamW, fp8amp.optim.Adam, fp8amp.optim.AdamW; got") as error:
        fp8amp.initialize_optimizer(model, optimizer, "O2")
    assert "None)" not in str(error.value)
    with pytest.raises(ValueError, match=r"fp8amp.optim.AdamW \(or None\); got torch.optim.sgd.SGD"):
        fp8amp.initialize(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), "O2")
