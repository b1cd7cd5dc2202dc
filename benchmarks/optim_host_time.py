"""Host time of the optimizer step and of the forward + backward, on the machine that drives the
GPU: fp8amp.testing's GPT (the gpt2 preset of bench_train: d 768, 12 layers, 16 x 1024 tokens)
with torch.optim.AdamW(fused=True), with O2 and every Linear kept in BF16 compute (what the default
policy does at this size), and with O2 and every Linear in FP8 (docs/benchmarks.md, "The 86M GPT
with the default policy and CUDA graphs").

Each timed call starts after a device synchronize, so the launch queue is empty and the host
clock measures the host's own work: Python, dispatch and launches; one more column times
optimizer.step() in the loop, right after the forward and backward with no synchronize, as a
training loop runs it. On a CPU (FP8 emulated) it
runs a small model and measures the arithmetic too: a smoke run, not a measurement.

The optimizer steps each cohort of params through a kept ``fast.AdamPlan`` (its buffers checked
once; each step passes its grads and numbers), or through the ``adam_step`` op where it cannot keep
one. The fused calls' host time is split once more: the same steps as ``adam_step`` calls, every
list passed and checked again (what each step cost before the plans), and those calls on the meta
device, where only torch's dispatch of the argument lists and the Meta kernel run, the column
"of those torch's dispatch"; the rest is fp8amp's binding, checks and launches.

The last row makes and times the first one's model and optimizer again, after the others in the
same process: an A/A row, whose difference from the first is the run's own drift (the allocator's
and the GPU's state after the other modes), in every column.

``--profile STEPS`` adds, for each optimizer, where ``step()``'s host time goes: its host-side
events under torch.profiler over STEPS steps (each after a synchronize), the largest by self
time, with their calls a step: Python ops, fp8amp's fused op, the CUDA runtime's launches.

Usage: python benchmarks/optim_host_time.py [--repeats N] [--profile STEPS]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.utils._pytree import tree_map_only

import fp8amp
import fp8amp.ops.fast as fast
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes
from _common import markdown_table, report
from bench_train import PRESETS

MODES = ("torch AdamW(fused)", "O2, Linears kept in BF16 compute", "O2, every Linear in FP8",
         "torch AdamW(fused), again")


def make(mode: str, cfg: GPTConfig, device: torch.device):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if mode == MODES[1]:
        return fp8amp.initialize(model, optimizer, "O2", module_filter_fn=lambda module, name: False)
    if mode == MODES[2]:
        return fp8amp.initialize(model, optimizer, "O2", policy="all")
    return model, optimizer


def host_seconds(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class FusedCalls:
    """The host time of each fused call of the optimizer's steps (a kept plan's step, or an
    ``adam_step`` call) and each as the ``adam_step`` call it stands for (args, kwargs)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.op_calls: list[tuple[tuple, dict]] = []

    def _timed(self, fn, *a):
        start = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.seconds.append(time.perf_counter() - start)

    @contextlib.contextmanager
    def timing(self, optimizer):
        calls, adam_step, adam_plan = self, fast.adam_step, fast.AdamPlan

        def timed_adam_step(*a, **k):
            calls.op_calls.append((a, k))
            return calls._timed(lambda: adam_step(*a, **k))

        class TimedPlan:
            def __init__(self, *buffers):
                self.plan, self.buffers = adam_plan(*buffers), buffers

            def step(self, grads, grad_scale_invs, lr, beta1, beta2, eps, weight_decay, adamw, maximize, step,
                     step_tensor, found_inf, margin, stochastic_rounding=False, rounding_seed=0):
                params, exp_avgs, exp_avg_sqs, param_scales, param_scale_invs, *scales = self.buffers
                calls.op_calls.append(((params, grads, exp_avgs, exp_avg_sqs, param_scales, param_scale_invs,
                                        grad_scale_invs, *scales),
                                       dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                            adamw=adamw, maximize=maximize, step=step, step_tensor=step_tensor,
                                            found_inf=found_inf, margin=margin,
                                            stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)))
                return calls._timed(self.plan.step, grads, grad_scale_invs, lr, beta1, beta2, eps, weight_decay,
                                    adamw, maximize, step, step_tensor, found_inf, margin, stochastic_rounding,
                                    rounding_seed)

        fast.adam_step, fast.AdamPlan = timed_adam_step, TimedPlan
        kept = getattr(optimizer, "_call_lists", {})  # fp8amp's optimizer: its kept plans made again, timed
        kept.clear()
        optimizer.step()
        self.seconds.clear()
        self.op_calls.clear()
        try:
            yield
        finally:
            fast.adam_step, fast.AdamPlan = adam_step, adam_plan
            kept.clear()


def op_seconds(calls: list, repeats: int, device: torch.device) -> float:
    """Host seconds of ``calls`` (one step's, as ``adam_step`` (args, kwargs)) made as op calls."""

    @torch.no_grad()  # as the optimizer's step: the op writes params that require grad
    def run():
        for a, k in calls:
            fast.adam_step(*a, **k)

    run()
    return host_seconds(run, repeats, device)


def dispatch_seconds(calls: list, repeats: int) -> float:
    """Host seconds of the fused op's ``calls`` (argument tuples of one step) with every tensor
    on the meta device: torch's dispatch of the argument lists and the Meta kernel, nothing else."""
    meta_calls = [tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), call) for call in calls]

    @torch.no_grad()
    def run():
        for a, k in meta_calls:
            fast.adam_step(*a, **k)

    run()  # the first meta call's one-time work is not dispatch
    return host_seconds(run, repeats, torch.device("meta"))


def in_loop_seconds(forward_backward, step, repeats: int) -> float:
    """step()'s host time right after forward_backward(), with no synchronize between: as in a
    training loop, where the GPU still runs the backward while the host steps."""
    times = []
    for _ in range(repeats):
        forward_backward()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


PROFILE_TOP = 12  # host-side events listed per optimizer


def host_profile(step, steps: int, device: torch.device) -> str:
    """The host-side events of ``steps`` calls of ``step()`` (each after a synchronize) under
    torch.profiler, the PROFILE_TOP largest by self time: a markdown table, per step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_TOP]
    return markdown_table(["host event", "calls a step", "self µs a step", "total µs a step"],
                          [[e.key, f"{e.count / steps:g}", f"{e.self_cpu_time_total / steps:.1f}",
                            f"{e.cpu_time_total / steps:.1f}"] for e in events])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also list step()'s host-side events under torch.profiler over STEPS steps")
    args = parser.parse_args()
    if args.repeats < 1 or args.profile < 0:
        parser.error("--repeats must be >= 1 and --profile >= 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    if on_gpu:
        cfg, batch = PRESETS["gpt2"]["model"], PRESETS["gpt2"]["batch"]
    else:
        cfg, batch = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32), 2
    x, y = next(iter(batches(load_text_bytes(), batch, cfg.seq_len, device, seed=0)))
    rows, profiles = [], []
    for mode in MODES:
        model, optimizer = make(mode, cfg, device)

        def forward_backward():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, torch.bfloat16, enabled=on_gpu):
                _, loss = model(x, y)
            loss.backward()

        for _ in range(fp8amp.ScalingRecipe().history_len + 2):  # past the scaling warm-up
            forward_backward()
            optimizer.step()
        fb = host_seconds(forward_backward, args.repeats, device)
        fused = FusedCalls()
        with fused.timing(optimizer):
            step = host_seconds(optimizer.step, args.repeats, device)
        op = as_op = dispatch = "–"
        if fused.seconds:
            calls_a_step = len(fused.seconds) // args.repeats
            op = f"{statistics.median(fused.seconds) * calls_a_step * 1e3:.2f}"
            last = fused.op_calls[-calls_a_step:]
            as_op = f"{op_seconds(last, args.repeats, device) * 1e3:.2f}"
            dispatch = f"{dispatch_seconds(last, args.repeats) * 1e3:.2f}"
        in_loop = in_loop_seconds(forward_backward, optimizer.step, args.repeats)
        rows.append([mode, f"{step * 1e3:.2f}", op, as_op, dispatch, f"{in_loop * 1e3:.2f}", f"{fb * 1e3:.2f}"])
        if args.profile:
            profiles.append(f"`step()` of {mode}, host-side events over {args.profile} steps:\n\n"
                            + host_profile(optimizer.step, args.profile, device) + "\n")
    where = torch.cuda.get_device_name() if on_gpu else "CPU (FP8 emulated: not a measurement)"
    # the profiles first, the timing table last (what the smoke test and the docs read)
    text = "".join(p + "\n" for p in profiles)
    text += (f"Host time on {where}, torch {torch.__version__}: GPT d {cfg.d_model}, {cfg.n_layer} layers, "
             f"{x.numel():,} tokens a step, {sum(1 for _ in model.parameters())} params; median of {args.repeats}, "
             "each after a synchronize\n\n"
             + markdown_table(["optimizer / model", "optimizer.step() ms", "of it the fused calls ms",
                               "the same as adam_step calls ms", "of those torch's dispatch ms",
                               "optimizer.step() in the loop ms", "forward + backward ms"], rows) + "\n")
    report("optim_host_time", text)


if __name__ == "__main__":
    main()
