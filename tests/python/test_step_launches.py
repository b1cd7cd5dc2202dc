"""What one O2 training step of a small GPT issues, counted on the CPU with
benchmarks/count_step_ops.py's counter (docs/benchmarks.md#where-a-small-models-step-goes): fp8amp
op calls, the other ops fp8amp's own code issues, and walks of the module tree. Each is a fixed
cost per Linear or per step that does not shrink with the model, so a change that adds one fails
here."""

import collections
import os
import sys

import torch

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from count_step_ops import CountOps  # noqa: E402

LINEARS, BIASED = 8, 4  # 2 blocks of qkv, proj (no bias), fc1, fc2


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
    assert sum(isinstance(m, fp8amp.Fp8Linear) for m in model.modules()) == LINEARS
    assert sum(isinstance(m, fp8amp.Fp8Linear) and m.bias is not None for m in model.modules()) == BIASED
    return model, optimizer, data


def counted_step():
    model, optimizer, data = small_o2_gpt()
    count = CountOps()
    with count:
        train_step(model, optimizer, *next(data))
    return count


def test_fp8amp_ops_a_step():
    count = counted_step()
    # a Linear: forward input cast + transpose, GEMM; backward weight transpose (re-cast from the
    # master's codes with the copy's scale), output-gradient cast + transpose (with the bias
    # gradient where there is a bias), two GEMMs, the weight gradient's current-scaled cast. A
    # step: one scaling update per format, one fused optimizer call.
    assert count.fp8amp == {
        "cast_transpose": LINEARS + (LINEARS - BIASED), "cast_transpose_rescaled": LINEARS,
        "cast_transpose_dbias": BIASED, "gemm": 3 * LINEARS, "quantize_current": LINEARS,
        "multi_update_delayed_scaling": 2, "adam_step": 1}
    assert sum(count.fp8amp.values()) == 7 * LINEARS + 3


def test_other_ops_fp8amp_issues_a_step():
    by_issuer = collections.Counter()
    for (_, issuer), n in counted_step().launches.items():
        by_issuer[issuer] += n
    # linear.py: per biased Linear the bias cast to the GEMM's dtype (the weight transpose's scale
    # product and amax scratch, 2 a Linear, went into cast_transpose_rescaled); the optimizer: none
    # (the step counts' copy, the masters' scales, a reciprocal of their scale_invs, and the skip
    # flag's zeros went into the fused op).
    assert by_issuer["linear.py"] == BIASED
    assert set(by_issuer) == {"linear.py", "model"}


def counting_walks(monkeypatch) -> list:
    """The walks of the module tree the optimizer hooks make (fp8amp.amax_sync.delayed_states, as
    fp8amp.scaling_hooks calls it), one entry each."""
    walks = []
    hooks = sys.modules["fp8amp.scaling_hooks"]
    walk = hooks.delayed_states

    def counting(model):
        walks.append(1)
        return walk(model)

    monkeypatch.setattr(hooks, "delayed_states", counting)
    return walks


def test_one_walk_of_the_modules_a_step(monkeypatch):
    model, optimizer, data = small_o2_gpt()
    walks = counting_walks(monkeypatch)
    train_step(model, optimizer, *next(data))
    assert len(walks) == 1  # the optimizer hooks' pre-hook finds the states, the post-hook reuses them


def test_one_walk_a_step_also_without_fp8_layers(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))  # 8: not a multiple of 16, stays nn.Linear
    optimizer = torch.optim.AdamW(model.parameters())
    fp8amp.convert(model, optimizer=optimizer)
    walks = counting_walks(monkeypatch)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert len(walks) == 1
