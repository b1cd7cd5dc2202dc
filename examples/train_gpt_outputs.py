"""What examples/train_gpt.py leaves in its --out directory: metrics.csv (a row a step), train.png
(loss against step for every precision; tokens/s and peak memory beside it) and summary.md (the
ratios to the baseline, BF16, which is float32 on a CPU)."""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

BASELINES = ("bf16", "fp32")  # fp32: what the bf16 baseline runs as on a CPU
FINAL_LOSS_STEPS = 10  # the final train loss is the mean of the last steps' losses (one step is noisy)


@dataclass
class RunRow:
    """One training step of one precision; throughput and memory on log steps, the validation
    loss on evaluation steps, None elsewhere."""
    precision: str
    step: int
    loss: float
    val_loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_memory_gib: Optional[float] = None


@dataclass
class PrecisionSummary:
    precision: str
    first_loss: float
    final_loss: float
    val_loss: Optional[float]
    tokens_per_s: float
    peak_memory_gib: Optional[float]


def summarize(rows: list[RunRow]) -> list[PrecisionSummary]:
    """One summary a precision, in the order they ran. Tokens/s is the median over the log
    intervals after the first (which holds compilation and warm-up), the only one if there is one."""
    summaries = []
    for precision in dict.fromkeys(r.precision for r in rows):
        mine = [r for r in rows if r.precision == precision]
        throughputs = [r.tokens_per_s for r in mine if r.tokens_per_s is not None]
        memories = [r.peak_memory_gib for r in mine if r.peak_memory_gib is not None]
        vals = [r.val_loss for r in mine if r.val_loss is not None]
        summaries.append(PrecisionSummary(
            precision=precision, first_loss=mine[0].loss,
            final_loss=statistics.fmean(r.loss for r in mine[-FINAL_LOSS_STEPS:]),
            val_loss=vals[-1] if vals else None,
            tokens_per_s=statistics.median(throughputs[1:] or throughputs),
            peak_memory_gib=max(memories) if memories else None))
    return summaries


def baseline_of(summaries: list[PrecisionSummary]) -> PrecisionSummary:
    """BF16 (fp32 on a CPU) when it ran, else the first precision."""
    return next((s for s in summaries if s.precision in BASELINES), summaries[0])


def write_metrics_csv(path: Path, rows: list[RunRow]) -> None:
    names = [f.name for f in fields(RunRow)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for row in rows:
            writer.writerow(["" if (v := getattr(row, n)) is None else (f"{v:.6g}" if isinstance(v, float) else v)
                             for n in names])


def write_plot(path: Path, rows: list[RunRow], summaries: list[PrecisionSummary], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed, ax_memory) = plt.subplots(
        1, 3, figsize=(13, 4), gridspec_kw=dict(width_ratios=[2.2, 1, 1]), layout="constrained")
    names = [s.precision for s in summaries]
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    for i, name in enumerate(names):
        mine = [r for r in rows if r.precision == name]
        # FP8 curves often lie on the baseline's: a line style each keeps them apart
        ax_loss.plot([r.step for r in mine], [r.loss for r in mine], ("-", "--", ":", "-.")[i % 4],
                     color=colors[name], lw=1.2, label=f"{name} train")
        val = [r for r in mine if r.val_loss is not None]
        ax_loss.plot([r.step for r in val], [r.val_loss for r in val], "o", color=colors[name], ms=5,
                     label=f"{name} validation")
    ax_loss.set(xlabel="step", ylabel="loss (nats a byte)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)

    ax_speed.bar(names, [s.tokens_per_s for s in summaries], color=[colors[n] for n in names])
    ax_speed.set(title="tokens/s", ylabel="tokens/s (median after warm-up)")
    memories = [s.peak_memory_gib for s in summaries]
    if all(m is not None for m in memories):
        ax_memory.bar(names, memories, color=[colors[n] for n in names])
        ax_memory.set(title="peak memory", ylabel="GiB (torch.cuda.max_memory_allocated)")
    else:
        ax_memory.set(title="peak memory", xticks=[], yticks=[])
        ax_memory.text(0.5, 0.5, "not measured on a CPU", ha="center", va="center", transform=ax_memory.transAxes)
    for ax in (ax_speed, ax_memory):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def ratio(value: Optional[float], base: Optional[float]) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}×"


def write_summary(path: Path, summaries: list[PrecisionSummary], meta: dict, title: str) -> None:
    base = baseline_of(summaries)
    lines = [f"# {title}", "",
             f"{meta['device']}, torch {meta['torch']}, preset {meta['preset']} (seq_len {meta['seq_len']}), "
             f"{meta['steps']} steps of batch {meta['batch']} a process, {meta['processes']} process(es), "
             f"compile {'on' if meta['compile'] else 'off'}, FP8 saved activations "
             f"{'on' if meta['fp8_activations'] else 'off'}.", "",
             f"| precision | final train loss | val loss | tokens/s | tokens/s vs {base.precision} | "
             f"peak memory (GiB) | memory vs {base.precision} |",
             "|---|---|---|---|---|---|---|"]
    for s in summaries:
        memory = "n/a (CPU)" if s.peak_memory_gib is None else f"{s.peak_memory_gib:.2f}"
        val = "–" if s.val_loss is None else f"{s.val_loss:.4f}"
        lines.append(f"| {s.precision} | {s.final_loss:.4f} | {val} | {s.tokens_per_s:,.0f} | "
                     f"{ratio(s.tokens_per_s, base.tokens_per_s)} | {memory} | "
                     f"{ratio(s.peak_memory_gib, base.peak_memory_gib)} |")
    lines += ["", f"Ratios are to {base.precision}"
              + (" (the bf16 baseline runs in float32 on a CPU)" if base.precision == "fp32" else "")
              + f". Final train loss: the mean of the last {FINAL_LOSS_STEPS} steps. Tokens/s: the median over the "
              "log intervals after the first (compilation and warm-up). On a CPU the FP8 precisions are "
              "emulated by the reference kernels: their speed says nothing about a GPU's.", ""]
    path.write_text("\n".join(lines))


def write_outputs(out: Path, rows: list[RunRow], summaries: list[PrecisionSummary], meta: dict) -> list[Path]:
    """Writes the three files into out; returns their paths."""
    title = f"GPT training, {' vs '.join(s.precision for s in summaries)}: {meta['device']}, preset {meta['preset']}"
    paths = [out / "metrics.csv", out / "train.png", out / "summary.md"]
    write_metrics_csv(paths[0], rows)
    write_plot(paths[1], rows, summaries, title)
    write_summary(paths[2], summaries, meta, title)
    return paths
