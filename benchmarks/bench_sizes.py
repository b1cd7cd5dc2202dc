"""GPT training step time and peak memory across model widths: fp8amp against BF16, eager against
eager and compiled against compiled (docs/benchmarks.md#model-sizes).

For each width d and token count per step, a GPT (fp8amp.testing.GPT, seq 1024 unless the token
count is smaller) trains on the built-in data with float32 parameters, bfloat16 autocast, gradient
clipping and torch.optim.AdamW(fused=True) in these modes:

    bf16 / bf16-compile        the baselines
    bf16-again / -compile      a second BF16 model, compared with the first: the noise floor of a
                               comparison (an A/A test; with --rounds, interleaved like the others)
    o2-optim / -compile        the BF16 model with fp8amp.optim.AdamW(state_dtypes="O2") alone (no
                               initialize, no scaling hooks): the optimizer's share of what the
                               default policy costs below the crossover
    fp8 / fp8-compile          fp8amp.convert(model, optimizer=..., policy="all"): FP8 compute, fp32 weights
    o1 / o1-compile            fp8amp.initialize(model, optimizer, "O1", policy="all")
    o2 / o2-compile            fp8amp.initialize(model, optimizer, "O2", policy="all")
    default / default-compile  fp8amp.initialize(model, optimizer, "O2", tokens=tokens per step): what the
                               default policy keeps (the whole-step rule, then the per-layer timing)

The fp8/o1/o2 modes put every Linear of the blocks in FP8 whatever its size: they measure FP8
itself, from which docs/benchmarks.md's crossover and convert_policy.STEP_CROSSOVER are made.
"compile" compiles each transformer block (regional compilation: the identical blocks share one
compiled graph, so compile time does not grow with depth). Every mode of one (width, tokens) starts
from the same weights and sees the same batches, prepared on the device beforehand. Warm-up steps
come first (compilation, and fp8amp's current-scaling warm-up of history_len steps), then the timed
steps, each between CUDA events (on a CPU: the host clock); the table shows the median step. Peak
memory is torch.cuda.max_memory_allocated over the timed steps (none on a CPU).

The ratios are against the BF16 run of the same width, tokens and compilation: speed = BF16 step
time / the mode's (> 1: faster), memory = the mode's peak / BF16's. Widths, depths and heads
(head size 64 up to d 1024, 128 above; fewer layers for the wide models keep the run short, and the
per-layer costs that decide the ratio do not depend on depth):

    d      512  768  1024  1536  2048  4096    (any other d: 2 layers, d / 64 heads)
    layers   8   12    12     8     8     4
    heads    8   12    16    12    16    32

--time-limit (seconds, default 450) stops starting new runs once it has passed, so that the whole
default run fits in 8 minutes of an H200; the runs not made are listed as such. The runs go token
count by token count (16k first), width by width within one.

--phases also cuts each step into its phases (forward, backward + clip, optimizer.step, zero_grad and
the loop) and prints, per mode, the host's time to enqueue each and the time that passed on the GPU
between the same points (benchmarks/_common.py's PhaseClock): where a host-bound step's time goes.

--rounds R (R > 1) makes the modes of one (width, tokens) side by side, warms them all up, then
times them in R rounds of --steps steps, each mode once a round in a rotated order. The step of a
small model is host-bound and follows the host's speed, which drifts during a run by more than the
differences measured; interleaved, the drift reaches every mode alike. Each mode's peak memory is
then its resident bytes (params, grads, states after warm-up) plus the most its step allocated
above what was resident, the other modes' models excluded. It needs every mode's model in memory at
once: for the small widths.

Usage: python benchmarks/bench_sizes.py [--sizes 512,768,...] [--tokens 8192,16384]
       [--modes bf16,bf16-compile,fp8,...] [--steps N] [--rounds R] [--phases] [--warmup N] [--time-limit S]
       [--device cuda|cpu]
Prints markdown tables (last); with $OUT set, also writes them to $OUT/bench_sizes.md.
CPU smoke run (FP8 emulated, no meaning as a measurement): --device cpu --sizes 64 --tokens 256 --steps 2
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import NamedTuple, Optional

import torch

import fp8amp
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step
from _common import StepClock, dynamo_reset_counters, dynamo_summary, markdown_table, parse_subset, report
from _common import PHASES, PhaseClock, RunResult, free_memory, run_guarded, set_recompile_limit

SIZES = (512, 768, 1024, 1536, 2048, 4096)
TOKENS = (16384, 8192)  # 16k first: the configuration of the figures known before, should --time-limit cut the run
SEQ_LEN = 1024
#: d_model -> (layers, heads)
SHAPES = {512: (8, 8), 768: (12, 12), 1024: (12, 16), 1536: (8, 12), 2048: (8, 16), 4096: (4, 32)}


class Mode(NamedTuple):
    label: str
    kind: str  # bf16, fp8, O1, O2
    compiled: bool
    policy: Optional[str]  # None: the default policy of convert / initialize


MODES = {
    "bf16": Mode("bf16", "bf16", False, None),
    "bf16-compile": Mode("bf16 + compile", "bf16", True, None),
    "bf16-again": Mode("bf16, a second model", "bf16", False, None),
    "bf16-again-compile": Mode("bf16 + compile, a second model", "bf16", True, None),
    "fp8": Mode("fp8", "fp8", False, "all"),
    "fp8-compile": Mode("fp8 + compile", "fp8", True, "all"),
    "o1": Mode("O1", "O1", False, "all"),
    "o1-compile": Mode("O1 + compile", "O1", True, "all"),
    "o2": Mode("O2", "O2", False, "all"),
    "o2-compile": Mode("O2 + compile", "O2", True, "all"),
    "o2-optim": Mode("BF16, fp8amp's O2 AdamW", "o2-optim", False, None),
    "o2-optim-compile": Mode("BF16 + compile, fp8amp's O2 AdamW", "o2-optim", True, None),
    "default": Mode("O2 default policy", "O2", False, None),
    "default-compile": Mode("O2 default policy + compile", "O2", True, None),
}


def model_config(d_model: int, tokens: int) -> tuple[GPTConfig, int]:
    """(the GPT of width d_model, sequences per step) for ``tokens`` tokens a step."""
    layers, heads = SHAPES.get(d_model, (2, max(1, d_model // 64)))
    seq = min(SEQ_LEN, tokens)
    if tokens % seq:
        raise SystemExit(f"bench_sizes: --tokens must be multiples of {SEQ_LEN} (or smaller than it), got {tokens}")
    return GPTConfig(seq_len=seq, n_layer=layers, n_head=heads, d_model=d_model), tokens // seq


class ModeRun:
    """One mode of one (width, tokens): its model made, converted, compiled and warmed up on
    construction; :meth:`time` trains it over the timed batches, as often as the caller asks
    (once, or once a round when modes are interleaved); :meth:`result` gives the median step."""

    def __init__(self, mode: Mode, cfg: GPTConfig, tokens: int, data: list, args, device: torch.device) -> None:
        self.mode, self.data, self.warmup, self.device = mode, data, args.warmup, device
        self.result_ = RunResult()
        self.times: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.transient_bytes = 0  # the most this mode's step allocated above what was resident
        resident_before = self._allocated()
        dynamo_reset_counters()
        torch.manual_seed(args.seed)
        with device:  # made on the device: a wide model's init on the host would take longer than its run
            model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                      fused=device.type == "cuda")
        policy = {} if mode.policy is None else {"policy": mode.policy}
        if mode.kind == "o2-optim":
            optimizer = fp8amp.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                           state_dtypes="O2")
        elif mode.kind == "fp8":
            model = fp8amp.convert(model, optimizer=optimizer, tokens=tokens, **policy)
        elif mode.kind in fp8amp.OPT_LEVELS:
            model, optimizer = fp8amp.initialize(model, optimizer, mode.kind, tokens=tokens, **policy)
        conversion = fp8amp.conversion_report(model)
        if conversion is not None:
            self.result_.notes.append(f"{len(conversion.converted)} of {len(conversion.decisions)} Linears in FP8")
            step_note = getattr(conversion, "step", None)
            if step_note is not None and mode.policy is None:
                self.result_.notes.append(str(step_note))
        if mode.compiled:
            for block in model.blocks:
                block.compile(dynamic=False)
        self.model, self.optimizer = model, optimizer
        self.phases = PhaseClock(model, optimizer, device) if args.phases else None
        for x, y in data[:self.warmup]:
            self._step(x, y)
        if mode.compiled:
            summary = dynamo_summary()
            reused = summary.startswith("0 graphs, 0 breaks")  # free_memory kept an earlier mode's graphs
            self.result_.notes.append(summary + (" (the blocks' compiled code of an earlier mode of this width, "
                                                 "reused)" if reused else ""))
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.resident_bytes = self._allocated() - resident_before  # params, states: what stays between steps

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.device.type == "cuda" else 0

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return train_step(self.model, self.optimizer, x, y)

    def time(self) -> None:
        """The timed batches once, each step timed."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start_bytes = self._allocated()
        clock = StepClock(self.device)
        clock.mark()
        if self.phases is not None:
            self.phases.start()
        for x, y in self.data[self.warmup:]:
            self.losses.append(self._step(x, y))
            clock.mark()
        if self.phases is not None:
            self.phases.stop()
        self.times += clock.seconds()
        if cuda:
            self.transient_bytes = max(self.transient_bytes, torch.cuda.max_memory_allocated() - start_bytes)

    def result(self) -> RunResult:
        result = self.result_
        result.step_seconds = statistics.median(self.times)
        if self.device.type == "cuda":
            result.peak_bytes = self.resident_bytes + self.transient_bytes
        result.final_loss = self.losses[-1].item()
        if self.phases is not None:
            result.phases = self.phases.medians()
        if not all(torch.isfinite(torch.stack(self.losses)).tolist()):
            result.notes.append("non-finite loss")
        return result


def run_mode(mode: Mode, cfg: GPTConfig, tokens: int, data: list, args, device: torch.device) -> RunResult:
    """One mode on its own: made, warmed up, timed once."""
    run = ModeRun(mode, cfg, tokens, data, args, device)
    run.time()
    return run.result()


def run_interleaved(keys: list[str], cfg: GPTConfig, tokens: int, data: list, args,
                    device: torch.device) -> dict[str, RunResult]:
    """The modes side by side: all made and warmed up first, then timed in args.rounds rounds, each
    mode once a round, the order rotated every round. A drift of the host's speed during the run
    (which sets a small model's step) then reaches every mode alike instead of the one that ran
    while it lasted."""
    runs, failed = {}, {}
    for key in keys:  # a mode that fails (out of memory, say) gets its row named so; the others run
        made = run_guarded(lambda: ModeRun(MODES[key], cfg, tokens, data, args, device), detail_chars=80)
        (failed if isinstance(made, RunResult) else runs)[key] = made
    for r in range(args.rounds):
        order = list(runs)
        for key in order[r % len(order):] + order[:r % len(order)] if order else []:
            timed = run_guarded(lambda: runs[key].time(), detail_chars=80)
            if timed is not None:
                failed[key] = timed
                del runs[key]
    results = {**failed, **{key: run_guarded(run.result, detail_chars=80) for key, run in runs.items()}}
    return {key: results[key] for key in keys}


def crossover_rows(results: dict[tuple[int, int], dict[str, RunResult]]) -> str:
    """The O2 rows in the form of fp8amp.convert_policy.STEP_CROSSOVER."""
    lines = []
    for (d, tokens), by_mode in sorted(results.items()):
        ratios = []
        for key in ("o2", "o2-compile"):
            r, base = by_mode.get(key), by_mode.get(baseline_of(key))
            ok = r is not None and base is not None and r.step_seconds and base.step_seconds
            ratios.append(f"{base.step_seconds / r.step_seconds:.2f}" if ok else "None")
        if ratios != ["None", "None"]:
            lines.append(f"    ({d}, {tokens}, {ratios[0]}, {ratios[1]}),")
    return "\n".join(lines)


def baseline_of(key: str) -> str:
    return "bf16-compile" if MODES[key].compiled else "bf16"


def tables(results: dict[tuple[int, int], dict[str, RunResult]], modes: list[str]) -> str:
    """Three markdown tables: step ms per mode, speed and memory ratios against the BF16 counterpart."""
    header = ["d", "layers", "tokens"]
    ms_rows, speed_rows, memory_rows, notes = [], [], [], []
    compared = [k for k in modes if k != baseline_of(k) and baseline_of(k) in modes]
    for (d, tokens), by_mode in sorted(results.items()):
        cfg, _ = model_config(d, tokens)
        lead = [str(d), str(cfg.n_layer), f"{tokens:,}"]
        ms_rows.append(lead + [f"{r.step_seconds * 1e3:.2f}" if r.step_seconds else (r.failure or "not run")
                               for r in (by_mode[k] for k in modes)])
        speed, memory = [], []
        for key in compared:
            r, base = by_mode[key], by_mode[baseline_of(key)]
            speed.append(f"{base.step_seconds / r.step_seconds:.2f}x" if r.step_seconds and base.step_seconds
                         else "–")
            memory.append(f"{r.peak_bytes / base.peak_bytes:.2f}x" if r.peak_bytes and base.peak_bytes else "–")
        speed_rows.append(lead + speed)
        memory_rows.append(lead + memory)
        notes += [f"- d {d}, {tokens:,} tokens, {MODES[k].label}: {'; '.join(by_mode[k].notes)}"
                  for k in modes if by_mode[k].notes]
    labels = [MODES[k].label for k in compared]
    return "\n\n".join([
        "Step time, ms (median)\n\n" + markdown_table(header + [MODES[k].label for k in modes], ms_rows),
        "Speed against the BF16 counterpart (BF16 step time / the mode's; eager against bf16, compiled against "
        "bf16 + compile; > 1: faster)\n\n" + markdown_table(header + labels, speed_rows),
        "Peak memory against the BF16 counterpart (the mode's / BF16's)\n\n" + markdown_table(header + labels,
                                                                                            memory_rows),
        "Notes\n\n" + "\n".join(notes),
    ])


def phase_table(results: dict[tuple[int, int], dict[str, RunResult]], modes: list[str]) -> str:
    """With --phases: per (width, tokens) and mode, each phase's host and GPU ms (medians)."""
    header = ["d", "tokens", "mode"] + [f"{p}: {side}" for p in PHASES for side in ("host", "GPU")]
    rows = []
    for (d, tokens), by_mode in sorted(results.items()):
        for key in modes:
            phases = by_mode[key].phases
            if not phases:
                continue
            cells = []
            for p in PHASES:
                host, gpu = phases.get(p, (None, None))
                cells += [f"{host * 1e3:.2f}" if host is not None else "–", f"{gpu * 1e3:.2f}" if gpu is not None else "–"]
            rows.append([str(d), f"{tokens:,}", MODES[key].label] + cells)
    return ("Phases of the step, ms (medians): the host's time to enqueue each phase and the time that passed on "
            "the GPU between the same points\n\n" + markdown_table(header, rows))


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, got {text!r}")
    return values


def positive(text: str) -> int:
    (value,) = int_list(text) if "," not in text else (None, None)
    if value is None:
        raise argparse.ArgumentTypeError(f"takes one positive integer, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int_list, default=list(SIZES), help="model widths d_model")
    parser.add_argument("--tokens", type=int_list, default=list(TOKENS), help="tokens per step")
    parser.add_argument("--modes", type=lambda t: parse_subset(t, list(MODES)), default=list(MODES),
                        help=", ".join(MODES))
    parser.add_argument("--steps", type=positive, default=8, help="timed steps")
    parser.add_argument("--warmup", type=positive, default=None,
                        help="untimed steps first (default: fp8amp's history_len + 2, i.e. 18)")
    parser.add_argument("--rounds", type=positive, default=1,
                        help="with more than 1: the modes of each (width, tokens) made side by side and timed "
                             "in this many interleaved rounds of --steps steps each (small models, whose host-bound "
                             "step follows the host's speed)")
    parser.add_argument("--time-limit", type=float, default=450.0,
                        help="seconds after which no new run starts (default 450)")
    parser.add_argument("--phases", action="store_true",
                        help="also time the phases of each step (forward, backward + clip, optimizer.step, the "
                             "rest), host and GPU side by side")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        sys.exit(f"bench_sizes: {torch.cuda.get_device_name()} has compute capability "
                 f"{torch.cuda.get_device_capability()}; FP8 GEMMs need 8.9 or newer")
    args.warmup = args.warmup or fp8amp.ScalingRecipe().history_len + 2
    set_recompile_limit(64)
    text_bytes = load_text_bytes()
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (FP8 emulated: not a measurement)"
    print(f"bench_sizes on {where}: widths {args.sizes}, tokens {args.tokens}, {args.warmup} warm-up + "
          f"{args.steps} timed steps, time limit {args.time_limit:g} s", file=sys.stderr, flush=True)

    start = time.perf_counter()
    results: dict[tuple[int, int], dict[str, RunResult]] = {}
    for tokens, d in itertools.product(args.tokens, args.sizes):
        cfg, batch = model_config(d, tokens)
        loader = batches(text_bytes, batch, cfg.seq_len, device, seed=args.seed)
        data = list(itertools.islice(loader, args.warmup + args.steps))
        results[(d, tokens)] = by_mode = {}
        if args.rounds > 1:
            by_mode.update(run_interleaved(args.modes, cfg, tokens, data, args, device))
            for key, r in by_mode.items():
                print(f"  d {d}, {tokens} tokens, {MODES[key].label}: "
                      f"{f'{r.step_seconds * 1e3:.2f} ms' if r.step_seconds else r.failure} "
                      f"[{time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
            free_memory(reset_dynamo=True)
            continue
        for key in args.modes:
            if time.perf_counter() - start > args.time_limit:
                by_mode[key] = RunResult(failure="not run (time limit)")
                continue
            by_mode[key] = run_guarded(lambda: run_mode(MODES[key], cfg, tokens, data, args, device), detail_chars=80)
            r = by_mode[key]
            print(f"  d {d}, {tokens} tokens, {MODES[key].label}: "
                  f"{f'{r.step_seconds * 1e3:.2f} ms' if r.step_seconds else r.failure} "
                  f"[{time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
            free_memory(reset_dynamo=False)  # the next mode's model may not fit beside this one's (d 4096)
        # Dynamo is reset only between widths: within one, the modes whose blocks trace to the same graph
        # (O1, O2 and the default policy above the crossover; BF16 and the default below it) reuse it.
        free_memory(reset_dynamo=True)

    rounds = (f" in each of {args.rounds} rounds, the modes interleaved (made side by side; peak memory: each "
              "mode's resident bytes plus the most its step allocated above them)") if args.rounds > 1 else ""
    text = (f"GPT training step across widths on {where}, torch {torch.__version__}: seq {SEQ_LEN} (or the token "
            f"count if smaller), AdamW(fused), autocast bfloat16 on CUDA, compile per block; {args.warmup} warm-up "
            f"+ {args.steps} timed steps{rounds}, median; {time.perf_counter() - start:.0f} s in all\n\n"
            f"{tables(results, args.modes)}\n")
    if args.phases:
        text += f"\n{phase_table(results, args.modes)}\n"
    rows = crossover_rows(results)
    if rows:
        text += f"\nO2 rows for fp8amp.convert_policy.STEP_CROSSOVER (d, tokens, eager, compiled):\n\n{rows}\n"
    report("sizes", text)


if __name__ == "__main__":
    main()
