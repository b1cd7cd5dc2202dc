"""Ops refuse written arguments that share memory with another argument (the core's
check::disjoint_writes, include/fp8amp/tensor.h): a ValueError naming both, and nothing written.
Before, these gave wrong results on the CPU (and races on CUDA)."""

import pytest
import torch

import fp8amp
from fp8amp import ops

E4M3 = fp8amp.E4M3


def _refused(call, *names):
    with pytest.raises(ValueError, match=f"{names[0]} and {names[1]} must not share memory"):
        call()


def test_quantize_amax_viewing_the_input():
    buf = torch.arange(17, dtype=torch.float32)
    before = buf.clone()
    _refused(lambda: ops.quantize(buf[:16], torch.ones(1), buf[3:4], E4M3), "x", "amax")
    assert torch.equal(buf, before)  # nothing folded into x
    _refused(lambda: ops.amax(buf[:16], buf[15:16]), "x", "amax")
    _refused(lambda: ops.cast_transpose(buf[:16].view(4, 4), torch.ones(1), buf[0:1], E4M3), "x", "amax")
    _refused(lambda: ops.multi_amax([buf[:8], buf[8:16]], buf[9:11]), r"xs\[1\]", "amax")
    # warmup_counter is read: it may not be the amax buffer's memory either.
    amax = torch.zeros(1)
    _refused(lambda: ops.quantize(buf[:16], torch.ones(1), amax, E4M3, warmup_counter=amax.view(torch.int32),
                                  warmup_steps=1), "warmup_counter", "amax")


def test_quantize_scale_may_not_be_amax():
    scale = torch.ones(1)
    _refused(lambda: ops.quantize(torch.randn(8), scale, scale, E4M3), "scale", "amax")


def test_scale_updates_with_scale_is_scale_inv():
    history, s, counter = torch.tensor([[4.0, 0.0]]), torch.ones(1), torch.zeros(1, dtype=torch.int32)
    _refused(lambda: ops.update_delayed_scaling(history, s, s, counter, 448.0), "scale", "scale_inv")
    assert history.tolist() == [[4.0, 0.0]] and s.item() == 1.0 and counter.item() == 0  # untouched
    _refused(lambda: ops.update_delayed_scaling(history, history[0, 1:], torch.ones(1), counter, 448.0),
             "amax_history", "scale")
    _refused(lambda: ops.compute_scale(torch.tensor([4.0]), s, s, 448.0), "scale", "scale_inv")
    # Disjoint state: the update still works (amax 4 -> the E4M3 pow2 scale 64).
    scale_inv = torch.ones(1)
    ops.update_delayed_scaling(history, s, scale_inv, counter, 448.0)
    assert s.item() == 64.0 and scale_inv.item() == 1 / 64


def test_gemm_accumulate_out_overlapping_its_operands():
    storage = torch.zeros(16 * 16 + 16)  # float32: out over the first 1 KiB, a's codes in its first 256 bytes
    a = storage.view(torch.uint8)[:256].view(E4M3).view(16, 16)
    a.copy_(torch.eye(16).to(E4M3))
    b = torch.eye(16).to(E4M3)
    one = torch.ones(1)
    _refused(lambda: ops.gemm_accumulate(a, b, one, one, storage[:256].view(16, 16)), "a", "out")
    _refused(lambda: ops.gemm_accumulate(b, b, storage[256:257], one, storage[16:272].view(16, 16)), "a_scale_inv",
             "out")
    out = torch.zeros(16, 16)
    ops.gemm_accumulate(a, b, one, one, out)
    assert torch.equal(out, torch.eye(16))


def test_adam_step_with_shared_state():
    p, g = torch.ones(8), torch.full((8,), 0.5)
    m = torch.zeros(8)
    _refused(lambda: ops.adam_step([p], [g], [m], [m], lr=0.1, step=1), r"exp_avgs\[0\]", r"exp_avg_sqs\[0\]")
    assert torch.equal(p, torch.ones(8))
    buf = torch.zeros(16)
    _refused(lambda: ops.adam_step([buf[:8]], [buf[4:12]], [torch.zeros(8)], [torch.zeros(8)], lr=0.1, step=1),
             r"grads\[0\]", r"params\[0\]")
    found = torch.zeros(1)
    _refused(lambda: ops.adam_step([p], [g], [torch.zeros(8)], [torch.zeros(8)], lr=0.1, step_tensor=found,
                                   found_inf=found), "step_tensor", "found_inf")
    # Grads of two params may share memory: they are only read.
    q = torch.ones(8)
    ops.adam_step([p, q], [g, g], [torch.zeros(8), torch.zeros(8)], [torch.zeros(8), torch.zeros(8)], lr=0.1, step=1)
    assert torch.equal(p, q) and p[0].item() < 1.0
