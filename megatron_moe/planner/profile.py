"""Measure this machine for the planner (`mmoe-plan profile`): compute per layout, GEMM rate, links.

    mmoe-plan profile --out prof.json --nodes 8 --gpus-per-node 8 [model flags]          # compute only
    torchrun --nnodes 2 --nproc-per-node 8 ... -m megatron_moe.cli.plan profile --out prof.json ...

Compute: for every layout (MP, EP, ESP) the plan considers for a world of nodes x gpus-per-node
ranks (`predict.enumerate_candidates`), one micro-batch forward and backward of the real model as
rank 0 of that layout sees it, built in one process on torch's fake process group
(`fake_world.fake_world`): every op runs with that rank's shapes, the collectives return at once,
so the time is the rank's compute alone. Timed for the MoE schedule the plan predicts for the
layout: on the nominal cluster with the GEMM rate measured first (Algorithm 1 prices the expert
compute with it), which is the plan's view of a profile without links. Measured links can move
Algorithm 1 to another schedule (the run says which layouts); --all-schedules times, with
--moe-schedule auto at MP > 1, every schedule it may pick (baseline, S1, S2). Median of --reps
after one warm-up run; bf16 autocast with --bf16 on CUDA; CUDA events on CUDA, perf_counter on
the CPU.

GEMM rate: the MLP's first GEMM at the model's shapes, [B x seq tokens, M] x [M, H].

Links (only under torchrun with 2+ ranks): ranks with the same GROUP_RANK (else rank //
LOCAL_WORLD_SIZE) share a node. Intra-node: each node's ranks form a group, all nodes at once.
Inter-node: the i-th rank of every node forms a group, for every i at once, so all a node's ranks
share its network as in training. all_reduce, all_gather and all_to_all are timed at sizes from
1 KB to --comm-max-mb (`moe.comm_profile`), the slowest rank's time kept per size, and fitted
t = alpha + beta n (`cost_model.fit_alpha_beta`, n in the cluster's size convention). Converted to
`planner.cluster`'s convention: latency alpha / (g - 1); intra bandwidth per GPU bus_factor / beta;
inter bandwidth per node L bus_factor / beta for L ranks per node (`Cluster.collective` with one
rank per node in the group and L ranks sharing the node: ring ops bus / (inter / L), the
all-to-all's remote term L n (g - 1) / g / inter). The link's figure is the mean latency and the
harmonic mean of the ops' bandwidths (the mean time per bus byte), since the plan prices all
three ops with one link. Every rank times its compute too; the slowest rank's compute and GEMM
rate are kept, so all ranks hold the same profile; rank 0 writes it (a temporary name, then
renamed: a failed run leaves no file).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_moe.arguments import GIVEN, HelpFormatter, add_config_flags, config_from_args
from megatron_moe.cli.plan import GPT2_VOCAB, SECTIONS
from megatron_moe.config import Config
from megatron_moe.planner import cluster as cl
from megatron_moe.planner.predict import Candidate, Predictor, enumerate_candidates

LINK_OPS = ("all_reduce", "all_gather", "all_to_all")
ALL_SCHEDULES = ("baseline", "s1", "s2")
GEMMS_PER_SAMPLE = 10  # back-to-back GEMMs per timed sample, the sample's time divided by it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmoe-plan profile",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
        epilog=__doc__,
    )
    g = p.add_argument_group("profile")
    g.add_argument("--out", required=True, help="the profile to write (JSON; `mmoe-plan --profile` reads it)")
    g.add_argument("--nodes", type=int, required=True, help="nodes of the cluster to plan for")
    g.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (ranks) per node of that cluster")
    g.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median kept)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to time the compute")
    g.add_argument(
        "--comm-max-mb",
        type=float,
        default=64.0,
        help="largest collective message timed [MB] (larger ones follow the fit)",
    )
    g.add_argument(
        "--all-schedules",
        action="store_true",
        help="with --moe-schedule auto, time every MoE schedule of the MP > 1 layouts (not only the predicted one)",
    )
    add_config_flags(p, SECTIONS)
    return p


# ----------------------------------------------------------------------------- timing


class Clock:
    """Marks on a device's timeline: CUDA events on CUDA (read after a synchronize), perf_counter
    on the CPU. `seconds(a, b)` is the time between two marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def layout_config(cfg: Config, mp: int, ep: int, esp: int, schedule: str) -> Config:
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = mp, ep, esp
    out.moe.moe_schedule = schedule
    return out


def time_layout(
    cfg: Config, world: int, mp: int, ep: int, esp: int, schedule: str, device: torch.device, reps: int
) -> dict:
    """{"forward": s, "backward": s, "optimizer": s}: medians over `reps` (after one warm-up) of one
    micro-batch of the model as rank 0 of the layout in a fake world of `world` ranks (no
    communication), and of the step's gradient clipping and optimizer update over that rank's
    parameters (the trainer's `clip_gradients` and optimizer)."""
    from megatron_moe.fake_world import fake_world
    from megatron_moe.model.gpt2 import GPT2MoE
    from megatron_moe.optim import build_optimizer, clip_gradients
    from megatron_moe.parallel_state import initialize_model_parallel

    c = layout_config(cfg, mp, ep, esp, schedule)
    B, T = c.train.micro_batch_size, c.model.seq_length
    bf16 = c.optim.bf16 and device.type == "cuda"
    clock = Clock(device)
    fwd, bwd = [], []
    with fake_world(0, world):
        ps = initialize_model_parallel(mp, ep, esp, device=device)
        torch.manual_seed(c.train.seed)
        model = GPT2MoE(c, ps).to(device)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, c.model.vocab_size, (B, T + 1), generator=gen, device="cpu").to(device)
        for i in range(reps + 1):
            clock.sync()
            t0 = clock.mark()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                lm, aux = model(ids[:, :-1], ids[:, 1:])
            loss = lm + aux
            t1 = clock.mark()
            loss.backward()
            t2 = clock.mark()
            clock.sync()
            if i:  # the first run allocates and tunes kernels
                fwd.append(clock.seconds(t0, t1))
                bwd.append(clock.seconds(t1, t2))
            if i < reps:
                model.zero_grad(set_to_none=True)
        opt_s = []
        optimizer, _ = build_optimizer(model, c.optim, device)
        for i in range(reps + 1):  # the gradients of the last micro-batch stay in place
            clock.sync()
            t0 = clock.mark()
            clip_gradients(model, ps, c.optim.clip_grad)
            optimizer.step()
            t1 = clock.mark()
            clock.sync()
            if i:  # the first step allocates the optimizer state
                opt_s.append(clock.seconds(t0, t1))
        del model, loss, lm, aux, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "forward": statistics.median(fwd),
        "backward": statistics.median(bwd),
        "optimizer": statistics.median(opt_s),
    }


def gemm_flops(tokens: int, M: int, H: int, device: torch.device, bf16: bool, reps: int) -> float:
    """FLOP/s of [tokens, M] x [M, H] (median of `reps` samples of GEMMS_PER_SAMPLE GEMMs, after a warm-up)."""
    dtype = torch.bfloat16 if bf16 and device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(tokens, M, generator=gen, device="cpu").to(device, dtype)
    b = torch.randn(M, H, generator=gen, device="cpu").to(device, dtype)
    clock = Clock(device)
    samples = []
    for i in range(reps + 1):
        clock.sync()
        t0 = clock.mark()
        for _ in range(GEMMS_PER_SAMPLE):
            torch.mm(a, b)
        t1 = clock.mark()
        clock.sync()
        if i:
            samples.append(clock.seconds(t0, t1) / GEMMS_PER_SAMPLE)
    return 2.0 * tokens * M * H / max(statistics.median(samples), 1e-12)


def layouts_to_time(cfg: Config, cluster: cl.Cluster, all_schedules: bool = False) -> list[tuple[int, int, int, str]]:
    """(mp, ep, esp, schedule) of every accepted layout of `cluster`'s world, with the schedule the
    plan predicts for it on `cluster`; `all_schedules`: with --moe-schedule auto at MP > 1 (not
    dropless) every schedule Algorithm 1 may pick on other link figures too."""
    ok, bad = enumerate_candidates(cfg, cluster.world, None)
    if not ok:
        first = bad[0].rejected if bad else "no layout"
        raise ValueError(f"no layout of {cluster.world} ranks passes the trainer's checks (first: {first})")
    pred = Predictor(cfg, cluster)
    moe = cfg.moe
    out: list[tuple[int, int, int, str]] = []
    seen: set[tuple[int, int, int]] = set()
    for c in ok:
        if (c.mp, c.ep, c.esp) in seen:
            continue
        seen.add((c.mp, c.ep, c.esp))
        predicted = pred.predict(Candidate(c.mp, c.ep, c.esp, c.dp)).schedule
        schedules = [predicted]
        if all_schedules and moe.num_experts and moe.moe_schedule == "auto" and c.mp > 1 and not moe.moe_dropless:
            schedules += [s for s in ALL_SCHEDULES if s != predicted]
        out += [(c.mp, c.ep, c.esp, s) for s in schedules]
    return out


# ----------------------------------------------------------------------------- links


def node_of_each_rank(device: torch.device) -> list[int]:
    """Every rank's node (collective): GROUP_RANK, else rank // LOCAL_WORLD_SIZE."""
    rank = dist.get_rank()
    if os.environ.get("GROUP_RANK", "") != "":
        node = int(os.environ["GROUP_RANK"])
    else:
        node = rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    mine = torch.tensor([node], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def effective_beta(fit, sizes: list[int], times: list[float]) -> float:
    """The fit's seconds per element; when the fit clamped it to 0 (times flat within noise), the
    largest message's time above alpha per element, so the bandwidth stays finite."""
    if fit.beta > 0:
        return float(fit.beta)
    extra = times[-1] - fit.alpha
    return (extra if extra > 0 else times[-1]) / sizes[-1]


def sustained_beta(fit, sizes: list[int], times: list[float]) -> float:
    """Seconds per element at the link's sustained rate: the unweighted least-squares slope over the
    larger half of the sizes. Small messages ride a token bucket's burst, TCP's window or a
    protocol switch and go faster per byte than the link sustains; the fit's alpha (weighted to the
    small sizes) keeps the latency, this slope the rate the plan's megabyte messages see. Falls back
    to `effective_beta` when that slope is not positive (flat times: noise)."""
    n = len(sizes)
    xs, ys = sizes[n // 2 :], times[n // 2 :]
    if len(set(xs)) >= 2:
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            return slope
    return effective_beta(fit, sizes, times)


def fit_link(
    name: str,
    groups: list[list[int]],
    sharers: int,
    device: torch.device,
    sizes: list[int],
    reps: int,
    say: Callable[[str], None],
) -> dict:
    """Time LINK_OPS on `groups` (all at once; every rank is in one), fit and convert them (module
    docstring); `sharers`: the ranks of a node that share the link (1 intra, ranks per node inter)."""
    from megatron_moe.moe.comm_profile import fit_sizes, time_collective
    from megatron_moe.moe.cost_model import fit_alpha_beta

    rank = dist.get_rank()
    mine = None
    for ranks in groups:  # new_group is collective: every rank creates every group, in one order
        grp = dist.new_group(ranks)
        if rank in ranks:
            mine = grp
    g = len(groups[0])
    measured = [[time_collective(op, mine, n, reps, 1, device) for n in sizes] for op in LINK_OPS]
    times = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest group sets the pace; every rank fits the same
    rows = times.cpu().tolist()
    fits, lats, bws = {}, [], []
    for op, t in zip(LINK_OPS, rows):
        priced = fit_sizes(op, g, sizes)  # elements of the op's size argument (cluster.py's convention)
        fit = fit_alpha_beta(priced, t)
        per_byte = sustained_beta(fit, priced, t) / 4  # fp32 messages
        latency = fit.alpha / (g - 1)
        bandwidth = sharers * cl.bus_factor(op, g) / per_byte
        fits[op] = {
            "alpha": fit.alpha,
            "beta_per_byte": per_byte,
            "group_size": g,
            "groups": len(groups),
            "sharers": sharers,
            "latency": latency,
            "bandwidth": bandwidth,
            "bytes": [4 * n for n in priced],
            "times": t,
        }
        lats.append(latency)
        bws.append(bandwidth)
        say(
            f"link {name} {op} on {len(groups)} x {g} ranks: alpha {fit.alpha * 1e6:.1f} us, "
            f"{bandwidth * 8e-9:.3g} Gb/s {'per node' if name == 'inter' else 'per GPU'}"
        )
    return {
        "latency": statistics.mean(lats),
        "bandwidth": len(bws) / sum(1.0 / b for b in bws),
        "fits": fits,
    }


def measure_links(device: torch.device, sizes: list[int], reps: int, say: Callable[[str], None]) -> dict:
    """{"intra": ..., "inter": ...} for the link classes this run's ranks span (collective)."""
    nodes = node_of_each_rank(device)
    members: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        members.setdefault(n, []).append(r)
    counts = sorted({len(v) for v in members.values()})
    if len(counts) != 1:
        raise ValueError(f"nodes run unequal numbers of ranks ({counts}): launch the same count on each node")
    per_node, ordered = counts[0], [members[n] for n in sorted(members)]
    say(f"links: {len(ordered)} nodes x {per_node} ranks ({dist.get_backend()})")
    links = {}
    if per_node >= 2:
        links["intra"] = fit_link("intra", ordered, 1, device, sizes, reps, say)
    if len(ordered) >= 2:
        inter_groups = [[node[i] for node in ordered] for i in range(per_node)]
        links["inter"] = fit_link("inter", inter_groups, per_node, device, sizes, reps, say)
    return links


# ----------------------------------------------------------------------------- main


def write_profile(path: str, profile: cl.Profile) -> None:
    """JSON to a temporary name, then renamed over `path`: a failed write leaves no file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(profile.to_json(), f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ValueError(f"--out {path}: cannot write it ({e.strerror or e})") from None


def parse(argv: Optional[list]) -> tuple[argparse.Namespace, Config]:
    args = build_parser().parse_args(argv)
    vars(args).pop(GIVEN, None)
    cfg = config_from_args(args)
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = GPT2_VOCAB
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if not args.comm_max_mb > 0:
        raise ValueError(f"--comm-max-mb must be positive, got {args.comm_max_mb:g}")
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v}")
    return args, cfg


def main(argv: Optional[list] = None) -> int:
    from megatron_moe.parallel_state import resolve_device

    start = time.perf_counter()
    args, cfg = parse(sys.argv[1:] if argv is None else list(argv))
    world_env = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank_env = int(os.environ.get("RANK", "0") or 0)
    if world_env > 1 and dist.is_initialized():
        raise ValueError("torch.distributed is initialized already: the profile initializes it itself")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if rank_env == 0 and not os.path.isdir(out_dir):
        raise ValueError(f"--out {args.out}: directory {out_dir} does not exist")
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # events, synchronize and NCCL use the current device: this rank's
    say: Callable[[str], None] = print if rank_env == 0 else (lambda _msg: None)
    nominal = cl.nominal(args.nodes, args.gpus_per_node)

    m = cfg.model
    tokens, H = cfg.train.micro_batch_size * m.seq_length, m.ffn_hidden_size or 4 * m.hidden_size
    flops = gemm_flops(tokens, m.hidden_size, H, device, cfg.optim.bf16, args.reps)
    say(f"GEMM [{tokens}, {m.hidden_size}] x [{m.hidden_size}, {H}] on {device}: {flops * 1e-12:.4g} TFLOP/s")
    if device.type == "cuda":
        name, memory = torch.cuda.get_device_name(device), float(torch.cuda.get_device_properties(device).total_memory)
    else:
        name, memory = "cpu", 0.0
    sections = {"model": dataclasses.asdict(cfg.model), "moe": dataclasses.asdict(cfg.moe)}
    profile = cl.Profile(name, flops, {}, {}, sections, memory)

    # Compute, on every rank before the process group exists (the fake world is the default group
    # meanwhile). Schedules as the plan predicts them with this GEMM rate (Algorithm 1 prices the
    # expert compute with it) and nominal links.
    todo = layouts_to_time(cfg, profile.apply(nominal), args.all_schedules)
    world = nominal.world
    say(
        f"compute of {len(todo)} layouts of {args.nodes} x {args.gpus_per_node} ranks: micro-batch "
        f"{cfg.train.micro_batch_size} x {m.seq_length} tokens, median of {args.reps}"
        + (", bf16 autocast" if cfg.optim.bf16 and device.type == "cuda" else "")
    )
    for mp, ep, esp, sched in todo:
        key = cl.layout_key(mp, ep, esp, cfg.train.micro_batch_size, sched)
        profile.compute[key] = t = time_layout(cfg, world, mp, ep, esp, sched, device, args.reps)
        say(
            f"compute MP{mp} EP{ep} ESP{esp} {sched}: forward {t['forward'] * 1e3:.2f} ms, "
            f"backward {t['backward'] * 1e3:.2f} ms, optimizer {t['optimizer'] * 1e3:.2f} ms"
        )

    if world_env <= 1:
        say("links: not measured (one process; under torchrun with 2+ ranks they are): the plan uses nominal figures")
        write_profile(args.out, profile)
    else:
        # the ranks reach the rendezvous when their own compute timing ends: the wait is bounded
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=600))
        try:
            profile.links = measure_links(device, profile_sizes_mb(args.comm_max_mb), args.reps, say)
            agree(profile)
            say(f"compute and GEMM rate: the slowest of {dist.get_world_size()} ranks kept")
            untimed = missing_schedules(cfg, profile.apply(nominal))
            if untimed:
                say(
                    f"note: with the measured links the plan predicts schedules not timed here "
                    f"({', '.join(untimed)}): they fall back to FLOPs; --all-schedules times every schedule"
                )
            error = ""
            if dist.get_rank() == 0:
                try:
                    write_profile(args.out, profile)
                except ValueError as e:
                    error = str(e)
            failed = torch.tensor([1 if error else 0], device=device)
            dist.broadcast(failed, src=0)  # every rank exits as rank 0 does
            if int(failed.item()):
                raise ValueError(error or f"--out {args.out}: rank 0 could not write it")
            dist.barrier()
        finally:
            dist.destroy_process_group()
    say(
        f"wrote {args.out} ({len(profile.compute)} layouts, links: {', '.join(sorted(profile.links)) or 'none'}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


def missing_schedules(cfg: Config, cluster: cl.Cluster) -> list[str]:
    """Layout keys the plan would look up on `cluster` that it has no measured compute for."""
    keys = [
        cl.layout_key(mp, ep, esp, cfg.train.micro_batch_size, s) for mp, ep, esp, s in layouts_to_time(cfg, cluster)
    ]
    return [k for k in keys if k not in cluster.compute]


def profile_sizes_mb(max_mb: float) -> list[int]:
    from megatron_moe.moe.comm_profile import profile_sizes

    return profile_sizes(max(1, int(max_mb * 2**20 / 4)))


def agree(profile: cl.Profile) -> None:
    """Every rank's profile becomes the same (collective): per layout the slowest rank's forward and
    backward, the slowest rank's GEMM rate. The ranks' layout keys may differ (each predicted its
    schedules with its own GEMM rate): every key any rank timed is kept."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (profile.compute, profile.flops))
    merged: dict[str, dict[str, float]] = {}
    for compute, _ in every:
        for key, t in compute.items():
            m = merged.setdefault(key, {})
            for part, v in t.items():
                m[part] = max(m.get(part, 0.0), v)
    profile.compute = dict(sorted(merged.items()))
    profile.flops = min(flops for _, flops in every)
