"""fp8amp as Lightning precision plugins (docs/integrations.md#lightning): ``Fp8ampPrecision`` for the
Trainer, ``Fp8ampFabricPrecision`` for Fabric.

    trainer = lightning.Trainer(plugins=[Fp8ampPrecision("O2")])
    fabric = lightning.Fabric(plugins=[Fp8ampFabricPrecision("O2")])

The Trainer calls its plugin at two points of its set-up, and the plugin does
:func:`fp8amp.initialize`'s two halves there:

1. ``convert_module``, before the model is moved and wrapped (DDP): the model is converted in
   place, ``fp8amp.initialize(model, None, opt_level, **options)`` (Fp8Linear layers, O1/O2 FP16
   master weights); a model that holds Fp8Linear layers already (converted by the user, as under
   FSDP2, where ``configure_model`` shards it before this hook) is left as it is;
2. ``connect``, after ``configure_optimizers`` has built the optimizers over the converted model's
   parameters: each Adam/AdamW is rebuilt as fp8amp's (:func:`fp8amp.initialize_optimizer`, same
   param groups and hyperparameters), and each lr scheduler built on it is pointed at the new one;
   with ``fp8_allreduce``, the DDP module the strategy made gets fp8amp's FP8 gradient all-reduce
   as its comm hook.

Everything else is Lightning's own path: gradient clipping (norms of FP8 gradients come from their
codes), gradient accumulation (FP8 gradients add up in one fused pass), and checkpoints, which hold
the unconverted model's state dict (real-valued weights: Lightning loads it before the plugin
converts the module; the masters are made again from them, bit for bit) with every layer's
scaling state beside it, and fp8amp's optimizer state, so ``fit(ckpt_path=...)`` resumes bit for
bit. The forward runs under ``torch.autocast`` of ``autocast_dtype`` (bfloat16 by default;
``None``: no autocast).

Fabric gives a precision plugin the module at ``setup`` / ``setup_module`` but never the
optimizers, so ``Fp8ampFabricPrecision.convert_optimizer`` is the one explicit call: the model is
converted by ``fabric.setup_module``, the optimizer built on it goes through ``convert_optimizer``
and then ``fabric.setup_optimizers``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import optim as fp8_optim
from ..distributed import FP8CommState, fp8_allreduce_hook
from ..convert import check_options
from ..scaling_hooks import registered_optimizers, release_scaling, scales_after_step
from ..skipped_steps import training_step
from ..initialize import check_level, initialize, initialize_optimizer
from ..optim_calls import master_rounding
from ..linear import Fp8Linear
from ..scaled_tensor import ScaledTensor
from ..scaling import ScalingState, carry_in_metadata

__all__ = ["Fp8ampPrecision", "Fp8ampFabricPrecision"]

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16, None)
#: The keywords the plugins pass on to fp8amp.initialize, and to fp8amp.initialize_optimizer.
_INITIALIZE_OPTIONS = ("module_filter_fn", "recipe", "weight_grad", "policy", "tokens", "compiled")
_OPTIMIZER_OPTIONS = ("master_rounding",)
_PRECISION_NAMES = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed", None: "32-true"}
_CHECKPOINT_KEY = "fp8amp"


class _Fp8ampConversion:
    """What both plugins share: the arguments, the model's conversion and the forward's autocast."""

    def _configure(self, opt_level: str, autocast_dtype: Optional[torch.dtype], options: dict) -> None:
        where = type(self).__name__
        check_level(opt_level, options.get("weight_grad", "fp8"), where)
        if autocast_dtype not in _AUTOCAST_DTYPES:
            raise ValueError(f"{where}: autocast_dtype must be torch.bfloat16, torch.float16 or None; "
                             f"got {autocast_dtype!r}")
        unknown = sorted(set(options) - set(_INITIALIZE_OPTIONS) - set(_OPTIMIZER_OPTIONS))
        if unknown:
            raise TypeError(f"{where}: unknown keyword argument(s) {', '.join(unknown)}; accepted: opt_level, "
                            f"autocast_dtype, {', '.join(_INITIALIZE_OPTIONS + _OPTIMIZER_OPTIONS)}"
                            + (", fp8_allreduce" if isinstance(self, Precision) else ""))
        # The options' values are checked now, as initialize checks them, not when the Trainer
        # first converts the module.
        self._optimizer_options = {k: options.pop(k) for k in _OPTIMIZER_OPTIONS if options.get(k) is not None}
        master_rounding(self._optimizer_options, where)
        check_options(**{k: v for k, v in options.items() if k != "weight_grad"}, caller=where)
        self.opt_level = opt_level
        self.autocast_dtype = autocast_dtype
        self.precision = _PRECISION_NAMES[autocast_dtype]
        self._options = options
        self._module: Optional[nn.Module] = None  # the last one set up
        self._modules: weakref.WeakSet = weakref.WeakSet()  # all set up (Fabric: a GAN's two models)
        # {parameter before conversion: the O1/O2 master that replaced it}, for an optimizer built
        # before; weak, so that the replaced weights are freed with such optimizers
        self._replaced = WeakIdKeyDictionary()
        self._made: weakref.WeakSet = weakref.WeakSet()  # the fp8amp optimizers Fp8ampPrecision.connect made

    def __getstate__(self) -> dict:
        # Weak containers do not pickle (ddp_spawn pickles the Trainer): a copy knows the module it
        # was given last (converted already, so not again) and none of the optimizers.
        return {k: v for k, v in self.__dict__.items() if k not in ("_modules", "_replaced", "_made")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._modules = weakref.WeakSet([self._module] if self._module is not None else [])
        self._replaced, self._made = WeakIdKeyDictionary(), weakref.WeakSet()

    def convert_module(self, module: nn.Module) -> nn.Module:
        if module not in self._modules:  # (Lightning calls this again on every fit/validate/test)
            if not any(isinstance(m, Fp8Linear) for m in module.modules()):
                _check_callbacks(module, self.opt_level)
                before = dict(module.named_parameters(remove_duplicate=False))
                initialize(module, None, self.opt_level, **self._options)
                after = dict(module.named_parameters(remove_duplicate=False))
                self._replaced.update({p: after[name] for name, p in before.items() if after.get(name) is not p})
            self._modules.add(module)
        self._module = module
        return module

    def _fp8amp_optimizer(self, optimizer: torch.optim.Optimizer) -> fp8_optim.Adam:
        """fp8amp's Adam/AdamW at the plugin's level with ``optimizer``'s param groups (a parameter
        that conversion replaced by its master is taken as the master), updating the module's FP8
        scaling after each step (an fp8amp optimizer given is rebuilt too: that hook is its own)."""
        if self._module is None:
            raise RuntimeError(f"{type(self).__name__}: the optimizer came before the module was converted; "
                               "the module must be set up first")
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(p, p) for p in group["params"]]
        # The scaling to update is that of the modules set up whose parameters it holds, not the last one's.
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        modules = [m for m in self._modules if any(id(p) in held for p in m.parameters())]
        model = self._module if not modules else modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        return initialize_optimizer(model, optimizer, self.opt_level, caller=type(self).__name__,
                                    **self._optimizer_options)

    @contextlib.contextmanager
    def forward_context(self):
        if self.autocast_dtype is None or self._module is None:
            yield
            return
        device = next(self._module.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast_dtype):
            yield


class Fp8ampPrecision(_Fp8ampConversion, Precision):
    """A Lightning ``Precision`` plugin that trains the LightningModule with fp8amp.

    Args:
        opt_level: ``"O1"`` or ``"O2"`` (docs/o1_o2.md#optimization-levels).
        autocast_dtype: the autocast dtype of the forward (``torch.bfloat16``, ``torch.float16``)
            or ``None``. Float16 autocast wants a GradScaler, which this plugin does not add.
        fp8_allreduce: under the DDP strategy, average the gradients with FP8 on the wire
            (:func:`fp8amp.distributed.fp8_allreduce_hook`): ``True`` (an ``FP8CommState()``), an
            :class:`~fp8amp.distributed.FP8CommState` (its format, method and group), or ``False``.
            Ignored when the model is not wrapped in DDP (one process).
        **options: passed to :func:`fp8amp.initialize`: ``module_filter_fn``, ``recipe``,
            ``weight_grad``, ``policy``, ``tokens``, ``compiled``; and ``master_rounding`` to
            :func:`fp8amp.initialize_optimizer`.

    The optimizers ``configure_optimizers`` returns must be ``torch.optim.Adam`` / ``AdamW`` (or
    fp8amp's); another one is refused with a ``ValueError`` that names the accepted ones.
    """

    def __init__(self, opt_level: str = "O2", *, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
                 fp8_allreduce: Union[bool, FP8CommState] = False, **options: Any) -> None:
        self._configure(opt_level, autocast_dtype, options)
        if not isinstance(fp8_allreduce, (bool, FP8CommState)):
            raise TypeError(f"Fp8ampPrecision: fp8_allreduce must be True, False or an "
                            f"fp8amp.distributed.FP8CommState; got {type(fp8_allreduce).__name__}")
        self.fp8_allreduce = FP8CommState() if fp8_allreduce is True else fp8_allreduce or None

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple[nn.Module, list, list]:
        if self._module is None:
            raise RuntimeError("Fp8ampPrecision: connect before convert_module; the strategy must convert the "
                               "module first (Lightning's strategies do)")
        converted, made = [], False
        for optimizer in optimizers:
            # made here (validate/test after fit connect again, also once a later fit took the scaling over)
            if optimizer in self._made or _updates_scaling_of(optimizer, self._module):
                converted.append(optimizer)
                continue
            if not any(group["params"] for group in optimizer.param_groups):
                converted.append(optimizer)  # configure_optimizers returned None: Lightning's stand-in steps nothing
                continue
            new = self._fp8amp_optimizer(optimizer)
            for config in lr_schedulers:
                if config.scheduler.optimizer is optimizer:
                    _point_scheduler_at(config.scheduler, new)
            converted.append(new)
            self._made.add(new)
            made = True
        if made:
            # An earlier fit's optimizers (another Trainer's, or this one's before a refit) were registered
            # first: while anything held them, they kept the module's scaling from this fit's steps.
            for old in registered_optimizers(self._module):
                if not any(old is o for o in converted):
                    release_scaling(old)
        if self.fp8_allreduce is not None and isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(self.fp8_allreduce, fp8_allreduce_hook)
        return model, converted, lr_schedulers

    @contextlib.contextmanager
    def train_step_context(self):
        # The training step is the module's training forward for the skipped-step check
        # (fp8amp/skipped_steps.py): a training_step that calls its layers, not self(...), never runs
        # the module's forward pre-hook, and manual optimization's zero_grad comes after the forward.
        module = self._module
        with training_step(module) if module is not None else contextlib.nullcontext(), self.forward_context():
            yield

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Makes the checkpoint's ``state_dict`` that of the unconverted model (Fp8Linear already
        saves an O1/O2 master as its real values; the scaling buffers move out of its keys):
        Lightning loads it into the module before this plugin converts the module. The scaling
        state goes under ``checkpoint["fp8amp"]``, which :meth:`on_load_checkpoint` restores once
        it has, and into the state dict's metadata, from which a module that is converted already
        when Lightning loads takes it."""
        if self._module is None:
            return
        state = checkpoint["state_dict"]
        scaling = {key: state.pop(key) for key in _scaling_keys(self._module) if key in state}
        checkpoint[_CHECKPOINT_KEY] = {"opt_level": self.opt_level, "scaling": scaling}
        # ... and in the state dict's metadata, for a module that is converted when Lightning loads
        # (trained already, or converted in its __init__): its states take them from there.
        carry_in_metadata(state, scaling)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get(_CHECKPOINT_KEY)
        # (before the optimizers' states load) BaseFinetuning's on_fit_start puts back the param groups
        # of the run that saved the checkpoint, at that run's level, or none (a run without fp8amp); a
        # group given a level of its own keeps it
        saved_level = saved.get("opt_level") if saved is not None else None
        for optimizer in self._made:
            for group in optimizer.param_groups:
                if group.get("state_dtypes", saved_level) == saved_level:
                    group["state_dtypes"] = self.opt_level
        if saved is None or self._module is None:
            return
        buffers = dict(self._module.named_buffers())
        # (not in buffers: a layer that this run keeps in high precision, by its module_filter_fn or policy)
        restored = {key: value for key, value in saved["scaling"].items() if key in buffers}
        for key, value in restored.items():
            if value.shape != buffers[key].shape:
                raise ValueError(f"Fp8ampPrecision: the checkpoint's {key} has shape {tuple(value.shape)}, this "
                                 f"run's {tuple(buffers[key].shape)}: resume with the recipe the checkpoint was "
                                 "saved with (its history_len)")
        by_state: dict[str, dict] = {}  # (checked as a state dict's: copy_ would take a NaN scale)
        for key, value in restored.items():
            module, _, buffer = key.rpartition(".")
            by_state.setdefault(module, {})[buffer] = value
        for module, values in by_state.items():
            self._module.get_submodule(module).check_saved(values, module + ".")
        with torch.no_grad():
            for key, value in restored.items():
                buffers[key].copy_(value)


class Fp8ampFabricPrecision(_Fp8ampConversion, FabricPrecision):
    """fp8amp as a Lightning Fabric precision plugin::

        precision = Fp8ampFabricPrecision("O2")
        fabric = Fabric(plugins=[precision])
        model = fabric.setup_module(model)                     # converted in place
        optimizer = fabric.setup_optimizers(precision.convert_optimizer(torch.optim.AdamW(model.parameters())))

    A model and optimizer that :func:`fp8amp.initialize` converted before ``fabric.setup(model,
    optimizer)`` are taken as they are. ``fabric.save`` / ``fabric.load`` of the model and the
    optimizer save the converted state dicts (every layer's scaling state included) and resume bit
    for bit. Arguments as :class:`Fp8ampPrecision`'s, without ``fp8_allreduce``.
    """

    def __init__(self, opt_level: str = "O2", *, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
                 **options: Any) -> None:
        self._configure(opt_level, autocast_dtype, options)

    def convert_optimizer(self, optimizer: torch.optim.Optimizer) -> fp8_optim.Adam:
        """fp8amp's Adam/AdamW for ``optimizer`` (a ``torch.optim.Adam`` / ``AdamW`` over the
        converted model's parameters, or over the model's parameters before ``setup``), before
        ``fabric.setup_optimizers``. Build lr schedulers on the optimizer it returns.

        Raises:
            ValueError: another optimizer (the message names the accepted ones), or one that stepped.
            RuntimeError: called before ``fabric.setup`` / ``setup_module`` converted the model.
        """
        return self._fp8amp_optimizer(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # A torch optimizer over the converted model would not step its O1/O2 masters (or would step
        # the parameters they replaced); one over other modules' parameters is left alone.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not isinstance(optimizer, fp8_optim.Adam) and any(p in self._replaced or isinstance(p, ScaledTensor)
                                                              for p in params):
            raise RuntimeError(
                f"Fp8ampFabricPrecision: the optimizer is {type(optimizer).__module__}.{type(optimizer).__qualname__}, "
                "not fp8amp's: Fabric does not hand optimizers to precision plugins, so pass it through "
                "precision.convert_optimizer(optimizer) before fabric.setup_optimizers (after fabric.setup_module)")
        return optimizer.step(**kwargs)


# (Lightning 2.6 added WeightAveraging; fp8amp takes 2.5 too)
_WEIGHT_AVERAGING = getattr(lightning_callbacks, "WeightAveraging", ())


def _check_callbacks(module: nn.Module, opt_level: str) -> None:
    """Lightning runs the callbacks' ``setup`` before the plugin converts the module: ModelPruning
    collects the layers to prune there (it would prune the nn.Linear layers conversion replaces),
    and WeightAveraging copies the module, whose buffers it then pairs with the converted one's,
    among which are the FP8 scaling states."""
    trainer = getattr(module, "_trainer", None)
    callbacks = trainer.callbacks if trainer is not None else []
    problem = None
    if any(isinstance(c, ModelPruning) for c in callbacks):
        problem = ("ModelPruning collects the layers to prune before this plugin converts them, so it would prune "
                   "the nn.Linear layers that Fp8Linear layers replace")
    elif any(isinstance(c, _WEIGHT_AVERAGING) for c in callbacks) and next(module.buffers(), None) is not None:
        problem = ("WeightAveraging copies the module before this plugin converts it and pairs the copy's buffers "
                   "with the converted module's, which hold the FP8 scaling states besides its own")
    if problem:
        raise ValueError(f"Fp8ampPrecision: {problem}; convert the model in the LightningModule's __init__ "
                         f"(fp8amp.initialize(self, None, '{opt_level}')), which this plugin then takes as it is")


def _updates_scaling_of(optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
    """Whether ``optimizer`` is an fp8amp one whose step hooks already update ``module``'s scaling
    (what :func:`fp8amp.initialize_optimizer` returned for it)."""
    return isinstance(optimizer, fp8_optim.Adam) and scales_after_step(optimizer, module)


def _scaling_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of every ScalingState buffer in ``module``."""
    return [f"{name}.{buffer}" for name, sub in module.named_modules() if isinstance(sub, ScalingState)
            for buffer, value in sub._buffers.items() if value is not None and buffer not in sub._non_persistent_buffers_set]


def _point_scheduler_at(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Makes an lr scheduler built on the original optimizer drive ``optimizer``, which took the
    original's param group dicts (their ``lr`` and ``initial_lr`` included), and so are the
    schedulers it steps (a SequentialLR's or ChainedScheduler's: left on the original, they set the
    lr of an optimizer nothing steps). torch's schedulers also mark the optimizer's ``step`` so as to
    warn when the scheduler steps first; the new one gets the same mark."""
    original, scheduler.optimizer = scheduler.optimizer, optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        if inner.optimizer is original:
            _point_scheduler_at(inner, optimizer)
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):  # a second scheduler on the same optimizer
        return

    @functools.wraps(step)
    def marked_step(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    marked_step._wrapped_by_lr_sched = True
    optimizer.step = marked_step
