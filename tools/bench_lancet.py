"""Lancet ablation: none / dW scheduling / partition pipelining / both (Lancet, MLSys 2024, Fig. 9).

Run under torchrun, one process per rank (gloo on CPU, NCCL with CUDA):

    torchrun --nproc-per-node 4 tools/bench_lancet.py --expert-model-parallel-size 4 --json lancet.json
    scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 200mbit -- \\
        tools/bench_lancet.py --expert-model-parallel-size 2 --json lancet.json

Every mode gets its own copy of the same model (same seed); the modes run
round-robin, `--warmup` untimed and `--iters` timed iterations of forward +
backward each on one fixed micro-batch, so load that comes and goes on a
shared machine hits every mode alike (gradient sync and the optimizer step are
the same in every mode and are left out). Per iteration it measures:
  iter_ms          wall time of forward + backward (the slowest rank's median; also its min),
  a2a_ms           time some all-to-all was in flight (union of [launch, finish]),
  a2a_exposed_ms   time the main thread was blocked on an all-to-all (a synchronous
                   call, or `wait()` on an asynchronous one) minus the part of it in
                   which the dW worker thread was computing,
  remote_bytes     bytes this rank's all-to-alls sent to other ranks (the link's load; with
                   --link-mbit R the table adds "wire ms" = the slowest rank's remote bytes at R Mbit/s:
                   the least time any schedule of these messages keeps the link busy),
and reports the cost model's predicted iteration time (`planner.predict`). Mode "auto" is
the trainer's choice: the fastest measured of the top predicted plans and "none"
(`controller.choose_plan`); its contention fit (`planner.fit_contention`) is applied to every
mode's prediction ("fitted err").
The all-to-alls come from the library's collective observer (`distributed/observer.py`).
Prints a table and writes `--json PATH`: a list of objects with keys mode,
iter_ms_median, a2a_ms, a2a_exposed_ms, predicted_ms, fitted_ms, chosen, selection, speedup_paired
([median, low, high]: `none`'s time over the mode's, round by round, and its 95 % bootstrap interval,
`profiling.paired_ratio`) and details.
`--timeline` times one more iteration of every mode and adds rank 0's all-to-alls in it (key
"timeline": forward_ms, iteration_ms and per all-to-all its phase, group, launch and finish ms
from the iteration's start, ms the main thread was blocked on it, KB sent to other ranks), printed
after the table: where the link idles and where the host waits.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_moe.arguments import add_config_flags, config_from_args
from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.distributed.observer import CommLog, intersection_length, total_length, union
from megatron_moe.lancet.controller import choose_plan, setup
from megatron_moe.fileio import atomic_write_json
from megatron_moe.lancet.model_ir import model_shapes, profile_a2a_model, profile_costs
from megatron_moe.lancet.planner import candidate_plans, fitted_ms, make_plan
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import device_and_backend, initialize_model_parallel, shutdown
from megatron_moe.profiling import paired_ratio

MODES = {
    "none": (False, False),
    "dw": (True, False),
    "partition": (False, True),
    "both": (True, True),
    "auto": (True, True),
}


def a2a_times(log: CommLog, helper: list) -> tuple[float, float, float]:
    """From the observer: (ms some all-to-all was in flight, ms the main thread was blocked on one
    while no helper-thread dW ran, bytes sent to other ranks); a synchronous all-to-all blocks from
    launch to finish."""
    a2a = [e for e in log.snapshot() if e.op == "all_to_all" and e.finish is not None]
    blocked = union([iv for e in a2a for iv in e.info.get("blocked", [(e.launch, e.finish)])])
    hidden = intersection_length(blocked, union(helper))
    in_flight = 1e3 * total_length(union([(e.launch, e.finish) for e in a2a]))
    return in_flight, 1e3 * (total_length(blocked) - hidden), float(sum(e.remote_sent for e in a2a))


def bench_defaults() -> Config:
    """The benchmark's default model (the trainer's flags change any of it)."""
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 4, 256, 4, 128, 1024
    moe.num_experts, moe.moe_expert_capacity_factor, moe.moe_schedule = 8, 1.0, "baseline"
    cfg.train.micro_batch_size, cfg.train.seed = 8, 1234
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    """The trainer's model / MoE / parallelism / training / optimization flags
    (`arguments.add_config_flags`; --expert-model-parallel-size defaults to the world size / MP,
    --lancet-report PATH writes PATH.<mode>.json)
    plus the benchmark's own: --modes, --warmup, --iters, --json."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_flags(p, ("model", "moe", "parallel", "train", "opts"), bench_defaults())
    a = p.add_argument
    a("--modes", default="none,dw,partition,both,auto")
    a("--warmup", type=int, default=3)
    a("--iters", type=int, default=10)
    a("--json", default=None, help="write the rows as JSON to this path")
    a("--link-mbit", type=float, default=None, help="link rate in Mbit/s per direction: adds the wire-time column")
    a("--timeline", action="store_true", help="add each mode's all-to-alls of one more iteration (rank 0's)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    try:
        args.cfg = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    args.ep_given = any(x.split("=")[0] == "--expert-model-parallel-size" for x in argv)
    if args.link_mbit is not None and args.link_mbit <= 0:
        p.error(f"--link-mbit must be > 0, got {args.link_mbit}")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {sorted(MODES)}")
    return args


def build_config(args, world: int) -> Config:
    """The parsed Config, with EP = the world size / MP unless --expert-model-parallel-size was given."""
    cfg = args.cfg
    if not args.ep_given:
        cfg.parallel.expert_model_parallel_size = world // cfg.parallel.tensor_model_parallel_size
    return cfg


def prepare(mode: str, cfg: Config, ps, costs, comm, ids, labels):
    """Model (same seed in every mode), plan and installed controller of one mode. "auto" is what
    the trainer does: the fastest *measured* of the top predicted plans and "none"
    (`controller.choose_plan`, --measure-iters passes each)."""
    wgrad, partition = MODES[mode]
    B, T = ids.shape
    model = GPT2MoE(cfg, ps)
    if mode == "auto":
        opts = dataclasses.replace(cfg.opts, lancet_wgrad=True, lancet_partition=True)
        plans = candidate_plans(model, ps, opts, B, T, costs=costs, comm=comm)
        plan = choose_plan(model, ps, opts, plans, B, T)
        return model, plan, setup(model, ps, cfg.opts, plan=plan if (plan.ranges or plan.wgrad) else None)
    plan = make_plan(model, ps, cfg.opts, B, T, wgrad=wgrad, partition=partition, costs=costs, comm=comm)
    return model, plan, setup(model, ps, cfg.opts, plan=plan if (wgrad or partition) else None)


def iteration(model, ctl, ids, labels) -> tuple[CommLog, float, float, float]:
    """One forward + backward after a barrier, observed: (the collectives' log, perf_counter s at the
    start, after the forward, at the end); gradients dropped."""
    dist.barrier()
    with CommLog() as log:
        t0 = time.perf_counter()
        lm, aux = model(ids, labels)
        t_fwd = time.perf_counter()
        ctl.backward(lm + aux)
        t1 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return log, t0, t_fwd, t1


def step(model, ctl, ids, labels) -> tuple[float, float, float, float]:
    """One timed forward + backward: (iteration ms, all-to-all ms, exposed all-to-all ms, remote bytes)."""
    if ctl.wgrad is not None:
        ctl.wgrad.stats.helper_intervals.clear()
    log, t0, _, t1 = iteration(model, ctl, ids, labels)
    a2a, exposed, remote = a2a_times(log, ctl.wgrad.stats.helper_intervals if ctl.wgrad is not None else [])
    return 1e3 * (t1 - t0), a2a, exposed, remote


def timeline(model, ctl, ids, labels) -> dict:
    """One more forward + backward: this rank's all-to-alls in it, times in ms from its start."""
    log, t0, t_fwd, t1 = iteration(model, ctl, ids, labels)
    events = []
    for e in sorted(log.finish_step(), key=lambda e: e.launch):  # CUDA: after a synchronize, GPU-timed
        if e.op != "all_to_all" or e.finish is None:
            continue
        blocked = e.info.get("blocked", [(e.launch, e.finish)])
        events.append(
            {
                "phase": e.phase,
                "group": e.group,
                "launch_ms": round(1e3 * (e.launch - t0), 3),
                "finish_ms": round(1e3 * (e.finish - t0), 3),
                "blocked_ms": round(1e3 * sum(b - a for a, b in blocked), 3),
                "remote_kb": round(e.remote_sent / 1024, 1),
            }
        )
    return {"forward_ms": round(1e3 * (t_fwd - t0), 3), "iteration_ms": round(1e3 * (t1 - t0), 3), "a2a": events}


def print_timeline(mode: str, tl: dict) -> None:
    """`timeline`'s all-to-alls of one mode as a table."""
    print(f"timeline of {mode}: forward {tl['forward_ms']:.1f} ms, forward + backward {tl['iteration_ms']:.1f} ms")
    print(f"  {'phase':<5} {'group':<10} {'launch':>8} {'finish':>8} {'blocked':>8} {'remote KB':>10}")
    for e in tl["a2a"]:
        print(
            f"  {e['phase']:<5} {e['group']:<10} {e['launch_ms']:>8.1f} {e['finish_ms']:>8.1f} "
            f"{e['blocked_ms']:>8.1f} {e['remote_kb']:>10.1f}"
        )


def run_modes(modes: list[str], args, cfg: Config, ps, costs, comm, ids, labels) -> list[dict]:
    """Time all modes round-robin (iteration i of every mode, then i + 1, ...), so load that
    comes and goes on a shared machine hits every mode alike; medians, slowest rank."""
    setups = {m: prepare(m, cfg, ps, costs, comm, ids, labels) for m in modes}
    samples: dict = {m: [] for m in modes}
    for it in range(args.warmup + args.iters):
        for j in range(len(modes)):  # rotate the order: no mode always runs first
            m = modes[(it + j) % len(modes)]
            model, _, ctl = setups[m]
            r = step(model, ctl, ids, labels)
            if it >= args.warmup:
                samples[m].append(r)
    timelines = {m: timeline(setups[m][0], setups[m][2], ids, labels) for m in modes} if args.timeline else {}
    rows, iter_ms = [], {}
    for m in modes:
        model, plan, ctl = setups[m]
        slowest = torch.tensor([s[0] for s in samples[m]], dtype=torch.float64, device=ps.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # each round's slowest rank
        iter_ms[m] = slowest.cpu().tolist()
        med = torch.tensor(
            [statistics.median(s[j] for s in samples[m]) for j in range(4)] + [min(s[0] for s in samples[m])],
            dtype=torch.float64,
            device=ps.device,
        )
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        med = med.cpu()
        if cfg.opts.lancet_report and ctl.plan is not None:
            ctl.write_report(f"{cfg.opts.lancet_report}.{m}.json", measured_iter_ms=float(med[0]))
        ctl.remove()
        rows.append(
            {
                "mode": m,
                "iter_ms_median": round(float(med[0]), 3),
                "iter_ms_min": round(float(med[4]), 3),
                "remote_bytes": int(med[3]),
                "a2a_ms": round(float(med[1]), 3),
                "a2a_exposed_ms": round(float(med[2]), 3),
                "predicted_ms": round(plan.predicted["iteration_ms"], 3),
                "predicted_a2a_exposed_ms": round(plan.predicted["a2a_exposed_ms"], 3),
                "ranges": [f"L{r.layer}:{r.start}->{r.end} k={r.k}" for r in plan.ranges],
                "dw_assigned": sum(len(v) for v in plan.assignment.values()),
                "chosen": plan.selection.get("chosen"),
                "selection": plan.selection or None,
            }
        )
        if m in timelines:
            rows[-1]["timeline"] = timelines[m]
    for r in rows:  # none's time over the mode's, round by round, with its 95 % bootstrap interval
        r["speedup_paired"] = list(paired_ratio(iter_ms["none"], iter_ms[r["mode"]])) if "none" in iter_ms else None
    fit = next((r["selection"]["contention"] for r in rows if r["selection"]), None)
    for r, m in zip(rows, modes):  # the planner's contention fit applied to every mode's plan
        r["fitted_ms"] = round(fitted_ms(setups[m][1], fit), 3) if fit is not None else None
    return rows


def paired_text(paired) -> str:
    """A paired speedup's cell: "1.25x (1.21-1.30)", or "-" without a `none` row."""
    return "-" if paired is None else "{:.2f}x ({:.2f}-{:.2f})".format(*paired)


def print_table(rows: list[dict], head: dict, iters: int) -> None:
    """The rows as a readable table, with prediction error and speedup over `none` (of the medians, and of
    the minima: load from other jobs only adds time, so on a shared machine the minima are the steadier
    comparison); "wire ms" with --link-mbit."""
    base = next((r for r in rows if r["mode"] == "none"), rows[0])
    wire = "wire_ms" in rows[0]
    print(f"Lancet ablation ({iters} timed iterations per mode, medians): {head}")
    print(
        f"{'mode':<10} {'iter ms':>9} {'(min)':>8} {'a2a ms':>9} {'exposed a2a ms':>15} "
        + (f"{'wire ms':>8} " if wire else "")
        + f"{'predicted ms':>13} {'pred err':>9} {'fitted err':>10} {'speedup':>8} {'(min)':>6} {'paired (95%)':>20}  ranges"
    )
    for r in rows:
        err = (r["predicted_ms"] - r["iter_ms_median"]) / r["iter_ms_median"]
        ferr = (
            f"{(r['fitted_ms'] - r['iter_ms_median']) / r['iter_ms_median']:>+10.0%}"
            if r["fitted_ms"]
            else f"{'-':>10}"
        )
        chosen = f" (kept {r['chosen']})" if r["chosen"] else ""
        print(
            f"{r['mode']:<10} {r['iter_ms_median']:>9.1f} {r['iter_ms_min']:>8.1f} {r['a2a_ms']:>9.1f} "
            f"{r['a2a_exposed_ms']:>15.1f} "
            + (f"{r['wire_ms']:>8.1f} " if wire else "")
            + f"{r['predicted_ms']:>13.1f} {err:>+9.0%} {ferr} {base['iter_ms_median'] / r['iter_ms_median']:>7.2f}x "
            f"{base['iter_ms_min'] / r['iter_ms_min']:>5.2f}x {paired_text(r['speedup_paired']):>20}  "
            f"{', '.join(r['ranges']) or '-'}{chosen}"
        )
    sel = next((r["selection"] for r in rows if r["selection"]), None)
    if sel:
        fit = sel["contention"]
        times = ", ".join(f"{n} {c['measured_ms']:.1f}" for n, c in sel["candidates"].items())
        print(
            f"auto: measured {times} ms; kept {sel['chosen']}; contention fit scale {fit['scale']:.3f}, {fit['contention']:.3f} ms per "
            f"overlapped ms"
        )


def main(argv=None) -> None:
    """Profile once, time every mode, print the table (rank 0) and write --json; then the shared
    teardown (after `run` returned, so its groups are released)."""
    args = parse_args(argv)
    with exit_on_comm_error():
        run(args)
        shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        time.sleep(2.0)  # let the other nodes' torchrun agents reach their exit barrier on our store first


def run(args: argparse.Namespace) -> None:
    """The benchmark proper (see `main`)."""
    device, backend = device_and_backend(args.cfg.parallel.device, args.cfg.parallel.distributed_backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = dist.get_world_size()
    cfg = build_config(args, world)
    ps = initialize_model_parallel(
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.expert_model_parallel_size,
        cfg.parallel.expert_sharding_parallel_size,
        backend,
        device=device,
    )
    m, moe = cfg.model, cfg.moe
    B, T = cfg.train.micro_batch_size, m.seq_length
    g = torch.Generator(device="cpu").manual_seed(100 + ps.rank("dp"))  # host draws: same ids on every device
    ids = torch.randint(0, m.vocab_size, (B, T + 1), generator=g, device="cpu").to(device)
    probe = GPT2MoE(cfg, ps)
    costs = profile_costs(probe, ps, B, T, max_parts=cfg.opts.lancet_max_partitions)
    comm = profile_a2a_model(ps, int(model_shapes(probe, ps, B, T).a2a_bytes()))
    del probe
    rows = run_modes(args.modes.split(","), args, cfg, ps, costs, comm, ids[:, :-1], ids[:, 1:])
    if args.link_mbit is not None:  # the least time the link carries these bytes (slowest rank's)
        for r in rows:
            r["wire_ms"] = round(r["remote_bytes"] * 8 / (args.link_mbit * 1e6) * 1e3, 3)
    head = {
        "world": world,
        "mp": ps.size("mp"),
        "ep": ps.size("ep"),
        "esp": ps.size("esp"),
        "layers": m.num_layers,
        "hidden": m.hidden_size,
        "experts": moe.num_experts,
        "topk": moe.moe_router_topk,
        "micro_batch": B,
        "seq": T,
        "backend": backend,
    }
    if dist.get_rank() == 0:
        print_table(rows, head, args.iters)
        for r in rows:
            if "timeline" in r:
                print_timeline(r["mode"], r["timeline"])
        if args.json:
            atomic_write_json(args.json, [dict(r, config=head) for r in rows])


if __name__ == "__main__":
    main()
