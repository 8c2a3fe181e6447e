"""Benchmark one MoE layer (forward + backward) under each Parm schedule.

Run under torchrun (plain localhost or the emulated cluster of scripts/emulate_cluster.sh):

  OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 tools/bench_moe_layer.py \\
      --hidden-size 256 --ffn-hidden-size 1024 --num-experts 8 --topk 2 --capacity-factor 1.2 \\
      --micro-batch-size 4 --seq-length 256 --tensor-model-parallel-size 2 \\
      --expert-model-parallel-size 2 --schedules baseline,s1,s2,s2-aas,auto --iters 20 --warmup 3 --json out.json

Schedules: baseline, s1, s2, auto (Algorithm 1's pick from the fitted cost model,
--comm-profile caches the fit) and s2-aas (S2 with SAA off). Iterations are
interleaved across schedules (round robin) so a slow spell of a shared machine
hits all of them alike; an iteration's time is the slowest rank's. Bytes are the
comm tracer's "sent" per collective@group, averaged over ranks (S1's uneven
all-to-all sends differ per rank). Prints a table on rank 0; --json writes a
list of {schedule, ms_median, ms_p90, bytes, speedup_vs_baseline, chosen}.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.distributed.tracer import CommTracer
from megatron_moe.moe.layer import MoELayer
from megatron_moe.parallel_state import initialize_model_parallel, shutdown

KNOWN = ("baseline", "s1", "s2", "s2-aas", "auto")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--hidden-size", type=int, default=256)
    a("--ffn-hidden-size", type=int, default=1024)
    a("--num-experts", type=int, default=8)
    a("--topk", type=int, default=2, choices=[1, 2])
    a("--capacity-factor", type=float, default=1.2)
    a("--micro-batch-size", type=int, default=4)
    a("--seq-length", type=int, default=256)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--expert-model-parallel-size", type=int, default=1)
    a("--expert-sharding-parallel-size", type=int, default=1)
    a("--schedules", default="baseline,s1,s2,auto", help=f"comma-separated, from {','.join(KNOWN)}")
    a("--iters", type=int, default=20)
    a("--warmup", type=int, default=3)
    a("--comm-profile", default=None, help="cache file of the alpha-beta fit used by auto")
    a("--distributed-backend", default=None, choices=["gloo", "nccl"])
    a("--seed", type=int, default=1234)
    a("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in args.schedule_list if s not in KNOWN]
    if bad or not args.schedule_list:
        p.error(f"--schedules: unknown {bad}; choose from {KNOWN}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def make_config(args, schedule: str) -> Config:
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = args.hidden_size, args.ffn_hidden_size, 1
    m.seq_length = m.max_position_embeddings = args.seq_length
    moe.num_experts, moe.moe_router_topk = args.num_experts, args.topk
    moe.moe_expert_capacity_factor, moe.moe_min_capacity = args.capacity_factor, 4
    moe.moe_schedule = "s2" if schedule == "s2-aas" else schedule
    moe.moe_saa = schedule != "s2-aas"
    moe.comm_profile = args.comm_profile
    cfg.train.micro_batch_size, cfg.train.seed = args.micro_batch_size, args.seed
    return cfg


def init_distributed(backend: str | None) -> str:
    """Join the torchrun job (or make a one-process group when run without torchrun); returns the backend."""
    if "RANK" not in os.environ:
        from megatron_moe.testing import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    return backend


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
    backend = init_distributed(args.distributed_backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ps = initialize_model_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                                   args.expert_sharding_parallel_size, backend)
    g = torch.Generator().manual_seed(args.seed + ps.rank("dp"))       # same tokens on the MP ranks of a group
    x = torch.randn(args.micro_batch_size, args.seq_length, args.hidden_size, generator=g).to(device)
    x.requires_grad_()
    gy = torch.randn(x.shape, generator=g).to(device)
    layers = {s: MoELayer(make_config(args, s), ps, args.seed, "bench.moe", 1).to(device) for s in args.schedule_list}
    times = {s: [] for s in layers}
    for s, layer in layers.items():
        for _ in range(args.warmup):
            one_iteration(layer, x, gy, device)
    for _ in range(args.iters):
        for s, layer in layers.items():
            times[s].append(one_iteration(layer, x, gy, device))
    rows = []
    for s, layer in layers.items():
        t = torch.tensor(times[s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)                  # the layer takes as long as its slowest rank
        with CommTracer() as tr:
            one_iteration(layer, x, gy, device)
        sent = tr.by_kind()
        every = [None] * world
        dist.all_gather_object(every, sent)
        kinds = sorted({k for d in every for k in d})
        bytes_per_rank = {k: sum(d.get(k, 0) for d in every) // world for k in kinds}
        ms = torch.sort(t).values * 1e3
        p90 = float(ms[max(0, -(-9 * len(ms) // 10) - 1)])                 # nearest-rank 90th percentile
        rows.append({"schedule": s, "ms_median": float(ms.median()), "ms_p90": p90,
                     "bytes": bytes_per_rank, "speedup_vs_baseline": None,
                     "chosen": layer.schedule if s == "auto" else None})
    base = next((r["ms_median"] for r in rows if r["schedule"] == "baseline"), None)
    for r in rows:
        r["speedup_vs_baseline"] = None if base is None else base / r["ms_median"]
    if rank == 0:
        print_table(args, world, rows, layers)
        if args.json:
            tmp = f"{args.json}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(tmp, args.json)


def print_table(args, world: int, rows: list, layers: dict) -> None:
    print(f"MoE layer fwd+bwd: P={world} MP{args.tensor_model_parallel_size} EP{args.expert_model_parallel_size} "
          f"ESP{args.expert_sharding_parallel_size} B={args.micro_batch_size} L={args.seq_length} "
          f"M={args.hidden_size} H={args.ffn_hidden_size} E={args.num_experts} k={args.topk} "
          f"f={args.capacity_factor}; {args.iters} iters after {args.warmup} warmup")
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
