"""Helpers shared by the GPU benchmarks (this file is no benchmark: gpu_check.sh runs bench_*.py).

- require_gpu: the clear exit on a machine without a (suitable) CUDA GPU.
- rotation_sets: how many input sets to rotate through so that no call reads from L2.
- median_seconds: event-timed batches of back-to-back calls, median per call.
- interleaved_seconds: the same for several functions in alternation (ratios of like kernels).
- copy_bandwidth: the measured device-to-device copy bandwidth (the floor of memory-bound ops).
- warm_up_gpu: clocks up and cuBLAS loaded before the first timed shape.
- markdown_table, report: the table printed last and written to $OUT/bench_<name>.md.
- parse_mkn, parse_subset: argparse types for MxKxN shape lists and --modes subsets.
- import_torchao: torchao's float8 training conversion, or why it is not there.
- dynamo_summary: how many graphs torch.compile made and where it broke them (a silent fallback
  to eager would otherwise pass for a slow compiled run).
- RunResult, run_guarded, free_memory: one training mode's outcome, a mode run so that its failure
  (out of memory, an error) becomes a table row, and the memory handed back between modes.
- StepClock: per-step times of a training loop; PhaseClock: the same cut into the step's phases,
  host and GPU side by side.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

L2_BYTES = 60 * 2**20  # H200 (torch.cuda.get_device_properties().L2_cache_size)
FP8_PEAK_FLOPS = 1979e12  # H200 / H100 SXM dense FP8 (datasheet)
BF16_PEAK_FLOPS = 989.5e12  # H200 / H100 SXM dense BF16 (datasheet)
SAMPLE_SECONDS = 0.02  # length of one timed batch in median_seconds


def require_gpu(name: str, min_capability: Optional[tuple[int, int]] = None) -> None:
    """Exits (status 1, message on stderr) unless a CUDA GPU of at least min_capability is here."""
    if not torch.cuda.is_available():
        sys.exit(f"{name}: needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure")
    if min_capability is not None and torch.cuda.get_device_capability() < min_capability:
        sys.exit(f"{name}: {torch.cuda.get_device_name()} has compute capability "
                 f"{torch.cuda.get_device_capability()}; FP8 GEMMs need "
                 f"{min_capability[0]}.{min_capability[1]} or newer")


def rotation_sets(bytes_per_set: int, min_sets: int = 1, max_sets: Optional[int] = 8, cover: int = 4) -> int:
    """The number of input sets whose bytes together exceed cover x the L2 cache, clamped."""
    sets = max(min_sets, math.ceil(cover * L2_BYTES / max(bytes_per_set, 1)))
    return sets if max_sets is None else max(min_sets, min(max_sets, sets))


def median_seconds(fn: Callable[[int], object], samples: int, sample_seconds: float = SAMPLE_SECONDS) -> float:
    """Median time of one fn(i) call (i rotates the operand set), from batches of calls.

    Each sample is a batch of back-to-back calls between two CUDA events, the batch sized to
    last about sample_seconds, so launch overhead hides behind the GPU where it can, as in
    training; where the host is slower than the GPU, the time is the host's.
    """
    return statistics.median(interleaved_seconds([fn], samples, sample_seconds)[0])


def interleaved_seconds(fns: Sequence[Callable[[int], object]], samples: int,
                        sample_seconds: float = SAMPLE_SECONDS) -> list[list[float]]:
    """Per-call times of several functions measured in alternation: sample s times a batch of
    fns[0], then of fns[1], ... back to back, so that clock and thermal drift during the run hit
    all of them alike. Returns, per function, the per-call time of each sample; compare two
    functions by the median of their per-sample ratios (what a same-kernel comparison needs:
    separately timed medians drift apart by several percent on a GPU whose clocks move)."""
    for fn in fns:
        for i in range(3):
            fn(i)
    torch.cuda.synchronize()
    batches = []
    for fn in fns:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(0)
        end.record()
        torch.cuda.synchronize()
        batches.append(max(1, min(1000, round(sample_seconds / max(start.elapsed_time(end) * 1e-3, 1e-7)))))
    batch = min(batches)  # the same batch for all, so each sample covers the same calls
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
              for _ in range(samples)]
    for s in range(samples):
        for fn, (start, end) in zip(fns, events[s]):
            start.record()
            for i in range(batch):
                fn(s * batch + i)
            end.record()
    torch.cuda.synchronize()
    return [[events[s][f][0].elapsed_time(events[s][f][1]) * 1e-3 / batch for s in range(samples)]
            for f in range(len(fns))]


def copy_bandwidth(iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (median of
    `iters` copies of 1 GiB).

    Timed with direct launches: a 1 GiB copy has no launch overhead to hide, and the same copy
    replayed from a CUDA graph ran slower on the H200 (2.8 against 4.2 TB/s, 2026-11-30).
    """
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    return 2 * src.numel() / (ms * 1e-3)


def warm_up_gpu() -> None:
    """Clocks up and cuBLAS(Lt) loaded before the first timed shape."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        x @ x
    torch.cuda.synchronize()
    del x


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def report(name: str, text: str) -> None:
    """Prints text (the table, last) and, with $OUT set, writes it to $OUT/bench_<name>.md."""
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"bench_{name}.md"), "w") as f:
            f.write(text)


def dynamo_reset_counters() -> None:
    try:
        from torch._dynamo.utils import counters

        counters.clear()
    except Exception:  # private API: a diagnostic only
        pass


def dynamo_summary() -> str:
    """'N graphs, M breaks' since the last dynamo_reset_counters(), with the first break reason, and
    how many compiled graphs did not become CUDA graphs where a mode asked for them."""
    try:
        from torch._dynamo.utils import counters

        graphs = counters["stats"].get("unique_graphs", 0)
        breaks = sum(counters["graph_break"].values())
        text = f"{graphs} graph{'s' if graphs != 1 else ''}, {breaks} break{'s' if breaks != 1 else ''}"
        if breaks:
            text += f" (first: {next(iter(counters['graph_break']))[:120]!r})"
        skips = counters["inductor"].get("cudagraph_skips", 0)
        if skips:
            text += f", {skips} CUDA-graph skip{'s' if skips != 1 else ''} (TORCH_LOGS=perf_hints says why)"
        return text
    except Exception:  # private API: a diagnostic only
        return "dynamo counters unavailable"


def set_recompile_limit(limit: int) -> None:
    """Raises dynamo's per-code-object recompile limit (named cache_size_limit before torch 2.6),
    so that compiling many shapes or module instances never falls back to eager silently."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(limit, getattr(config, name)))


def parse_mkn(text: str) -> list[tuple[int, int, int]]:
    """argparse type of --shapes: 'MxKxN,MxKxN,...' (M rows/tokens, K inner, N out)."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"takes MxKxN,MxKxN,... (e.g. 8192x4096x14336), got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_subset(text: str, choices: Sequence[str]) -> list[str]:
    """A comma-separated subset of choices, returned in the order of choices."""
    picked = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in picked if c not in choices]
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"takes a comma-separated subset of {', '.join(choices)}; got {text!r}")
    return [c for c in choices if c in picked]


def import_torchao() -> tuple[Optional[Callable], str]:
    """(torchao.float8.convert_to_float8_training or None, a note for the table)."""
    try:
        import torchao
        from torchao.float8 import convert_to_float8_training
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "torchao":
            return None, "torchao: not installed"
        return None, f"torchao: import failed ({type(e).__name__}: {e})"
    except Exception as e:  # installed but broken (e.g. built for another torch)
        return None, f"torchao: import failed ({type(e).__name__}: {e})"
    return convert_to_float8_training, f"torchao {getattr(torchao, '__version__', '?')}"


class StepClock:
    """Per-step times: CUDA events on a GPU (the GPU's time, host gaps included), the host clock on
    a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) * 1e-3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


#: The phases of a training step that PhaseClock tells apart (fp8amp.testing.train_step's order).
PHASES = ("forward", "backward + clip", "optimizer.step", "zero_grad + loop")


class PhaseClock:
    """Where a training step's time goes: at the start and end of ``model``'s forward (module hooks,
    the first and the last to run) and of ``optimizer.step`` (the instance's step wrapped, hooks
    included), the host clock and, on a GPU, a CUDA event. Between two marks, the host's time is
    what it took to enqueue that phase, the GPU's what passed on the GPU between reaching the two
    points: both for each phase, so that a host-bound step shows which phase's host time grew, and
    a GPU wait (a sync, an idle GPU) shows where it sits. Marks are taken between :meth:`start`
    and :meth:`stop` only."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[int, float, Optional[torch.cuda.Event]]] = []
        self.on = False
        model.register_forward_pre_hook(lambda *_: self._mark(0), prepend=True)
        model.register_forward_hook(lambda *_: self._mark(1))
        step = optimizer.step

        def timed_step(*args, **kwargs):
            self._mark(2)
            out = step(*args, **kwargs)
            self._mark(3)
            return out

        optimizer.step = timed_step

    def _mark(self, phase: int) -> None:
        if not self.on:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, time.perf_counter(), event))

    def start(self) -> None:
        self.on = True

    def stop(self) -> None:
        """Ends the last step's last phase (as if the next forward began) and stops marking."""
        self._mark(0)
        self.on = False

    def medians(self) -> dict[str, tuple[float, Optional[float]]]:
        """Per phase: (the host's seconds, the GPU's seconds or None on a CPU), medians over the steps."""
        if self.cuda:
            torch.cuda.synchronize()
        host: dict[int, list[float]] = {i: [] for i in range(len(PHASES))}
        gpu: dict[int, list[float]] = {i: [] for i in range(len(PHASES))}
        for (i, t0, e0), (j, t1, e1) in zip(self.marks, self.marks[1:]):
            if j != (i + 1) % len(PHASES):  # a stop and the next start: no phase between them
                continue
            host[i].append(t1 - t0)
            if self.cuda:
                gpu[i].append(e0.elapsed_time(e1) * 1e-3)
        return {name: (statistics.median(host[i]), statistics.median(gpu[i]) if self.cuda else None)
                for i, name in enumerate(PHASES) if host[i]}


@dataclass
class RunResult:
    """One training mode of a benchmark: its median step, peak memory, last loss and warm-up time,
    or why it has none (``failure``); ``notes`` for the table (graphs, layers in FP8, ...)."""

    step_seconds: Optional[float] = None
    peak_bytes: Optional[int] = None
    final_loss: Optional[float] = None
    warmup_seconds: Optional[float] = None
    failure: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    #: PhaseClock.medians() of the timed steps, where the benchmark was asked for them
    phases: dict[str, tuple[float, Optional[float]]] = field(default_factory=dict)


def run_guarded(run: Callable[[], RunResult], detail_chars: int = 100) -> RunResult:
    """``run()``, or a RunResult naming its failure (the traceback goes to stderr), so that one mode
    that runs out of memory or breaks leaves the others' rows."""
    try:
        return run()
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        if isinstance(e, torch.OutOfMemoryError):
            return RunResult(failure="out of memory")
        return RunResult(failure=f"error: {type(e).__name__}: {str(e)[:detail_chars]}")


def run_modes(keys: Sequence[str], run: Callable[[str], RunResult], *, skip: Callable[[str], Optional[str]],
              per_step: float, unit: str, label: Callable[[str], str] = str,
              start: Optional[float] = None) -> dict[str, RunResult]:
    """The rows of a training benchmark: ``run(key)`` for each mode under :func:`run_guarded`, its
    memory freed before the next, a progress line each on stderr (``per_step`` units a step; the
    seconds since ``start``, default now). A mode for which ``skip(key)`` gives a reason (torchao
    not installed, say) is not run: its row names the reason."""
    start = time.perf_counter() if start is None else start
    results: dict[str, RunResult] = {}
    for key in keys:
        reason = skip(key)
        if reason is not None:
            results[key] = RunResult(failure=reason)
            continue
        results[key] = r = run_guarded(lambda: run(key))
        free_memory()
        text = f"{per_step / r.step_seconds:,.0f} {unit}/s, loss {r.final_loss:.4f}" if r.step_seconds else r.failure
        print(f"  {label(key)}: {text} ({'; '.join(r.notes)}) [{time.perf_counter() - start:.0f} s]",
              file=sys.stderr, flush=True)
    return results


def torchao_skip(modes: dict, torchao_convert, torchao_note: str) -> Callable[[str], Optional[str]]:
    """:func:`run_modes`' ``skip`` for modes with a ``kind``: a torchao mode where torchao is
    missing (``torchao_convert`` None, as :func:`import_torchao` returns it) is skipped with its note."""
    return lambda key: torchao_note if modes[key].kind == "torchao" and torchao_convert is None else None


def free_memory(reset_dynamo: bool = True) -> None:
    """The last mode's memory back before the next mode builds its model; with ``reset_dynamo``,
    its compiled graphs too."""
    gc.collect()
    if reset_dynamo:
        torch._dynamo.reset()
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
