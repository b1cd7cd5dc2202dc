"""``Fp8ampPrecision``: fp8amp as a Lightning precision plugin (docs/integrations.md#lightning).

    trainer = lightning.Trainer(plugins=[Fp8ampPrecision("O2")])

Lightning calls the plugin at two points of its set-up, and the plugin does
:func:`fp8amp.initialize`'s two halves there:

1. ``convert_module``, before the model is moved and wrapped (DDP): the model is converted in
   place, ``fp8amp.initialize(model, None, opt_level, **options)`` (Fp8Linear layers, O1/O2 FP16
   master weights);
2. ``connect``, after ``configure_optimizers`` has built the optimizers over the converted model's
   parameters: each Adam/AdamW is rebuilt as fp8amp's (:func:`fp8amp.initialize_optimizer`, same
   param groups and hyperparameters), and each lr scheduler built on it is pointed at the new one.

Everything else is Lightning's own path: gradient clipping (norms of FP8 gradients come from their
codes), gradient accumulation (FP8 gradients add up in one fused pass), and checkpoints, which hold
the unconverted model's state dict (real-valued weights: Lightning loads it before the plugin
converts the module; the masters are made again from them, bit for bit) with every layer's
scaling state beside it, and fp8amp's optimizer state, so ``fit(ckpt_path=...)`` resumes bit for
bit. The forward runs under
``torch.autocast`` of ``autocast_dtype`` (bfloat16 by default; ``None``: no autocast).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from ..initialize import OPT_LEVELS, initialize, initialize_optimizer
from ..scaling import ScalingState

__all__ = ["Fp8ampPrecision"]

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16, None)
_CHECKPOINT_KEY = "fp8amp"


class Fp8ampPrecision(Precision):
    """A Lightning ``Precision`` plugin that trains the LightningModule with fp8amp.

    Args:
        opt_level: ``"O1"`` or ``"O2"`` (docs/o1_o2.md#optimization-levels).
        autocast_dtype: the autocast dtype of the forward (``torch.bfloat16``, ``torch.float16``)
            or ``None``. Float16 autocast wants a GradScaler, which this plugin does not add.
        **options: passed to :func:`fp8amp.initialize`: ``module_filter_fn``, ``recipe``,
            ``weight_grad``, ``policy``, ``tokens``.

    The optimizers ``configure_optimizers`` returns must be ``torch.optim.Adam`` / ``AdamW`` (or
    fp8amp's); another one is refused with a ``ValueError`` that names the accepted ones.
    """

    def __init__(self, opt_level: str = "O2", *, autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
                 **options: Any) -> None:
        if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
            raise ValueError(f"Fp8ampPrecision: opt_level must be one of {', '.join(map(repr, OPT_LEVELS))}; "
                             f"got {opt_level!r}")
        if autocast_dtype not in _AUTOCAST_DTYPES:
            raise ValueError(f"Fp8ampPrecision: autocast_dtype must be torch.bfloat16, torch.float16 or None; "
                             f"got {autocast_dtype!r}")
        self.opt_level = opt_level
        self.autocast_dtype = autocast_dtype
        self.precision = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed", None: "32-true"}[autocast_dtype]
        self._options = options
        self._module: Optional[nn.Module] = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self._module is not module:  # Lightning calls this again on every fit/validate/test
            initialize(module, None, self.opt_level, **self._options)
            self._module = module
        return module

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple[nn.Module, list, list]:
        if self._module is None:
            raise RuntimeError("Fp8ampPrecision: connect before convert_module; the strategy must convert the "
                               "module first (Lightning's strategies do)")
        converted = []
        for optimizer in optimizers:
            new = initialize_optimizer(self._module, optimizer, self.opt_level, caller="Fp8ampPrecision")
            for config in lr_schedulers:
                if config.scheduler.optimizer is optimizer:
                    _point_scheduler_at(config.scheduler, new)
            converted.append(new)
        return model, converted, lr_schedulers

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Makes the checkpoint's ``state_dict`` that of the unconverted model (Fp8Linear already
        saves an O1/O2 master as its real values; the scaling buffers move out): Lightning loads it
        into the module before this plugin converts the module. The scaling state goes under
        ``checkpoint["fp8amp"]``, which :meth:`on_load_checkpoint` restores once it has."""
        if self._module is None:
            return
        state = checkpoint["state_dict"]
        scaling = {key: state.pop(key) for key in _scaling_keys(self._module) if key in state}
        checkpoint[_CHECKPOINT_KEY] = {"opt_level": self.opt_level, "scaling": scaling}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is None or self._module is None:
            return
        with torch.no_grad():
            for key, value in saved["scaling"].items():
                self._module.get_buffer(key).copy_(value)

    @contextlib.contextmanager
    def forward_context(self):
        if self.autocast_dtype is None or self._module is None:
            yield
            return
        device = next(self._module.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast_dtype):
            yield


def _scaling_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of every ScalingState buffer in ``module``."""
    return [f"{name}.{buffer}" for name, sub in module.named_modules() if isinstance(sub, ScalingState)
            for buffer, value in sub._buffers.items() if value is not None and buffer not in sub._non_persistent_buffers_set]


def _point_scheduler_at(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Makes an lr scheduler built on the original optimizer drive ``optimizer``, which took the
    original's param group dicts (their ``lr`` and ``initial_lr`` included). torch's schedulers
    also mark the optimizer's ``step`` so as to warn when the scheduler steps first; the new one
    gets the same mark."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):  # a second scheduler on the same optimizer
        return

    @functools.wraps(step)
    def marked_step(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    marked_step._wrapped_by_lr_sched = True
    optimizer.step = marked_step
