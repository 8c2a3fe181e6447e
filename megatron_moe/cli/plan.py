"""Choose the layout and the optimizations for a cluster before launching (`mmoe-plan`).

    # the bundled GPT-2 MoE on 8 nodes x 8 H100 (400 Gb/s per GPU: 3200 Gb/s per node)
    mmoe-plan --nodes 8 --gpus-per-node 8 --gpu h100 --inter-node-gbps 3200 \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512 \\
        --num-experts 64 --micro-batch-size 8 --global-batch-size 512 --bf16

    mmoe-plan profile --out prof.json [model flags]       # measure this machine (torchrun for links)
    mmoe-plan --profile prof.json --nodes 2 ... [model flags]

Takes the trainer's model, MoE, optimizer and training flags (same names, same checks) and a
cluster: nominal data-sheet figures of --gpu, overridden by the link, memory and TFLOP/s flags, or
a profile measured on the user's hardware. Prints the ranked candidates (layout x switches), the
top one's breakdown, and its torchrun and sbatch command lines; --json writes every candidate,
rejected ones with the trainer's or the memory check's reason. `megatron_moe.planner.predict`
says what is modelled. Bad input: one `error: ...` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import Optional

from megatron_moe.arguments import GIVEN, HelpFormatter, add_config_flags, config_from_args
from megatron_moe.fileio import atomic_write_json
from megatron_moe.planner import cluster as cl
from megatron_moe.planner.predict import Predictor, enumerate_candidates, rank

SECTIONS = ("model", "moe", "optim", "train", "opts")
GPT2_VOCAB = 50257  # the GPT-2 tokenizer's vocabulary, when --vocab-size is not given
PLAN_SECTIONS_SKIP = {"train.save", "train.load"}


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, required=True, help="nodes")
    g.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node")
    g.add_argument("--gpu", default="h100", choices=sorted(cl.GPUS), help="data-sheet defaults of the GPU")
    g.add_argument("--intra-node-gbps", type=float, default=None, help="intra-node bandwidth per GPU [Gbit/s]")
    g.add_argument("--inter-node-gbps", type=float, default=3200.0, help="inter-node bandwidth per node [Gbit/s]")
    g.add_argument("--intra-node-latency-us", type=float, default=None, help="intra-node latency per step [us]")
    g.add_argument("--inter-node-latency-us", type=float, default=10.0, help="inter-node latency per step [us]")
    g.add_argument("--gpu-memory-gib", type=float, default=None, help="memory per GPU [GiB] (default: --gpu's)")
    g.add_argument("--gpu-tflops", type=float, default=None, help="peak dense TFLOP/s (default: --gpu's bf16)")
    g.add_argument("--profile", default=None, help="a profile from `mmoe-plan profile` (replaces nominal figures)")
    g.add_argument(
        "--skew",
        type=float,
        default=None,
        help="dropless runs: Zipf exponent of expert popularity (sizes buffers; adds Pro-Prophet candidates)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    out.add_argument("--json", default=None, help="write every candidate (accepted and rejected) here")
    out.add_argument("--script", default="pretrain_gpt_moe.py", help="the training script of the command line")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmoe-plan", description=__doc__.split("\n")[0], formatter_class=HelpFormatter, epilog=__doc__
    )
    add_cluster_flags(p)
    add_config_flags(p, SECTIONS)
    return p


def cluster_from_args(args) -> cl.Cluster:
    c = cl.nominal(
        args.nodes,
        args.gpus_per_node,
        args.gpu,
        args.intra_node_gbps,
        args.inter_node_gbps,
        args.intra_node_latency_us,
        args.inter_node_latency_us,
        args.gpu_memory_gib,
        args.gpu_tflops,
    )
    if args.profile:
        c = cl.Profile.read(args.profile).apply(c)
    return c


def model_flags(cfg, given: frozenset) -> list[str]:
    """The trainer flags the user gave (so the command line reproduces the planned run)."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser, SECTIONS)
    out = []
    for action in parser._actions:
        if action.dest not in given or action.dest in PLAN_SECTIONS_SKIP:
            continue
        section, name = action.dest.split(".", 1)
        value = getattr(getattr(cfg, section), name)
        flag = action.option_strings[0]
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def commands(c, cfg, cluster: cl.Cluster, flags: list[str], script: str) -> dict:
    """The torchrun line of the candidate, and the sbatch line of the project's launcher."""
    layout = c.flags()
    torchrun = (
        f"torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.gpus_per_node} "
        f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 {script} "
        + " ".join(shlex.quote(x) for x in layout + flags)
    )
    env = [f"TP={c.mp}", f"EP={c.ep}", f"ESP={c.esp}", f"NUM_EXPERTS={cfg.moe.num_experts}"]
    env += ["LINA=1"] if c.opts["lina"] else []
    env += ["LANCET_WGRAD=1"] if c.opts["lancet"] else []
    extra = ["--pro-prophet"] if c.opts["pro_prophet"] else []
    # the launcher's own flags come from its preset; flags given after the script replace them
    sbatch = (
        " ".join(env)
        + f" sbatch --nodes {cluster.nodes} --gpus-per-node {cluster.gpus_per_node} "
        + " ".join(shlex.quote(x) for x in ["scripts/pretrain_gpt2_s_moe.sbatch", *flags, *extra])
    )
    return {"torchrun": torchrun, "sbatch": sbatch}


def table(rows: list, top: int) -> list[str]:
    lines = [f"{'#':>3} {'candidate':<44}{'schedule':>9}{'step ms':>10}{'compute':>9}{'comm':>8}{'mem GiB':>9}"]
    for i, c in enumerate(rows[:top], 1):
        b = c.breakdown
        comm = b["exposed_comm"]
        lines.append(
            f"{i:>3} {c.name:<44}{c.schedule:>9}{c.step_s * 1e3:>10.2f}{b['compute'] * 1e3:>9.1f}"
            f"{comm * 1e3:>8.1f}{c.memory['total'] / 2**30:>9.2f}"
        )
    return lines


def breakdown(c) -> list[str]:
    b = c.breakdown
    lines = [f"top candidate: {c.name}, schedule {c.schedule}, {b['micro_batches']} micro-batches per step"]
    for k, v in b.items():
        if isinstance(v, float) and v:
            lines.append(f"  {k:<34}{v * 1e3:>10.2f} ms")
    lines.append(f"  compute from {b['compute_source']}")
    lines.append(
        "  exposed communication by link: "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(b["exposed_comm_by_link"].items()) if v)
    )
    lines.append("  groups' links: " + ", ".join(f"{k} {'/'.join(v)}" for k, v in c.links.items()))
    lines.append(
        "  memory per GPU: "
        + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in c.memory.items() if k != "total")
        + f"; total {c.memory['total'] / 2**30:.2f} GiB"
    )
    return lines


def write_json(path: str, data) -> None:
    """`fileio.atomic_write_json` into an existing folder; a failure is a ValueError naming --json."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--json {path}: cannot write it (no directory {folder})")
    try:
        atomic_write_json(path, data, sort_keys=False)
    except OSError as e:
        raise ValueError(f"--json {path}: cannot write it ({e.strerror or e})") from None


def plan(argv: Optional[list] = None) -> int:
    start = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    given = frozenset(vars(args).pop(GIVEN, ()))
    cfg = config_from_args(args)
    assumed_vocab = not cfg.model.vocab_size
    if assumed_vocab:  # the trainer takes it from the tokenizer, which the plan does not load
        cfg.model.vocab_size = GPT2_VOCAB
    if args.skew is not None and not args.skew >= 0:
        raise ValueError(f"--skew must be >= 0, got {args.skew:g}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    cluster = cluster_from_args(args)
    ok, bad = enumerate_candidates(cfg, cluster.world, args.skew if cfg.moe.moe_dropless else None)
    if not ok:
        first = bad[0].rejected if bad else "no layout"
        raise ValueError(f"no layout of {cluster.world} ranks passes the trainer's checks (first: {first})")
    pred = Predictor(cfg, cluster, args.skew)
    for c in ok:
        pred.predict(c)
    ranked = rank(ok)
    fits = [c for c in ranked if not c.rejected]
    print(f"cluster: {cluster.describe()}")
    if not cluster.compute and not args.profile:
        print("figures: nominal (no --profile): data-sheet bandwidths and GEMMs at a fixed share of the peak")
    print(
        f"model: {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, {cfg.moe.num_experts} experts "
        f"top-{cfg.moe.moe_router_topk}, vocabulary {cfg.model.vocab_size}"
        f"{' (GPT-2 tokenizer assumed: give --vocab-size for another)' if assumed_vocab else ''}, "
        f"global batch {cfg.train.global_batch_size} x {cfg.model.seq_length} tokens; "
        f"{len(ok)} candidates, {len(fits)} fit, {len(bad)} layouts rejected by the trainer's checks"
    )
    for line in table(fits, args.top):
        print(line)
    if fits:
        best = fits[0]
        for line in breakdown(best):
            print(line)
        cmd = commands(best, cfg, cluster, model_flags(cfg, given), args.script)
        print(f"command:\n  {cmd['torchrun']}\n  {cmd['sbatch']}")
    else:
        print(f"no candidate fits in memory; the smallest: {min(ok, key=lambda c: c.memory['total']).rejected}")
    reasons: dict = {}
    for c in bad + [c for c in ranked if c.rejected]:
        reasons.setdefault(c.rejected.split(" (")[0], 0)
        reasons[c.rejected.split(" (")[0]] += 1
    for r, n in sorted(reasons.items(), key=lambda x: -x[1])[:5]:
        print(f"rejected x{n}: {r}")
    if args.json:
        write_json(
            args.json,
            {
                "cluster": cluster.describe(),
                "nominal": not args.profile,
                "candidates": [c.to_json() for c in ranked] + [c.to_json() for c in bad],
                "command": commands(fits[0], cfg, cluster, model_flags(cfg, given), args.script) if fits else None,
            },
        )
    print(f"planned in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["profile"]:
            from megatron_moe.planner.profile import main as profile_main

            return profile_main(argv[1:])
        return plan(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
