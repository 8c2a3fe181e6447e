"""Plot training runs from their --log-json files: losses, throughput, drops and expert load.

  python pretrain_gpt_moe.py --log-json runs/a.jsonl
  python tools/plot_run.py runs/a.jsonl [runs/b.jsonl ...] --out runs/a.png [--labels a,b]

Top row, every run overlaid (legend = --labels, default the file names):
  loss        train lm loss (lines) and valid loss (markers) against tokens seen
  throughput  tokens/s against tokens seen
  dropped     fraction of routed token choices dropped by capacity, against tokens seen
Below, one heatmap per run that logged `expert_counts` (MoE runs): rows are (layer, expert),
columns the logged iterations, colour the expert's kept tokens divided by the layer's mean
(1 = perfectly balanced, one scale 0..2 for every run, brighter above); white lines separate layers.

Tokens seen = iteration x tokens per iteration, where tokens per iteration is
`tokens_per_s * ms_per_iter / 1000` of the run's train records. A file that is not a run log
(no train records with iteration, loss, tokens_per_s, ms_per_iter) is refused with
`error: ...` and exit status 2; nothing is written then. The PNG is written to a temporary
name and renamed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field

TRAIN_KEYS = ("iteration", "loss", "tokens_per_s", "ms_per_iter")


class NotARunLog(ValueError):
    """The file is not a --log-json file of the trainer."""


@dataclass
class Run:
    """One run log: train records, eval records (split 'valid'), tokens per iteration."""

    label: str
    train: list = field(default_factory=list)
    valid: list = field(default_factory=list)
    tokens_per_iter: float = 0.0

    def tokens(self, iteration: float) -> float:
        return iteration * self.tokens_per_iter


def read_run(path: str, label: str) -> Run:
    """Parse a JSON-lines run log; raises NotARunLog saying why it is not one."""
    if not os.path.isfile(path):
        raise NotARunLog(f"{path}: no such file")
    run = Run(label)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise NotARunLog(f"{path} is not a run log (not UTF-8 text)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise NotARunLog(f"{path} is not a run log (line {n} is not a JSON object)") from None
        if not isinstance(rec, dict):
            raise NotARunLog(f"{path} is not a run log (line {n} is not a JSON object)")
        if "split" in rec:
            if rec["split"] == "valid" and isinstance(rec.get("iteration"), int) and "loss" in rec:
                run.valid.append(rec)
        elif all(isinstance(rec.get(k), (int, float)) for k in TRAIN_KEYS):
            run.train.append(rec)
    if not run.train:
        raise NotARunLog(
            f"{path} is not a run log (no training records with {', '.join(TRAIN_KEYS)}; "
            f"write one with pretrain_gpt_moe.py --log-json)"
        )
    first = run.train[0]
    run.tokens_per_iter = first["tokens_per_s"] * first["ms_per_iter"] / 1e3
    return run


def load_matrix(run: Run):
    """(rows [(layer, expert)], iterations, matrix [rows, iterations] of count / layer mean) or None."""
    recs = [r for r in run.train if isinstance(r.get("expert_counts"), dict) and r["expert_counts"]]
    if not recs:
        return None
    layers = sorted({int(k) for r in recs for k in r["expert_counts"]})
    sizes = {l: max(len(r["expert_counts"].get(str(l), [])) for r in recs) for l in layers}
    rows = [(l, e) for l in layers for e in range(sizes[l])]
    cols = []
    for r in recs:
        col = []
        for l in layers:
            c = r["expert_counts"].get(str(l)) or [math.nan] * sizes[l]
            mean = sum(c) / len(c) if c else math.nan
            col += [x / mean if mean and not math.isnan(mean) else math.nan for x in c]
        cols.append(col)
    matrix = [[cols[j][i] for j in range(len(cols))] for i in range(len(rows))]
    return rows, [r["iteration"] for r in recs], matrix


def plot(runs: list[Run], out: str, dpi: int = 80) -> None:
    """Draw the figure described in the module docstring and write it to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    heat = [(r, m) for r in runs if (m := load_matrix(r)) is not None]
    ncols = max(1, min(len(heat), 2))
    nrows_heat = -(-len(heat) // ncols)
    fig = plt.figure(figsize=(13, 3.6 + 3.0 * nrows_heat), dpi=dpi)
    grid = fig.add_gridspec(1 + nrows_heat, 3 * ncols)
    span = 3 * ncols // 3
    ax_loss = fig.add_subplot(grid[0, 0:span])
    ax_tps = fig.add_subplot(grid[0, span : 2 * span])
    ax_drop = fig.add_subplot(grid[0, 2 * span : 3 * span])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        x = [run.tokens(r["iteration"]) for r in run.train]
        ax_loss.plot(x, [r["loss"] for r in run.train], color=c, lw=1.2, label=f"{run.label} train")
        if run.valid:
            ax_loss.plot(
                [run.tokens(r["iteration"]) for r in run.valid],
                [r["loss"] for r in run.valid],
                color=c,
                ls="--",
                marker="o",
                ms=4,
                label=f"{run.label} valid",
            )
        ax_tps.plot(x, [r["tokens_per_s"] for r in run.train], color=c, lw=1.0, label=run.label)
        ax_drop.plot(x, [100 * r.get("dropped_frac", 0.0) for r in run.train], color=c, lw=1.0, label=run.label)
    from matplotlib.ticker import FuncFormatter

    short = FuncFormatter(
        lambda v, _: f"{v / 1e6:g}M" if abs(v) >= 1e6 else f"{v / 1e3:g}k" if abs(v) >= 1e3 else f"{v:g}"
    )
    for ax, title, ylabel in (
        (ax_loss, "loss", "lm loss"),
        (ax_tps, "throughput", "tokens/s"),
        (ax_drop, "dropped by capacity", "% of routed choices"),
    ):
        ax.xaxis.set_major_formatter(short)
        ax.set_title(title)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=7)
    ax_tps.legend(fontsize=7)
    for k, (run, (rows, iters, matrix)) in enumerate(heat):
        r, c = 1 + k // ncols, (k % ncols) * 3
        ax = fig.add_subplot(grid[r, c : c + 3])
        data = np.array(matrix, dtype=float)
        im = ax.imshow(
            data,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=2.0,
            extent=(iters[0] - 0.5, iters[-1] + 0.5, len(rows) - 0.5, -0.5),
        )
        for b in range(1, len(rows)):
            if rows[b][0] != rows[b - 1][0]:
                ax.axhline(b - 0.5, color="white", lw=1.5)
        ticks = [i for i, (l, e) in enumerate(rows) if e == 0]
        ax.set_yticks(ticks, [f"layer {rows[i][0]}" for i in ticks], fontsize=7)
        ax.set_xlabel("iteration")
        ax.set_ylabel("experts of each MoE layer", fontsize=8)
        ax.set_title(f"{run.label}: expert load / layer mean", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01, extend="max")  # same scale for every run
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}.png"
    try:
        fig.savefig(tmp, format="png", dpi=dpi)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", metavar="RUN.jsonl", help="--log-json files of the trainer")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--labels", help="comma-separated legend labels, one per log (default: file names)")
    p.add_argument("--dpi", type=int, default=80)
    args = p.parse_args(argv)
    labels = [os.path.splitext(os.path.basename(f))[0] for f in args.logs]
    if args.labels is not None:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(args.logs):
            print(f"error: --labels has {len(labels)} names for {len(args.logs)} logs", file=sys.stderr)
            sys.exit(2)
    if not args.out.lower().endswith(".png"):
        print(f"error: --out {args.out}: the figure is a PNG, name it FILE.png", file=sys.stderr)
        sys.exit(2)
    try:
        runs = [read_run(f, lab) for f, lab in zip(args.logs, labels)]
    except NotARunLog as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    plot(runs, args.out, args.dpi)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
