"""Benchmark Lina: step time, backward all-to-all time and its slowdown, per mode of the paper's ablation.

Run under torchrun (every rank runs every mode):

  torchrun --nproc-per-node 2 tools/bench_lina.py --modes all --json lina_local.json
  scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 200mbit -- \\
      tools/bench_lina.py --modes all --json lina_cluster.json

Modes (the same model, batches and weights in each; Lina section 6, Figure 14):
  alone           gradients all-reduced after backward (blocking), so the all-to-alls
                  run alone: the reference all-to-all time and the all-to-all share;
  no_lina         GradSync: --bucket-mb buckets all-reduced asynchronously from
                  grad-ready hooks during backward (the usual overlap);
  lina_priority   LinaScheduler with whole tensors as ops, one in flight: the priority
                  gate only;
  lina_partition  + micro-ops of each --partitions size, up to --max-in-flight in
                  flight under the link-rate launch budget;
  lina_pipeline   + all-to-alls in --pipeline-chunks micro-ops pipelined with the experts;
  lina            the full system as the trainer runs it: lina_pipeline, then the trainer's
                  Lina trial (`distributed.lina_trial`, the same code): warm-up rounds, then
                  --measure-iters K timed iterations each with the plain bucketed sync
                  (no_lina's) and with Lina, taking turns, MAX over ranks; Lina stays only if
                  faster by more than 2 % (`choose`), else the mode goes on (and is measured)
                  with the plain sync. Then, after --warmup iterations and the Lina trial (the
                  trainer's order, `training.take_turns`), expert packing (`moe.packing`): Lina's
                  rule is asked (FFN vs all-to-all micro-op time, MAX over ranks); a pack is
                  measured (K iterations unpacked, K packed) and kept only if faster, else the
                  experts go back and packing stops; a kept pack is followed by the next one (up
                  to --max-experts-per-rank). MMOE_CHOOSE forces picks ("lina=plain",
                  "lina-packing-rule=pack", "lina-packing=packed"). Those iterations are the
                  mode's warm-up; the measured ones run in the final layout.
The modes take turns, --rounds times; each turn builds the model, runs
--warmup iterations (mode lina: until its Lina trial and its packing are decided),
then --iters measured ones (mode lina's medians exclude the trial's steps, as the
trainer amortizes them over a run; their cost is reported separately); an iteration is
forward, backward, gradient sync and an SGD step, started together on all
ranks (a barrier). Step time: max over ranks; backward all-to-all time
(a2a_bwd_ms): how long a backward all-to-all was in flight (the union of
their intervals, launch to transfer completion), minimum over ranks (a gloo
call also waits for late peers; the last rank to arrive does not);
a2a_bwd_calls_ms: per call the minimum over ranks, summed (the earlier
metric; concurrent chunk all-to-alls of the pipelined modes each count
whole); a2a_share: that per-call sum over every all-to-all of the step
(forward too) / step time, meaningful for `alone`;
overlap (time a gradient all-reduce ran during an all-to-all) and
pipelining_efficiency (fraction of the time an all-to-all was in flight
during which an expert forward or backward ran, from the experts' module
hooks): mean over ranks; medians over iterations. experts_per_rank: after
the mode's last iteration (packing changes it in mode lina); the layout is
restored before the next mode. packing_decisions (mode lina): per round, the
packing and trial decisions with their times and log lines. Mode lina's Lina trial:
lina_kept (true / false when every round decided the same, else null; lina_kept_rounds
per round), trial_lina_ms_median / trial_plain_ms_median (the trial's own medians, MAX
over ranks, median over rounds), trial_ms_total (the trial's 2K timed steps summed,
mean over rounds), lina_trial (per round: the decision and its log line).

--model representative (default): 4 blocks, MoE at 2 and 4, M=256, H=1024, top-2,
2048 tokens per rank: all-to-all buffers of 4 MB, ~9 MB of dense gradients, so the
all-to-all is a large share of the step on a shaped link and the all-reduce can hide
under backward. --model heavy_allreduce: the earlier default, M=512, H=2048, top-1,
512 tokens per rank: ~34 MB of dense gradients, 1 MB all-to-all buffers. Both: 2
experts per rank with EP = world size, so the all-to-alls cross nodes.

Prints a table and, with --json PATH, writes a list of objects with keys mode,
partition_mb, step_ms_median, a2a_bwd_ms_median, a2a_alone_ms_median, a2a_slowdown,
a2a_share, speedup_vs_no_lina, pipelining_efficiency_median, experts_per_rank (plus
packing_decisions, lina_kept, lina_kept_rounds, trial_lina_ms_median, trial_plain_ms_median,
trial_ms_total, lina_trial, a2a_total_ms_median, a2a_bwd_raw_ms_median, overlap_ms_median, model, world_size,
load_avg_1min).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_moe.fileio import atomic_write_json
from megatron_moe.arguments import add_config_flags, config_from_args
from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.distributed.grad_sync import GradSync, grad_group_kind, sync_gradients
from megatron_moe.distributed.lina import LinaScheduler
from megatron_moe.distributed.lina_trial import LinaTrial
from megatron_moe.distributed import observer
from megatron_moe.distributed.observer import CommLog
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.packing import ExpertPacking
from megatron_moe.parallel_state import device_and_backend, initialize_model_parallel, shutdown, validate_degrees
from megatron_moe.training import take_turns


MODELS = ("representative", "heavy_allreduce")
ALL_MODES = ("alone", "no_lina", "lina_priority", "lina_partition", "lina_pipeline", "lina")
PER_ROUND = ("experts_per_rank", "packing_decisions", "lina_trial")  # run_mode's values that are not per iteration
WHOLE_TENSORS_MB = 1024.0  # lina_priority: a micro-op is one whole gradient tensor (no partitioning)


def bench_defaults(model: str = "representative") -> Config:
    """The benchmark model (module docstring): GPT-2 MoE with MoE blocks 2, 4, ..., capacity factor 1.

    representative: M=256, H=1024, top-2, micro-batch 16 (2048 tokens per rank): ~9 MB of dense
        gradients, all-to-all buffers of 4 MB;
    heavy_allreduce: the earlier default, M=512, H=2048, top-1, micro-batch 4: ~34 MB of dense
        gradients, all-to-all buffers of 1 MB."""
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.num_layers, m.num_attention_heads, m.seq_length, m.vocab_size = 4, 8, 128, 1024
    moe.moe_expert_capacity_factor, moe.moe_min_capacity, moe.moe_schedule = 1.0, 4, "baseline"
    if model == "heavy_allreduce":
        m.hidden_size, moe.moe_router_topk, cfg.train.micro_batch_size = 512, 1, 4
    else:
        m.hidden_size, m.ffn_hidden_size, moe.moe_router_topk, cfg.train.micro_batch_size = 256, 1024, 2, 16
    return cfg


def parse_args(argv=None) -> argparse.Namespace:
    """The trainer's model / MoE / parallelism / training flags (`arguments.add_config_flags`;
    --num-experts 0 means 2 x EP, --expert-model-parallel-size defaults to the world size) with
    the defaults of --model, plus the benchmark's own: --model, --iters, --warmup, --rounds,
    --partitions, --bucket-mb, --max-in-flight, --pipeline-chunks, --modes, --json."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="representative")
    model = pre.parse_known_args(argv)[0].model
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="representative",
        choices=MODELS,
        help="the default model / MoE flags (module docstring); explicit flags override them",
    )
    add_config_flags(p, ("model", "moe", "parallel", "train"), bench_defaults(model if model in MODELS else MODELS[0]))
    p.add_argument("--iters", type=int, default=4, help="measured iterations per mode and round")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured iterations per mode and round")
    p.add_argument("--rounds", type=int, default=2, help="times every mode runs, in turn")
    p.add_argument(
        "--partitions",
        default="1",
        help="micro-op sizes in MB of the partitioned Lina modes, comma-separated (each runs once per size)",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=4.0,
        help="GradSync bucket size of the no_lina mode (small enough that buckets start during backward)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=4,
        help="micro-ops in flight at most (LinaScheduler max_in_flight) in the partitioned Lina modes",
    )
    p.add_argument("--pipeline-chunks", type=int, default=4, help="--lina-pipeline-chunks of lina_pipeline and lina")
    p.add_argument(
        "--max-experts-per-rank",
        type=int,
        default=0,
        help="--lina-max-experts-per-rank of mode lina's expert packing (0: no bound)",
    )
    p.add_argument(
        "--measure-iters",
        type=int,
        default=Config().opts.measure_iters,
        help="mode lina: the trainer's --measure-iters: timed iterations of each alternative of the Lina trial "
        "and of a pack's trial (0: no trial: Lina stays, packing follows Lina's rule)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["alone,no_lina,lina"],
        help=f"modes to run, comma- or space-separated, or 'all' ({','.join(ALL_MODES)})",
    )
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    a = p.parse_args(argv)
    try:
        a.cfg = config_from_args(a)
    except ValueError as e:
        p.error(str(e))
    a.ep_given = any(x.split("=")[0] == "--expert-model-parallel-size" for x in argv)
    a.comm_timeout, a.micro_batch_size = a.cfg.parallel.comm_timeout, a.cfg.train.micro_batch_size
    try:
        a.partitions = [float(x) for x in a.partitions.split(",") if x.strip()]
    except ValueError:
        p.error(f"--partitions must be comma-separated numbers, got {a.partitions!r}")
    if not a.partitions or any(x <= 0 for x in a.partitions):
        p.error("--partitions sizes must be positive")
    names = [m.strip() for x in a.modes for m in x.split(",") if m.strip()]
    a.modes = list(ALL_MODES) if names == ["all"] else names
    bad = [m for m in a.modes if m not in ALL_MODES]
    if bad:
        p.error(f"--modes: unknown mode(s) {bad}; choose from {', '.join(ALL_MODES)} or all")
    if a.iters < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--iters and --rounds must be >= 1, --warmup >= 0")
    if a.max_in_flight < 1 or a.pipeline_chunks < 1:
        p.error("--max-in-flight and --pipeline-chunks must be >= 1")
    if a.max_experts_per_rank < 0:
        p.error("--max-experts-per-rank must be >= 0")
    if a.measure_iters < 0:
        p.error("--measure-iters must be >= 0 (0: mode lina runs without the trials)")
    return a


def build_config(a: argparse.Namespace, world: int) -> Config:
    """The parsed Config with EP = the world size unless given and 2 x EP experts unless given."""
    cfg = a.cfg
    ep = cfg.parallel.expert_model_parallel_size if a.ep_given else world
    cfg.parallel.expert_model_parallel_size = ep
    cfg.moe.num_experts = cfg.moe.num_experts or 2 * ep
    validate_degrees(world, 1, ep, 1, cfg.moe.num_experts, cfg.model.ffn_hidden_size)
    return cfg


def mode_settings(a: argparse.Namespace, mode: str, partition_mb) -> tuple[Optional[LinaScheduler], int]:
    """(the Lina scheduler of `mode` or None, pipeline chunks) -- the paper's Figure 14 ablation:
    lina_priority: whole tensors, one in flight, only the priority gate; lina_partition: + micro-ops
    of `partition_mb` (coalesced) under the launch budget; lina_pipeline: + all-to-all micro-ops pipelined with
    the experts; lina: the same plus expert packing (`packing_for`)."""
    if mode in ("alone", "no_lina"):
        return None, 1
    if mode == "lina_priority":
        return LinaScheduler(WHOLE_TENSORS_MB, a.comm_timeout, max_in_flight=1), 1
    sched = LinaScheduler(partition_mb, a.comm_timeout, max_in_flight=a.max_in_flight, coalesce=True)
    return sched, (1 if mode == "lina_partition" else a.pipeline_chunks)


def trial_for(
    a: argparse.Namespace, mode: str, sync: Optional[GradSync], sched, ps, model, chunks: int
) -> Optional[LinaTrial]:
    """Mode lina's Lina trial, the trainer's (`distributed.lina_trial`): the plain run (no_lina's bucketed
    sync, all-to-alls not pipelined) and Lina take turns over the first iterations; the rest of the mode
    runs with the pick. None for the other modes or with --measure-iters 0."""
    if mode != "lina" or not a.measure_iters or sync is None or sched is None:
        return None
    pipeline = (lambda on: model.set_pipeline_chunks(chunks if on else 1)) if chunks > 1 else None
    return LinaTrial(sync, sched, ps, a.measure_iters, pipeline)


def packing_for(a: argparse.Namespace, mode: str, model, opt, ps, num_experts: int) -> Optional[ExpertPacking]:
    """Mode lina's expert packing: Lina's rule is asked at every iteration from max(--warmup, 1) on once the
    Lina trial decided (`training.take_turns`), a pack measured as in the trainer (`packing_pending`)."""
    if mode != "lina":
        return None
    return ExpertPacking(model, opt, ps, num_experts, a.max_experts_per_rank, a.measure_iters, max(a.warmup, 1), 1)


def packing_pending(packing: ExpertPacking) -> bool:
    """Mode lina warms up while packing has something to do: a pack is measured, Lina's rule was not asked
    yet, or the last decision packed and another pack is possible (asked at the next iteration)."""
    d = packing.decisions
    return packing.busy or not d or (d[-1]["pick"] in ("pack", "packed") and not packing.decided)


class ExpertClock:
    """Intervals [start, end] (perf_counter s) of every expert forward and backward of a model,
    from the modules' own forward / full-backward hooks."""

    def __init__(self, model: torch.nn.Module):
        self.intervals: list[tuple[float, float]] = []
        self._t: dict = {}
        self._hooks = []
        for layer in model.moe_layers():
            e = layer.experts
            self._hooks += [
                e.register_forward_pre_hook(lambda m, i: self._begin(("f", id(m)))),
                e.register_forward_hook(lambda m, i, o: self._end(("f", id(m)))),
                e.register_full_backward_pre_hook(lambda m, g: self._begin(("b", id(m)))),
                e.register_full_backward_hook(lambda m, gi, go: self._end(("b", id(m)))),
            ]

    def _begin(self, key) -> None:
        self._t[key] = time.perf_counter()

    def _end(self, key) -> None:
        if key in self._t:
            self.intervals.append((self._t.pop(key), time.perf_counter()))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def pipelining_efficiency(a2a: list, expert: list[tuple[float, float]]) -> float:
    """Fraction of the time an all-to-all was in flight during which expert compute ran (0: none)."""
    busy = observer.union([(e.launch, e.finish) for e in a2a if e.finish is not None])
    total = observer.total_length(busy)
    return observer.intersection_length(busy, observer.union(expert)) / total if total > 0 else 0.0


def run_mode(cfg: Config, ps, a: argparse.Namespace, mode: str, partition_mb) -> dict:
    """Warm up, measure, and return per-iteration lists (ms) of step time, backward and total
    all-to-all time, the backward time with waits, overlap, and the pipelining efficiency.

    A gloo all-to-all call also lasts while it waits for the last peer to arrive,
    so per call the *minimum* over ranks (the last rank's wait is nil) is its
    transfer time; a2a_bwd_ms sums that over the backward all-to-alls of the
    iteration (a2a_total_ms over all of them). a2a_bwd_raw_ms is the mean over
    ranks of the plain sum, waits included.
    """
    model = GPT2MoE(cfg, ps)
    sched, chunks = mode_settings(a, mode, partition_mb)
    model.set_pipeline_chunks(chunks)
    sync = None if mode == "alone" else GradSync(model, ps, bucket_mb=a.bucket_mb, scheduler=sched)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    ep_before = ps.size("ep")
    trial = trial_for(a, mode, sync, sched, ps, model, chunks)
    packing = packing_for(a, mode, model, opt, ps, cfg.moe.num_experts)
    trials = {name: t for name, t in (("lina", trial), ("lina-packing", packing)) if t is not None}
    gen = torch.Generator(device="cpu").manual_seed(1234 + ps.rank("dp"))  # host draws: same ids on every device
    log = CommLog().start()
    # the expert clock's full backward hooks keep the last call's graph (and so the parameters' gradient
    # accumulators, with their shapes) alive until the next call: it starts once packing is over
    clock: Optional[ExpertClock] = None
    steps, a2a_calls, a2a_all, overlap, eff, syncs, bwd_union = [], [], [], [], [], [], []
    it = 0
    while len(steps) < a.iters:
        # the same on every rank: the warm-up, the Lina trial, then packing (`training.take_turns`)
        take_turns(trials)
        warming = it < a.warmup or (trial is not None and not trial.decided)
        warming = warming or (packing is not None and packing_pending(packing))
        packing_now = packing is not None and warming
        ids = torch.randint(
            0, cfg.model.vocab_size, (a.micro_batch_size, cfg.model.seq_length + 1), generator=gen, device="cpu"
        ).to(ps.device)
        dist.barrier()
        if packing_now:
            packing.step_begins()
        log.clear()
        if clock is None and not warming:
            clock = ExpertClock(model)
        if clock is not None:
            clock.intervals.clear()
        if trial is not None:
            trial.before_step()  # while the trial runs: Lina or the plain sync for this step; starts its clock
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lm, aux = model(ids[:, :-1], ids[:, 1:])
        (lm + aux).backward()
        t1 = time.perf_counter()
        if sync is None:
            sync_gradients(model, ps)
        else:
            sync.finish()
        t2 = time.perf_counter()
        opt.step()
        step = time.perf_counter() - t0
        del lm, aux  # their graph holds the parameters' gradient accumulators: none may outlive a step
        it += 1
        if trial is not None:
            verdict = trial.after_step()  # at the trial's last step: the decision (collective), between steps
            if verdict is not None and ps.global_rank == 0:
                print(f"    {mode}: {verdict}", flush=True)
        if packing_now:  # between steps, outside the measured time
            for decision in packing.step_done(it):
                if ps.global_rank == 0:
                    print(f"    {mode}: {decision}", flush=True)
            if not packing_pending(packing):
                packing.close()  # no packing (and no timing hooks) in the measured iterations
        if not warming:
            steps.append(1e3 * step)
            syncs.append(1e3 * (t2 - t1))
            a2a_calls.append([1e3 * e.duration for e in log.of("all_to_all", phase="bwd")])
            bwd_union.append(
                1e3
                * observer.total_length(
                    observer.union(
                        [(e.launch, e.finish) for e in log.of("all_to_all", phase="bwd") if e.finish is not None]
                    )
                )
            )
            a2a_all.append([1e3 * e.duration for e in log.of("all_to_all")])
            overlap.append(log.summary()["overlap_ms"])
            assert clock is not None  # created before the first measured iteration
            eff.append(pipelining_efficiency(log.of("all_to_all"), clock.intervals))
    log.stop()
    if clock is not None:
        clock.remove()
    experts_per_rank = cfg.moe.num_experts // ps.size("ep")
    decisions = [] if packing is None else packing.decisions
    trial_info = None
    d = trial.trial.decision if trial is not None else None
    if d is not None:  # the same numbers on every rank (MAX over the world)
        trial_info = {
            "lina_kept": d.pick == "lina",
            "lina_ms_median": d.medians["lina"],
            "plain_ms_median": d.medians["plain"],
            "trial_ms_total": sum(sum(v) for v in d.samples.values()),
            "line": d.line(),
        }
    if packing is not None:
        packing.close()
        if ps.size("ep") != ep_before:
            ps.relayout_experts(ep_before)  # the next mode starts from the configured layout
    stats = {} if sched is None else {"max_in_flight_seen": sched.max_concurrent, "link_mb_s": sched.rate_bps or 0.0}
    if sync is not None:
        sync.remove()
    if stats and ps.rank("dp") == 0 and dist.get_rank() == 0:
        print(
            f"    {mode}: at most {stats['max_in_flight_seen']} micro-ops in flight, link "
            f"{stats['link_mb_s'] / 2**20:.1f} MB/s measured",
            flush=True,
        )
    world = dist.get_world_size()
    step_max = torch.tensor(steps, dtype=torch.float64, device=ps.device)
    dist.all_reduce(step_max, op=dist.ReduceOp.MAX)
    calls = torch.tensor(a2a_calls, dtype=torch.float64, device=ps.device)  # [iters, backward a2a calls]
    calls_min, calls_sum = calls.clone(), calls.clone()
    dist.all_reduce(calls_min, op=dist.ReduceOp.MIN)
    dist.all_reduce(calls_sum)
    every = torch.tensor(a2a_all, dtype=torch.float64, device=ps.device)  # [iters, all a2a calls]
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    in_flight = torch.tensor(bwd_union, dtype=torch.float64, device=ps.device)  # [iters]
    dist.all_reduce(in_flight, op=dist.ReduceOp.MIN)
    ov = torch.tensor([overlap, eff, syncs], dtype=torch.float64, device=ps.device)
    dist.all_reduce(ov)
    step_max, calls_min, calls_sum, every, ov, in_flight = (
        t.cpu() for t in (step_max, calls_min, calls_sum, every, ov, in_flight)
    )
    return {
        "step_ms": step_max.tolist(),
        "a2a_bwd_ms": in_flight.tolist(),
        "a2a_bwd_calls_ms": calls_min.sum(1).tolist(),
        "a2a_total_ms": every.sum(1).tolist(),
        "a2a_bwd_raw_ms": (calls_sum.sum(1) / world).tolist(),
        "overlap_ms": (ov[0] / world).tolist(),
        "pipelining_efficiency": (ov[1] / world).tolist(),
        "sync_after_backward_ms": (ov[2] / world).tolist(),
        "experts_per_rank": [experts_per_rank],
        "packing_decisions": [decisions],
        "lina_trial": [trial_info],
    }


def trial_summary(rounds: list[Optional[dict]]) -> dict:
    """Mode lina's trial over the rounds (one trial per round, `run_mode`'s lina_trial): whether Lina was
    kept (True / False when every round agreed, else None; per round in lina_kept_rounds), the medians
    over the rounds of the trial's own medians (ms, MAX over ranks), and the trial's cost: its 2K timed
    steps summed (trial_ms_total, mean over the rounds). No trial (--measure-iters 0): all None."""
    done = [r for r in rounds if r is not None]
    if not done:
        return {
            "lina_kept": None,
            "lina_kept_rounds": None,
            "trial_lina_ms_median": None,
            "trial_plain_ms_median": None,
            "trial_ms_total": None,
        }
    kept = [r["lina_kept"] for r in done]
    return {
        "lina_kept": kept[0] if all(k == kept[0] for k in kept) else None,
        "lina_kept_rounds": kept,
        "trial_lina_ms_median": statistics.median(r["lina_ms_median"] for r in done),
        "trial_plain_ms_median": statistics.median(r["plain_ms_median"] for r in done),
        "trial_ms_total": statistics.fmean(r["trial_ms_total"] for r in done),
    }


TABLE_NOTE = (
    "step ms / bwd a2a / ...: medians of the measured iterations only; in mode lina they exclude the Lina trial's "
    "steps (as the trainer amortizes them over a run) and run with what it kept ('kept': Lina, 'plain': the "
    "no_lina sync, 'mixed': the rounds differed); 'trial ms': the trial's 2K timed steps summed (MAX over "
    "ranks per step, mean over rounds), its medians in the JSON (trial_lina_ms_median, trial_plain_ms_median)"
)


def table(rows: list[dict]) -> str:
    """The rows as a text table, with the note on what the medians exclude when a row ran the Lina trial."""
    head = (
        f"{'mode':14s} {'part MB':>8s} {'step ms':>9s} {'vs no_lina':>10s} {'bwd a2a ms':>11s} {'slowdown':>9s} "
        f"{'a2a share':>9s} {'overlap ms':>11s} {'pipe eff':>9s} {'exp/rank':>8s} {'lina':>6s} {'trial ms':>9s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        part = "-" if r["partition_mb"] is None else f"{r['partition_mb']:g}"
        lines.append(
            f"{r['mode']:14s} {part:>8s} {r['step_ms_median']:9.1f} {r['speedup_vs_no_lina']:9.2f}x "
            f"{r['a2a_bwd_ms_median']:11.2f} {r['a2a_slowdown']:8.2f}x {r['a2a_share']:9.2f} "
            f"{r['overlap_ms_median']:11.2f} {r['pipelining_efficiency_median']:9.2f} {r['experts_per_rank']:8d} "
            f"{kept_word(r.get('lina_kept_rounds'), r.get('lina_kept')):>6s} "
            f"{'-' if r.get('trial_ms_total') is None else format(r['trial_ms_total'], '.1f'):>9s}"
        )
    if any(r.get("lina_kept_rounds") for r in rows):
        lines.append(f"note: {TABLE_NOTE}")
    return "\n".join(lines)


def kept_word(rounds: Optional[list], kept: Optional[bool]) -> str:
    """The table's 'lina' column: '-' (no trial), 'kept', 'plain' or 'mixed'."""
    if not rounds:
        return "-"
    return "mixed" if kept is None else ("kept" if kept else "plain")


def main(argv=None) -> None:
    """Parse, benchmark, then the shared teardown (after `run` returned: its groups are released)."""
    a = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("bench_lina.py: run it under torchrun (e.g. torchrun --nproc-per-node 2 tools/bench_lina.py)")
    with exit_on_comm_error():
        run(a)
        shutdown()


def run(a: argparse.Namespace) -> None:
    """Every mode for --rounds rounds; table and --json on rank 0."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device, backend = device_and_backend(a.cfg.parallel.device, a.cfg.parallel.distributed_backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=a.comm_timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        cfg = build_config(a, world)
    except ValueError as e:
        sys.exit(f"bench_lina.py: {e}")
    ps = initialize_model_parallel(1, cfg.parallel.expert_model_parallel_size, 1, backend, device=device)
    probe = GPT2MoE(cfg, ps)
    dense_mb = sum(p.numel() * 4 for p in probe.parameters() if grad_group_kind(p) == "dp") / 2**20
    expert_mb = sum(p.numel() * 4 for p in probe.parameters() if grad_group_kind(p) == "expert_dp") / 2**20
    del probe
    if rank == 0:
        print(
            f"bench_lina: world {world}, EP {ps.size('ep')}, expert-DP {ps.size('expert_dp')}, "
            f"model {a.model}, dense gradients {dense_mb:.1f} MB, expert gradients {expert_mb:.1f} MB per rank",
            flush=True,
        )
    plan = [(m, None) for m in ("alone", "no_lina", "lina_priority") if m in a.modes]
    plan += [(m, p) for m in ("lina_partition", "lina_pipeline", "lina") if m in a.modes for p in a.partitions]
    pooled = {key: {} for key in plan}
    for rnd in range(a.rounds):  # modes take turns, so a change in machine load hits all of them
        for mode, part in plan:
            r = run_mode(cfg, ps, a, mode, part)
            for k, v in r.items():
                pooled[(mode, part)].setdefault(k, []).extend(v)
            if rank == 0:
                print(
                    f"  round {rnd} {mode} {'' if part is None else part}: step "
                    f"{statistics.median(r['step_ms']):.1f} ms, bwd a2a {statistics.median(r['a2a_bwd_ms']):.2f} ms",
                    flush=True,
                )
    results = [
        {
            "mode": mode,
            "partition_mb": part,
            **{f"{k}_median": statistics.median(v) for k, v in pooled[(mode, part)].items() if k not in PER_ROUND},
            "experts_per_rank": pooled[(mode, part)]["experts_per_rank"][-1],  # after the last round
            "packing_decisions": pooled[(mode, part)]["packing_decisions"] if mode == "lina" else None,
            **trial_summary(pooled[(mode, part)]["lina_trial"]),
            "lina_trial": pooled[(mode, part)]["lina_trial"] if mode == "lina" else None,
        }
        for mode, part in plan
    ]
    alone = next((r for r in results if r["mode"] == "alone"), None)
    base = next((r["step_ms_median"] for r in results if r["mode"] == "no_lina"), float("nan"))
    for r in results:
        r["a2a_alone_ms_median"] = alone["a2a_bwd_ms_median"] if alone else float("nan")
        r["a2a_slowdown"] = (
            r["a2a_bwd_ms_median"] / r["a2a_alone_ms_median"]
            if alone and alone["a2a_bwd_ms_median"] > 0
            else float("nan")
        )
        r["a2a_share"] = r["a2a_total_ms_median"] / r["step_ms_median"] if r["step_ms_median"] > 0 else float("nan")
        r["speedup_vs_no_lina"] = base / r["step_ms_median"] if r["step_ms_median"] > 0 else float("nan")
        r["model"] = a.model
        r["world_size"] = world
        r["load_avg_1min"] = os.getloadavg()[0]  # other work on the machine makes timings noisy
    if rank == 0:
        print(table(results), flush=True)
        if a.json:
            atomic_write_json(a.json, results, sort_keys=False)
            print(f"wrote {a.json}", flush=True)


if __name__ == "__main__":
    main()
