"""What one training step of a GPT issues, counted on a CPU: fp8amp op calls, the other ops by who
issues them, and the host time of one Linear's forward + backward
(docs/benchmarks.md#where-a-small-models-step-goes).

Not a benchmark (gpu_check.sh runs only bench_*.py): a count, and the counts do not depend on the
width or the token count (only on the number of layers and which have a bias), so the CPU's FP8
emulation can run the GPT-2 small shape (default d 768, 12 layers, 12 heads: where O2 + compile
measured 0.75x BF16 + compile on the H200) on a short sequence. The model trains with
torch.optim.AdamW through fp8amp.initialize (fp8amp.convert for --mode fp8; nothing for bf16)
for one step (the optimizer makes its states), then one step runs under a TorchDispatchMode that
counts every op dispatched at the top level (what runs inside a ScaledTensor's own dispatch is not
seen). Ops that launch nothing on a GPU (views, detach, empty) are left out of the launch counts.

The host time is of a Linear alone, 16 rows x 64 features on the CPU, where its arithmetic is
negligible: the Python and dispatch time a GPU step pays per Linear while the host enqueues (median
of --host-iters forward + backward calls, nn.Linear against Fp8Linear at O2).

Usage: python benchmarks/count_step_ops.py [--mode bf16|fp8|O1|O2] [--d-model 768] [--layers 12]
       [--heads 12] [--seq 16] [--host-iters 200]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

MODES = ("bf16", "fp8", "O1", "O2")
PACKAGE = os.path.dirname(fp8amp.__file__)
#: Ops that launch nothing on a GPU: views, metadata, allocation, the wrapper's detach.
NO_LAUNCH = frozenset({"view", "_unsafe_view", "detach", "transpose", "t", "as_strided", "alias", "unbind", "empty",
                       "empty_strided", "slice", "select", "expand", "reshape", "split", "split_with_sizes",
                       "_record_function_enter_new", "_record_function_exit"})


class CountOps(TorchDispatchMode):
    """The ops dispatched at the top level: ``fp8amp`` {op: calls}; ``launches`` {(op, issuer):
    calls} of the other ops that launch, the issuer being the innermost fp8amp module on the stack
    (``linear.py``, ``optim.py``, ...) or ``"model"`` (the model's code, torch's autograd and
    optimizer utilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8amp: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8amp":
            self.fp8amp[func._opname] += 1
        elif func._opname not in NO_LAUNCH:
            self.launches[(func._opname, _issuer(sys._getframe(1)))] += 1
        return func(*args, **(kwargs or {}))


def _issuer(frame) -> str:
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE) and os.path.basename(path) != "testing.py":
            return os.path.basename(path)
        frame = frame.f_back
    return "model"


def build(mode: str, cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg)
    # fused, as the benchmarks' BF16 baseline (initialize replaces it by fp8amp's at O1/O2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    if mode == "fp8":
        fp8amp.convert(model, optimizer=optimizer, policy="all")
    elif mode in fp8amp.OPT_LEVELS:
        model, optimizer = fp8amp.initialize(model, optimizer, mode, policy="all")
    return model, optimizer


def count_step(model: nn.Module, optimizer, data) -> CountOps:
    """One step (after one that made the optimizer's states) under CountOps."""
    train_step(model, optimizer, *next(data))
    count = CountOps()
    with count:
        train_step(model, optimizer, *next(data))
    return count


def linear_host_seconds(layer: nn.Module, iters: int) -> float:
    """Median seconds of one forward + backward of ``layer`` on 16 rows."""
    x = torch.randn(16, layer.in_features, requires_grad=True)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        layer(x).sum().backward()
        times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="O2")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--host-iters", type=int, default=200)
    args = parser.parse_args()
    cfg = GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    model, optimizer = build(args.mode, cfg)
    count = count_step(model, optimizer, batches(load_text_bytes(max_bytes=1 << 20), 1, args.seq))
    fp8_linears = sum(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    fp8_calls = sum(count.fp8amp.values())
    by_issuer: collections.Counter = collections.Counter()
    for (_, issuer), n in count.launches.items():
        by_issuer[issuer] += n
    print(f"{args.mode}, GPT d {args.d_model}, {args.layers} layers, {fp8_linears} Fp8Linears: one step issues")
    print(f"  fp8amp ops: {fp8_calls}: " + ", ".join(f"{k} {v}" for k, v in sorted(count.fp8amp.items())))
    print(f"  other ops that launch: {sum(by_issuer.values())}, by issuer: "
          + ", ".join(f"{k} {v}" for k, v in by_issuer.most_common()))
    for (name, issuer), n in sorted(count.launches.items(), key=lambda kv: (-kv[1], kv[0])):
        if issuer != "model":
            print(f"    {n:5d}  {name} ({issuer})")
    plain = nn.Linear(64, 64)
    o2, _ = fp8amp.initialize(nn.Sequential(nn.Linear(64, 64)), None, "O2", policy="all")
    t_plain, t_o2 = (linear_host_seconds(layer, args.host_iters) for layer in (plain, o2[0]))
    print(f"  host time of one Linear's forward + backward (16 x 64 on the CPU): nn.Linear {t_plain * 1e6:.0f} us, "
          f"Fp8Linear O2 {t_o2 * 1e6:.0f} us")


if __name__ == "__main__":
    main()
