"""fp8amp.ops, the op layer: the wrappers check their arguments and name them, the fast path is
the same op, and the names that moved from the top level still work for a release, with a
DeprecationWarning."""

import importlib
import sys

import pytest
import torch

import fp8amp
from fp8amp import ops


def test_fast_path_is_the_core_op():
    x = torch.randn(32, 16)
    checked = ops.quantize(x, torch.ones(1), torch.zeros(1, 4), fp8amp.E4M3)
    fast = ops.fast.quantize(x, torch.ones(1), torch.zeros(1, 4), fp8amp.E4M3, None, 0, 0, True)
    assert torch.equal(checked[0].view(torch.uint8), fast[0].view(torch.uint8))
    assert torch.equal(checked[1], fast[1])


def adam_args(n=2):
    params = [torch.randn(8) for _ in range(n)]
    return params, [torch.randn(8) for _ in range(n)], [torch.zeros(8) for _ in range(n)], \
        [torch.zeros(8) for _ in range(n)]


def test_adam_step_wrapper_matches_the_op():
    a, b = adam_args(), adam_args()
    for src, dst in zip(a, b):
        for s, d in zip(src, dst):
            d.copy_(s)
    ops.adam_step(*a, lr=1e-2, weight_decay=0.1, step=1)
    torch.ops.fp8amp.adam_step(*b, *([[]] * 12), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                               adamw=True, maximize=False, step=1)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr="0.1"), TypeError, "fp8amp.ops.adam_step: lr must be a float, got str"),
    (dict(lr=0.1, adamw=1), TypeError, "fp8amp.ops.adam_step: adamw must be a bool, got int"),
    (dict(lr=0.1, step=1.0), TypeError, "fp8amp.ops.adam_step: step must be an int, got float"),
    (dict(lr=0.1, exp_avg_scale=[None]), TypeError, r"unknown keyword argument\(s\) \['exp_avg_scale'\]"),
    (dict(lr=0.1, param_scales=torch.ones(1)), TypeError, "param_scales must be a list or tuple"),
])
def test_adam_step_wrapper_names_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.adam_step(*adam_args(), **kwargs)


def test_adam_step_lists_must_be_lists():
    params, grads, m, v = adam_args()
    with pytest.raises(TypeError, match="fp8amp.ops.adam_step: grads must be a list or tuple of tensors"):
        ops.adam_step(params, grads[0], m, v, lr=0.1)


@pytest.mark.parametrize("name", ["quantize", "cast_transpose", "dequantize", "compute_scale", "scaled_accumulate"])
def test_moved_top_level_names_warn_and_work(name):
    with pytest.warns(DeprecationWarning, match=f"fp8amp.{name} moved to fp8amp.ops.{name}"):
        assert getattr(fp8amp, name) is getattr(ops, name)


def test_old_gemm_module_warns_and_keeps_its_names():
    sys.modules.pop("fp8amp.gemm", None)
    with pytest.warns(DeprecationWarning, match="fp8amp.gemm moved to fp8amp.ops"):
        old = importlib.import_module("fp8amp.gemm")
    assert old.set_autotune is ops.set_gemm_autotune and old.gemm is ops.gemm


def test_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        fp8amp.no_such_name  # noqa: B018


def test_use_master_takes_a_master_policy_over_a_master_weight():
    from fp8amp.linear import MasterPolicy

    layer = fp8amp.Fp8Linear(16, 16)
    assert layer.master is None
    with pytest.raises(TypeError, match="master must be a MasterPolicy, got dict"):
        layer.use_master({"fp8_weight_grad": True})
    with pytest.raises(TypeError, match="the weight must be a MasterWeight, got Parameter"):
        layer.use_master(MasterPolicy())
    layer.weight = torch.nn.Parameter(fp8amp.MasterWeight.from_tensor(layer.weight.detach()))
    layer.use_master(MasterPolicy())
    assert layer.master == MasterPolicy()


@pytest.mark.parametrize("fmt", [fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16])
def test_format_maxima_agree_with_torch_and_the_core(fmt):
    """formats.py's maxima, torch's finfo and the core's dtype table (what a saturating quantize
    writes) are one number."""
    fmax = fp8amp.format_max(fmt)
    assert fmax == torch.finfo(fmt).max
    counter = torch.zeros(1, dtype=torch.int32)
    # warmup_steps=0: the stored scale 1 is used, so a huge value saturates to the core's maximum.
    out, _ = ops.quantize(torch.tensor([1e30, -1e30]), torch.ones(1), torch.zeros(1, 1), fmt,
                          warmup_counter=counter, warmup_steps=0)
    assert out.float().tolist() == [fmax, -fmax]


def test_adam_step_of_no_tensors_is_a_clear_error():
    with pytest.raises(ValueError, match="params must hold at least one tensor"):
        ops.adam_step([], [], [], [], lr=0.1)
