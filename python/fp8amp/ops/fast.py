"""The trusted fast path: the core's op overloads, resolved once.

For fp8amp's own hot loops (the scaling state, Fp8Linear, the optimizer, the FP8 all-reduce and reduce-scatter),
whose arguments are checked where they enter fp8amp: a ``torch.ops`` attribute lookup and
overload resolution per call would be host time on every step. Each takes the schema's
positional arguments (``torch.ops.fp8amp.<name>`` documents them) and checks nothing in Python;
the core still refuses bad values with a ValueError naming the argument. Everyone else calls the
typed wrappers of :mod:`fp8amp.ops`.
"""

from ._library import classes, lib

quantize = lib.quantize.default
quantize_current = lib.quantize_current.default
cast_transpose = lib.cast_transpose.default
cast_transpose_dbias = lib.cast_transpose_dbias.default
cast_transpose_rescaled = lib.cast_transpose_rescaled.default
dequantize = lib.dequantize.default
amax = lib.amax.default
amax_of = lib.amax_of.default
multi_amax = lib.multi_amax.default
multi_quantize = lib.multi_quantize.default
multi_dequantize = lib.multi_dequantize.default
compute_scale = lib.compute_scale.default
update_delayed_scaling = lib.update_delayed_scaling.default
multi_update_delayed_scaling = lib.multi_update_delayed_scaling.default
gemm = lib.gemm.default
gemm_accumulate = lib.gemm_accumulate.default
scaled_accumulate = lib.scaled_accumulate.default
adam_step = lib.adam_step.default
set_gemm_autotune = lib.set_gemm_autotune.default
gemm_autotune = lib.gemm_autotune.default
gemm_autotune_stats = lib.gemm_autotune_stats.default
quantize_tiles = lib.quantize_tiles.default
dequantize_tiles = lib.dequantize_tiles.default
cast_transpose_tiles = lib.cast_transpose_tiles.default
scaled_accumulate_tiles = lib.scaled_accumulate_tiles.default
multi_norm_tiles = lib.multi_norm_tiles.default
comm_quantize = lib.comm_quantize.default
comm_sum_shards = lib.comm_sum_shards.default
comm_sum_requantize = lib.comm_sum_requantize.default

#: ``AdamPlan(params, exp_avgs, exp_avg_sqs, param_scales, param_scale_invs, exp_avg_scales,
#: exp_avg_scale_invs, exp_avg_sq_scales, exp_avg_sq_scale_invs, weights_fp8, weight_scales,
#: weight_scale_invs, step_counts, param_amaxes)``: ``adam_step``'s buffers but the grads, checked once, for the optimizer's
#: repeated steps; ``plan.step(grads, grad_scale_invs, lr, beta1, beta2, eps, weight_decay, adamw,
#: maximize, step, step_tensor, found_inf, margin, stochastic_rounding=False, rounding_seed=0)`` is
#: ``adam_step`` over them, or does nothing and returns None once one of them has other storage,
#: shape or dtype than when the plan was made.
AdamPlan = classes.AdamPlan
