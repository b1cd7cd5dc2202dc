"""``Fp8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in FP8 (docs/architecture.md#fp8linear-dataflow).

Forward: the input is cast to E4M3 with delayed scaling and, in the same pass, transposed (the
transpose is what the weight-gradient GEMM needs, and it is all that is saved for backward:
1 byte per element); the weight is cast to E4M3 with current scaling, also with its transpose;
``y = x·Wᵀ (+ bias)`` runs on the FP8 tensor cores with FP32 accumulation, output in the autocast
dtype. Backward: the output gradient is cast to E5M2 (delayed) with its transpose in one pass,
which also sums its columns into the bias gradient (float32); ``dX = dY·W`` and ``dW = dYᵀ·X``
run in FP8 with full FP32 accumulation, dW output in the autocast dtype too.

At O1/O2 (:func:`fp8amp.initialize`) the weight parameter is a :class:`~fp8amp.MasterWeight`
(FP16 codes + scale) carrying an E4M3 copy of itself that the fp8amp optimizer rewrites in its fused step and
every other write re-casts: the forward GEMM reads it (no per-forward cast, in eager mode and in
compiled graphs alike), the backward casts its transpose from the master's codes (bit-identical),
and the weight gradient is an E4M3 ``ScaledTensor`` with a current scale, accumulated across
micro-batches by
:func:`fp8amp.ops.scaled_accumulate` (one fused dequantize-add-requantize).

cuBLASLt's FP8 GEMMs take only K-major operands whose inner dimensions are multiples of 16:
in_features and out_features must be (``convert`` leaves other Linears alone), and the token
count is padded with zero rows to a multiple of 16 when needed (zero rows change no gradient).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from . import cast_recorder
from ._inductor_config import apply_inductor_config
from .ops import bias_dtype, fast
from .formats import E4M3, E5M2
from .linear_common import (NO_FUNCTORCH, first_order_backward, fp8_weight_grad, functorch_active, no_torchscript,
                            output_dtype, pad_rows, refuse_unsupported_input, saved_tensors_mutable, unpadded_output)
from .master_weight import MasterWeight
from .scaled_tensor import ScaledTensor
from .recipes import Recipe, resolve_recipe
from .scaling import ScalingRecipe, ScalingState
from .tiled_linear import TiledLinearFunction
from .block_scaled_tensor import BlockScaledTensor
from .user_hooks import carry_module_hooks

__all__ = ["Fp8Linear", "Fp8Conv1D", "MasterPolicy", "fp8_linear_supported", "is_hf_conv1d",
           "weight_not_parameter_reason"]

_ALIGN = 16
#: Told of each layer that Fp8Linear's constructor builds (fp8amp.scaling_hooks watches it: no optimizer is
#: registered for its scaling); from_linear's caller, convert, registers or watches the whole model.
on_built: list = []


def fp8_linear_supported(in_features: int, out_features: int) -> bool:
    """Whether cuBLASLt's FP8 GEMMs can take a Linear of this shape."""
    return in_features % _ALIGN == 0 and out_features % _ALIGN == 0 and in_features > 0 and out_features > 0


#: What ``recipe=`` takes: a name of :data:`fp8amp.recipes.RECIPES`, a Recipe, a ScalingRecipe (tensorwise), None.
RecipeArg = Union[None, str, Recipe, ScalingRecipe]


def weight_not_parameter_reason(linear: nn.Module) -> Optional[str]:
    """Why a Linear (or Conv1D) whose ``weight`` is not its registered parameter cannot become an
    Fp8Linear (None: it can). torch.nn.utils.prune, weight_norm and spectral_norm move the
    parameter aside and recompute ``weight`` in a forward pre-hook, which the Fp8Linear would not
    keep: it would hold their last weight, and no parameter that trains."""
    if linear._parameters.get("weight") is not None:
        return None
    return ("its weight is not a parameter of the layer (a forward pre-hook computes it from other parameters: "
            "torch.nn.utils.prune, weight_norm, spectral_norm), and an Fp8Linear would not keep the hook; apply "
            "them after convert / initialize instead")


def _recipe_for(caller: str, recipe: RecipeArg, in_features: int, out_features: int, dtype: torch.dtype) -> Recipe:
    """The resolved recipe, if it can take a Linear of this shape and weight dtype (else ValueError
    saying why)."""
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{caller}: {name} must be an int, got {type(value).__name__}")
    recipe = resolve_recipe(recipe, caller)
    why = recipe.unsupported_reason(in_features, out_features, dtype)
    if why is not None:
        raise ValueError(f"{caller}: in_features ({in_features}) and out_features ({out_features}) of dtype {dtype}: "
                         f"{why}; keep this layer as nn.Linear")
    return recipe


def _fp8_weight(weight: torch.Tensor, weight_scaling: ScalingState, record: bool):
    """(w_fp8, w_fp8_t, scale_inv, transpose_from) for the forward GEMM. A master with an E4M3
    copy (O1/O2) gives the copy itself, w_fp8_t None and what the backward makes the transpose
    from (see _transposed_copy); an E4M3 weight (FSDP2's FP8 all-gather, fp8amp.fsdp) gives its
    codes and their transpose; otherwise both layouts come from one current-scaling cast, whose
    amax goes into the weight's history only with ``record`` (a training forward)."""
    if isinstance(weight, ScaledTensor):
        operands = weight.fp8_operands()
        if operands is not None:
            return operands
        weight = weight.dequantize(torch.float32)  # exact; a 16-bit logical dtype would round before the E4M3 cast
    return (*weight_scaling.cast_transpose_current(weight, record=record), None)


def _transposed_copy(codes: torch.Tensor, master_scale_inv: torch.Tensor, copy_scale: torch.Tensor) -> torch.Tensor:
    """The transpose of a master's E4M3 copy, cast again from the master's FP16 codes in one launch
    that writes only the transpose (2 bytes read, 1 written per element; a transposing copy of the
    1-byte codes runs at a fraction of the bandwidth). Bit-identical to the copy: it holds
    quantize((code * master_scale_inv) * copy_scale) and both scales are powers of two, so
    quantize(code * (master_scale_inv * copy_scale)) rounds the same exact product, which the op
    makes in float32 in the kernel (no scale-product launch, no amax scratch)."""
    return fast.cast_transpose_rescaled(codes, master_scale_inv, copy_scale, E4M3)


@dataclass(frozen=True)
class MasterPolicy:
    """The terms on which :func:`fp8amp.initialize` (O1/O2) made an Fp8Linear's weight a
    :class:`~fp8amp.MasterWeight`, held by the layer.

    Attributes:
        fp8_weight_grad: the weight gradient is an E4M3 ScaledTensor (True), or a float32 tensor
            (False: the higher-precision accumulator across micro-batches, 4 bytes per element).
        optimizer_built: initialize also built the optimizer over the masters (FSDP2's
            ``fully_shard`` would then replace the masters that optimizer holds: refused).
    """

    fp8_weight_grad: bool = True
    optimizer_built: bool = False


_WEIGHT_WRITTEN = (
    "Fp8Linear: the layer's O1/O2 master weight was modified in place (an optimizer step, a write under "
    "torch.no_grad()) after the forward and before this backward, which reads it (nn.Linear's backward raises "
    "torch's \"modified by an inplace operation\" here). Step the optimizer after loss.backward() of every loss "
    "computed through the layer (in a GAN, compute the loss through D after D's step), or run the forward again")


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        input_scaling: ScalingState,
        weight_scaling: ScalingState,
        grad_output_scaling: ScalingState,
        fp8_weight_grad: bool,
        record_amax: bool,
    ) -> torch.Tensor:
        out_dtype = output_dtype(x)
        # Host time: no reshape / pad / slice ops where the input is 2-D with aligned rows.
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        padded = rows % _ALIGN != 0
        x_fp8, x_fp8_t, x_scale_inv = input_scaling.cast_transpose(pad_rows(x2d, _ALIGN) if padded else x2d,
                                                                   record=record_amax)
        w_fp8, w_fp8_t, w_scale_inv, transpose_from = _fp8_weight(weight, weight_scaling, record_amax)
        bias_cast = None if bias is None else bias.to(bias_dtype(out_dtype)).contiguous()
        # The GEMMs' operands come from fp8amp's casts (contiguous, FP8, [1] scales) and their
        # dtypes passed the casts' checks: the op is called unchecked (host time of every step).
        y = fast.gemm(x_fp8, w_fp8, x_scale_inv, w_scale_inv, out_dtype, bias_cast, True)
        if cast_recorder.recording():
            cast_recorder.record(input_scaling, "input", x2d, x_fp8[:rows], x_scale_inv)
            w_real = weight.dequantize(torch.float32) if isinstance(weight, ScaledTensor) else weight
            cast_recorder.record(input_scaling, "weight", w_real, w_fp8, w_scale_inv)
        # With the optimizer's copy, the transpose is made in backward: nothing more is kept; but
        # where torch lets a write to the master come first (it re-casts the copy and its scale in
        # place), the backward needs this forward's.
        if transpose_from is not None and saved_tensors_mutable():
            w_fp8_t, w_scale_inv, transpose_from = _transposed_copy(*transpose_from), w_scale_inv.clone(), None
        # The backward reads the master as it is then: a write in between is refused, as torch
        # refuses one to a tensor it saved. Dynamo cannot read a version counter, so a compiled
        # forward saves the master's tensors, whose counters the compiled graph checks (the fused
        # optimizer step bumps them); eager, the layer compares the master's own counter, which
        # gives the clearer message. A master made under inference_mode has no counter (and torch
        # refuses writes to it outside).
        compiling = torch.compiler.is_compiling()
        saved_master = transpose_from if transpose_from is not None and compiling else ()
        ctx.save_for_backward(x_fp8_t, x_scale_inv, w_fp8_t, w_scale_inv, *saved_master)
        ctx.w_transpose_from = None if saved_master else transpose_from
        eager_master = transpose_from is not None and not compiling and not weight.is_inference()
        ctx.weight_version = (weight, weight._version) if eager_master else None
        # FP8 weight gradients are for O1/O2's masters only (not FSDP2's gathered E4M3 weight).
        ctx.fp8_weight_grad = isinstance(weight, MasterWeight) and fp8_weight_grad
        ctx.grad_output_scaling, ctx.record_amax = grad_output_scaling, record_amax
        ctx.rows = rows
        ctx.input_dtype = x.dtype
        ctx.output_dtype = out_dtype
        ctx.weight_dtype = weight.dtype
        ctx.has_bias = bias is not None
        return unpadded_output(y, x)

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_output: torch.Tensor):
        x_fp8_t, x_scale_inv, w_fp8_t, w_scale_inv, *saved_master = ctx.saved_tensors
        transpose_from = saved_master or ctx.w_transpose_from
        if transpose_from is not None and ctx.needs_input_grad[0]:  # only dX reads the weight
            if ctx.weight_version is not None and ctx.weight_version[0]._version != ctx.weight_version[1]:
                raise RuntimeError(_WEIGHT_WRITTEN)
            w_fp8_t = _transposed_copy(*transpose_from)
        two_d = grad_output.dim() == 2
        dy2d = grad_output if two_d else grad_output.reshape(-1, grad_output.shape[-1])
        padded = ctx.rows % _ALIGN != 0
        dy_in = pad_rows(dy2d, _ALIGN) if padded else dy2d
        grad_x = grad_weight = grad_bias = None
        record = ctx.record_amax  # as its forward did: an eval() forward's input gradient records nothing
        if ctx.has_bias and ctx.needs_input_grad[2]:  # the bias gradient from the same pass over dY
            dy_fp8, dy_fp8_t, dy_scale_inv, dbias = ctx.grad_output_scaling.cast_transpose_dbias(dy_in, record=record)
            grad_bias = dbias.to(ctx.weight_dtype)
        else:
            dy_fp8, dy_fp8_t, dy_scale_inv = ctx.grad_output_scaling.cast_transpose(dy_in, record=record)
        recording = cast_recorder.recording()
        if recording:
            cast_recorder.record(ctx.grad_output_scaling, "grad_output", dy2d, dy_fp8[: ctx.rows], dy_scale_inv)
        if ctx.needs_input_grad[0]:
            grad_x = fast.gemm(dy_fp8, w_fp8_t, dy_scale_inv, w_scale_inv, ctx.input_dtype, None, False)
            if padded:
                grad_x = grad_x[: ctx.rows]
            if not two_d:
                grad_x = grad_x.view(*grad_output.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[1] and ctx.fp8_weight_grad:
            # In the autocast dtype, as the forward's output (docs/numerics.md#numerics; MS-AMP does the same): under
            # bf16 autocast half the bytes of float32 for the GEMM to write and for the current
            # scaling to read twice, before the E4M3 rounding (2^-4) that dwarfs bf16's (2^-9).
            grad_weight = fast.gemm(dy_fp8_t, x_fp8_t, dy_scale_inv, x_scale_inv, ctx.output_dtype, None, False)
            real, grad_weight = grad_weight, fp8_weight_grad(grad_weight, ctx.weight_dtype)
            if recording:
                cast_recorder.record(ctx.grad_output_scaling, "weight_grad", real, grad_weight.codes, grad_weight.scale_inv)
        elif ctx.needs_input_grad[1]:
            grad_weight = fast.gemm(dy_fp8_t, x_fp8_t, dy_scale_inv, x_scale_inv, ctx.weight_dtype, None, False)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _reshaped_weight(out_in: torch.Tensor) -> str:
    """The message for a weight whose shape FP8 cannot take: the layer was made for one it could
    (Fp8Linear refuses others), so its weight changed shape since, as Hugging Face's
    resize_token_embeddings changes an output head tied to the embeddings."""
    out_features, in_features = out_in.shape
    return (f"Fp8Linear: the weight now has out_features {out_features} and in_features {in_features}; FP8 GEMMs "
            f"need multiples of {_ALIGN}. It changed shape after fp8amp converted the layer (e.g. "
            "resize_token_embeddings of an output head tied to the embeddings): resize to a multiple of "
            f"{_ALIGN} (resize_token_embeddings(n, pad_to_multiple_of={_ALIGN})), or before fp8amp.convert / "
            "initialize (which keep such a layer an nn.Linear), or call fp8amp.unconvert(model) first")


class Fp8Linear(nn.Linear):
    """``nn.Linear`` computing in FP8, with the same parameters and state-dict keys.

    Extra state, in buffers (so checkpoints resume the scaling warm-up where it was):
    ``input_scaling`` (E4M3, delayed), ``grad_output_scaling`` (E5M2, delayed) and
    ``weight_scaling`` (E4M3, current scaling from the weight's own amax). Call
    :func:`fp8amp.update_scaling` (or let the optimizer hook of :func:`fp8amp.convert` do it)
    after each optimizer step.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe: RecipeArg = None,
    ) -> None:
        recipe = _recipe_for("Fp8Linear", recipe, in_features, out_features,
                             torch.get_default_dtype() if dtype is None else dtype)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._add_scaling_states(recipe, device)
        apply_inductor_config()
        for callback in on_built:
            callback(self)

    #: Whether forwards in ``eval()`` or without grad (validation, generation) record their input's amax (and
    #: their backwards the output gradient's) into the delayed-scaling histories. Off: only training shapes
    #: the training scales; such a forward still casts with the delayed scale (in the warm-up, its own amax's).
    record_amax_outside_training: bool = False

    #: Set by :meth:`use_master` (fp8amp.initialize at O1/O2); None for FP8 compute alone.
    master: Optional[MasterPolicy] = None

    def use_master(self, master: MasterPolicy) -> None:
        """Makes this layer's weight an O1/O2 master under ``master``'s terms (what
        :func:`fp8amp.initialize` decided); the weight must already be that MasterWeight."""
        if not isinstance(master, MasterPolicy):
            raise TypeError(f"Fp8Linear.use_master: master must be a MasterPolicy, got {type(master).__name__}")
        if not isinstance(self.weight, MasterWeight):
            raise TypeError(f"Fp8Linear.use_master: the weight must be a MasterWeight, got {type(self.weight).__name__}")
        self.master = master

    #: The class of the three scaling states (a framework's layer may need them to be its modules too).
    scaling_state_type: type[ScalingState] = ScalingState

    @property
    def _distribute_module_applied(self) -> bool:
        # torch's distribute_module (under parallelize_module's Colwise/RowwiseParallel) reads this first: the
        # only point before it scatters an O1/O2 master from its empty wrapper storage (gloo aborted the
        # process) or reads .weight of the scaling states (an AttributeError). To any other reader (those
        # that walk every attribute: torch.jit.trace) the layer has no such attribute.
        if sys._getframe(1).f_code.co_name != "distribute_module":
            raise AttributeError("_distribute_module_applied")
        raise NotImplementedError(
            "Fp8Linear: tensor parallelism of fp8amp layers (parallelize_module with ColwiseParallel / "
            "RowwiseParallel, distribute_module) is not supported: Fp8Linear computes on local tensors, not DTensors; "
            "keep the layers to parallelize nn.Linear (fp8amp.convert / initialize with module_filter_fn returning "
            "False for them); FSDP2, DDP and pipeline parallelism take fp8amp layers "
            "(docs/distributed.md#tensor-and-pipeline-parallelism)")

    def _add_scaling_states(self, recipe: Recipe, device) -> None:
        # The tiled recipes keep the states too (unused): the state dict has the same keys
        # whatever the recipe, so a checkpoint loads across recipes.
        recipe.check_device(device, type(self).__name__)  # mxfp8 below Blackwell: refused here
        self.recipe = recipe
        state = self.scaling_state_type
        self.input_scaling = state(1, E4M3, recipe.scaling, device=device)
        self.weight_scaling = state(1, E4M3, recipe.scaling, device=device)
        self.grad_output_scaling = state(1, recipe.grad_format, recipe.scaling, device=device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: RecipeArg = None) -> "Fp8Linear":
        """Wraps an existing ``nn.Linear``, sharing its parameter objects (an optimizer built on
        the old module keeps working) and its hooks."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear.from_linear: linear must be an nn.Linear, got {type(linear).__name__}")
        if (why := weight_not_parameter_reason(linear)) is not None:
            raise ValueError(f"Fp8Linear.from_linear: {why}")
        recipe = _recipe_for("Fp8Linear.from_linear", recipe, linear.in_features, linear.out_features,
                             linear.weight.dtype)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._add_scaling_states(recipe, linear.weight.device)
        new.train(linear.training)
        carry_module_hooks(linear, new)
        apply_inductor_config()
        return new

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling it.
        raise NotImplementedError(no_torchscript())

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name: layer(input=x) works
        if functorch_active():  # first: a transform's wrapped weight would fail the O1/O2 master check
            raise NotImplementedError(NO_FUNCTORCH)
        weight = self.weight  # one lookup (nn.Module.__getattr__) a forward, not three
        refuse_unsupported_input(input, weight, self)
        if input.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear: input's last dimension must be in_features ({self.in_features}), got "
                             f"shape {tuple(input.shape)}")
        out_in = self._out_in_weight(weight)
        if out_in.shape[0] % _ALIGN or out_in.shape[1] % _ALIGN:
            raise RuntimeError(_reshaped_weight(out_in))
        master = self.master
        if master is not None:
            self._check_master(master, weight)
        fp8_grad = True if master is None else master.fp8_weight_grad
        if self.recipe.tiled:
            return TiledLinearFunction.apply(input, out_in, self.bias, self.recipe,
                                             self.input_scaling, self.grad_output_scaling, fp8_grad)
        return _Fp8LinearFunction.apply(
            input, out_in, self.bias, self.input_scaling, self.weight_scaling,
            self.grad_output_scaling, fp8_grad,
            self.record_amax_outside_training or (self.training and torch.is_grad_enabled()),
        )

    def _check_master(self, master: MasterPolicy, weight: torch.Tensor) -> None:
        """Refuses a forward whose O1/O2 master the optimizer no longer updates: a weight that is
        not a ScaledTensor any more (load_state_dict(..., assign=True) replaced it), or one that
        FSDP2 gathered (an E4M3 ScaledTensor) from shards of masters that initialize's optimizer
        does not hold (fully_shard replaced them after that optimizer was built)."""
        if self._parameters.get("weight") is not weight:
            # Computed from the master by a parametrization or a forward pre-hook (parametrize,
            # prune, spectral_norm): the optimizer steps the master the weight is made from.
            return
        if not isinstance(weight, (ScaledTensor, BlockScaledTensor)):
            raise RuntimeError(
                "Fp8Linear: fp8amp.initialize made this layer's weight an FP16 master (O1/O2), but the weight is "
                f"now a {type(weight).__name__} of {weight.dtype}: something replaced the parameter (e.g. "
                "load_state_dict(..., assign=True), module.to_empty() of a model initialized on the meta device, "
                "torch.nn.utils.parametrize.remove_parametrizations(..., leave_parametrized=True), "
                "torch.func.functional_call given a plain tensor for it, a tie after initialize: lm_head.weight = "
                "embed.weight, or fully_shard with a shard_placement_fn that shards it along a dim other than 0). "
                "The optimizer that initialize returned would not update it as a master and this layer would not "
                "train; load without assign=True, call fp8amp.initialize after the model's weights are "
                "materialized, tie weights before fp8amp.initialize, remove a parametrization with "
                "leave_parametrized=False and copy_ the weight it made into the master under torch.no_grad(), "
                "return Shard(0) (or None) from shard_placement_fn for the masters, and give functional_call the "
                "model's own parameters (named_parameters(): the masters) or call it on fp8amp.unconvert(model)")
        if not isinstance(weight, MasterWeight) and master.optimizer_built:  # gathered by FSDP2
            raise RuntimeError(
                "Fp8Linear: fully_shard (FSDP2) sharded this layer's FP16 master after fp8amp.initialize built the "
                "optimizer over the unsharded masters: that optimizer would update the old masters and the model "
                "would not train. Under FSDP2: model, _ = fp8amp.initialize(model, opt_level=...) without an "
                "optimizer, then fully_shard, then build fp8amp.optim.AdamW(model.parameters(), state_dtypes=...) "
                "and register fp8amp.update_scaling(model) after its step (docs/distributed.md)")

    def _apply(self, fn, recurse=True):
        # An O1/O2 master keeps its logical dtype: module.to(torch.float64) / .half() / .double()
        # would replace it by a plain tensor that the optimizer does not update (device moves are fine).
        weight = self.weight
        if isinstance(weight, MasterWeight):
            probe = fn(torch.empty(0, dtype=weight.dtype, device=weight.device))
            if probe.dtype != weight.dtype:
                raise ValueError(
                    f"Fp8Linear: the weight is an O1/O2 FP16 master of logical dtype {weight.dtype} "
                    f"(fp8amp.initialize), which cannot become {probe.dtype}; keep the model in float32 and "
                    "let torch.autocast choose the compute dtype (device moves, .to('cuda'), work; the Hugging Face "
                    "Trainer's bf16_full_eval / fp16_full_eval make this cast: use bf16=True, its autocast)")
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """The real values of a ScaledTensor weight (O1/O2), loadable into an ``nn.Linear``: in
        float32, which holds them exactly (a bfloat16 or float16 model's logical dtype would round
        the FP16 master's scaled values, and a resume would not be bit for bit)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if isinstance(self.weight, ScaledTensor) and not keep_vars:
            destination[prefix + "weight"] = self.weight.dequantize(torch.float32)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # An inf or NaN loaded into an O1/O2 master would make the whole master read NaN (a
        # ScaledTensor cannot hold it): a corrupt checkpoint is refused here, at load time, where
        # one host read per weight is affordable (docs/numerics.md#non-finite-values).
        weight = state_dict.get(prefix + "weight")
        if (isinstance(self.weight, ScaledTensor) and isinstance(weight, torch.Tensor)
                and not weight.is_meta and not bool(weight.isfinite().all())):
            raise ValueError(f"Fp8Linear.load_state_dict: {prefix}weight holds inf or NaN; the checkpoint is "
                             "corrupt (an O1/O2 master stores finite values only)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        weight = self.weight
        if not weight.is_meta:
            # A model built on meta, loaded with assign=True from a state dict without scaling
            # buffers (fresh_scaling_if_missing(), strict=False): its states would stay on meta.
            # Made where the weight is, from the initial state, before they load (they load next).
            for state in (self.input_scaling, self.weight_scaling, self.grad_output_scaling):
                if state.scale.is_meta:
                    state.to_empty(device=weight.device)

    def update_scaling(self) -> None:
        """Delayed-scaling update of the input and output-gradient states (after a step)."""
        self.input_scaling.update()
        self.grad_output_scaling.update()

    def _out_in_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The layer's ``weight`` as the GEMMs take it, ``[out_features, in_features]``."""
        return weight

    def extra_repr(self) -> str:
        if not self.recipe.tiled and self.recipe.grad_format == E5M2:
            return super().extra_repr() + ", fp8=e4m3/e5m2"
        return super().extra_repr() + f", recipe={self.recipe}"


def is_hf_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2 and the models built on it): a
    Linear whose weight is stored transposed, ``[in, out]``. Known by its class, so that fp8amp
    needs no import of transformers."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers"


class Fp8Conv1D(Fp8Linear):
    """A Hugging Face ``Conv1D`` computing in FP8, with the Conv1D's parameter objects, shapes and
    state-dict keys (its weight stays ``[in_features, out_features]``): a GPT-2 converted this way
    still saves and loads as GPT-2 does. The GEMMs take the weight's transpose, cast from it in one
    pass per forward (FP8 compute: at O1/O2 :func:`fp8amp.initialize` keeps this weight a plain
    tensor, since an FP16 master's E4M3 copy is made in the ``[out, in]`` layout), and its gradient
    reaches the ``[in, out]`` parameter through autograd's transpose."""

    #: The Conv1D class the layer came from (what :func:`fp8amp.unconvert` makes again).
    conv1d_type: type

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: RecipeArg = None) -> "Fp8Conv1D":
        """Wraps an existing Conv1D, sharing its parameter objects and its hooks."""
        if not is_hf_conv1d(conv):
            raise TypeError(f"Fp8Conv1D.from_conv1d: conv must be a transformers Conv1D, got {type(conv).__name__}")
        if (why := weight_not_parameter_reason(conv)) is not None:
            raise ValueError(f"Fp8Conv1D.from_conv1d: {why}")
        in_features, out_features = conv.weight.shape
        recipe = _recipe_for("Fp8Conv1D.from_conv1d", recipe, in_features, out_features, conv.weight.dtype)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = in_features, out_features
        new.weight = conv.weight
        new.bias = conv.bias
        new.conv1d_type = type(conv)
        new._add_scaling_states(recipe, conv.weight.device)
        new.train(conv.training)
        carry_module_hooks(conv, new)
        apply_inductor_config()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # Conv1D's name for it: layer(x=x) works
        return super().forward(x)

    def _out_in_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t()
