"""Benchmark one MoE layer (forward + backward) under each Parm schedule.

Run under torchrun (plain localhost or the emulated cluster of scripts/emulate_cluster.sh):

  OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 tools/bench_moe_layer.py \\
      --hidden-size 256 --ffn-hidden-size 1024 --num-experts 8 --moe-router-topk 2 --moe-expert-capacity-factor 1.2 \\
      --micro-batch-size 4 --seq-length 256 --tensor-model-parallel-size 2 \\
      --expert-model-parallel-size 2 --schedules baseline,s1,s2,s2-aas,auto --iters 20 --warmup 3 --json out.json

Flags: the trainer's (model, MoE, parallelism, training groups; `--help` lists them) plus
--schedules, --iters, --warmup, --json.
Schedules: baseline, s1, s2, auto (Algorithm 1's ranking from the fitted cost model,
--comm-profile caches the fit, then --measure-iters passes of each candidate timed on the
auto layer by `megatron_moe.choose`; 0: the model's pick) and s2-aas (S2 with SAA off). Iterations are
interleaved across schedules (round robin) so a slow spell of a shared machine
hits all of them alike; an iteration's time is the slowest rank's. Bytes are the
collective observer's "sent" per collective@group, averaged over ranks (S1's uneven
all-to-all sends differ per rank). Prints a table on rank 0; --json writes a
list of {schedule, ms_median, ms_p90, bytes, speedup_vs_baseline, chosen} and, with auto
and any of baseline/s1/s2, a last {summary: auto_vs_fastest, auto_picked, auto_ms, fastest, fastest_ms,
auto_over_fastest}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist

from megatron_moe.arguments import add_config_flags, config_from_args
from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.distributed.observer import CommLog
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.schedule_trial import auto_schedule
from megatron_moe.parallel_state import device_and_backend, initialize_model_parallel, shutdown

KNOWN = ("baseline", "s1", "s2", "s2-aas", "auto")


def bench_defaults() -> Config:
    """The benchmark's default layer (the trainer's flags change any of it)."""
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.num_attention_heads, m.seq_length = 256, 1, 256
    moe.num_experts, moe.moe_router_topk, moe.moe_expert_capacity_factor = 8, 2, 1.2
    cfg.train.micro_batch_size, cfg.train.seed = 4, 1234
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    """The trainer's model / MoE / parallelism / training flags (`arguments.add_config_flags`) plus
    the benchmark's own: --schedules, --iters, --warmup, --json."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, ("model", "moe", "parallel", "train"), bench_defaults())
    a = p.add_argument
    a("--schedules", default="baseline,s1,s2,auto", help=f"comma-separated, from {','.join(KNOWN)}")
    a("--iters", type=int, default=20)
    a("--warmup", type=int, default=3)
    a("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    try:
        args.cfg = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in args.schedule_list if s not in KNOWN]
    if bad or not args.schedule_list:
        p.error(f"--schedules: unknown {bad}; choose from {KNOWN}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def make_config(args, schedule: str) -> Config:
    """The layer's config with `schedule` (s2-aas: S2 with SAA off)."""
    cfg = copy.deepcopy(args.cfg)
    cfg.moe.moe_schedule = "s2" if schedule == "s2-aas" else schedule
    cfg.moe.moe_saa = cfg.moe.moe_saa and schedule != "s2-aas"
    return cfg


def init_distributed(backend: str) -> None:
    """Join the torchrun job (or make a one-process group when run without torchrun)."""
    if "RANK" not in os.environ:
        from megatron_moe.testing import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend)


def one_iteration(layer, x, gy, device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    y, aux = layer(x)
    ((y * gy).sum() + aux).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return dt


def main(argv=None) -> None:
    """Parse, benchmark, then the shared teardown (after `run` returned: its groups are released)."""
    args = parse_args(argv)
    with exit_on_comm_error():
        run(args)
        shutdown()


def run(args: argparse.Namespace) -> None:
    """Time every schedule; print the table and write --json on rank 0."""
    cfg, par = args.cfg, args.cfg.parallel
    m, t = cfg.model, cfg.train
    device, backend = device_and_backend(par.device, par.distributed_backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ps = initialize_model_parallel(
        par.tensor_model_parallel_size,
        par.expert_model_parallel_size,
        par.expert_sharding_parallel_size,
        backend,
        device=device,
    )
    # inputs drawn on the host (same numbers on every device), then placed
    g = torch.Generator(device="cpu").manual_seed(t.seed + ps.rank("dp"))  # same tokens on the MP ranks of a group
    x = torch.randn(t.micro_batch_size, m.seq_length, m.hidden_size, generator=g, device="cpu").to(device)
    x.requires_grad_()
    gy = torch.randn(x.shape, generator=g, device="cpu").to(device)
    layers = {s: MoELayer(make_config(args, s), ps, t.seed, "bench.moe", 1, device=device) for s in args.schedule_list}
    if "auto" in layers:  # as optimizations.apply does: the model's ranking, then measured on the layer
        auto_schedule(make_config(args, "auto"), ps, layers["auto"])
    times = {s: [] for s in layers}
    for s, layer in layers.items():
        for _ in range(args.warmup):
            one_iteration(layer, x, gy, device)
    for _ in range(args.iters):
        for s, layer in layers.items():
            times[s].append(one_iteration(layer, x, gy, device))
    rows = []
    for s, layer in layers.items():
        t = torch.tensor(times[s], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the layer takes as long as its slowest rank
        t = t.cpu()
        with CommLog() as tr:
            one_iteration(layer, x, gy, device)
        sent = tr.by_kind()
        every = [None] * world
        dist.all_gather_object(every, sent)
        kinds = sorted({k for d in every for k in d})
        bytes_per_rank = {k: sum(d.get(k, 0) for d in every) // world for k in kinds}
        ms = torch.sort(t).values * 1e3
        p90 = float(ms[max(0, -(-9 * len(ms) // 10) - 1)])  # nearest-rank 90th percentile
        rows.append(
            {
                "schedule": s,
                "ms_median": float(ms.median()),
                "ms_p90": p90,
                "bytes": bytes_per_rank,
                "speedup_vs_baseline": None,
                "chosen": layer.schedule if s == "auto" else None,
            }
        )
    base = next((r["ms_median"] for r in rows if r["schedule"] == "baseline"), None)
    for r in rows:
        r["speedup_vs_baseline"] = None if base is None else base / r["ms_median"]
    summary = auto_vs_fastest(rows)
    if summary is not None:  # the auto row carries the comparison (the JSON stays one object per schedule)
        auto_row = next(r for r in rows if r["schedule"] == "auto")
        auto_row.update({k: summary[k] for k in ("fastest", "fastest_ms", "auto_over_fastest")})
    if rank == 0:
        print_table(args, world, rows, layers)
        if summary is not None:
            print(
                f"auto picked {summary['auto_picked']}: {summary['auto_ms']:.2f} ms; fastest measured schedule "
                f"{summary['fastest']}: {summary['fastest_ms']:.2f} ms; auto / fastest = {summary['auto_over_fastest']:.3f}"
            )
        if args.json:
            tmp = f"{args.json}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(tmp, args.json)


def auto_vs_fastest(rows: list) -> dict | None:
    """auto's median against the fastest measured schedule it chooses among (baseline, s1, s2), or None
    when auto or all of those were not run."""
    by = {r["schedule"]: r for r in rows}
    cands = [s for s in ("baseline", "s1", "s2") if s in by]
    if "auto" not in by or not cands:
        return None
    fastest = min(cands, key=lambda s: by[s]["ms_median"])
    auto_ms, best_ms = by["auto"]["ms_median"], by[fastest]["ms_median"]
    return {
        "summary": "auto_vs_fastest",
        "auto_picked": by["auto"]["chosen"],
        "auto_ms": auto_ms,
        "fastest": fastest,
        "fastest_ms": best_ms,
        "auto_over_fastest": auto_ms / best_ms,
    }


def print_table(args, world: int, rows: list, layers: dict) -> None:
    m, moe, par = args.cfg.model, args.cfg.moe, args.cfg.parallel
    print(
        f"MoE layer fwd+bwd: P={world} MP{par.tensor_model_parallel_size} EP{par.expert_model_parallel_size} "
        f"ESP{par.expert_sharding_parallel_size} B={args.cfg.train.micro_batch_size} L={m.seq_length} "
        f"M={m.hidden_size} H={m.ffn_hidden_size} E={moe.num_experts} k={moe.moe_router_topk} "
        f"f={moe.moe_expert_capacity_factor}; {args.iters} iters after {args.warmup} warmup"
    )
    print(f"{'schedule':<12}{'median ms':>11}{'p90 ms':>10}{'speedup':>9}  bytes sent per rank (MB)")
    for r in rows:
        sp = "" if r["speedup_vs_baseline"] is None else f"{r['speedup_vs_baseline']:.2f}x"
        name = r["schedule"] + (f"->{r['chosen']}" if r["chosen"] else "")
        detail = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in r["bytes"].items())
        print(f"{name:<12}{r['ms_median']:>11.2f}{r['ms_p90']:>10.2f}{sp:>9}  {detail}")
    auto = layers.get("auto")
    if auto is not None and auto.schedule_choice is not None:
        print(f"auto: {auto.schedule_choice.describe()}")


if __name__ == "__main__":
    main()
