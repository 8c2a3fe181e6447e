"""One MoE layer (forward + backward) side by side with DeepSpeed-MoE's `MoE` layer.

Run under torchrun (gloo, CPU):

  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/bench_vs_deepspeed.py \\
      --expert-model-parallel-size 2 --moe-expert-capacity-factor 1.0 --iters 20 --json out.json

Defaults: E=4, top-2, 512 tokens per rank (--micro-batch-size 2 x --seq-length 256), M=256,
H=1024, baseline schedule (flags are the trainer's; `--help` lists them). Variants, timed
round robin so a slow spell of a shared machine hits them alike, each round starting one variant
later than the last so that none always runs first (an iteration's time is the slowest rank's):
  ours         our MoE layer (baseline schedule): kept rows on one rank, the padded buffer on several
  deepspeed    deepspeed.moe.layer.MoE with the same E, k, capacity factor, min capacity and
               EP size (its expert: Linear -> tanh-GELU -> Linear, our experts' function); skipped with a message when
               DeepSpeed is not installed (a benchmark peer, never a dependency of the library);
               its GELU is PyTorch's (`nn.GELU`), what a DeepSpeed user's expert gets
  floor        forward + backward of the expert GEMMs alone on the rows our layer keeps
               (this rank's local experts and their kept counts; no routing, no communication)
--profile N: afterwards, every rank profiles N iterations of each variant with torch.profiler
and rank 0 prints each rank's ops by self time (`op_table`). The timed table gives each rank's
median wall and thread-CPU time too: wall - CPU is the time a rank spends off the CPU (waiting
inside collectives, or preempted by other jobs). Prints a table on rank 0; --json writes
{config, rows: [{variant, ms_median, ms_p90, round_ms, ratio_vs_deepspeed, paired_ratio_vs_deepspeed (median over
rounds of the round's ratio), paired_ci_vs_deepspeed ([low, high]: its 95 % bootstrap interval,
`profiling.paired_ratio`), ratio_vs_floor, rank_wall_ms, rank_cpu_ms}], kept_rows, padded_rows}.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_moe.arguments import add_config_flags, config_from_args
from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.layer import MoELayer
from megatron_moe.parallel_state import initialize_model_parallel, resolve_device, shutdown
from megatron_moe.profiling import paired_ratio

VARIANTS = ("ours", "deepspeed", "floor")


def bench_defaults() -> Config:
    """The issue's layer: E=4, top-2, cf 1.0, 2 x 256 tokens per rank, M=256, H=1024, EP2."""
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.num_attention_heads, m.seq_length = 256, 1, 256
    moe.num_experts, moe.moe_router_topk, moe.moe_expert_capacity_factor, moe.moe_min_capacity = 4, 2, 1.0, 4
    cfg.train.micro_batch_size, cfg.train.seed = 2, 1234
    cfg.parallel.expert_model_parallel_size = 2
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    """The trainer's model / MoE / parallelism / training flags plus --variants, --iters, --warmup,
    --profile, --json."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, ("model", "moe", "parallel", "train"), bench_defaults())
    a = p.add_argument
    a("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    a("--iters", type=int, default=20)
    a("--warmup", type=int, default=3)
    a("--profile", type=int, default=0, help="profile this many iterations of each variant on rank 0")
    a("--json", default=None, help="write the results here (rank 0)")
    a("--bf16", action="store_true", help="run every variant under bf16 autocast (as --bf16 trains)")
    args = p.parse_args(argv)
    try:
        args.cfg = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    args.variant_list = [s.strip() for s in args.variants.split(",") if s.strip()]
    bad = [s for s in args.variant_list if s not in VARIANTS]
    if bad or not args.variant_list:
        p.error(f"--variants: unknown {bad}; choose from {VARIANTS}")
    if args.iters < 1 or args.warmup < 0 or args.profile < 0:
        p.error("--iters must be >= 1, --warmup and --profile >= 0")
    par = args.cfg.parallel
    if par.tensor_model_parallel_size * par.expert_sharding_parallel_size != 1:
        p.error(
            "--tensor-model-parallel-size and --expert-sharding-parallel-size must be 1 "
            "(DeepSpeed's MoE layer has expert parallelism only)"
        )
    if args.cfg.moe.moe_dropless:  # DeepSpeed's MoE layer has a capacity: ours and the floor only
        args.variant_list = [v for v in args.variant_list if v in ("ours", "floor")]
        if not args.variant_list:
            p.error("--moe-dropless: DeepSpeed's MoE layer has a capacity; choose among ours, floor")
    try:
        args.device = resolve_device(args.cfg.parallel.device).type
    except ValueError as e:
        p.error(str(e))
    return args


def deepspeed_layer(cfg: Config, ep: int, activation: nn.Module):
    """DeepSpeed-MoE's layer of the same shape, or None (with the reason printed) when not installed."""
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError as e:  # a benchmark peer only
        if dist.get_rank() == 0:
            print(f"deepspeed: skipped (not importable: {e})")
        return None
    deepspeed.init_distributed(dist.get_backend())  # wraps the process group torchrun already made
    m, moe = cfg.model, cfg.moe
    expert = nn.Sequential(
        nn.Linear(m.hidden_size, m.ffn_hidden_size),
        activation,
        nn.Linear(m.ffn_hidden_size, m.hidden_size),
    )
    layer = MoE(
        m.hidden_size,
        expert,
        num_experts=moe.num_experts,
        ep_size=ep,
        k=moe.moe_router_topk,
        capacity_factor=moe.moe_expert_capacity_factor,
        eval_capacity_factor=moe.moe_expert_capacity_factor,
        min_capacity=moe.moe_min_capacity,
        drop_tokens=True,
        use_rts=False,
    )
    layer.set_deepspeed_parallelism()
    return layer


class Floor:
    """Forward + backward of this rank's experts on the kept rows of our layer: the grouped GEMMs and the
    activation alone (`Experts.forward_offsets`), no routing, no permutation, no communication."""

    def __init__(self, layer: MoELayer, cfg: Config, x: torch.Tensor, ps, device: torch.device):
        x_GSM = x.detach().reshape(1, -1, x.size(-1))
        d = layer.dispatcher
        with torch.no_grad():
            routes, _, _ = layer.route(x_GSM, split=False)
        counts = torch.stack([r.counts for r in routes]).sum(0)
        if ps.size("ep") > 1:  # this rank's local experts get every EP rank's kept rows of them (collective)
            dist.all_reduce(counts, group=ps.group("ep"))
            counts = counts.view(ps.size("ep"), -1)[ps.rank("ep")]
        self.counts = counts.tolist()
        self.padded = d.num_local * d.n_ep * len(routes) * routes[0].capacity
        self.offs = torch.tensor(list(itertools.accumulate(self.counts)), dtype=torch.int32).to(device)
        m = cfg.model
        self.experts = Experts(
            cfg.moe.num_experts, m.hidden_size, m.ffn_hidden_size, ps, cfg.train.seed, "bench.floor", device=device
        )
        g = torch.Generator(device="cpu").manual_seed(cfg.train.seed + 1)
        rows = sum(self.counts)
        self.x = torch.randn(rows, m.hidden_size, generator=g, device="cpu").to(device).requires_grad_()
        self.gy = torch.randn(rows, m.hidden_size, generator=g, device="cpu").to(device)

    def step(self) -> None:
        (self.experts.forward_offsets(self.x, self.offs) * self.gy).sum().backward()
        self.experts.zero_grad(set_to_none=True)
        self.x.grad = None


def make_steps(args, ps, x, gy, device) -> tuple[dict, dict]:
    """One callable per variant (a forward + backward), and what the floor keeps."""
    steps, info = {}, {}
    if "ours" in args.variant_list or "floor" in args.variant_list:
        cfg = copy.deepcopy(args.cfg)
        cfg.moe.moe_schedule = "baseline"
        layer = MoELayer(cfg, ps, cfg.train.seed, "bench.moe", 1, device=device)

        def ours():
            y, aux = layer(x)
            ((y * gy).sum() + aux).backward()
            layer.zero_grad(set_to_none=True)

        if "ours" in args.variant_list:
            steps["ours"] = ours
        if "floor" in args.variant_list:
            floor = Floor(layer, args.cfg, x, ps, device)
            steps["floor"] = floor.step
            info.update(kept_rows=floor.counts, padded_rows=floor.padded)
    ds = (
        deepspeed_layer(args.cfg, ps.size("ep"), nn.GELU(approximate="tanh"))
        if "deepspeed" in args.variant_list
        else None
    )
    if ds is not None:
        ds = ds.to(device)
        xs = x.detach().reshape(-1, x.size(-1)).requires_grad_()

        def deepspeed_step():
            y, aux, _ = ds(xs)
            ((y * gy.reshape(y.shape)).sum() + aux).backward()
            ds.zero_grad(set_to_none=True)

        steps["deepspeed"] = deepspeed_step
    return {v: steps[v] for v in VARIANTS if v in steps}, info


def timed(step, cuda: bool) -> tuple[float, float]:
    """(seconds, this thread's CPU seconds) of one step, started together on every rank. On CUDA the
    seconds are the device's, between two events around the step (the host only enqueues)."""
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0 = time.thread_time()
        start.record()
        step()
        end.record()
        cpu = time.thread_time() - c0
        end.synchronize()
        return start.elapsed_time(end) / 1e3, cpu
    t0, c0 = time.perf_counter(), time.thread_time()
    step()
    return time.perf_counter() - t0, time.thread_time() - c0


def main(argv=None) -> None:
    """Parse, benchmark, then the shared teardown."""
    args = parse_args(argv)
    with exit_on_comm_error():
        run(args)
        shutdown()


def run(args: argparse.Namespace) -> None:
    """Time every variant round robin; table and --json on rank 0; optional profile."""
    cfg, par = args.cfg, args.cfg.parallel
    if "RANK" not in os.environ:
        from megatron_moe.testing import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    ps = initialize_model_parallel(1, par.expert_model_parallel_size, 1, backend, device=device)
    m, t = cfg.model, cfg.train
    g = torch.Generator(device="cpu").manual_seed(t.seed + dist.get_rank())
    x = torch.randn(t.micro_batch_size, m.seq_length, m.hidden_size, generator=g, device="cpu").to(device)
    x.requires_grad_()
    gy = torch.randn(x.shape, generator=g, device="cpu").to(device)
    steps, info = make_steps(args, ps, x, gy, device)
    if args.bf16:  # every variant under the same autocast
        steps = {v: (lambda step=step: _autocast(step, device)) for v, step in steps.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in steps}
    order = list(steps.items())
    for it in range(args.iters):  # each iteration starts one variant later: every variant in every position
        for v, step in order[it % len(order) :] + order[: it % len(order)]:
            times[v].append(timed(step, cuda))
    rows = []
    for v in steps:
        wall_cpu = torch.tensor(times[v], dtype=torch.float64, device=device) * 1e3  # [iters, 2] ms
        per_rank = [torch.empty_like(wall_cpu) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, wall_cpu)
        slowest = torch.stack(per_rank)[:, :, 0].max(dim=0).values  # the slowest rank's time, by round
        ms = torch.sort(slowest).values
        rows.append(
            {
                "variant": v,
                "round_ms": slowest.tolist(),
                "ms_median": float(ms.median()),
                "ms_p90": float(ms[max(0, -(-9 * len(ms) // 10) - 1)]),
                # each rank's median wall and thread-CPU ms: wall - CPU is time off the CPU (waiting
                # inside collectives for the other ranks or the bytes, or preempted)
                "rank_wall_ms": [float(t[:, 0].median()) for t in per_rank],
                "rank_cpu_ms": [float(t[:, 1].median()) for t in per_rank],
            }
        )
    ref = {r["variant"]: r["ms_median"] for r in rows}
    rounds = {r["variant"]: r["round_ms"] for r in rows}
    for r in rows:
        r["ratio_vs_deepspeed"] = r["ms_median"] / ref["deepspeed"] if "deepspeed" in ref else None
        r["ratio_vs_floor"] = r["ms_median"] / ref["floor"] if "floor" in ref else None
        # paired: the median over rounds of this round's time over DeepSpeed's time in the same round
        # (a slow spell of a shared machine slows both sides of a pair), with its 95 % bootstrap interval
        paired = paired_ratio(rounds[r["variant"]], rounds["deepspeed"]) if "deepspeed" in rounds else None
        r["paired_ratio_vs_deepspeed"] = paired[0] if paired else None
        r["paired_ci_vs_deepspeed"] = list(paired[1:]) if paired else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, info)
    if dist.get_rank() == 0:
        print_table(args, rows, every)
        if args.json:
            out = {
                "config": describe(args),
                "rows": rows,
                "kept_rows": [i.get("kept_rows") for i in every],
                "padded_rows": [i.get("padded_rows") for i in every],
            }
            tmp = f"{args.json}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, args.json)
    if args.profile:
        profile(args, steps)


def _autocast(step, device: torch.device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        step()


def describe(args) -> str:
    m, moe, t = args.cfg.model, args.cfg.moe, args.cfg.train
    return (
        f"EP{args.cfg.parallel.expert_model_parallel_size} on {dist.get_world_size()} processes ({args.device}"
        f"{', bf16 autocast' if args.bf16 else ''}{', dropless' if moe.moe_dropless else ''}), "
        f"E={moe.num_experts} top-{moe.moe_router_topk} cf={moe.moe_expert_capacity_factor} "
        f"{t.micro_batch_size * m.seq_length} tokens/rank M={m.hidden_size} H={m.ffn_hidden_size}; "
        f"{args.iters} iters after {args.warmup} warmup"
    )


def print_table(args, rows: list, info: list) -> None:
    print(f"MoE layer fwd+bwd: {describe(args)}")
    kept = [sum(i["kept_rows"]) for i in info if i.get("kept_rows")]
    if kept:
        print(f"expert rows per rank: kept {kept} of padded {[i['padded_rows'] for i in info]}")
    print(
        f"{'variant':<17}{'median ms':>11}{'p90 ms':>10}{'vs deepspeed':>14}{'paired':>9}{'95% interval':>15}"
        f"{'vs floor':>10}"
    )
    for r in rows:
        ds = "" if r["ratio_vs_deepspeed"] is None else f"{r['ratio_vs_deepspeed']:.3f}x"
        pr = "" if r["paired_ratio_vs_deepspeed"] is None else f"{r['paired_ratio_vs_deepspeed']:.3f}x"
        ci = "" if r["paired_ci_vs_deepspeed"] is None else "{:.3f}-{:.3f}".format(*r["paired_ci_vs_deepspeed"])
        fl = "" if r["ratio_vs_floor"] is None else f"{r['ratio_vs_floor']:.3f}x"
        print(f"{r['variant']:<17}{r['ms_median']:>11.2f}{r['ms_p90']:>10.2f}{ds:>14}{pr:>9}{ci:>15}{fl:>10}")
    print("per rank, median ms: wall / thread CPU / off CPU (waiting in collectives or preempted)")
    for r in rows:
        cells = [f"{w:.1f} / {c:.1f} / {w - c:.1f}" for w, c in zip(r["rank_wall_ms"], r["rank_cpu_ms"])]
        print(f"  {r['variant']:<17}" + "   ".join(f"rank {i}: {c}" for i, c in enumerate(cells)))


def op_table(events, iters: int, limit: int = 16) -> list[tuple[str, float, float, float]]:
    """(op, calls per iteration, self ms per iteration, robust self ms per iteration) of the `limit` ops with the
    largest robust time: calls x the median call's self time, which a preempted call does not inflate (on a shared
    machine a few calls absorb another job's time slices)."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.self_cpu_time_total / 1e3)
    rows = []
    for name, ms in by_name.items():
        ms.sort()
        rows.append((name, len(ms) / iters, sum(ms) / iters, ms[len(ms) // 2] * len(ms) / iters))
    return sorted(rows, key=lambda r: -r[3])[:limit]


def profile(args, steps: dict) -> None:
    """torch.profiler over --profile iterations of each variant on every rank (the collectives match); rank 0
    prints each rank's top ops by self time, with calls and the robust time of `op_table`. An op that waits for
    a collective (`_Finish`, `_StartBackward`, DeepSpeed's `_AllToAll`, ...) shows the wait as self time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for v, step in steps.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile):
                step()
        table = op_table(prof.events(), args.profile)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, table)
        if dist.get_rank() == 0:
            print(f"\n== profile: {v}, {args.profile} iterations; per iteration: calls, self ms, robust self ms ==")
            for rank, tab in enumerate(every):
                print(f"rank {rank}:")
                for name, calls, ms, robust in tab:
                    print(f"  {name[:44]:<44}{calls:>7.1f}{ms:>9.2f}{robust:>9.2f}")
        dist.barrier()


if __name__ == "__main__":
    main()
