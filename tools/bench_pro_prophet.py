"""Benchmark Pro-Prophet: step and MoE-layer time, computed-token balance, Trans/Agg bytes and the
performance model's prediction, per placement mode and gate skew, on dropless MoE.

Run under torchrun (every rank runs every mode; EP = the world size):

  torchrun --nproc-per-node 2 tools/bench_pro_prophet.py --skew 0 1.2 --json pp_local.json
  scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 400mbit --timeout 1200 -- \\
      tools/bench_pro_prophet.py --skew 0 1.2 --iters 6 --warmup 8 --json pp_cluster.json
  scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 400mbit --timeout 1200 -- \\
      tools/bench_pro_prophet.py --model small --skew 0 1.2 --iters 6 --warmup 8 --json pp_cluster_small.json
  scripts/emulate_cluster.sh --nodes 4 --procs-per-node 1 --inter-node-rate 400mbit -- \\
      tools/bench_pro_prophet.py --skew 0 1.2 --json pp_cluster_ep4.json     # EP4, 16 experts

The model: --blocks blocks, each a dense FFN (LayerNorm, M -> 4M -> M: the non-expert compute)
and a dropless MoE layer (`moe.layer.MoELayer`, E experts over EP ranks). Sizes (--model, each
overridable by --hidden-size, --ffn-hidden-size, --tokens):
  paper (default)  M 256, H 2048, 4096 tokens per rank: what Pro-Prophet targets, expert compute
                   the largest part of the step, so imbalance costs real time. Measured with
                   --breakdown (emulated 2 nodes x 1 process, 400 Mbit/s, `none`, shared machine,
                   load average about 20, so shares not times; two runs): at skew 1.2 the
                   busiest rank's expert compute was 52-65 % of its step (3373 of 6434 ms, 5589 of
                   8631 ms) and the other rank spent 58-71 % waiting in the all-to-all for it; at
                   skew 0 the experts were 43-56 %.
                   The expert FFN is 2x the dense FFN's FLOPs per token. Moving expert 0 at skew
                   1.2 (the other rank routes it about 1760 tokens) keeps about as many bytes off
                   the link as Trans + Agg cost (4 all-to-alls x 1760 x M x 4 B = 7.2 MB vs
                   2 x 2 M H x 4 B = 8.4 MB), and Trans runs on the direction the skewed
                   all-to-all leaves idle (owner -> replica rank).
  small            M 256, H 1024, 2048 tokens per rank (the earlier default; its figures are in
                   git's history of docs/BENCHMARKS.md): expert and dense FFN equal per token; there perfect balance at
                   no cost bounds the speed-up near 1.17x (MoE layer 480 ms at skew 0, 574-588 ms at
                   1.2, of a step near 700 ms on a quiet machine).
--breakdown profiles one extra iteration per mode (torch.profiler, CPU; outside the medians) and
prints per rank: step, dense (= step - MoE layers), MoE layers (forward + backward), and within
them the gate (`moe/router`), the all-to-alls (`_Start` / `_Finish` forward and backward: launch
plus wait, so a rank waiting for a slower peer shows it here), expert compute (`moe/experts` +
`_GroupedMLPBackward`) and the exposed Trans / Agg waits (`pro_prophet/trans_wait`,
`pro_prophet/agg_wait`); the JSON rows carry it as `breakdown_ms`. The MoE layer's input
is LayerNorm(h) + u with a fixed vector u, and the gate carries a bias along u: logit_e =
LayerNorm(h) . w_e + log p_e with p_e proportional to (e + 1) ** -skew (a Zipf law over the
experts; skew 0: uniform), while LayerNorm(h) . w_e has a standard deviation of about 1.3 (as
Gumbel noise would), so the top-1 choice follows roughly p. Expert 0, the most popular, sits on
rank 0. Learning rate 0, so routing keeps its distribution.
--counts-from RUN.jsonl replaces the Zipf law by a trained model's popularity: the trainer's
--log-json lines of a dropless run with --experts-per-rank x EP experts carry, per MoE layer, the
tokens each expert was routed in the logged iteration; MoE layer i here takes the shares of the
run's i-th MoE layer summed over the last --counts-records of them, each expert on the rank that
owns it in the trained layout (expert e on EP rank e // (E / EP)). Each layer's bias along u is
fitted, layer by layer, on the benchmark's own inputs (a Monte-Carlo start, then steps of
log(target / routed share) over the EP group) until its top-k routing gives those shares; the
rows report skew null, "popularity" and the measured shares ("expert_shares"). E.g. the bundled
model with 8 experts trained without the load-balancing loss:
  mmoe-pretrain --num-experts 8 --moe-dropless --moe-aux-loss-coeff 0 --log-json run8.jsonl
  scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 400mbit --timeout 1200 -- \\
      tools/bench_pro_prophet.py --counts-from run8.jsonl --iters 10 --warmup 8 --json pp_real.json

Modes (the same weights and batches in each):
  none                   no placement
  heaviest_to_all        the 2 experts with the most tokens replicated on every other rank
                         (the paper's comparison), Trans/Agg overlapped
  pro_prophet_plan_only  Algorithm 1 (`pro_prophet.planner.plan`, eq. (6)), Trans/Agg blocking
  pro_prophet            Algorithm 1 with eq. (8) and the block-wise scheduler (Algorithm 2), and the
                         trainer's runtime trial (`moe.placement`, --trial-iters K): after the
                         calibration, K timed passes each of the empty plan ("plain"), the plan
                         ("placed") and the plan plus the next move of Algorithm 1's greedy order
                         ("wider", `plan(extra=1)`), in turns of a settling and a timed iteration,
                         step times MAX over ranks, picked by `choose` (a less simple alternative must
                         be faster by more than 2 %; "wider" only if it moved more experts than the
                         plan; MMOE_CHOOSE="pro-prophet=placed" forces a pick). The trial's iterations
                         are added to this mode's warm-up (outside the medians); the row reports the
                         pick and the trial's own medians.
The scheduled modes (heaviest_to_all, pro_prophet) give the runtime the first LayerNorm as its anchor:
the first MoE layer's Trans starts when the forward starts and its Agg is waited when the backward
reaches that norm (the dense block in between hides both), as the trainer does with the embedding.
Every mode plans iteration j+1 from iteration j's counts (`moe.placement.ProProphet`: they ride the
dispatchers' count exchange, and the plan is made while the last dispatch all-to-all is in flight).
The model's constants are measured once on the real EP group (`pro_prophet.perf_model.measure_constants`);
the two pro_prophet modes then calibrate it (`pro_prophet.calibration`: scale and overlap efficiency
fitted on the MoE-layer times of their first --calibrate-iters iterations after --calibrate-skip,
which alternate no placement and the plan) and plan with the fit. Those iterations are part of
the warm-up (--warmup must exceed skip + iters), so every measured iteration uses the fitted model.
Mode pro_prophet's trial iterations are sampled too, and at its end the fit is multiplied by one
contention factor k fitted on them (`calibration.contention`: k = sum(u) / sum(u^2), u = modelled /
measured MoE-layer time of each trial iteration, MAX over ranks): the model then predicts the later
iterations from the run's own most recent layer times, with every plan unchanged (a uniform factor
does not change which plan Algorithm 1 finds fastest). No constant is tuned to this benchmark: k,
scale, eta and the overhead are all fitted on the run's own samples, and the error is measured on
the iterations after them (err % = predicted / measured - 1 over the measured medians).

Each mode has its own model and runtime. The warm-ups run mode by mode; the measured iterations
run round-robin (iteration i of every mode, then i + 1, the order rotated each time), so a machine
whose speed drifts over minutes slows every mode alike (run one after another, the same graph
measured up to 10 % apart between modes).
An iteration is forward, backward and an SGD step, started together on all ranks (a barrier);
step time: max over ranks; MoE-layer time: forward + backward of the MoE layers (autograd stamps
around them), max over ranks; load std: population std of the tokens each EP rank computes, per
layer, averaged over layers, without (before) and with (after) the placement used; predicted_ms:
the calibrated model's T'' of the MoE layers under that placement (a mode without a calibration of
its own takes the fit of the pro_prophet mode of its kind: eq. (6) for none, eq. (8) for
heaviest_to_all; predicted_uncalibrated_ms: the paper's form); trans_bytes / agg_bytes: bytes sent
by all ranks per iteration (the collective observer). Medians over the measured iterations.

Prints a table and, with --json PATH, writes a list of objects (one per mode and skew) with keys
mode, skew, step_ms_median, moe_ms_median, load_std_before, load_std_after, predicted_ms,
trans_bytes, agg_bytes (plus world_size, top_expert_share, load_avg_1min, predicted_uncalibrated_ms,
model_error = predicted / measured MoE ms - 1, calibration_scale, calibration_comm, calibration_eta,
calibration_overhead_ms: the measured fixed cost of a layer with replicas, breakdown_ms: --breakdown,
plan_ms: the median per iteration of the milliseconds the planner ran (every layer's plan; under the
last dispatch all-to-all or at the iteration's end; rank 0's), trial: mode pro_prophet's trial
decision or null: pick ("plain" / "placed" / "wider"), reason, plain_ms / placed_ms / wider_ms (the
medians, MAX over ranks; null when not timed), samples_ms, line), speedup_vs_none_paired / speedup_vs_heaviest_to_all_paired ([median, low, high]: that mode's
step time over this mode's, iteration by iteration of the round-robin, and its 95 % bootstrap
interval, `profiling.paired_ratio`; null when that mode did not run), printed under the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megatron_moe.fileio import atomic_write_json
from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.distributed.observer import CommLog
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.placement import Placement, ProProphet, gather_counts, routed_counts
from megatron_moe.parallel_state import device_and_backend, initialize_model_parallel, shutdown
from megatron_moe.profiling import paired_ratio
from megatron_moe.pro_prophet.calibration import Calibrator
from megatron_moe.pro_prophet.perf_model import Calibration, PerfModel, measure_constants
from megatron_moe.pro_prophet.planner import heaviest_to_all, plan

MODES = ("none", "heaviest_to_all", "pro_prophet_plan_only", "pro_prophet")
# --model presets: (hidden size M, expert hidden size H, tokens per rank); explicit flags override
MODELS = {"paper": (256, 2048, 4096), "small": (256, 1024, 2048)}
# --breakdown: profiler ranges / autograd nodes per part of the step (totals of the listed events, ms)
PARTS = {
    "gate": ("moe/router",),
    "all_to_all": ("_Start", "_Finish", "_StartBackward", "_FinishBackward"),
    "experts": ("moe/experts", "_GroupedMLPBackward"),
    "trans_wait": ("pro_prophet/trans_wait",),
    "agg_wait": ("pro_prophet/agg_wait",),
}
GATE_NOISE = 1.3  # std of the unbiased gate logits (Gumbel noise's is pi / sqrt(6) = 1.28)
U_NORM = 10.0  # |u|, the fixed vector added to the MoE layers' input that carries the gate's bias


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skew", type=float, nargs="+", default=[0.0, 1.2], help="Zipf exponents of expert popularity")
    p.add_argument(
        "--counts-from",
        default=None,
        metavar="JSONL",
        help="expert popularity of a trained model instead of --skew: the trainer's --log-json file of a dropless "
        "run with E = --experts-per-rank x EP experts; MoE layer i here takes the token shares of the run's i-th "
        "MoE layer over its last --counts-records logged iterations",
    )
    p.add_argument(
        "--counts-records",
        type=int,
        default=10,
        help="--counts-from: how many of the last logged iterations the shares are summed over",
    )
    p.add_argument("--modes", default=",".join(MODES), help="modes to run, comma-separated")
    p.add_argument("--blocks", type=int, default=2, help="blocks (dense FFN + MoE layer)")
    p.add_argument("--model", choices=sorted(MODELS), default="paper", help="size preset (M, H, tokens per rank)")
    p.add_argument("--hidden-size", type=int, default=None, help="model dim M (default: from --model)")
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="expert hidden dim H (default: from --model)")
    p.add_argument("--experts-per-rank", type=int, default=4, help="E / EP")
    p.add_argument("--topk", type=int, default=1, choices=[1, 2], help="experts per token")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank per iteration (default: from --model)")
    p.add_argument("--alpha", type=float, default=0.25, help="--pro-prophet-alpha")
    p.add_argument("--n", type=int, default=0, help="--pro-prophet-n")
    p.add_argument("--iters", type=int, default=8, help="measured iterations per mode")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured iterations per mode (calibration included)")
    p.add_argument("--calibrate-skip", type=int, default=2, help="first iterations not sampled by the calibration")
    p.add_argument("--calibrate-iters", type=int, default=4, help="iterations the calibration samples (0: off)")
    p.add_argument(
        "--trial-iters",
        type=int,
        default=Config().opts.measure_iters,
        help="mode pro_prophet: the trainer's trial (--measure-iters): after the calibration this many timed "
        "iterations each without placement, with the plan and with one more expert moved (0: no trial)",
    )
    p.add_argument("--comm-timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    p.add_argument(
        "--breakdown", action="store_true", help="profile one extra iteration per mode: the step's parts per rank"
    )
    a = p.parse_args(argv)
    preset = MODELS[a.model]
    for name, value in zip(("hidden_size", "ffn_hidden_size", "tokens"), preset):
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    for name in ("blocks", "hidden_size", "ffn_hidden_size", "experts_per_rank", "tokens", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first iteration only gathers the counts the planner needs)")
    if a.calibrate_skip < 0 or a.calibrate_iters < 0:
        p.error("--calibrate-skip and --calibrate-iters must be >= 0")
    if a.calibrate_iters and a.warmup <= a.calibrate_skip + a.calibrate_iters:
        p.error(
            f"--warmup ({a.warmup}) must exceed --calibrate-skip + --calibrate-iters "
            f"({a.calibrate_skip + a.calibrate_iters}): measured iterations plan with the fitted model"
        )
    if a.trial_iters < 0:
        p.error("--trial-iters must be >= 0 (0: mode pro_prophet runs without the trial)")
    if any(s < 0 for s in a.skew):
        p.error("--skew values must be >= 0")
    if a.counts_records < 1:
        p.error("--counts-records must be >= 1")
    a.popularity = None
    if a.counts_from is not None:
        try:
            a.popularity = load_popularity(a.counts_from, a.blocks, a.counts_records)
        except ValueError as e:
            p.error(str(e))
    return a


def load_popularity(path: str, layers: int, records: int) -> list[list[float]]:
    """Token shares per expert of the first `layers` MoE layers of a trained model, from the trainer's
    --log-json lines (`expert_counts`: per MoE layer, the tokens each expert was routed in the logged
    iteration), summed over the last `records` iterations that carry them. Raises ValueError naming
    --counts-from and the file when it cannot serve."""
    where = f"--counts-from {path}"
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
    logged = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: line {n} is not JSON (expected the trainer's --log-json lines)") from None
        if isinstance(rec, dict) and rec.get("expert_counts"):
            logged.append(rec["expert_counts"])
    if not logged:
        raise ValueError(f"{where}: no line carries expert_counts (log a run of an MoE model with --log-json)")
    last = logged[-records:]
    names = sorted(last[0], key=int)
    if len(names) < layers:
        raise ValueError(f"{where}: the run has {len(names)} MoE layer(s), --blocks asks for {layers}")
    shares = []
    for name in names[:layers]:
        rows = [rec.get(name) for rec in last]
        if any(r is None or len(r) != len(rows[0]) for r in rows):
            raise ValueError(f"{where}: MoE layer {name} is not logged with the same experts in every record")
        total = [sum(col) for col in zip(*rows)]
        if sum(total) <= 0:
            raise ValueError(f"{where}: MoE layer {name} routed no tokens in the last {len(last)} records")
        shares.append([t / sum(total) for t in total])
    return shares


def gate_bias(shares: list[float], topk: int, u_scale: float, samples: int = 100_000, steps: int = 30) -> torch.Tensor:
    """Log-bias b of the benchmark's gate such that top-`topk` routing of b_e (1 + u_scale eps) +
    GATE_NOISE g_e (eps, g_e standard normal: the gate's logits, see BenchModel) picks expert e with
    share `shares[e]`: a fixed point b += log(target / realized) on a seeded Monte-Carlo sample (the
    same on every rank). Experts with no tokens get a share of 1e-4."""
    E = len(shares)
    gen = torch.Generator(device="cpu").manual_seed(4321)
    g = torch.randn(samples, E, generator=gen, device="cpu") * GATE_NOISE
    eps = torch.randn(samples, 1, generator=gen, device="cpu") * u_scale
    target = torch.tensor(shares, dtype=torch.float32, device="cpu").clamp_min(1e-4)
    target = target / target.sum()
    b = target.log()
    for _ in range(steps):
        realized = routed_shares(b, g, eps, topk)
        b = b + (target / realized.clamp_min(1e-6)).log()
        b = b - b.mean()
    return b


def routed_shares(b: torch.Tensor, g: torch.Tensor, eps: torch.Tensor, topk: int) -> torch.Tensor:
    """Share of the routed choices per expert when `g` + `b` (1 + `eps`) is routed top-`topk`."""
    idx = (b[None, :] * (1 + eps) + g).topk(topk, dim=1).indices
    return torch.bincount(idx.flatten(), minlength=b.numel()).float() / idx.numel()


def moe_config(a: argparse.Namespace, ep: int) -> Config:
    cfg = Config()
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.ffn_hidden_size, m.num_layers = a.hidden_size, a.ffn_hidden_size, 2 * a.blocks
    m.num_attention_heads = 1
    moe.num_experts, moe.moe_router_topk, moe.moe_dropless = a.experts_per_rank * ep, a.topk, True
    moe.moe_schedule, moe.moe_aux_loss_coeff = "baseline", 0.0
    return cfg


class _Stamp(torch.autograd.Function):
    """Identity; backward appends perf_counter() to `box` (where backward passes this point)."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.box.append(time.perf_counter())
        return g, None


class BenchModel(nn.Module):
    """--blocks x (dense FFN, skewed dropless MoE layer); `moe_s` collects the MoE layers' time."""

    def __init__(self, cfg: Config, ps, skew: float, seed: int = 1234, gates: Optional[list] = None):
        super().__init__()
        M, E, nb = cfg.model.hidden_size, cfg.moe.num_experts, cfg.model.num_layers // 2
        dev = ps.device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        torch.manual_seed(seed)  # the dense layers: the same weights in every mode
        self.norms = nn.ModuleList([nn.LayerNorm(M, device=dev) for _ in range(2 * nb)])
        self.fc1 = nn.ModuleList([nn.Linear(M, 4 * M, device=dev) for _ in range(nb)])
        self.fc2 = nn.ModuleList([nn.Linear(4 * M, M, device=dev) for _ in range(nb)])
        self.moes = nn.ModuleList([MoELayer(cfg, ps, seed, f"moe{i}", 2 * i + 1, device=dev) for i in range(nb)])
        u = torch.randn(M, generator=gen, device="cpu").to(dev)
        self.register_buffer("u", u * (U_NORM / u.norm()))
        log_p = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32, device=dev))
        with torch.no_grad():
            for i, moe in enumerate(self.moes):
                w = torch.randn(E, M, generator=gen, device="cpu").to(dev) * (GATE_NOISE / M**0.5)
                w -= (w @ self.u)[:, None] * self.u[None, :] / self.u.dot(self.u)  # u . w_e = 0: no hidden bias
                zipf = w + log_p[:, None] * self.u[None, :] / self.u.dot(self.u)
                # --counts-from: the gates `fit_gates` fitted from this same start (`fitted_gates`)
                moe.router.gate_w.copy_(zipf if gates is None else gates[i])
        self.moe_s: list[float] = []  # forward seconds per MoE layer call
        self.moe_bwd: list[list[float]] = []  # per MoE layer call: backward [start, end] stamps

    @torch.no_grad()
    def fit_gates(self, x: torch.Tensor, shares: list, group, steps: int = 8) -> None:
        """--counts-from: layer by layer, move each MoE layer's gate bias along u by log(target /
        realized) until its top-k routing of the benchmark's own inputs `x` (the earlier layers run,
        counts summed over `group`, so every rank makes the same move) gives the trained shares; the
        Monte-Carlo bias of `gate_bias` is the start (it ignores what the earlier layers add to h).
        Call it on a model built with skew 0 (no bias yet)."""
        uu, k = self.u.dot(self.u), self.moes[0].router.k
        for i, moe in enumerate(self.moes):
            target = torch.tensor(shares[i], dtype=torch.float32, device=self.u.device).clamp_min(1e-4)
            target = target / target.sum()
            # u . LayerNorm(h) / u . u, the bias's multiplier, is 1 + N(0, 1 / |u|) (unit-variance entries)
            start = gate_bias(shares[i], k, 1 / U_NORM).to(self.u.device)
            moe.router.gate_w += start[:, None] * self.u[None, :] / uu
            for _ in range(steps):
                h = x
                for j in range(i):
                    h = self.block(h, j)
                z = self.moe_input(self.dense(h, i), i).reshape(-1, h.size(-1))
                idx = (z @ moe.router.gate_w.t()).topk(k, dim=-1).indices.flatten()
                counts = torch.bincount(idx, minlength=target.numel()).to(torch.float64)
                dist.all_reduce(counts, group=group)
                delta = (target / (counts / counts.sum()).clamp_min(1e-6).float()).log()
                moe.router.gate_w += (delta - delta.mean())[:, None] * self.u[None, :] / uu
        self.moe_s, self.moe_bwd = [], []

    def dense(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Block i's dense FFN on the residual stream h."""
        return h + self.fc2[i](F.gelu(self.fc1[i](self.norms[2 * i](h))))

    def moe_input(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Block i's MoE layer input from its residual stream h (after the dense FFN)."""
        return self.norms[2 * i + 1](h) + self.u

    def block(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Block i: dense FFN, then the MoE layer (its forward time appended to `moe_s`)."""
        h = self.dense(h, i)
        bwd: list[float] = []
        z = _Stamp.apply(self.moe_input(h, i), bwd)
        t0 = time.perf_counter()
        y, _ = self.moes[i](z)
        self.moe_s.append(time.perf_counter() - t0)
        self.moe_bwd.append(bwd)
        return h + _Stamp.apply(y, bwd)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.moes)):
            h = self.block(h, i)
        return h


def timed(planner: Callable, spent: list) -> Callable:
    """`planner`, appending the seconds each call takes to `spent` (the planning cost per iteration)."""

    def run(counts):
        t0 = time.perf_counter()
        out = planner(counts)
        spent.append(time.perf_counter() - t0)
        return out

    return run


def make_runtime(model: BenchModel, ps, mode: str, perf: dict, a, spent: list) -> Optional[ProProphet]:
    layers = list(model.moes)
    if mode == "none":
        return None
    if mode == "heaviest_to_all":
        return ProProphet(
            layers,
            ps,
            schedule=True,
            planner=timed(lambda c: heaviest_to_all(c, 2).replicas, spent),
            anchor=model.norms[0],
        )
    calib = Calibrator(perf[kind_of(mode)], skip=a.calibrate_skip, iters=a.calibrate_iters)
    return ProProphet(
        layers,
        ps,
        schedule=mode == "pro_prophet",
        planner=timed(lambda c: plan(c, calib.model, a.alpha, a.n).replicas, spent),
        # the trial's "wider" alternative: one more move of Algorithm 1's greedy order (`moe.placement`)
        wider=timed(lambda c: plan(c, calib.model, a.alpha, a.n, extra=1).replicas, spent)
        if trial_iters(a, mode)
        else None,
        calibrator=calib,
        measure_iters=trial_iters(a, mode),
        anchor=model.norms[0],  # scheduled: the first MoE layer's Trans starts, and its Agg waits, here
    )


def trial_iters(a, mode: str) -> int:
    """K of the mode's trial (`moe.placement`): mode pro_prophet only (the others are fixed rows)."""
    return a.trial_iters if mode == "pro_prophet" else 0


def kind_of(mode: str) -> str:
    """The model a mode is predicted with: eq. (8) ("overlap") when Trans/Agg are scheduled, else eq. (6)."""
    return "overlap" if mode in ("pro_prophet", "heaviest_to_all") else "plain"


def fitted_gates(a, cfg: Config, ps) -> list:
    """--counts-from: the MoE layers' gate weights, fitted once (`BenchModel.fit_gates`, on a
    calibration batch of this rank's) and given to every mode's model (the same weights in each)."""
    model = BenchModel(cfg, ps, 0.0)
    fit = torch.Generator(device="cpu").manual_seed(7 + ps.rank("ep"))
    x = torch.randn(1, a.tokens, cfg.model.hidden_size, generator=fit, device="cpu").to(ps.device)
    model.fit_gates(x, a.popularity, ps.group("ep"))
    return [moe.router.gate_w.detach().clone() for moe in model.moes]


class ModeRun:
    """One mode's model, runtime and per-iteration records, advanced one iteration per `step` call
    (`run` interleaves the modes' measured iterations round-robin). skew None: the popularity of
    --counts-from, realized by `gates` (`fitted_gates`). `log`: the collective observer, shared."""

    def __init__(
        self, a, cfg: Config, ps, mode: str, skew: Optional[float], perf: dict, log: CommLog, gates=None
    ) -> None:
        self.a, self.ps, self.log = a, ps, log
        self.model = BenchModel(cfg, ps, skew or 0.0, gates=gates)
        self.spent: list[float] = []  # seconds in the planner (every layer's plan), this iteration
        self.runtime = make_runtime(self.model, ps, mode, perf, a, self.spent)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.gen = torch.Generator(device="cpu").manual_seed(99 + ps.rank("ep"))
        self.M = cfg.model.hidden_size
        self.plain = Placement.of(cfg.moe.num_experts, ps.size("ep"), {})
        self.model_for = perf[kind_of(mode)]
        self.rows: dict = {
            k: [] for k in ("step", "moe", "std_before", "std_after", "terms", "trans", "agg", "top", "plan")
        }
        self.rows["breakdown"] = None
        self.total: Optional[torch.Tensor] = None
        trial = self.runtime.trial if self.runtime is not None else None
        self.warmup = a.warmup + (trial.length if trial is not None else 0)  # the trial's: unmeasured
        self.it = 0  # iterations run

    def step(self, profiled: bool = False) -> None:
        """One iteration (collective: every rank steps the same mode); recorded after the warm-up.
        `profiled` (--breakdown): under the profiler, outside the medians."""
        a, ps, model, runtime, it = self.a, self.ps, self.model, self.runtime, self.it
        self.it += 1
        x = torch.randn(1, a.tokens, self.M, generator=self.gen, device="cpu").to(ps.device)
        used = [runtime.placement_of(m.layer_idx) if runtime else self.plain for m in model.moes]
        model.moe_s, model.moe_bwd = [], []
        plan_s = sum(self.spent)  # the plans made during the last iteration and at its end (for this one)
        self.spent.clear()
        prof = profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext()
        dist.barrier()
        self.log.clear()
        with prof:
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            out = model(x)
            out.float().pow(2).mean().backward()
            self.opt.step()
            step = time.perf_counter() - t0
        moe = sum(model.moe_s) + sum(b[1] - b[0] for b in model.moe_bwd if len(b) == 2)
        if profiled:
            self.rows["breakdown"] = step_parts(prof, 1e3 * step, 1e3 * moe, ps)
            return
        sent = {op: sum(e.sent for e in self.log.of(op)) for op in ("trans", "agg")}
        if runtime is not None:  # the counts came with the dispatchers' count exchanges
            counts = runtime.collected_counts()  # [L, N_EP, E]
            runtime.end_iteration(it + 1)
        else:
            counts = gather_counts(ps, torch.stack([routed_counts(m) for m in model.moes]))
        if it < self.warmup:
            return
        rows = self.rows
        std = lambda v: statistics.pstdev(float(x) for x in v)  # noqa: E731
        rows["step"].append(1e3 * step)
        rows["plan"].append(1e3 * plan_s)
        rows["moe"].append(1e3 * moe)
        rows["std_before"].append(statistics.mean(std(self.plain.computed_tokens(c.tolist())) for c in counts))
        rows["std_after"].append(statistics.mean(std(p.computed_tokens(c.tolist())) for p, c in zip(used, counts)))
        rows["terms"].append([self.model_for.terms(c.tolist(), p.replicas) for p, c in zip(used, counts)])
        rows["trans"].append(sent["trans"])
        rows["agg"].append(sent["agg"])
        per_expert = counts.sum(dim=(0, 1))
        rows["top"].append(float(per_expert.max() / per_expert.sum()))
        routed = counts.sum(dim=1).double()  # [L, E]: the measured iterations' routed tokens per expert
        self.total = routed if self.total is None else self.total + routed

    def result(self) -> dict:
        """The per-iteration lists (collective: every rank then holds the same numbers)."""
        rows, ps, runtime = self.rows, self.ps, self.runtime
        t = torch.tensor([rows["step"], rows["moe"]], dtype=torch.float64, device=ps.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        b = torch.tensor([rows["trans"], rows["agg"]], dtype=torch.float64, device=ps.device)
        dist.all_reduce(b)
        rows["step"], rows["moe"] = t[0].cpu().tolist(), t[1].cpu().tolist()
        rows["trans"], rows["agg"] = b[0].cpu().tolist(), b[1].cpu().tolist()
        cal = runtime.calibrator if runtime is not None else None
        rows["calibration"] = cal.fitted if cal is not None else None
        # per layer, the share of the measured iterations' routed tokens each expert received
        rows["shares"] = (
            [[round(float(v), 4) for v in layer / layer.sum()] for layer in self.total]
            if self.total is not None
            else None
        )
        d = runtime.decision if runtime is not None else None
        medians = {f"{k}_ms": (d.medians.get(k) if d is not None else None) for k in ("plain", "placed", "wider")}
        rows["trial"] = None if d is None else {**d.as_dict(), **medians, "line": d.line()}
        return rows


def run_modes(a, cfg: Config, ps, skew: Optional[float], perf: dict, gates=None) -> dict:
    """Every mode's warm-up on its own (a trial's arms must follow each other), then the measured
    iterations round-robin, iteration i of every mode before i + 1, in an order rotated each time,
    so load that comes and goes on a shared machine hits every mode alike (as `bench_lancet`);
    then --breakdown's profiled iteration of each. mode -> `ModeRun.result`."""
    log = CommLog().start()
    runs = {mode: ModeRun(a, cfg, ps, mode, skew, perf, log, gates) for mode in a.modes}
    for r in runs.values():
        while r.it < r.warmup:
            r.step()
    modes = list(runs)
    for i in range(a.iters):
        for j in range(len(modes)):
            runs[modes[(i + j) % len(modes)]].step()
    if a.breakdown:
        for r in runs.values():
            r.step(profiled=True)
    log.stop()
    return {mode: r.result() for mode, r in runs.items()}


def step_parts(prof, step_ms: float, moe_ms: float, ps) -> list[dict]:
    """Per EP rank (gathered): the profiled step's parts [ms], each the total time of its `PARTS`
    events (forward ranges and autograd nodes, waits for the peer included), plus step and MoE time
    (the layers' forward + backward spans) and dense = step - MoE (dense FFNs, norms, optimizer)."""
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        totals[ev.key] = totals.get(ev.key, 0.0) + ev.cpu_time_total / 1e3
    mine = [step_ms, moe_ms] + [sum(totals.get(n, 0.0) for n in names) for names in PARTS.values()]
    every = torch.zeros(ps.size("ep"), len(mine), dtype=torch.float64, device=ps.device)
    every[ps.rank("ep")] = torch.tensor(mine, dtype=torch.float64, device=ps.device)
    dist.all_reduce(every)  # each rank fills its own row
    out = []
    for rank, row in enumerate(every.cpu().tolist()):
        d = {"rank": rank, "step_ms": row[0], "moe_ms": row[1], "dense_ms": row[0] - row[1]}
        d.update({f"{k}_ms": v for k, v in zip(PARTS, row[2:])})
        out.append(d)
    return out


def breakdown_table(rows: list[dict]) -> str:
    """The --breakdown rows: one line per mode, skew and rank."""
    keys = ["step", "dense", "moe", *PARTS]
    head = f"{'skew':>5s} {'mode':22s} {'rank':>4s} " + " ".join(f"{k:>10s}" for k in keys)
    lines = [head, "-" * len(head)]
    for r in rows:
        for b in r.get("breakdown_ms") or []:
            vals = " ".join(f"{b[k + '_ms']:10.1f}" for k in keys)
            lines.append(f"{skew_cell(r['skew'])} {r['mode']:22s} {b['rank']:4d} {vals}")
    return "\n".join(lines)


def predicted_ms(terms: list, overlap: bool, cal: Calibration) -> float:
    """Median over iterations of the model's T'' [ms] of the MoE layers (terms: per iteration, per layer)."""
    return statistics.median(1e3 * sum(t.time(overlap, cal) for t in ts) for ts in terms)


def measure_perf(cfg: Config, ps, a) -> dict:
    """The performance model, plain (eq. (6)) and with the scheduler (eq. (8)), on measured constants."""
    M, H = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    expert = 2 * H * M + H + M
    constants = measure_constants(ps, M, expert, H, a.tokens * a.topk)
    return {
        "plain": PerfModel(constants, M, expert, expert),
        "overlap": PerfModel(constants, M, expert, expert, overlap=True),
    }


def popularity_text(skew: Optional[float]) -> str:
    """How a row's expert popularity was made: "skew S" (Zipf) or "counts" (--counts-from)."""
    return "counts" if skew is None else f"skew {skew:g}"


def skew_cell(skew: Optional[float]) -> str:
    """The tables' skew column (5 wide): the Zipf exponent, or "real" for --counts-from."""
    return " real" if skew is None else f"{skew:5.2f}"


def table(rows: list[dict]) -> str:
    head = (
        f"{'skew':>5s} {'mode':22s} {'step ms':>8s} {'moe ms':>8s} {'pred ms':>8s} {'std before':>10s} "
        f"{'std after':>9s} {'trans MB':>8s} {'agg MB':>7s} {'top share':>9s} {'err %':>6s} {'scale':>5s} {'comm':>5s} {'eta':>4s} {'ovh ms':>6s} {'plan ms':>7s} {'trial (placed / wider / plain ms)':s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{skew_cell(r['skew'])} {r['mode']:22s} {r['step_ms_median']:8.1f} {r['moe_ms_median']:8.1f} "
            f"{r['predicted_ms']:8.1f} {r['load_std_before']:10.1f} {r['load_std_after']:9.1f} "
            f"{r['trans_bytes'] / 2**20:8.2f} {r['agg_bytes'] / 2**20:7.2f} {r['top_expert_share']:9.3f} "
            f"{100 * r['model_error']:6.1f} {r['calibration_scale']:5.2f} {r['calibration_comm']:5.2f} {r['calibration_eta']:4.2f} {r['calibration_overhead_ms']:6.1f} {r['plan_ms']:7.2f} {trial_text(r['trial'])}"
        )
    return "\n".join(lines)


def speedup_lines(rows: list[dict]) -> str:
    """Under the table: each placing mode's paired speedups with their 95 % intervals."""
    lines = []
    for r in rows:
        cells = [
            "{:.3f}x ({:.3f}-{:.3f}) over {}".format(*r[f"speedup_vs_{other}_paired"], other)
            for other in ("none", "heaviest_to_all")
            if r[f"speedup_vs_{other}_paired"] is not None and r["mode"] not in ("none", other)
        ]
        if cells:
            lines.append(f"{popularity_text(r['skew'])} {r['mode']}: " + ", ".join(cells))
    return "\n".join(["paired step speedups (95% bootstrap intervals):"] + lines)


def trial_text(trial: Optional[dict]) -> str:
    """The table's trial column: the pick and the medians (placed / wider / plain ms; "-" where not
    timed), or "-" (no trial)."""
    if trial is None:
        return "-"
    ms = ["-" if trial.get(k) is None else f"{trial[k]:.1f}" for k in ("placed_ms", "wider_ms", "plain_ms")]
    return f"{trial['pick']} ({' / '.join(ms)})"


def main(argv=None) -> None:
    a = parse_args(argv)
    if "RANK" not in os.environ:
        print(
            "error: run it under torchrun (e.g. torchrun --nproc-per-node 2 tools/bench_pro_prophet.py)",
            file=sys.stderr,
        )
        sys.exit(2)
    with exit_on_comm_error():
        run(a)
        shutdown()


def run(a: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device, backend = device_and_backend("auto", None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=a.comm_timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        if rank == 0:
            print("error: Pro-Prophet needs 2 or more ranks (EP = the world size)", file=sys.stderr)
        sys.exit(2)
    ps = initialize_model_parallel(1, world, 1, backend, device=device)
    cfg = moe_config(a, world)
    if a.popularity is not None and len(a.popularity[0]) != cfg.moe.num_experts:
        if rank == 0:
            print(
                f"error: --counts-from {a.counts_from}: the run has {len(a.popularity[0])} experts per MoE layer, "
                f"this benchmark {cfg.moe.num_experts} (--experts-per-rank {a.experts_per_rank} x EP {world})",
                file=sys.stderr,
            )
        sys.exit(2)
    perf = measure_perf(cfg, ps, a)
    if rank == 0:
        c = perf["plain"].constants
        print(
            f"bench_pro_prophet: world {world}, EP {world}, {cfg.moe.num_experts} experts, top-{a.topk}, "
            f"{a.tokens} tokens/rank, M {a.hidden_size}, H {a.ffn_hidden_size}; constants: a2a "
            f"{c.a2a_alpha * 1e3:.3f} ms + {c.a2a_beta * 1e9:.3f} ns/elem, trans {c.bcast_alpha * 1e3:.3f} ms + "
            f"{c.bcast_beta * 1e9:.3f} ns/elem, expert {c.expert_alpha * 1e3:.3f} ms + "
            f"{c.expert_beta * 1e6:.3f} us/token",
            flush=True,
        )
    results = []
    gates = fitted_gates(a, cfg, ps) if a.popularity is not None else None
    for skew in a.skew if a.popularity is None else [None]:
        raw = run_modes(a, cfg, ps, skew, perf, gates)
        for mode, r in raw.items():
            if rank == 0:
                print(
                    f"  {popularity_text(skew)} {mode}: step {statistics.median(r['step']):.1f} ms, "
                    f"moe {statistics.median(r['moe']):.1f} ms, calibration {r['calibration']}",
                    flush=True,
                )
                if r["trial"] is not None:
                    print(f"  {popularity_text(skew)} {mode}: {r['trial']['line']}", flush=True)
        fits = {kind_of(m): raw[m]["calibration"] for m in ("pro_prophet_plan_only", "pro_prophet") if m in raw}
        for mode, r in raw.items():
            kind = kind_of(mode)
            cal = r["calibration"] or fits.get(kind) or Calibration()
            overlap = kind == "overlap"
            med = {k: statistics.median(r[k]) for k in ("step", "moe", "trans", "agg", "top", "plan")}
            pred = predicted_ms(r["terms"], overlap, cal)
            results.append(
                {
                    "mode": mode,
                    "skew": skew,
                    "step_ms_median": med["step"],
                    "moe_ms_median": med["moe"],
                    "load_std_before": statistics.mean(r["std_before"]),
                    "load_std_after": statistics.mean(r["std_after"]),
                    "predicted_ms": pred,
                    "trans_bytes": med["trans"],
                    "agg_bytes": med["agg"],
                    "world_size": world,
                    "top_expert_share": med["top"],
                    "load_avg_1min": os.getloadavg()[0],
                    "predicted_uncalibrated_ms": predicted_ms(r["terms"], overlap, Calibration()),
                    "model_error": pred / med["moe"] - 1.0,
                    "calibration_scale": cal.scale,
                    "calibration_comm": cal.comm,
                    "calibration_eta": cal.eta,
                    "calibration_overhead_ms": 1e3 * cal.overhead,
                    "breakdown_ms": r["breakdown"],
                    "trial": r["trial"],
                    "plan_ms": med["plan"],
                    # the other mode's step over this one's, iteration by iteration (round-robin)
                    **{
                        f"speedup_vs_{other}_paired": (
                            list(paired_ratio(raw[other]["step"], r["step"])) if other in raw else None
                        )
                        for other in ("none", "heaviest_to_all")
                    },
                    "popularity": "zipf" if skew is not None else f"counts {os.path.basename(a.counts_from)}",
                    "expert_shares": r["shares"],
                }
            )
    if rank == 0:
        print(table(results), flush=True)
        print(speedup_lines(results), flush=True)
        if a.breakdown:
            print(breakdown_table(results), flush=True)
        if a.json:
            atomic_write_json(a.json, results, sort_keys=False)
            print(f"wrote {a.json}", flush=True)


if __name__ == "__main__":
    main()
