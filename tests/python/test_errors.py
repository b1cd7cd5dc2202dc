"""Bad inputs raise ValueError / TypeError with a message naming the argument (and, for dtypes,
the accepted values), from the Python wrappers or from the core through the binding."""

import pytest
import torch

import fp8amp
from fp8amp.ops import scaled_accumulate

E4M3 = fp8amp.E4M3


def x():
    return torch.randn(4, 8)


def one():
    return torch.ones(1)


def codes():
    return x().to(E4M3)


def counter(value=0, n=1):
    return torch.full((n,), value, dtype=torch.int32)


def e4m3(n=4):
    return torch.zeros(n, dtype=E4M3)


def dequantize_over_codes():
    """multi_dequantize into float16 values that occupy the codes' own bytes."""
    buf = torch.zeros(64, dtype=torch.uint8)
    return fp8amp.ops.multi_dequantize([buf[:32].view(E4M3).view(4, 8)], one(), torch.float16,
                                   outs=[buf.view(torch.float16).view(4, 8)])


CASES = {
    # quantize / cast_transpose: Python types and dtype arguments
    "quantize x not a tensor": (lambda: fp8amp.ops.quantize([1.0], one(), one(), E4M3), TypeError, ["x", "Tensor"]),
    "quantize scale a float": (lambda: fp8amp.ops.quantize(x(), 1.0, one(), E4M3), TypeError, ["scale"]),
    "quantize amax None": (lambda: fp8amp.ops.quantize(x(), one(), None, E4M3), TypeError, ["amax"]),
    "quantize dtype int8": (lambda: fp8amp.ops.quantize(x(), one(), one(), torch.int8), ValueError,
                            ["dtype", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float16", "torch.int8"]),
    "quantize dtype bfloat16": (lambda: fp8amp.ops.quantize(x(), one(), one(), torch.bfloat16), ValueError, ["dtype"]),
    "quantize dtype a string": (lambda: fp8amp.ops.quantize(x(), one(), one(), "e4m3"), TypeError, ["dtype"]),
    "quantize margin a float": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, margin=1.0), TypeError, ["margin"]),
    "quantize pow2_scale an int": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, pow2_scale=1), TypeError,
                                   ["pow2_scale"]),
    "quantize warmup_steps a bool": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, warmup_steps=True), TypeError,
                                     ["warmup_steps"]),
    "quantize warmup_counter a list": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, warmup_counter=[0]),
                                       TypeError, ["warmup_counter"]),
    "quantize positional options": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, None), TypeError, []),
    "quantize_current dtype bfloat16": (lambda: fp8amp.ops.quantize_current(x(), torch.bfloat16), ValueError, ["dtype"]),
    "quantize_current margin a float": (lambda: fp8amp.ops.quantize_current(x(), E4M3, margin=1.0), TypeError,
                                        ["margin"]),
    "quantize_current margin -1": (lambda: fp8amp.ops.quantize_current(x(), E4M3, margin=-1), ValueError, ["margin"]),
    "quantize_current nan_if_nonfinite an int": (lambda: fp8amp.ops.quantize_current(x(), E4M3, nan_if_nonfinite=1),
                                                 TypeError, ["nan_if_nonfinite"]),
    "quantize_current x float64": (lambda: fp8amp.ops.quantize_current(x().double(), E4M3), ValueError, ["x"]),
    # quantize / cast_transpose: checks of the core
    "quantize x float64": (lambda: fp8amp.ops.quantize(x().double(), one(), one(), E4M3), ValueError, ["x"]),
    "quantize x int32": (lambda: fp8amp.ops.quantize(counter(), one(), one(), E4M3), ValueError, ["x"]),
    "quantize scale [2]": (lambda: fp8amp.ops.quantize(x(), torch.ones(2), one(), E4M3), ValueError, ["scale"]),
    "quantize scale float16": (lambda: fp8amp.ops.quantize(x(), one().half(), one(), E4M3), ValueError, ["scale"]),
    "quantize amax [2, 3]": (lambda: fp8amp.ops.quantize(x(), one(), torch.zeros(2, 3), E4M3), ValueError, ["amax"]),
    "quantize amax empty": (lambda: fp8amp.ops.quantize(x(), one(), torch.zeros(0), E4M3), ValueError, ["amax"]),
    "quantize amax not contiguous": (lambda: fp8amp.ops.quantize(x(), one(), torch.zeros(1, 8)[:, ::2], E4M3), ValueError,
                                     ["amax"]),
    "quantize warmup_counter float": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, warmup_counter=one()),
                                      ValueError, ["warmup_counter", "int32"]),
    "quantize warmup_counter [2]": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, warmup_counter=counter(0, 2)),
                                    ValueError, ["warmup_counter"]),
    "quantize warmup_steps negative": (lambda: fp8amp.ops.quantize(x(), one(), one(), E4M3, warmup_counter=counter(),
                                                               warmup_steps=-1), ValueError, ["warmup_steps"]),
    "cast_transpose 0-d x": (lambda: fp8amp.ops.cast_transpose(torch.tensor(1.0), one(), one(), E4M3), ValueError,
                             ["x"]),
    "cast_transpose x float64": (lambda: fp8amp.ops.cast_transpose(x().double(), one(), one(), E4M3), ValueError, ["x"]),
    "cast_transpose dtype float32": (lambda: fp8amp.ops.cast_transpose(x(), one(), one(), torch.float32), ValueError,
                                     ["dtype", "torch.float8_e4m3fn"]),
    "cast_transpose scale_inv-like scale [3]": (lambda: fp8amp.ops.cast_transpose(x(), torch.ones(3), one(), E4M3),
                                                ValueError, ["scale"]),
    # cast_transpose_dbias: the same checks, naming its own op
    "cast_transpose_dbias x not a tensor": (lambda: fp8amp.ops.cast_transpose_dbias([1.0], one(), one(), E4M3),
                                            TypeError, ["cast_transpose_dbias", "x", "Tensor"]),
    "cast_transpose_dbias 0-d x": (lambda: fp8amp.ops.cast_transpose_dbias(torch.tensor(1.0), one(), one(), E4M3),
                                   ValueError, ["cast_transpose_dbias", "x", "at least 1 dimension"]),
    "cast_transpose_dbias x float64": (lambda: fp8amp.ops.cast_transpose_dbias(x().double(), one(), one(), E4M3),
                                       ValueError, ["cast_transpose_dbias", "x"]),
    "cast_transpose_dbias x int32": (lambda: fp8amp.ops.cast_transpose_dbias(counter(0, 8), one(), one(), E4M3),
                                     ValueError, ["cast_transpose_dbias", "x", "float32"]),
    "cast_transpose_dbias x fp8": (lambda: fp8amp.ops.cast_transpose_dbias(codes(), one(), one(), E4M3), ValueError,
                                   ["cast_transpose_dbias", "x", "float32"]),
    "cast_transpose_dbias dtype float32": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), one(), torch.float32),
                                           ValueError, ["cast_transpose_dbias", "dtype", "torch.float8_e4m3fn",
                                                        "torch.float32"]),
    "cast_transpose_dbias dtype a string": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), one(), "e5m2"),
                                            TypeError, ["cast_transpose_dbias", "dtype"]),
    "cast_transpose_dbias scale [3]": (lambda: fp8amp.ops.cast_transpose_dbias(x(), torch.ones(3), one(), E4M3),
                                       ValueError, ["cast_transpose_dbias", "scale", "1 element"]),
    "cast_transpose_dbias scale a float": (lambda: fp8amp.ops.cast_transpose_dbias(x(), 1.0, one(), E4M3), TypeError,
                                           ["cast_transpose_dbias", "scale"]),
    "cast_transpose_dbias scale float16": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one().half(), one(), E4M3),
                                           ValueError, ["cast_transpose_dbias", "scale", "float32"]),
    "cast_transpose_dbias amax None": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), None, E4M3), TypeError,
                                       ["cast_transpose_dbias", "amax"]),
    "cast_transpose_dbias amax [2, 3]": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), torch.zeros(2, 3), E4M3),
                                         ValueError, ["cast_transpose_dbias", "amax"]),
    "cast_transpose_dbias warmup_counter float": (
        lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), one(), E4M3, warmup_counter=one(), warmup_steps=1),
        ValueError, ["cast_transpose_dbias", "warmup_counter", "int32"]),
    "cast_transpose_dbias margin a float": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), one(), E4M3, margin=1.0),
                                            TypeError, ["cast_transpose_dbias", "margin"]),
    "cast_transpose_dbias positional options": (lambda: fp8amp.ops.cast_transpose_dbias(x(), one(), one(), E4M3, None),
                                                TypeError, []),
    "cast_transpose_dbias op dtype bfloat16": (
        lambda: torch.ops.fp8amp.cast_transpose_dbias.default(x(), one(), one(), torch.bfloat16),
        ValueError, ["cast_transpose_dbias", "dtype", "bfloat16"]),
    "cast_transpose_dbias op x not contiguous": (
        lambda: torch.ops.fp8amp.cast_transpose_dbias.default(x().t(), one(), one(), E4M3),
        ValueError, ["cast_transpose_dbias", "x", "contiguous"]),
    # dequantize
    "dequantize x float32": (lambda: fp8amp.ops.dequantize(x(), one(), torch.float32), ValueError, ["x"]),
    "dequantize dtype fp8": (lambda: fp8amp.ops.dequantize(x().to(E4M3), one(), E4M3), ValueError,
                             ["dtype", "torch.float32", "torch.bfloat16", "torch.float16"]),
    "dequantize scale_inv [2]": (lambda: fp8amp.ops.dequantize(x().to(E4M3), torch.ones(2), torch.float32), ValueError,
                                 ["scale_inv"]),
    "dequantize scale_inv a float": (lambda: fp8amp.ops.dequantize(x().to(E4M3), 1.0, torch.float32), TypeError,
                                     ["scale_inv"]),
    # amax and the multi-tensor ops
    "amax buffer int32": (lambda: fp8amp.ops.amax(x(), counter()), ValueError, ["amax"]),
    "amax buffer empty": (lambda: fp8amp.ops.amax(x(), torch.zeros(0)), ValueError, ["amax"]),
    "amax warmup_counter float": (lambda: fp8amp.ops.amax(x(), one(), warmup_counter=one(), warmup_steps=1), ValueError,
                                  ["warmup_counter"]),
    "multi_amax xs a tensor": (lambda: fp8amp.ops.multi_amax(x(), torch.zeros(4)), TypeError, ["xs"]),
    "multi_amax xs[1] a float": (lambda: fp8amp.ops.multi_amax([x(), 1.0], torch.zeros(2)), TypeError, ["xs[1]"]),
    "multi_amax xs empty": (lambda: fp8amp.ops.multi_amax([], torch.zeros(1)), ValueError, ["xs"]),
    "multi_amax xs mixed dtypes": (lambda: fp8amp.ops.multi_amax([x(), x().half()], torch.zeros(2)), ValueError, ["xs"]),
    "multi_amax amax [3] for 2": (lambda: fp8amp.ops.multi_amax([x(), x()], torch.zeros(3)), ValueError, ["amax"]),
    "multi_quantize scale [1] for 2": (lambda: fp8amp.ops.multi_quantize([x(), x()], one(), torch.zeros(2), E4M3),
                                       ValueError, ["scale"]),
    "multi_quantize warmup_counter [1] for 2": (
        lambda: fp8amp.ops.multi_quantize([x(), x()], torch.ones(2), torch.zeros(2), E4M3, warmup_counter=counter()),
        ValueError, ["warmup_counter"]),
    "multi_quantize dtype bad": (lambda: fp8amp.ops.multi_quantize([x()], one(), one(), torch.uint8), ValueError,
                                 ["dtype"]),
    "multi_dequantize scale_inv [1] for 2": (
        lambda: fp8amp.ops.multi_dequantize([x().to(E4M3), x().to(E4M3)], one(), torch.float32), ValueError,
        ["scale_inv"]),
    "multi_dequantize xs a tuple of non-tensors": (lambda: fp8amp.ops.multi_dequantize((1, 2), one(), torch.float32),
                                                   TypeError, ["xs[0]"]),
    # multi_dequantize's outs: the Python types and the dtype in the wrapper, the rest in the core
    "multi_dequantize outs a tensor": (lambda: fp8amp.ops.multi_dequantize([codes()], one(), torch.float32, outs=x()),
                                       TypeError, ["outs", "list or tuple"]),
    "multi_dequantize outs[1] None": (
        lambda: fp8amp.ops.multi_dequantize([codes(), codes()], torch.ones(2), torch.float32, outs=[x(), None]),
        TypeError, ["outs[1]", "Tensor"]),
    "multi_dequantize outs[1] bfloat16": (
        lambda: fp8amp.ops.multi_dequantize([codes(), codes()], torch.ones(2), torch.float32, outs=[x(), x().bfloat16()]),
        ValueError, ["outs[1] must be torch.float32", "dtype", "torch.bfloat16"]),
    "multi_dequantize outs 1 for 2": (
        lambda: fp8amp.ops.multi_dequantize([codes(), codes()], torch.ones(2), torch.float32, outs=[x()]),
        ValueError, ["outs must hold as many tensors as xs (2), got 1"]),
    "multi_dequantize outs[1] shape": (
        lambda: fp8amp.ops.multi_dequantize([codes(), codes()], torch.ones(2), torch.float32, outs=[x(), x().T]),
        ValueError, ["xs[1] and outs[1] must have the same shape"]),
    "multi_dequantize outs[1] not contiguous": (
        lambda: fp8amp.ops.multi_dequantize([codes(), codes()], torch.ones(2), torch.float32,
                                        outs=[x(), torch.zeros(4, 16)[:, ::2]]),
        ValueError, ["outs[1] must be contiguous"]),
    "multi_dequantize outs overlapping": (
        lambda: fp8amp.ops.multi_dequantize([codes(), codes()], torch.ones(2), torch.float32,
                                        outs=list(torch.zeros(48).unfold(0, 32, 16).view(2, 4, 8))),
        ValueError, ["outs[0] and outs[1] must not share memory"]),
    "multi_dequantize out over the codes": (lambda: dequantize_over_codes(), ValueError,
                                            ["xs[0] and outs[0] must not share memory"]),
    "scaled_accumulate src inside dst": (lambda: (lambda b: scaled_accumulate(b[:8], one(), b[1:9], one()))(e4m3(9)),
                                         ValueError, ["dst and src must not share memory"]),
    # scaled_accumulate: TypeError from the wrapper; ValueError from the core, naming the op and the argument
    "scaled_accumulate dst a list": (lambda: scaled_accumulate([0.0], torch.ones(1), torch.ones(1)), TypeError,
                                     ["dst", "Tensor"]),
    "scaled_accumulate dst_scale_inv a float": (lambda: scaled_accumulate(e4m3(), 1.0, torch.ones(4)), TypeError,
                                                ["dst_scale_inv"]),
    "scaled_accumulate src None": (lambda: scaled_accumulate(e4m3(), torch.ones(1), None), TypeError, ["src"]),
    "scaled_accumulate src_scale_inv a float": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), e4m3(), 1.0),
        TypeError, ["src_scale_inv"]),
    "scaled_accumulate alpha a string": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), alpha="1"),
        TypeError, ["alpha"]),
    "scaled_accumulate margin a float": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), margin=1.0),
        TypeError, ["margin"]),
    "scaled_accumulate pow2_scale an int": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), pow2_scale=1),
        TypeError, ["pow2_scale"]),
    "scaled_accumulate alpha positional": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), None, 2.0),
        TypeError, []),
    "scaled_accumulate dst float32": (
        lambda: scaled_accumulate(torch.zeros(4), torch.ones(1), torch.ones(4)),
        ValueError, ["scaled_accumulate", "dst", "float8_e4m3fn", "float8_e5m2", "float16"]),
    "scaled_accumulate dst bfloat16": (
        lambda: scaled_accumulate(torch.zeros(4, dtype=torch.bfloat16), torch.ones(1), torch.ones(4)),
        ValueError, ["scaled_accumulate", "dst", "float8_e4m3fn"]),
    "scaled_accumulate dst float64": (
        lambda: scaled_accumulate(torch.zeros(4, dtype=torch.float64), torch.ones(1), torch.ones(4)),
        ValueError, ["scaled_accumulate", "dst", "unsupported dtype", "float8_e4m3fn"]),
    "scaled_accumulate dst not contiguous": (
        lambda: scaled_accumulate(torch.zeros(4, 2, dtype=E4M3)[:, 0], torch.ones(1), torch.ones(4)),
        ValueError, ["scaled_accumulate", "dst", "contiguous"]),
    "scaled_accumulate src float64": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4, dtype=torch.float64)),
        ValueError, ["scaled_accumulate", "src", "float32"]),
    "scaled_accumulate src int32": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4, dtype=torch.int32)),
        ValueError, ["scaled_accumulate", "src", "float32", "bfloat16", "float16"]),
    "scaled_accumulate src fp8 without scale_inv": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), e4m3()),
        ValueError, ["scaled_accumulate", "src", "src_scale_inv"]),
    "scaled_accumulate src float32 with scale_inv": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), torch.ones(1)),
        ValueError, ["scaled_accumulate", "src", "float8_e4m3fn", "float8_e5m2", "float16"]),
    "scaled_accumulate src numel": (lambda: scaled_accumulate(e4m3(4), torch.ones(1), torch.ones(5)), ValueError,
                                    ["scaled_accumulate", "src", "as many elements as dst (4)"]),
    "scaled_accumulate src shape [2, 3] for 4": (
        lambda: scaled_accumulate(e4m3(4), torch.ones(1), torch.ones(2, 3)),
        ValueError, ["scaled_accumulate", "src"]),
    "scaled_accumulate dst_scale_inv [2]": (lambda: scaled_accumulate(e4m3(), torch.ones(2), torch.ones(4)), ValueError,
                                            ["scaled_accumulate", "dst_scale_inv", "1 element"]),
    "scaled_accumulate dst_scale_inv empty": (
        lambda: scaled_accumulate(e4m3(), torch.ones(0), torch.ones(4)),
        ValueError, ["scaled_accumulate", "dst_scale_inv"]),
    "scaled_accumulate dst_scale_inv float16": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1, dtype=torch.float16), torch.ones(4)),
        ValueError, ["scaled_accumulate", "dst_scale_inv", "float32"]),
    "scaled_accumulate src_scale_inv [1, 2]": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), e4m3(), torch.ones(1, 2)),
        ValueError, ["scaled_accumulate", "src_scale_inv", "1 element"]),
    "scaled_accumulate src_scale_inv int32": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), e4m3(), torch.ones(1, dtype=torch.int32)),
        ValueError, ["scaled_accumulate", "src_scale_inv", "float32"]),
    "scaled_accumulate margin negative": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), margin=-1),
        ValueError, ["scaled_accumulate", "margin"]),
    "scaled_accumulate margin 127": (
        lambda: scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), margin=127),
        ValueError, ["scaled_accumulate", "margin"]),
    "scaled_accumulate op amax [2]": (
        lambda: torch.ops.fp8amp.scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), None, 1.0, torch.zeros(2)),
        ValueError, ["scaled_accumulate", "amax", "1 element"]),
    "scaled_accumulate op amax float16": (
        lambda: torch.ops.fp8amp.scaled_accumulate(e4m3(), torch.ones(1), torch.ones(4), None, 1.0,
                                             torch.zeros(1, dtype=torch.float16)),
        ValueError, ["scaled_accumulate", "amax"]),
    # scale updates
    "compute_scale fmax a string": (lambda: fp8amp.ops.compute_scale(one(), one(), one(), "448"), TypeError, ["fmax"]),
    "compute_scale fmax negative": (lambda: fp8amp.ops.compute_scale(one(), one(), one(), -448.0), ValueError, ["fmax"]),
    "compute_scale fmax infinite": (lambda: fp8amp.ops.compute_scale(one(), one(), one(), float("inf")), ValueError,
                                    ["fmax"]),
    "compute_scale scale_inv [2]": (lambda: fp8amp.ops.compute_scale(one(), one(), torch.ones(2), 448.0), ValueError,
                                    ["scale_inv"]),
    "compute_scale amax [2] for 1": (lambda: fp8amp.ops.compute_scale(torch.zeros(2, 2), one(), one(), 448.0),
                                     ValueError, ["amax"]),
    "update amax_history 1-D": (lambda: fp8amp.ops.update_delayed_scaling(torch.zeros(4), one(), one(), counter(), 448.0),
                                ValueError, ["amax_history"]),
    "update counter float": (lambda: fp8amp.ops.update_delayed_scaling(torch.zeros(1, 4), one(), one(), one(), 448.0),
                             ValueError, ["counter", "int32"]),
    "update scale [2] for 1": (
        lambda: fp8amp.ops.update_delayed_scaling(torch.zeros(1, 4), torch.ones(2), one(), counter(), 448.0),
        ValueError, ["scale"]),
    "update scale_inv float16": (
        lambda: fp8amp.ops.update_delayed_scaling(torch.zeros(1, 4), one(), one().half(), counter(), 448.0),
        ValueError, ["scale_inv"]),
    "update counter None": (lambda: fp8amp.ops.update_delayed_scaling(torch.zeros(1, 4), one(), one(), None, 448.0),
                            TypeError, ["counter"]),
    # formats
    "format_max int8": (lambda: fp8amp.format_max(torch.int8), ValueError,
                        ["dtype", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float16"]),
    "format_max a string": (lambda: fp8amp.format_max("e4m3"), TypeError, ["dtype"]),
    # ScalingRecipe and ScalingState
    "recipe history_len 0": (lambda: fp8amp.ScalingRecipe(history_len=0), ValueError, ["history_len"]),
    "recipe history_len a float": (lambda: fp8amp.ScalingRecipe(history_len=4.0), TypeError, ["history_len"]),
    "recipe margin negative": (lambda: fp8amp.ScalingRecipe(margin=-1), ValueError, ["margin"]),
    "recipe margin too large": (lambda: fp8amp.ScalingRecipe(margin=127), ValueError, ["margin"]),
    "recipe pow2_scale a string": (lambda: fp8amp.ScalingRecipe(pow2_scale="yes"), TypeError, ["pow2_scale"]),
    "state num_tensors 0": (lambda: fp8amp.ScalingState(0), ValueError, ["num_tensors"]),
    "state num_tensors a float": (lambda: fp8amp.ScalingState(2.0), TypeError, ["num_tensors"]),
    "state dtype bfloat16": (lambda: fp8amp.ScalingState(1, torch.bfloat16), ValueError,
                             ["dtype", "torch.float8_e4m3fn"]),
    "state recipe a dict": (lambda: fp8amp.ScalingState(1, E4M3, {"history_len": 4}), TypeError, ["recipe"]),
    "state index out of range": (lambda: fp8amp.ScalingState(2).quantize(x(), 2), ValueError, ["index"]),
    "state index negative": (lambda: fp8amp.ScalingState(2).cast_transpose(x(), -1), ValueError, ["index"]),
    "state index a tensor": (lambda: fp8amp.ScalingState(2).quantize(x(), torch.tensor(0)), TypeError, ["index"]),
    "state x float64": (lambda: fp8amp.ScalingState(1).quantize(x().double()), ValueError, ["x"]),
    "state cast_transpose_dbias index out of range": (lambda: fp8amp.ScalingState(2).cast_transpose_dbias(x(), 2),
                                                      ValueError, ["index", "[0, 2)"]),
    "state cast_transpose_dbias index negative": (lambda: fp8amp.ScalingState(2).cast_transpose_dbias(x(), -1),
                                                  ValueError, ["index"]),
    "state cast_transpose_dbias index a tensor": (
        lambda: fp8amp.ScalingState(2).cast_transpose_dbias(x(), torch.tensor(0)), TypeError, ["index"]),
    "state cast_transpose_dbias index a bool": (lambda: fp8amp.ScalingState(2).cast_transpose_dbias(x(), True),
                                                TypeError, ["index"]),
    "state cast_transpose_dbias x float64": (lambda: fp8amp.ScalingState(1).cast_transpose_dbias(x().double()),
                                             ValueError, ["cast_transpose_dbias", "x"]),
    "state cast_transpose_dbias 0-d x": (lambda: fp8amp.ScalingState(1).cast_transpose_dbias(torch.tensor(1.0)),
                                         ValueError, ["cast_transpose_dbias", "x"]),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_raises_clear_error(name):
    call, error, words = CASES[name]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.gpu
def test_cpu_cuda_mix_names_the_argument():
    xc = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="scale"):
        fp8amp.ops.quantize(xc, one(), torch.zeros(1, device="cuda"), E4M3)
    with pytest.raises(ValueError, match="amax"):
        fp8amp.ops.quantize(xc, torch.ones(1, device="cuda"), one(), E4M3)
    with pytest.raises(ValueError, match="warmup_counter"):
        fp8amp.ops.cast_transpose(xc, torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"), E4M3,
                              warmup_counter=counter(), warmup_steps=1)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8amp.ops.dequantize(xc.to(E4M3), one(), torch.float32)
    with pytest.raises(ValueError, match="xs"):
        fp8amp.ops.multi_amax([xc, x()], torch.zeros(2, device="cuda"))
    with pytest.raises(ValueError, match=r"xs\[0\] and outs\[0\] must be on the same device"):
        fp8amp.ops.multi_dequantize([codes()], one(), torch.float32, outs=[torch.empty(4, 8, device="cuda")])
    with pytest.raises(ValueError, match="counter"):
        fp8amp.ops.update_delayed_scaling(torch.zeros(1, 4, device="cuda"), torch.ones(1, device="cuda"),
                                      torch.ones(1, device="cuda"), counter(), 448.0)
    with pytest.raises(ValueError, match="x"):
        fp8amp.ScalingState(1).quantize(xc)


@pytest.mark.gpu
def test_cast_transpose_dbias_cpu_cuda_mix_names_the_argument():
    xc = torch.randn(300, 8, device="cuda")
    with pytest.raises(ValueError, match="scale"):
        fp8amp.ops.cast_transpose_dbias(xc, one(), torch.zeros(1, device="cuda"), E4M3)
    with pytest.raises(ValueError, match="amax"):
        fp8amp.ops.cast_transpose_dbias(xc, torch.ones(1, device="cuda"), one(), E4M3)
    with pytest.raises(ValueError, match="warmup_counter"):
        fp8amp.ops.cast_transpose_dbias(xc, torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"), E4M3,
                                    warmup_counter=counter(), warmup_steps=1)
    with pytest.raises(ValueError, match="x"):
        fp8amp.ScalingState(1).cast_transpose_dbias(xc)


def _with_one_meta(args, i):
    """args with the tensor at position i (or element 0 of the list there) moved to the meta device."""
    args = list(args)
    a = args[i]
    args[i] = [a[0].to("meta"), *a[1:]] if isinstance(a, list) else a.to("meta")
    return args


def _meta_cases():
    x, one, amax = torch.randn(16, 16), torch.ones(1), torch.zeros(1, 4)
    e4m3 = x.to(E4M3)
    return {
        "quantize": (torch.ops.fp8amp.quantize.default, (x, one, amax, E4M3), (1, 2)),
        "cast_transpose": (torch.ops.fp8amp.cast_transpose.default, (x, one, amax, E4M3), (0, 1, 2)),
        "cast_transpose_dbias": (torch.ops.fp8amp.cast_transpose_dbias.default, (x, one, amax, E4M3), (1,)),
        "cast_transpose_rescaled": (torch.ops.fp8amp.cast_transpose_rescaled.default, (x.half(), one, one, E4M3),
                                    (0, 2)),
        "dequantize": (torch.ops.fp8amp.dequantize.default, (x.half(), one, torch.float32), (1,)),
        "amax": (torch.ops.fp8amp.amax.default, (x, amax), (0, 1)),
        "multi_amax": (torch.ops.fp8amp.multi_amax.default, ([x, x], torch.zeros(2, 1)), (0, 1)),
        "gemm": (torch.ops.fp8amp.gemm.default, (e4m3, e4m3, one, one, torch.float32), (2, 3)),
        "gemm_accumulate": (torch.ops.fp8amp.gemm_accumulate.default, (e4m3, e4m3, one, one, torch.zeros(16, 16)),
                            (4,)),
        "scaled_accumulate": (torch.ops.fp8amp.scaled_accumulate.default,
                              (x.half(), torch.ones(1), x, None, 1.0, torch.zeros(1)), (1, 5)),
        "compute_scale": (torch.ops.fp8amp.compute_scale.default, (amax, one, one.clone(), 448.0), (1,)),
    }


@pytest.mark.parametrize("name", list(_meta_cases()))
def test_a_meta_tensor_among_real_ones_is_refused(name):
    """The dispatcher runs the Meta kernel when any argument is meta: it used to return
    uninitialized memory (or write nothing) for the real tensors."""
    op, args, positions = _meta_cases()[name]
    for i in positions:
        with pytest.raises(ValueError, match=f"fp8amp.{name}: every tensor argument must be on one device, got .* on meta"):
            op(*_with_one_meta(args, i))
