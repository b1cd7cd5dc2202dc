"""``unconvert``: the inverse of :func:`fp8amp.convert` / :func:`fp8amp.initialize` (docs/integrations.md#unconvert).

In place, every :class:`~fp8amp.Fp8Linear` becomes an ``nn.Linear`` again (an
:class:`~fp8amp.linear.Fp8Conv1D` the Hugging Face ``Conv1D`` it was): its weight a plain
parameter of the dtype the original Linear had (an O1/O2 FP16 master is dequantized: its real
values, rounded once into that dtype, and so is a gradient not yet stepped), its bias the same
parameter object, the hooks registered on the layer and its weight kept, its three scaling states
gone. The model's ``state_dict()`` then has exactly the keys and dtypes of the model as it was
built, so it loads with ``strict=True`` into a fresh one, and a Hugging Face model goes through
``save_pretrained`` / ``from_pretrained``.

With the optimizer too, the fp8amp optimizer that :func:`~fp8amp.initialize` built becomes a
plain ``torch.optim.Adam`` / ``AdamW`` over the new parameters, with the same param groups,
hyperparameters and hooks (step, state dict) and its moments as real values (O2's E4M3 m and
FP16 v dequantized); the fp8amp one is retired (its ``step`` and ``zero_grad`` raise: it holds
the old masters). Without it, a model whose masters were replaced warns that such an optimizer
would not train them, unless no optimizer can hold them (a copy of the model made without one).

What is lost: the delayed-scaling histories and scales of every layer, and the scales of the
moments. To resume FP8 training bit for bit, keep the converted model's and optimizer's own
state dicts; ``unconvert`` is for export, inference, and going back to plain torch.
"""

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from . import optim as fp8_optim
from .convert import report_holder
from .initialize import retire
from .linear import Fp8Conv1D, Fp8Linear
from .scaled_tensor import ScaledTensor
from .scaling_hooks import carry_hooks, hand_over_scaling, may_be_stepped
from .skipped_steps import unwatch_skipped_steps
from .user_hooks import carry_module_hooks, carry_tensor_attributes, carry_tensor_hooks

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = ()

__all__ = ["unconvert"]


def unconvert(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
) -> Union[nn.Module, tuple[nn.Module, Optional[torch.optim.Optimizer]]]:
    """Turns ``model``'s Fp8Linear layers back into ``nn.Linear`` (in place); returns ``model``,
    or ``(model, optimizer)`` when an optimizer is given.

    Args:
        model: a model that went through :func:`fp8amp.convert` or :func:`fp8amp.initialize`
            (one that never did is returned unchanged). Not under FSDP2's ``fully_shard``
            (gather a full state dict first): a sharded master is refused.
        optimizer: the optimizer ``initialize`` returned (an :class:`fp8amp.optim.Adam` /
            ``AdamW``) or any ``torch.optim`` optimizer over the model's parameters. An fp8amp
            optimizer is replaced by a plain ``torch.optim.Adam`` / ``AdamW`` whose states hold
            real values (float32 moments for float32 params, the param's dtype otherwise, as torch
            keeps them); another optimizer is returned as it is (``convert`` shares the parameter
            objects, so it still holds the model's parameters).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not a ``torch.optim.Optimizer``.
        ValueError: ``model`` is a ``DistributedDataParallel`` (pass its ``module``, then wrap the
            result again); ``optimizer`` holds O1/O2 master weights that are not ``model``'s, or holds
            masters and is not fp8amp's; a layer's weight is computed by a parametrization or a
            forward pre-hook (checked before the model is changed).
        NotImplementedError: a weight sharded by FSDP2 (a DTensor).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unconvert: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"unconvert: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    if ddp and any(isinstance(m, Fp8Linear) for m in model.modules()):
        # DDP broadcasts the buffers it listed when it wrapped the model (the scaling states, which
        # go) and reduces the gradients of the parameters it listed (the O1/O2 masters, replaced).
        raise ValueError("unconvert: model is a DistributedDataParallel, which holds the layers' scaling buffers and "
                         "master weights that unconvert removes; call model, optimizer = "
                         "fp8amp.unconvert(ddp.module, optimizer), then wrap the model in a new "
                         "DistributedDataParallel")
    _check_weights_are_parameters(model)  # before the model is changed
    if optimizer is not None:
        _check_optimizer_masters(model, optimizer)
    # (a copy, say an EMA's, that no optimizer steps has no one to warn about)
    stepped = optimizer is None and may_be_stepped(model)
    replaced: dict[int, torch.Tensor] = {}  # id(old weight) -> new plain parameter
    model = _unconvert_modules(model, replaced)
    report_holder(model).__dict__.pop("_fp8amp_conversion_report", None)
    unwatch_skipped_steps(model)
    if optimizer is None:
        if replaced and stepped:
            warnings.warn(
                f"unconvert: {len(replaced)} O1/O2 master weight(s) became plain parameters; an fp8amp optimizer "
                "built on the model (the one fp8amp.initialize returned) still holds the old masters and would "
                "train only the other parameters: pass it, model, optimizer = fp8amp.unconvert(model, optimizer), "
                "or build a new optimizer over model.parameters()", UserWarning, stacklevel=2)
        return model
    if isinstance(optimizer, fp8_optim.Adam):
        plain = _plain_optimizer(optimizer, replaced)
        carry_hooks(optimizer, plain)  # (dropped: an EMA or logging hook stopped without a word)
        hand_over_scaling(optimizer, plain)  # (other models it stepped keep their scaling updates)
        retire(optimizer, "unconvert", "torch.optim optimizer", "model, optimizer = fp8amp.unconvert(model, optimizer)")
        optimizer = plain
    return model, optimizer


def _check_weights_are_parameters(model: nn.Module) -> None:
    """Refuses a layer whose weight is not its registered parameter: a parametrization or a forward
    pre-hook computes it, and the nn.Linear made from the layer would keep neither them nor the
    parameter they read (it would hold their last weight, and nothing that trains). Also refuses
    an Fp8Linear that torch.compile wraps."""
    for name, module in model.named_modules():
        if isinstance(module, OptimizedModule) and isinstance(module._orig_mod, Fp8Linear):
            # Its forward is bound to the layer it compiled: an nn.Linear put in its place would never run.
            raise ValueError(f"unconvert: {name + '.' if name else ''}_orig_mod is an Fp8Linear that torch.compile "
                             "wraps, whose compiled forward would keep calling it; unconvert the layer itself, then "
                             "torch.compile the module unconvert returns")
        if isinstance(module, Fp8Linear) and module._parameters.get("weight") is None:
            raise ValueError(
                f"unconvert: layer {name or '(the model)'}'s weight is computed by a parametrization or a forward "
                "pre-hook (torch.nn.utils.parametrize, prune, weight_norm, spectral_norm), which the nn.Linear made "
                "from it would not keep; remove them first (parametrize.remove_parametrizations, prune.remove, "
                "remove_weight_norm, remove_spectral_norm), then apply them again to the nn.Linear")


def _check_optimizer_masters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer that would be left stepping O1/O2 masters outside the unconverted model:
    masters of another model (in a new plain optimizer they would stay ScaledTensors), or masters
    in an optimizer that is not fp8amp's (returned as it is, it would hold the replaced tensors)."""
    if (caller := optimizer.__dict__.get("_fp8amp_replaced_by")) is not None:
        raise ValueError(f"unconvert: fp8amp.{caller} already replaced this optimizer by the one it returned, which "
                         f"holds the model's weights: pass the optimizer {caller} returned")
    masters = {id(m.weight) for m in model.modules() if isinstance(m, Fp8Linear)}
    for k, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if not isinstance(p, ScaledTensor):
                continue
            if not masters:  # (one of several optimizers, after unconvert took another)
                raise ValueError(f"unconvert: param {i} of the optimizer's group {k} is an O1/O2 master weight, "
                                 "but model holds none (never converted, or made plain by an earlier unconvert, "
                                 "which converts one optimizer: build the others anew over the unconverted "
                                 "model's parameters; their states do not carry over)")
            if id(p) not in masters:
                raise ValueError(f"unconvert: param {i} of the optimizer's group {k} is an O1/O2 master weight "
                                 "that is not in model (the optimizer of another model, or of a model that holds "
                                 "this one): pass the optimizer of this model, or unconvert the whole model it "
                                 "trains, fp8amp.unconvert(whole_model, optimizer)")
            if not isinstance(optimizer, fp8_optim.Adam):
                raise ValueError(f"unconvert: the optimizer ({type(optimizer).__name__}) holds O1/O2 master weights "
                                 f"(param {i} of group {k}), which unconvert replaces; only fp8amp's Adam / AdamW "
                                 f"is converted with them: build a new optimizer over the unconverted model's "
                                 f"parameters instead")


def _unconvert_modules(model: nn.Module, replaced: dict[int, torch.Tensor]) -> nn.Module:
    linears: dict[int, nn.Module] = {}  # one module per Fp8Linear, however many names reach it
    if isinstance(model, Fp8Linear):
        return _to_linear(model, linears, replaced)
    for module in list(model.modules()):
        for child_name, child in list(module._modules.items()):
            if isinstance(child, Fp8Linear):
                setattr(module, child_name, _to_linear(child, linears, replaced))
    return model


def _to_linear(layer: Fp8Linear, linears: dict[int, nn.Module], replaced: dict[int, torch.Tensor]) -> nn.Module:
    """The nn.Linear (or, for an Fp8Conv1D, the Hugging Face Conv1D) the layer was made from."""
    if id(layer) in linears:
        return linears[id(layer)]
    if isinstance(layer, Fp8Conv1D):
        linear = layer.conv1d_type.__new__(layer.conv1d_type)
        nn.Module.__init__(linear)
        linear.nx, linear.nf = layer.in_features, layer.out_features
    else:
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = layer.in_features, layer.out_features
    linear.weight = _plain_weight(layer.weight, replaced)
    linear.bias = layer.bias
    linear.train(layer.training)
    carry_module_hooks(layer, linear)
    linears[id(layer)] = linear
    return linear


def _plain_weight(weight: nn.Parameter, replaced: dict[int, torch.Tensor]) -> nn.Parameter:
    """The weight itself when it is plain; an O1/O2 master as a new parameter of its real values in
    its logical dtype (the dtype of the Linear it was made from). A master shared by several
    layers gives one new parameter."""
    if isinstance(weight, DTensor):
        raise NotImplementedError(
            "unconvert: this weight is sharded by FSDP2 (a DTensor); gather the full state dict "
            "(torch.distributed.checkpoint.state_dict.get_model_state_dict(..., full_state_dict=True)) and "
            "load it into an unconverted model instead")
    if not isinstance(weight, ScaledTensor):
        return weight
    if id(weight) not in replaced:
        with torch.no_grad():
            plain = nn.Parameter(weight.dequantize(), requires_grad=weight.requires_grad)
            if (grad := weight.grad) is not None:  # a gradient not yet stepped (an FP8 one: its real values)
                plain.grad = (grad.dequantize() if hasattr(grad, "dequantize") else grad).to(plain.dtype)
        carry_tensor_hooks(weight, plain)
        carry_tensor_attributes(weight, plain)
        replaced[id(weight)] = plain
    return replaced[id(weight)]


def _plain_optimizer(optimizer: fp8_optim.Adam, replaced: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """A torch.optim.Adam / AdamW with the same groups and hyperparameters over the unconverted
    parameters, loaded from the fp8amp optimizer's state dict (which saves O2 moments with their
    scales, so torch's load reads real values)."""
    decoupled = isinstance(optimizer, fp8_optim.AdamW) or bool(optimizer.defaults["decoupled_weight_decay"])
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    hyper = ("lr", "betas", "eps", "weight_decay", "maximize", "foreach", "capturable", "fused")
    # Every key of a group but fp8amp's own: the user's (a name, a scale), an lr scheduler's
    # (initial_lr, max_lr...), torch's options. (A rounding key kept would be taken up again by a
    # later initialize of the plain optimizer, against its default.)
    own = ("state_dtypes", "master_rounding", "rounding_seed")
    groups = [{**{key: value for key, value in group.items() if key not in own},
               "params": [replaced.get(id(p), p) for p in group["params"]]} for group in optimizer.param_groups]
    plain = cls(groups, **{key: optimizer.defaults[key] for key in hyper})
    saved = optimizer.state_dict()
    saved["param_groups"] = [{**new, "params": old["params"]}
                             for new, old in zip(plain.state_dict()["param_groups"], saved["param_groups"])]
    plain.load_state_dict(saved)
    for group in plain.param_groups:
        for state in (plain.state[p] for p in group["params"] if p in plain.state):
            if isinstance(state.get("step"), torch.Tensor) and not (group["capturable"] or group["fused"]):
                # torch keeps a non-capturable step on the host (fp8amp's is on the param's device).
                state["step"] = state["step"].detach().to("cpu", torch.float32)
            for key in [k for k in state if k not in ("step", "exp_avg", "exp_avg_sq")]:
                del state[key]
    return plain
