"""What one O2 training step of a small GPT issues, counted on the CPU
(docs/benchmarks.md#where-a-small-models-step-goes): fp8amp op calls, the other ops fp8amp's own code issues, and walks of the module tree. Each is a
fixed cost per Linear or per step that does not shrink with the model, so a change that adds one
fails here."""

import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

PACKAGE = os.path.dirname(fp8amp.__file__)
# Ops that launch nothing on a GPU: views, metadata, the wrapper's detach.
NO_LAUNCH = {"view", "_unsafe_view", "detach", "transpose", "t", "as_strided", "alias", "unbind", "empty",
             "empty_strided", "slice", "select", "expand", "reshape", "split", "split_with_sizes"}


class CountOps(TorchDispatchMode):
    """Every op dispatched (the top level: what runs under a ScaledTensor's own dispatch is not
    seen), by name, and by the fp8amp source file that issued it."""

    def __init__(self):
        super().__init__()
        self.fp8amp_ops = collections.Counter()
        self.from_package = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._opname
        if namespace == "fp8amp":
            self.fp8amp_ops[name] += 1
        elif name not in NO_LAUNCH:
            frame = _innermost_package_frame()
            if frame is not None:
                self.from_package[(name, frame)] += 1
        return func(*args, **(kwargs or {}))


def _innermost_package_frame():
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(PACKAGE) and not path.endswith("testing.py"):
            return os.path.basename(path)
        f = f.f_back
    return None


def small_o2_gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, optimizer = fp8amp.initialize(model, optimizer, "O2", recipe=fp8amp.ScalingRecipe(history_len=2),
                                         policy="all")
    data = batches(load_text_bytes(max_bytes=1 << 20), 2, cfg.seq_len)
    for _ in range(3):  # past the warm-up of history_len steps
        train_step(model, optimizer, *next(data))
    return model, optimizer, data


def test_fp8amp_ops_a_step():
    model, optimizer, data = small_o2_gpt()
    linears = sum(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    biased = sum(isinstance(m, fp8amp.Fp8Linear) and m.bias is not None for m in model.modules())
    assert (linears, biased) == (8, 4)
    count = CountOps()
    with count:
        train_step(model, optimizer, *next(data))
    # a Linear: forward input cast + transpose, GEMM; backward weight transpose (from the master's
    # codes), output-gradient cast + transpose (with the bias gradient where there is a bias), two
    # GEMMs, the weight gradient's current-scaled cast. A step: one scaling update per format, one
    # fused optimizer call.
    assert count.fp8amp_ops == {
        "cast_transpose": 2 * linears + (linears - biased), "cast_transpose_dbias": biased, "gemm": 3 * linears,
        "quantize_current": linears, "multi_update_delayed_scaling": 2, "adam_step": 1}
    assert sum(count.fp8amp_ops.values()) == 7 * linears + 3


def test_other_ops_fp8amp_issues_a_step():
    model, optimizer, data = small_o2_gpt()
    count = CountOps()
    with count:
        train_step(model, optimizer, *next(data))
    by_file = collections.Counter()
    for (name, where), n in count.from_package.items():
        by_file[where] += n
    # linear.py: per Linear the backward's scale product and amax scratch of the weight transpose
    # (2 x 8), per biased Linear the bias cast to the GEMM's dtype (4); optim.py: 3 for the whole
    # step (the skip flag, the masters' scales, the step counters).
    assert dict(by_file) == {"linear.py": 2 * 8 + 4, "optim.py": 3}, count.from_package


def test_one_walk_of_the_modules_a_step():
    model, optimizer, data = small_o2_gpt()
    walks = []
    modules = model.modules

    def counting_modules():
        walks.append(1)
        return modules()

    model.modules = counting_modules
    train_step(model, optimizer, *next(data))
    assert len(walks) == 1  # the optimizer hooks' pre-hook finds the states, the post-hook reuses them
