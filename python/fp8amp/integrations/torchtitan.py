"""fp8amp in torchtitan (0.3): FP8 compute for the Linears of a torchtitan model, from a config
function outside torchtitan's repository (docs/integrations.md#torchtitan).

torchtitan converts the *config tree* of a model before building it on the meta device, so
fp8amp's side is three pieces, and a fourth for the optimizer states:

- :class:`Fp8ampLinearConverter`, a ``ModelConfigConverter`` for ``model_registry(flavor,
  converters=[...])``: every ``Linear.Config`` whose shape the recipe takes (and whose FQN no entry
  of ``filter_fqns`` is part of) becomes an :class:`Fp8ampLinear` config, keeping its
  ``param_init`` and sharding fields;
- :class:`Fp8ampLinear`, an :class:`~fp8amp.Fp8Linear` that is also a torchtitan ``Module``
  (``verify_module_protocol`` accepts it; ``init_states`` initializes its weights with the
  config's ``param_init`` and its scaling states after ``to_empty``), optionally with its weight
  all-gathered in E4M3 under FSDP2 (:class:`~fp8amp.fsdp.Fp8AllGatherWeight`);
- :func:`with_scaling_updates`, which sets the model spec's ``post_optimizer_build_fn`` so that the
  delayed scaling of every model part is updated after each step of the optimizers container,
  its amaxes MAX-reduced over the ranks that see different data (torchtitan's ``loss`` mesh);
- :class:`Fp8ampOptimizersContainer` (optional), torchtitan's optimizers container with fp8amp's
  Adam / AdamW: O2's optimizer states (E4M3 and FP16 moments) for every parameter.

    def llama3_debugmodel_fp8amp() -> Trainer.Config:
        config = llama3_debugmodel()
        config.model_spec = with_scaling_updates(
            model_registry("debugmodel", converters=[Fp8ampLinearConverter.Config(recipe="tensorwise")]))
        config.optimizer = Fp8ampOptimizersContainer.config_from(config.optimizer, state_dtypes="O2")
        return config

O1/O2's FP16 master weights are not offered: they must replace the weights before ``fully_shard``,
and torchtitan shards on the meta device before it initializes the weights. Tensor parallelism is
refused (:func:`update_scaling_after_steps` raises).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module

from .. import optim as fp8_optim
from ..amax_sync import set_amax_reduction
from ..convert import register_scaling_hooks
from ..fsdp import enable_fp8_all_gather
from ..linear import Fp8Linear
from ..recipes import RECIPES, resolve_recipe
from ..scaling import ScalingState

__all__ = ["Fp8ampLinear", "Fp8ampLinearConverter", "Fp8ampOptimizersContainer", "Fp8ampScalingState",
           "update_scaling_after_steps", "with_scaling_updates"]

logger = logging.getLogger("fp8amp.convert")


class Fp8ampScalingState(ScalingState, Module):
    """A :class:`~fp8amp.ScalingState` that is a torchtitan ``Module``: the model's
    ``init_states`` (after ``to_empty``, which leaves buffers uninitialized) resets it."""

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        if buffer_device is not None:
            self.to(buffer_device)
        self.reset()


class Fp8ampLinear(Fp8Linear, Module):
    """torchtitan's ``Linear`` computing in FP8 (an :class:`~fp8amp.Fp8Linear`): the same
    parameters and parameter initialization, and the three scaling states' buffers beside them
    in the state dict."""

    scaling_state_type = Fp8ampScalingState

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = "tensorwise"
        """How the FP8 operands are scaled: one of fp8amp.recipes.RECIPES."""

        fp8_all_gather: bool = False
        """Whether FSDP2 all-gathers the weight in E4M3 (one scale per weight) instead of its dtype."""

    def __init__(self, config: Config):
        Fp8Linear.__init__(self, config.in_features, config.out_features, bias=config.bias, recipe=config.recipe)
        if config.fp8_all_gather:
            enable_fp8_all_gather(self)


def _init_fields(config, config_type: type) -> dict:
    """The values of ``config``'s constructor fields of ``config_type`` (one of its base classes):
    what a config of a subclass is made from."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config_type) if f.init}


class Fp8ampLinearConverter(QuantizationConverter):
    """Makes the ``Linear.Config`` entries of a torchtitan model config :class:`Fp8ampLinear`
    configs. Kept as they are, with the reason in the ``fp8amp.convert`` log (INFO): Linears whose
    FQN contains an entry of ``filter_fqns``, Linears whose shape the recipe cannot take (not
    multiples of 16; of 128 for blockwise, 32 for mxfp8), and subclasses of ``Linear`` (their own
    forward, e.g. ``ScaledBiasRowwiseLinear``, would be lost)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "tensorwise"
        """One of fp8amp.recipes.RECIPES: tensorwise (delayed scaling), rowwise, blockwise, mxfp8."""

        filter_fqns: list[str] = field(default_factory=list)
        """Linears whose fully qualified name contains one of these stay in high precision."""

        fp8_all_gather: bool = False
        """FSDP2 all-gathers the converted weights in E4M3 (tensorwise only)."""

    def __init__(self, config: Config):
        self.config = config
        if not isinstance(config.recipe, str):  # a config field: a name (configs are serialized)
            raise TypeError(f"Fp8ampLinearConverter: recipe must be a name, one of {', '.join(map(repr, RECIPES))}; "
                            f"got {type(config.recipe).__name__}")
        recipe = resolve_recipe(config.recipe, "Fp8ampLinearConverter")
        if not isinstance(config.filter_fqns, (list, tuple)) or not all(isinstance(f, str) for f in config.filter_fqns):
            raise TypeError(f"Fp8ampLinearConverter: filter_fqns must be a list of str, got {config.filter_fqns!r}")
        if not isinstance(config.fp8_all_gather, bool):
            raise TypeError(f"Fp8ampLinearConverter: fp8_all_gather must be a bool, got {config.fp8_all_gather!r}")
        if config.fp8_all_gather and recipe.tiled:
            raise ValueError(f"Fp8ampLinearConverter: fp8_all_gather is for recipe='tensorwise' (one scale per "
                             f"weight); got recipe={config.recipe!r}")
        self.recipe = recipe

    def _kept_because(self, fqn: str, linear: Linear.Config) -> Optional[str]:
        if type(linear) is not Linear.Config:
            return f"a {type(linear).__qualname__}, whose module has its own forward"
        if any(part in fqn for part in self.config.filter_fqns):
            return "named in filter_fqns"
        return self.recipe.unsupported_reason(linear.in_features, linear.out_features)

    def convert(self, model_config: Module.Config) -> Module.Config:
        converted, kept = 0, []
        for fqn, linear, parent, attr in list(model_config.traverse(Linear.Config)):
            why = self._kept_because(fqn, linear)
            if why is not None:
                kept.append(f"{fqn}: {why}")
                continue
            new = Fp8ampLinear.Config(**_init_fields(linear, Linear.Config), recipe=self.config.recipe,
                                      fp8_all_gather=self.config.fp8_all_gather)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted += 1
        logger.info("fp8amp torchtitan converter: %d Linear config(s) to Fp8ampLinear (recipe %s); kept: %s",
                    converted, self.config.recipe, "; ".join(kept) or "none")
        return model_config


def update_scaling_after_steps(optimizers: torch.optim.Optimizer, model_parts: list[nn.Module],
                               parallel_dims=None) -> None:
    """A ``post_optimizer_build_fn``: after each step of ``optimizers`` (torchtitan's optimizers
    container, or any optimizer) the delayed scaling of every part of ``model_parts`` is updated,
    with this step's amaxes MAX-reduced over ``parallel_dims``' ``loss`` mesh (the ranks that see
    different data: data parallel and context parallel), so every such rank holds the same scales;
    with none (one rank, or ``parallel_dims`` None and no process group) each rank keeps its own.

    Raises:
        NotImplementedError: tensor parallelism is enabled (Fp8Linear takes no DTensor inputs).
    """
    if parallel_dims is not None and parallel_dims.tp_enabled:
        raise NotImplementedError("fp8amp's torchtitan converter: tensor parallelism is not supported (Fp8Linear "
                                  "computes on local tensors); use data parallelism / FSDP2, context or pipeline "
                                  "parallelism, or leave the Linears out with filter_fqns")
    mesh = None if parallel_dims is None else parallel_dims.get_optional_mesh("loss")
    for part in model_parts:
        if parallel_dims is not None:
            if mesh is None:
                set_amax_reduction(part, enabled=False)
            else:
                set_amax_reduction(part, mesh.get_group())
        register_scaling_hooks(part, optimizers)


def with_scaling_updates(model_spec: ModelSpec) -> ModelSpec:
    """``model_spec`` with :func:`update_scaling_after_steps` run after its own
    ``post_optimizer_build_fn`` (if it has one)."""
    if not isinstance(model_spec, ModelSpec):
        raise TypeError(f"with_scaling_updates: model_spec must be a torchtitan ModelSpec, got "
                        f"{type(model_spec).__name__}")
    previous: Optional[Callable] = model_spec.post_optimizer_build_fn
    if getattr(previous, "updates_fp8amp_scaling", False):  # a second call would update twice a step
        return model_spec

    def post_optimizer_build(optimizers, model_parts, parallel_dims) -> None:
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)
        update_scaling_after_steps(optimizers, model_parts, parallel_dims)

    post_optimizer_build.updates_fp8amp_scaling = True
    return dataclasses.replace(model_spec, post_optimizer_build_fn=post_optimizer_build)


class Fp8ampOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container with fp8amp's Adam / AdamW for the parameter groups that
    name ``"Adam"`` or ``"AdamW"``, their states in ``state_dtypes``' formats (``"O2"``: E4M3
    ``exp_avg`` and FP16 ``exp_avg_sq``, each with its scale, a quarter and a half of float32's
    bytes); other optimizers (``"DistMuon"``) as torchtitan builds them. Its state dict is
    torchtitan's flat one, through fp8amp's optimizer state dict."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        state_dtypes: str = "O2"
        """fp8amp's moment formats: one of fp8amp.optim.STATE_DTYPES ("O1": float32, "O2")."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.state_dtypes not in fp8_optim.STATE_DTYPES:
            raise ValueError(f"Fp8ampOptimizersContainer: state_dtypes must be one of "
                             f"{', '.join(map(repr, fp8_optim.STATE_DTYPES))}; got {config.state_dtypes!r}")
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError("Fp8ampOptimizersContainer: implementation='fused_opt_states_bf16' makes bfloat16 "
                             "moments, which state_dtypes decides here; use 'fused' (or 'foreach', 'for-loop')")
        self._state_dtypes = config.state_dtypes
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:
        factory = {"Adam": fp8_optim.Adam, "AdamW": fp8_optim.AdamW}.get(name)
        if factory is None:
            return OptimizersContainer._resolve_optimizer_factory(name)
        return functools.partial(factory, state_dtypes=self._state_dtypes)

    @classmethod
    def config_from(cls, config: OptimizersContainer.Config, state_dtypes: str = "O2") -> "Fp8ampOptimizersContainer.Config":
        """This container's config with the fields of torchtitan's ``config`` (e.g.
        ``default_adamw(lr=...)``) and ``state_dtypes``."""
        if not isinstance(config, OptimizersContainer.Config):
            raise TypeError(f"Fp8ampOptimizersContainer.config_from: config must be an OptimizersContainer.Config, "
                            f"got {type(config).__name__}")
        return cls.Config(**_init_fields(config, OptimizersContainer.Config), state_dtypes=state_dtypes)
