"""Render docs/img/profile_timeline.png: the named ranges of one iteration, two ranks.

    python docs/img/make_profile_timeline.py [--out docs/img/profile_timeline.png]
    sudo python docs/img/make_profile_timeline.py --emulated 200mbit   # the published one

Trains a small GPT-2 MoE for 3 iterations on 2 CPU processes (gloo, expert parallel 2,
Lina on), profiles iteration 3 on both ranks with --profile, and draws the
`moe/*`, `lina/*` and `train/step` ranges of each rank's Chrome trace as a timeline.
With `--emulated RATE` the two processes run as two emulated nodes, one process each
(scripts/emulate_cluster.sh, needs root), joined by a link shaped to RATE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LANES = ["train/step", "moe/router", "moe/dispatch", "moe/all_to_all", "moe/experts", "moe/combine", "lina/micro_op"]
COLORS = {
    "train/step": "#bbbbbb",
    "moe/router": "#4c72b0",
    "moe/dispatch": "#55a868",
    "moe/all_to_all": "#c44e52",
    "moe/experts": "#8172b2",
    "moe/combine": "#ccb974",
    "lina/micro_op": "#64b5cd",
}


def _train(rank: int, world: int, argv: list[str]) -> None:
    from megatron_moe.arguments import parse_args
    from megatron_moe.training import pretrain

    pretrain(parse_args(argv))


def make_traces(work: str, emulated: str | None = None) -> list[str]:
    from megatron_moe.data.preprocess import prepare_sample_data
    from megatron_moe.testing import spawn

    data = os.path.join(work, "sample")
    prepare_sample_data(data, vocab_size=512)
    prof = os.path.join(work, "prof")
    argv = [
        "--data-path",
        data,
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "2",
        "--moe-schedule",
        "baseline",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "16",
        "--train-iters",
        "3",
        "--eval-interval",
        "0",
        "--eval-iters",
        "1",
        "--lina",
        "--lina-partition-mb",
        "0.05",
        "--profile",
        "--profile-step-start",
        "2",
        "--profile-step-end",
        "3",
        "--profile-ranks",
        "0",
        "1",
        "--profile-dir",
        prof,
    ]
    if emulated is None:
        spawn(_train, 2, argv, timeout=600)
    else:
        cmd = [
            "bash",
            os.path.join(ROOT, "scripts", "emulate_cluster.sh"),
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--inter-node-rate",
            emulated,
            "--timeout",
            "600",
            "--",
            os.path.join(ROOT, "pretrain_gpt_moe.py"),
            *argv,
        ]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return [os.path.join(prof, f) for f in sorted(os.listdir(prof))]


def draw(traces: list[str], out: str, emulated: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.2 + 1.5 * len(traces)), sharex=True)
    t0 = None
    per_rank = []
    for path in traces:
        with open(path) as f:
            ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("name") in LANES]
        per_rank.append(ev)
        start = min(e["ts"] for e in ev if e["name"] == "train/step")
        t0 = start if t0 is None else min(t0, start)
    for r, (ax, ev) in enumerate(zip(axes, per_rank)):
        for e in ev:
            lane = LANES.index(e["name"])
            ax.broken_barh(
                [((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.02))], (lane - 0.4, 0.8), facecolors=COLORS[e["name"]]
            )
        ax.set_yticks(range(len(LANES)), LANES, fontsize=7)
        ax.invert_yaxis()
        ax.set_ylabel(f"rank {r}", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms since the start of the profiled iteration")
    where = f"2 emulated nodes x 1 process, {emulated} link" if emulated else "2 CPU processes"
    axes[0].set_title(
        f"One iteration, EP=2 on {where} (gloo), Lina on: "
        "forward then backward; Lina micro-ops launch between all-to-alls",
        fontsize=9,
    )
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "profile_timeline.png"))
    ap.add_argument(
        "--emulated",
        metavar="RATE",
        default=None,
        help="run as 2 emulated nodes x 1 process with this inter-node rate (e.g. 200mbit; root)",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        draw(make_traces(work, args.emulated), args.out, args.emulated)
    print(args.out)


if __name__ == "__main__":
    main()
