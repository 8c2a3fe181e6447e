"""Benchmark expert-parallel inference with Lina's two-phase scheduling: none, phase1, phase1_2, lina.

Run under torchrun; EP = world size (every rank holds E / world experts and serves its own
batches of requests, DP = world size):

  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/bench_inference.py --skew 1.2 --json inf_local.json
  OMP_NUM_THREADS=1 scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 200mbit \\
      -- tools/bench_inference.py --skew 1.2 --json inf_cluster.json

Model: --load CKPT (any layout; requests tokenized with its tokenizer), else a seeded random-init
GPT-2 MoE (every block MoE, byte ids, vocabulary 256), its gate weights scaled by
--gate-scale so that routing depends on the token (the repository bundles no trained
checkpoint). `--model` picks its size (explicit flags override):
  representative (default)  4 blocks, M 256, 4 experts of H 4096, top-1 (the paper's inference
                            setting and its 4-expert model), prompts of 128 + 2 new tokens, 16
                            requests per rank: the expert GEMMs dominate the MoE layer (printed)
  wide16                    the same with 16 experts, top-2, 8 requests per rank
  small                     4 blocks, M 256, 8 experts of H 1024, top-2, prompts of 64 + 4 new
                            tokens, 8 requests per rank
Requests: windows of --prompt-len tokens of the bundled sample corpus's valid split,
--batch-size per rank per batch, each extended greedily by --new-tokens (prefill + decode on the
KV-cache engine). The profile (tools/profile_expert_paths.py's format, --path-length) is made on
the train split, with the same router. `--skew S` adds a gate bias per MoE layer, calibrated on
the train split (--skew-iters corrections by the log ratio of target to measured shares) so that
the share of choices of the i-th expert of a seeded per-layer permutation follows a Zipf law
(i + 1)^-S (S = 0: no bias, the model's own popularity).

Expert share: before the timed batches, one batch in mode none; the expert GEMMs' time over the
MoE layer's own compute (its wall time minus the time inside its collectives, waits included),
and over its whole wall time; sums over layer calls and ranks.

Modes take turns batch by batch (after --warmup batches each) through the same engine, all with
every expert resident on every rank (gathered once; a replica moves no weights):
  none      the trained placement (expert e on rank e // (E / world)), dropless uneven all-to-all
  phase1    Lina's phase 1: placement from the path estimate carried by the previous layer's exchange
  phase1_2  phase 1 plus phase 2: re-plan from the actual counts when the top-2k experts differ,
            priced by compute and link traffic (keeps phase 1's placement unless cheaper)
  phase1_2c the same with the earlier phase 2: re-plan for compute balance alone
  lina      what --lina-inference runs: phase1_2 checked against none over the first
            --lina-probe-forwards forwards (in the warm-up), kept only if faster (lina_decision)
  engine    skew 0 only: the engine's own dropless MoE layer (no gate-bias hook), the check that
            none is a fair baseline
A batch's latency is the slowest rank's; a MoE layer call's time is the slowest rank's for that
call (prefill and decode calls alike). Estimation accuracy: share of tokens whose estimated top
expert (their path's most likely) was their actual first choice (layers after the first).
popularity_skew: top expert / least popular expert of the actual choice counts (mean over
layers); phase_ms: median planning time per layer call (the estimate for the next layer, eq. (1),
the placement: the phase overhead); rows_max_over_mean: the busiest rank's expert rows over the
mean, summed over layer calls (what the placement does to the load, free of timing noise).

Where the time goes (second table, measured per scheduled runner; per layer call the slowest rank,
or for bytes the busiest sender): a2a_bytes (mean over layer calls of the bytes sent to other ranks
in both all-to-alls, counted from the rows sent), a2a_ms_median, expert_ms_median,
phase_overhead_ms (median planning time, phase 2 included), ms_per_batch (phase, count exchange,
all-to-alls, expert GEMMs and whole MoE layers summed over a batch's layer calls) and
phase2_choices (what a triggered phase 2 did: keep, keep+replicas, replan, replan+replicas,
everywhere).

Prints a table; --json PATH writes a list of objects with keys mode, layer_ms_median,
layer_ms_p95, batch_ms_median, batch_ms_p95, estimation_accuracy (plus skew, model,
popularity_skew, phase_ms_median, phase2_rate, world_size, rows_max_over_mean, lina_decision,
expert_share_of_compute, expert_share_of_call, and the time-split keys above).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_moe.config import Config
from megatron_moe.data.preprocess import sample_corpus_dir, split_wikitext_documents
from megatron_moe.inference.engine import InferenceEngine, inference_config, load_engine
from megatron_moe.inference.fallback import CheckedLina
from megatron_moe.inference.popularity import PathProfile, device_rows, static_placement
from megatron_moe.inference.scheduled import MODES, ScheduledMoE, gate_fingerprint, gather_experts
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import device_and_backend, initialize_model_parallel, shutdown


# --model presets (flags given explicitly override them)
MODELS = {
    # the paper's inference setting (top-1; its 4-expert model, few experts per device) with the expert
    # FFN dominating the MoE layer: wide experts (H = 16 M), long prompts, few decode steps
    "representative": dict(
        layers=4, hidden=256, ffn_hidden_size=4096, experts=4, topk=1, prompt_len=128, new_tokens=2, batch_size=16
    ),
    # the paper's 16-expert width, top-2 (8 experts per device on 2 ranks)
    "wide16": dict(
        layers=4, hidden=256, ffn_hidden_size=4096, experts=16, topk=2, prompt_len=128, new_tokens=2, batch_size=8
    ),
    # the earlier default: a few ms of expert compute per layer call, small against communication
    "small": dict(
        layers=4, hidden=256, ffn_hidden_size=1024, experts=8, topk=2, prompt_len=64, new_tokens=4, batch_size=8
    ),
}


def bench_config(args) -> Config:
    """The random-init benchmark model: every block MoE, top-2, byte vocabulary."""
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, 8
    m.ffn_hidden_size = args.ffn_hidden_size
    m.seq_length = m.max_position_embeddings = args.prompt_len + args.new_tokens
    m.vocab_size, cfg.train.seed = 256, 1234
    moe.num_experts, moe.moe_router_topk, moe.moe_layer_freq = args.experts, args.topk, 1
    return cfg


def corpus_ids(split: str, encode) -> list[int]:
    with open(sample_corpus_dir() / f"wiki.{split}.tokens", encoding="utf-8") as f:
        return [i for doc in split_wikitext_documents(f) for i in encode(doc)]


def windows(ids: list[int], length: int, count: int, offset: int) -> list[list[int]]:
    """`count` windows of `length` ids starting at window `offset` (wrapping around the text)."""
    n = len(ids) // length
    return [ids[((offset + j) % n) * length : ((offset + j) % n + 1) * length] for j in range(count)]


def zipf_targets(num_layers: int, num_experts: int, skew: float) -> list[torch.Tensor]:
    """Per MoE layer, the share of choices of each expert: (i + 1)^-S for the i-th expert of a seeded
    permutation, normalized."""
    out = []
    for m in range(num_layers):
        perm = torch.randperm(num_experts, generator=torch.Generator(device="cpu").manual_seed(100 + m), device="cpu")
        share = torch.zeros(num_experts, dtype=torch.float64, device="cpu")
        share[perm] = torch.tensor([(i + 1) ** -skew for i in range(num_experts)], dtype=torch.float64, device="cpu")
        out.append(share / share.sum())
    return out


def layer_counts(runner: ScheduledMoE, n_moe: int) -> list[torch.Tensor]:
    """Global choice counts [E] per MoE layer summed over the runner's calls."""
    return [torch.tensor(runner.actual[m::n_moe], dtype=torch.float64, device="cpu").sum(dim=0) for m in range(n_moe)]


class TimedPlain:
    """FFN runner: the engine's own (unscheduled, dropless) MoE layer, timing each call."""

    def __init__(self) -> None:
        self.call_s: list[float] = []

    def reset_stats(self) -> None:
        self.call_s = []

    def __call__(self, block_idx: int, block, x_1RM: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = block.ffn_residual(x_1RM)[0]
        self.call_s.append(time.perf_counter() - t0)
        return y


def calibrate_skew(
    engine: InferenceEngine, prompts: list[list[int]], skew: float, iters: int, max_per_rank: int, weights
) -> list[torch.Tensor]:
    """A gate bias per MoE layer under which the choice counts follow the Zipf shares of `zipf_targets`:
    start from -S * ln(i + 1) and correct by the log ratio of target to measured shares, `iters` times
    (each a prefill of this rank's `prompts` with the counts summed over ranks)."""
    E, n_moe = engine.cfg.moe.num_experts, len(engine.moe_blocks)
    target = zipf_targets(n_moe, E, skew)
    bias = [(t.log() - t.log().max()).to(device=engine.device, dtype=torch.float32) for t in target]
    for _ in range(iters):
        runner = ScheduledMoE(engine, None, "none", max_per_rank, bias, weights=weights)
        engine.set_ffn_runner(runner)
        engine.generate(prompts, 1)
        for m, c in enumerate(layer_counts(runner, n_moe)):
            share = (c + 0.5) / (c + 0.5).sum()
            bias[m] = bias[m] + (target[m].log() - share.log()).to(device=engine.device, dtype=torch.float32)
    return bias


def expert_share(engine: InferenceEngine, runner: ScheduledMoE, prompts: list[list[int]], new_tokens: int) -> dict:
    """One batch through `runner` (mode none, the trained placement): the expert GEMMs' share of the MoE
    layer's own compute (call time minus the time inside its collectives, waits included) and of the
    whole call; sums over the batch's layer calls and over ranks."""
    runner.reset_stats()
    engine.set_ffn_runner(runner)
    engine.generate(prompts, new_tokens)
    sums = torch.tensor(
        [sum(runner.expert_s), sum(runner.call_s) - sum(runner.comm_s), sum(runner.call_s)],
        dtype=torch.float64,
        device=engine.device,
    )
    dist.all_reduce(sums)
    return {"expert_share_of_compute": float(sums[0] / sums[1]), "expert_share_of_call": float(sums[0] / sums[2])}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", help="checkpoint (default: a seeded random-init model)")
    p.add_argument("--model", choices=sorted(MODELS), default="representative", help="random-init model preset")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of the gate bias (0: none)")
    p.add_argument("--skew-iters", type=int, default=8, help="corrections of the gate bias towards the Zipf shares")
    p.add_argument("--batches", type=int, default=8, help="timed batches per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches per mode first")
    p.add_argument("--batch-size", type=int, help="requests per rank per batch; default: from --model")
    p.add_argument("--prompt-len", type=int, help="default: from --model")
    p.add_argument("--new-tokens", type=int, help="default: from --model")
    p.add_argument("--calib-batches", type=int, default=8, help="profile windows: this x batch size")
    p.add_argument("--path-length", type=int, default=3)
    p.add_argument("--max-experts-per-rank", type=int, default=4)
    p.add_argument("--layers", type=int, help="default: from --model")
    p.add_argument("--hidden", type=int, help="default: from --model")
    p.add_argument("--ffn-hidden-size", type=int, help="expert hidden size; default: from --model")
    p.add_argument("--experts", type=int, help="default: from --model")
    p.add_argument("--topk", type=int, help="experts per token; default: from --model")
    p.add_argument("--gate-scale", type=float, default=8.0, help="random-init model: gate weights x this")
    p.add_argument("--lina-probe-forwards", type=int, default=4, help="mode lina: forwards probed (in the warm-up)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    for k, v in MODELS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(1)
    if not dist.is_initialized():  # CUDA + NCCL where a GPU is present (rank r on GPU LOCAL_RANK), else gloo
        device, backend = device_and_backend("auto", None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        if args.skew < 0:
            raise ValueError(f"--skew must be >= 0, got {args.skew}")
        if min(args.batches, args.batch_size, args.prompt_len, args.new_tokens) < 1 or args.warmup < 0:
            raise ValueError("--batches, --batch-size, --prompt-len and --new-tokens must be >= 1, --warmup >= 0")
        ps = initialize_model_parallel(1, world, 1)
        if args.load:
            engine = load_engine(args.load, ps)
            from megatron_moe.data.tokenizer import load_tokenizer
            from megatron_moe.generation import carried_tokenizer, tokenizer_path

            tok = load_tokenizer(tokenizer_path(engine.cfg, None, carried_tokenizer(args.load)))
            encode = tok.encode
        else:
            cfg = bench_config(args)
            engine = InferenceEngine(GPT2MoE(inference_config(cfg, ps), ps).eval())
            with torch.no_grad():  # a random gate routes almost alike for every token: spread it
                for b in engine.moe_blocks:
                    engine.model.blocks[b].moe.router.gate_w.mul_(args.gate_scale)
            encode = lambda s: list(s.encode("utf-8"))  # noqa: E731
        E, n_moe = engine.cfg.moe.num_experts, len(engine.moe_blocks)
        weights = gather_experts(engine)  # every expert resident on every rank, shared by all runners
        calib = windows(corpus_ids("train", encode), args.prompt_len, args.calib_batches * args.batch_size, 0)
        bias = None
        if args.skew > 0:
            share = calib[rank::world]
            bias = calibrate_skew(engine, share, args.skew, args.skew_iters, args.max_experts_per_rank, weights)
        # the profile: the train split through the same router, every rank alike (all ranks take part)
        profile = PathProfile(gate_fingerprint(engine), args.path_length, E, engine.cfg.moe.moe_router_topk)
        recorder = ScheduledMoE(
            engine, None, "none", args.max_experts_per_rank, bias, record_into=profile, weights=weights
        )
        engine.set_ffn_runner(recorder)
        for j in range(args.calib_batches):  # every rank profiles all windows, one batch per call
            for r in range(world):
                mine = calib[j * args.batch_size : (j + 1) * args.batch_size] if r == rank else []
                engine.generate(mine, 1)
        valid = corpus_ids("valid", encode)
        share = expert_share(
            engine, recorder, windows(valid, args.prompt_len, args.batch_size, rank * args.batch_size), args.new_tokens
        )
        runners: dict = {
            mode: ScheduledMoE(engine, profile, mode, args.max_experts_per_rank, bias, weights=weights)
            for mode in MODES
        }
        # the earlier phase 2 (re-plan for compute balance alone), the measured comparison
        runners["phase1_2c"] = ScheduledMoE(
            engine, profile, "phase1_2", args.max_experts_per_rank, bias, weights=weights, phase2_pricing="compute"
        )
        # lina: what --lina-inference runs (phase1_2 checked against none over the first forwards,
        # which fall in the warm-up batch; the unscheduled way has the same gate bias)
        unscheduled = ScheduledMoE(engine, None, "none", args.max_experts_per_rank, bias, weights=weights)
        sched = ScheduledMoE(engine, profile, "phase1_2", args.max_experts_per_rank, bias, weights=weights)
        runners["lina"] = CheckedLina(engine, sched, args.lina_probe_forwards, unscheduled)
        if bias is None:  # the engine's own MoE layer (no gate-bias hook: skew 0 only)
            runners["engine"] = TimedPlain()
        modes = list(runners)
        lat: dict[str, list[float]] = {m: [] for m in modes}
        for b in range(args.warmup + args.batches):
            prompts = windows(valid, args.prompt_len, args.batch_size, (b * world + rank) * args.batch_size)
            for mode in modes:
                runner = runners[mode]
                if b == args.warmup:
                    if mode != "lina":
                        runner.reset_stats()
                    elif runner.decision is None:
                        raise ValueError(
                            f"--lina-probe-forwards {args.lina_probe_forwards} is more than the warm-up's forwards"
                        )
                    else:
                        runner.scheduled.reset_stats()
                        runner.unscheduled.reset_stats()
                engine.set_ffn_runner(runner)
                dist.barrier()
                t0 = time.perf_counter()
                engine.generate(prompts, args.new_tokens)
                if ps.device.type == "cuda":  # completion, not enqueue
                    torch.cuda.synchronize(ps.device)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=ps.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if b >= args.warmup:
                    lat[mode].append(float(t) * 1e3)
        rows = [summarize(mode, runners, lat[mode], args, world, E, n_moe, share, ps.device) for mode in modes]
        if rank == 0:
            report(rows, args, world)
            if args.json:
                tmp = args.json + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(rows, f, indent=1)
                os.replace(tmp, args.json)
    except (ValueError, FileNotFoundError) as e:
        if dist.get_rank() == 0:
            print(f"bench_inference.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


def summarize(
    mode: str, runners: dict, lat: list[float], args, world: int, E: int, n_moe: int, share: dict, device: torch.device
) -> dict:
    """One result row (collective: the per-call times and the estimation hits are reduced over ranks).
    Routing is the same in every mode, so the choice counts, the estimation accuracy and the skew
    come from the phase1_2 runner; the rows of mode none are its counts on the trained placement."""
    r = runners[mode]
    decision = r.decision if isinstance(r, CheckedLina) else None
    if isinstance(r, CheckedLina):  # its timed batches ran one way only
        r = r.scheduled if r.decision == "scheduled" else r.unscheduled
    calls = torch.tensor(r.call_s, dtype=torch.float64, device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    ref = runners["phase1_2"]
    hits = torch.tensor([ref.hits, ref.predicted], dtype=torch.float64, device=device)
    dist.all_reduce(hits)
    ratios = []
    for m in range(n_moe):
        tot = [sum(a[e] for a in ref.actual[m::n_moe]) for e in range(E)]
        ratios.append(max(tot) / max(min(tot), 1.0))
    if isinstance(r, ScheduledMoE) and r.mode != "none":
        per_call = r.rows
    else:
        static = static_placement(E, world)
        per_call = [device_rows(static, [int(c) for c in a], world) for a in ref.actual]
    # the busiest rank's rows over the mean, summed over layer calls (a prefill call weighs its rows)
    total = sum(sum(x) for x in per_call)
    imbalance = sum(max(x) for x in per_call) * world / total if total else 1.0
    sched = isinstance(r, ScheduledMoE)
    fired = [f for f, est in zip(r.phase2_triggered, r.estimated) if est is not None] if sched else []
    split = time_split(r, device, args.batches) if sched else {}
    return {
        "mode": mode,
        "layer_ms_median": statistics.median(calls.tolist()) * 1e3,
        "layer_ms_p95": pct(calls.tolist(), 0.95) * 1e3,
        "batch_ms_median": statistics.median(lat),
        "batch_ms_p95": pct(lat, 0.95),
        "estimation_accuracy": float(hits[0] / hits[1]) if hits[1] else None,
        "skew": args.skew,
        "model": args.model if not args.load else args.load,
        "popularity_skew": statistics.fmean(ratios),
        "phase_ms_median": statistics.median(r.plan_s) * 1e3 if sched else 0.0,
        "phase2_rate": sum(fired) / len(fired) if fired else 0.0,
        "world_size": world,
        "rows_max_over_mean": imbalance,
        "lina_decision": decision,
        **split,
        **share,
    }


def time_split(r: ScheduledMoE, device: torch.device, batches: int) -> dict:
    """Where a scheduled runner's MoE-layer time goes, measured (collective: per layer call the slowest
    rank's time / the busiest sender's bytes): a2a_bytes, the mean over layer calls of the bytes the
    busiest rank sent to other ranks in both all-to-alls; *_ms_median per layer call; *_ms_per_batch
    summed over a batch's layer calls (phase overhead, count exchange, both all-to-alls, expert GEMMs,
    the whole call); phase2_choices, how often a triggered phase 2 kept phase 1's placement or re-planned."""
    per_call = torch.tensor(
        [r.a2a_bytes, r.plan_s, r.exchange_s, r.a2a_s, r.expert_s, r.call_s], dtype=torch.float64, device=device
    )
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    a2a_b, plan, exch, a2a, expert, call = per_call.tolist()
    if not call:
        return {}
    choices: dict[str, int] = {}
    for c in r.phase2_choice:
        if c is not None:
            choices[c] = choices.get(c, 0) + 1
    return {
        "a2a_bytes": statistics.fmean(a2a_b) if a2a_b else 0.0,
        "phase_overhead_ms": statistics.median(plan) * 1e3,
        "a2a_ms_median": statistics.median(a2a) * 1e3,
        "expert_ms_median": statistics.median(expert) * 1e3,
        "ms_per_batch": {
            k: sum(v) * 1e3 / batches
            for k, v in (("phase", plan), ("exchange", exch), ("a2a", a2a), ("expert", expert), ("layer", call))
        },
        "phase2_choices": choices,
    }


def report(rows: list[dict], args, world: int) -> None:
    """The table on stdout (rank 0)."""
    x0 = rows[0]
    print(
        f"world {world}, model {x0['model']}, skew {args.skew}, {args.batches} batches x {args.batch_size} "
        f"requests per rank, prompt {args.prompt_len} + {args.new_tokens} new tokens"
    )
    print(
        f"expert GEMMs: {x0['expert_share_of_compute']:.2f} of the MoE layer's compute, "
        f"{x0['expert_share_of_call']:.2f} of its wall time (collectives included; trained placement)"
    )
    print(
        f"{'mode':<9} {'layer ms med':>12} {'p95':>7} {'batch ms med':>12} {'p95':>8} {'est acc':>7} "
        f"{'pop skew':>8} {'phase ms':>8} {'phase2':>6} {'rows max/mean':>13}"
    )
    for x in rows:
        acc = "-" if x["estimation_accuracy"] is None else f"{x['estimation_accuracy']:.2f}"
        print(
            f"{x['mode']:<9} {x['layer_ms_median']:12.2f} {x['layer_ms_p95']:7.2f} "
            f"{x['batch_ms_median']:12.1f} {x['batch_ms_p95']:8.1f} {acc:>7} {x['popularity_skew']:8.2f} "
            f"{x['phase_ms_median']:8.3f} {x['phase2_rate']:6.2f} {x['rows_max_over_mean']:13.2f}"
        )
    for x in rows:
        if "a2a_bytes" not in x:
            continue
        t = x["ms_per_batch"]
        if x is rows[0]:  # mode none: a scheduled runner
            print(
                f"{'mode':<9} {'a2a KB/layer':>12} {'a2a ms med':>10} {'expert ms med':>13} {'phase ms med':>12}"
                f"   per batch ms: phase / exchange / a2a / expert / MoE layers   phase 2"
            )
        print(
            f"{x['mode']:<9} {x['a2a_bytes'] / 1024:12.1f} {x['a2a_ms_median']:10.2f} {x['expert_ms_median']:13.2f} "
            f"{x['phase_overhead_ms']:12.3f}   {t['phase']:.1f} / {t['exchange']:.1f} / {t['a2a']:.1f} / "
            f"{t['expert']:.1f} / {t['layer']:.1f}   {x['phase2_choices'] or '-'}"
        )
    by = {x["mode"]: x for x in rows}
    n, p = by["none"], by["phase1_2"]
    if by["lina"]["lina_decision"]:
        print(f"lina (--lina-inference, checked over the warm-up): {by['lina']['lina_decision']}")
    print(
        f"phase1_2 vs none: median {n['batch_ms_median'] / p['batch_ms_median']:.2f}x, "
        f"p95 {n['batch_ms_p95'] / p['batch_ms_p95']:.2f}x"
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
