"""Lightning (Trainer and Fabric) and Accelerate as users drive them with fp8amp, on the CPU (FP8
emulation): what a second Trainer, a refit, callbacks and checkpoints do to the module fp8amp
trains. Each test names what was wrong before its fix."""

import gc
import pickle
import warnings
import weakref

import pytest
import torch
from torch import nn

import fp8amp

L = pytest.importorskip("lightning")
from fp8amp.integrations.lightning import Fp8ampFabricPrecision, Fp8ampPrecision  # noqa: E402 (needs lightning)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]).float(), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2)), batch_size=10)


def trainer(epochs, **kwargs):
    return L.Trainer(max_epochs=epochs, plugins=[Fp8ampPrecision("O2")], accelerator="cpu", devices=1,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, **kwargs)


def test_a_second_trainer_on_a_trained_module_updates_its_scaling():
    """Stage 2 of a run (a new Trainer, say with another lr, fitting the module the first one
    trained): the first fit's fp8amp optimizer, alive while anything held the first Trainer, stayed
    first in line for the module's scaling, so the second fit's optimizer updated none of it and
    the scales stayed where the first fit left them."""
    module = Regression()
    first = trainer(epochs=1)
    first.fit(module, loader())  # 4 steps
    assert int(module.net[0].input_scaling.counter) == 4
    second = trainer(epochs=2)
    second.fit(module, loader())  # 8 more
    assert second.optimizers[0] is not first.optimizers[0]
    assert int(module.net[0].input_scaling.counter) == 12
    # the same Trainer fitting again (a new optimizer from configure_optimizers) takes it over too
    second.fit_loop.max_epochs = 3
    second.fit(module, loader())
    assert int(module.net[0].input_scaling.counter) == 16
    # the first Trainer still tests with the optimizer it made (it raised as a stepped optimizer)
    first.test(module, loader(), verbose=False)
    assert int(module.net[0].input_scaling.counter) == 16


def gan_batches(n):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 32, generator=gen) for _ in range(n)]


def test_fabric_with_two_models_updates_each_ones_scaling():
    """A GAN under one Fabric: both models set up, then each optimizer converted (the generator's
    built before setup, on its unconverted parameters). The plugin kept only the last module set up:
    the generator's optimizer was refused as holding replaced weights, and one built after setup
    was registered for the discriminator's scaling, so the generator's stayed at its first scales
    (with a warning that its parameters were not the model's)."""
    precision = Fp8ampFabricPrecision("O2", autocast_dtype=None)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    d = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    opt_g = torch.optim.AdamW(g.parameters(), lr=1e-2)  # built before setup
    g, d = fabric.setup_module(g), fabric.setup_module(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt_g = fabric.setup_optimizers(precision.convert_optimizer(opt_g))
        opt_d = fabric.setup_optimizers(precision.convert_optimizer(torch.optim.AdamW(d.parameters(), lr=1e-2)))
    assert g.module[0].weight in opt_g.param_groups[0]["params"]
    for z in gan_batches(4):
        loss_d = d(g(z).detach()).pow(2).mean()
        opt_d.zero_grad()
        fabric.backward(loss_d)
        opt_d.step()
        loss_g = d(g(z)).mean()
        opt_g.zero_grad()
        fabric.backward(loss_g)
        opt_g.step()
    for model in (g, d):
        for layer in (model.module[0], model.module[2]):
            assert int(layer.input_scaling.counter) == 4 and int(layer.grad_output_scaling.counter) == 4


@pytest.mark.parametrize("where", ["Trainer", "Fabric"])
def test_the_plugins_do_not_keep_the_replaced_weights_alive(where):
    """The plugins mapped each Linear weight that an O1/O2 master replaced to its master (for an
    optimizer built before setup) in a plain dict, which kept every original weight alive as long
    as the plugin (the Trainer): the model's Linear weights twice over in memory."""
    if where == "Trainer":
        module = Regression()
        original = weakref.ref(module.net[0].weight)
        fitted = trainer(epochs=1)
        fitted.fit(module, loader())
    else:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[Fp8ampFabricPrecision("O2")])
        model = nn.Sequential(nn.Linear(32, 64))
        original = weakref.ref(model[0].weight)
        model = fabric.setup_module(model)
    gc.collect()
    assert original() is None


def test_resume_with_a_layer_now_kept_in_high_precision(tmp_path):
    """A run resumed with a module_filter_fn that keeps a layer FP8 before in high precision (say the
    head, for fine-tuning): restoring the scaling state of that layer, which has none now, raised
    torch's "AttributeError: Linear has no attribute `input_scaling`". The other layers' scaling is
    restored; the head trains on from its saved weights."""
    first = trainer(epochs=1)
    first.fit(Regression(), loader())
    first.save_checkpoint(tmp_path / "all.ckpt")
    plugin = Fp8ampPrecision("O2", module_filter_fn=lambda module, name: name != "net.3")
    module = Regression()
    resumed = L.Trainer(max_epochs=2, plugins=[plugin], accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    resumed.fit(module, loader(), ckpt_path=tmp_path / "all.ckpt")
    assert type(module.net[3]) is nn.Linear and isinstance(module.net[0], fp8amp.Fp8Linear)
    assert int(module.net[0].input_scaling.counter) == 8  # 4 steps restored (a fresh state: 4)


def test_resume_with_another_history_length_says_so(tmp_path):
    """A checkpoint's amax histories copied into a run with another history_len raised torch's "The
    size of tensor a (32) must match the size of tensor b (16)", naming no state and no cause."""
    first = trainer(epochs=1)
    first.fit(Regression(), loader())
    first.save_checkpoint(tmp_path / "a.ckpt")
    plugin = Fp8ampPrecision("O2", recipe=fp8amp.ScalingRecipe(history_len=32))
    resumed = L.Trainer(max_epochs=2, plugins=[plugin], accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"Fp8ampPrecision: the checkpoint's net.0.input_scaling.amax_history has "
                                         r"shape \(1, 16\), this run's \(1, 32\): resume with the recipe"):
        resumed.fit(Regression(), loader(), ckpt_path=tmp_path / "a.ckpt")


@pytest.mark.parametrize("plugin", [Fp8ampPrecision, Fp8ampFabricPrecision])
def test_the_plugins_pickle_before_and_after_set_up(plugin):
    """ddp_spawn pickles the Trainer with its plugins; a copy of a plugin that converted a module
    takes that module as converted (not converted twice)."""
    fresh = pickle.loads(pickle.dumps(plugin("O1", autocast_dtype=None)))
    assert fresh.opt_level == "O1" and fresh.autocast_dtype is None
    precision = plugin("O2")
    model = nn.Sequential(nn.Linear(32, 64))
    precision.convert_module(model)
    master = model[0].weight
    model_copy, precision_copy = pickle.loads(pickle.dumps((model, precision)))
    assert precision_copy.convert_module(model_copy) is model_copy and precision_copy._module is model_copy
    assert type(model_copy[0].weight) is type(master)


def test_a_fit_without_optimizer():
    """configure_optimizers returning None, which Lightning runs with a stand-in that steps nothing
    (a warm-up of statistics, a check of the loop): the plugin refused it as a
    "lightning.pytorch.core.optimizer._MockOptimizer", not one of the accepted optimizers "(or None)"."""

    class NoOptimizer(Regression):
        def configure_optimizers(self):
            return None

    module = NoOptimizer()
    bias = module.net[0].bias.detach().clone()
    fitted = trainer(epochs=1)
    fitted.fit(module, loader())
    assert isinstance(module.net[0], fp8amp.Fp8Linear) and torch.equal(module.net[0].bias, bias)


def test_model_pruning_is_refused_naming_the_order_that_works():
    """ModelPruning collects the layers to prune in its setup, which Lightning runs before the
    plugin converts the module: it pruned the replaced nn.Linear layers, and the model trained
    dense (0 % zeros where the same fit without fp8amp has 50 % and more), without a word. Converted
    in the LightningModule's __init__, the layers it collects are the model's, and it prunes them."""
    from lightning.pytorch.callbacks import ModelPruning

    with pytest.raises(ValueError, match=r"Fp8ampPrecision: ModelPruning .*\(fp8amp.initialize\(self, None, 'O2'\)"):
        trainer(epochs=1, callbacks=[ModelPruning("l1_unstructured", amount=0.5)]).fit(Regression(), loader())

    class ConvertedInInit(Regression):
        def __init__(self):
            super().__init__()
            fp8amp.initialize(self, None, "O2")

    module, plain = ConvertedInInit(), Regression()
    trainer(epochs=1, callbacks=[ModelPruning("l1_unstructured", amount=0.5)]).fit(module, loader())
    L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False,
              callbacks=[ModelPruning("l1_unstructured", amount=0.5)]).fit(plain, loader())
    assert isinstance(module.net[0], fp8amp.Fp8Linear)
    for layer in (0, 3):
        pruned, plain_pruned = (float((m.net[layer].weight == 0).float().mean()) for m in (module, plain))
        assert plain_pruned > 0.3 and abs(pruned - plain_pruned) < 0.03, (layer, pruned, plain_pruned)


def test_weight_averaging_of_a_module_with_buffers_is_refused_naming_the_order_that_works():
    """WeightAveraging (EMA) copies the module in its setup, before the plugin converts it, then
    pairs the copy's parameters and buffers with the converted module's, whose buffers begin with
    FP8 scaling states: a module with buffers of its own (BatchNorm) failed in the first update
    with torch's "The size of tensor a (64) must match the size of tensor b (16)", and the end of
    training copies the copy's buffers over the scaling states (silently, where shapes broadcast).
    Converted in __init__, the copy is converted too and the buffers pair up."""
    EMAWeightAveraging = getattr(pytest.importorskip("lightning.pytorch.callbacks"), "EMAWeightAveraging", None)
    if EMAWeightAveraging is None:
        pytest.skip("this Lightning has no WeightAveraging (added in 2.6)")

    class Normed(Regression):
        def __init__(self):
            super().__init__()
            self.net[2] = nn.BatchNorm1d(64)

    with pytest.raises(ValueError, match=r"Fp8ampPrecision: WeightAveraging .*\(fp8amp.initialize\(self, None, 'O2'\)"):
        trainer(epochs=1, callbacks=[EMAWeightAveraging(decay=0.5)]).fit(Normed(), loader())

    class ConvertedInInit(Normed):
        def __init__(self):
            super().__init__()
            fp8amp.initialize(self, None, "O2")

    module = ConvertedInInit()
    trainer(epochs=1, callbacks=[EMAWeightAveraging(decay=0.5, use_buffers=False)]).fit(module, loader())
    assert int(module.net[0].input_scaling.counter) == 4 and int(module.net[2].num_batches_tracked) == 4
    module = Regression()  # no buffers of its own: averaged as it is
    trainer(epochs=1, callbacks=[EMAWeightAveraging(decay=0.5)]).fit(module, loader())
    assert int(module.net[0].input_scaling.counter) == 4
