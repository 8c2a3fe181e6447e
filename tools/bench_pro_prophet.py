"""Benchmark Pro-Prophet: step and MoE-layer time, computed-token balance, Trans/Agg bytes and the
performance model's prediction, per placement mode and gate skew, on dropless MoE.

Run under torchrun (every rank runs every mode; EP = the world size):

  torchrun --nproc-per-node 2 tools/bench_pro_prophet.py --skew 0 1.2 --json pp_local.json
  scripts/emulate_cluster.sh --nodes 2 --procs-per-node 1 --inter-node-rate 400mbit -- \\
      tools/bench_pro_prophet.py --skew 0 1.2 --json pp_cluster.json

The model: --blocks blocks, each a dense FFN (LayerNorm, M -> 4M -> M: the non-expert compute)
and a dropless MoE layer (`moe.layer.MoELayer`, E experts over EP ranks). The MoE layer's input
is LayerNorm(h) + u with a fixed vector u, and the gate carries a bias along u: logit_e =
LayerNorm(h) . w_e + log p_e with p_e proportional to (e + 1) ** -skew (a Zipf law over the
experts; skew 0: uniform), while LayerNorm(h) . w_e has a standard deviation of about 1.3 (as
Gumbel noise would), so the top-1 choice follows roughly p. Expert 0, the most popular, sits on
rank 0. Learning rate 0, so routing keeps its distribution.

Modes (the same weights and batches in each):
  none                   no placement
  heaviest_to_all        the 2 experts with the most tokens replicated on every other rank
                         (the paper's comparison), Trans/Agg overlapped
  pro_prophet_plan_only  Algorithm 1 (`pro_prophet.planner.plan`, eq. (6)), Trans/Agg blocking
  pro_prophet            Algorithm 1 with eq. (8) and the block-wise scheduler (Algorithm 2)
Every mode plans iteration j+1 from iteration j's counts (`moe.placement.ProProphet`). The model's
constants are measured once on the real EP group (`pro_prophet.perf_model.measure_constants`).

An iteration is forward, backward and an SGD step, started together on all ranks (a barrier);
step time: max over ranks; MoE-layer time: forward + backward of the MoE layers (autograd stamps
around them), max over ranks; load std: population std of the tokens each EP rank computes, per
layer, averaged over layers, without (before) and with (after) the placement used; predicted_ms:
the model's T' of the MoE layers under that placement; trans_bytes / agg_bytes: bytes sent by all
ranks per iteration (the collective observer). Medians over the measured iterations.

Prints a table and, with --json PATH, writes a list of objects (one per mode and skew) with keys
mode, skew, step_ms_median, moe_ms_median, load_std_before, load_std_after, predicted_ms,
trans_bytes, agg_bytes (plus world_size, top_expert_share, load_avg_1min).
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
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.fileio import atomic_write_json
from megatron_moe.config import Config
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.distributed.observer import CommLog
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.placement import Placement, ProProphet, gather_counts, routed_counts
from megatron_moe.parallel_state import device_and_backend, initialize_model_parallel, shutdown
from megatron_moe.pro_prophet.perf_model import PerfModel, measure_constants
from megatron_moe.pro_prophet.planner import heaviest_to_all, plan

MODES = ("none", "heaviest_to_all", "pro_prophet_plan_only", "pro_prophet")
GATE_NOISE = 1.3  # std of the unbiased gate logits (Gumbel noise's is pi / sqrt(6) = 1.28)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skew", type=float, nargs="+", default=[0.0, 1.2], help="Zipf exponents of expert popularity")
    p.add_argument("--modes", default=",".join(MODES), help="modes to run, comma-separated")
    p.add_argument("--blocks", type=int, default=2, help="blocks (dense FFN + MoE layer)")
    p.add_argument("--hidden-size", type=int, default=256, help="model dim M")
    p.add_argument("--ffn-hidden-size", type=int, default=1024, help="expert hidden dim H")
    p.add_argument("--experts-per-rank", type=int, default=4, help="E / EP")
    p.add_argument("--topk", type=int, default=1, choices=[1, 2], help="experts per token")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per iteration")
    p.add_argument("--alpha", type=float, default=0.25, help="--pro-prophet-alpha")
    p.add_argument("--n", type=int, default=0, help="--pro-prophet-n")
    p.add_argument("--iters", type=int, default=8, help="measured iterations per mode")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured iterations per mode")
    p.add_argument("--comm-timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    for name in ("blocks", "hidden_size", "ffn_hidden_size", "experts_per_rank", "tokens", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first iteration only gathers the counts the planner needs)")
    if any(s < 0 for s in a.skew):
        p.error("--skew values must be >= 0")
    return a


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

    def __init__(self, cfg: Config, ps, skew: float, seed: int = 1234):
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
        self.register_buffer("u", u * (10.0 / u.norm()))
        log_p = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32, device=dev))
        with torch.no_grad():
            for moe in self.moes:
                w = torch.randn(E, M, generator=gen, device="cpu").to(dev) * (GATE_NOISE / M**0.5)
                w -= (w @ self.u)[:, None] * self.u[None, :] / self.u.dot(self.u)  # u . w_e = 0: no hidden bias
                moe.router.gate_w.copy_(w + log_p[:, None] * self.u[None, :] / self.u.dot(self.u))
        self.moe_s: list[float] = []  # forward seconds per MoE layer call
        self.moe_bwd: list[list[float]] = []  # per MoE layer call: backward [start, end] stamps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for i, moe in enumerate(self.moes):
            h = h + self.fc2[i](F.gelu(self.fc1[i](self.norms[2 * i](h))))
            bwd: list[float] = []
            z = _Stamp.apply(self.norms[2 * i + 1](h) + self.u, bwd)
            t0 = time.perf_counter()
            y, _ = moe(z)
            self.moe_s.append(time.perf_counter() - t0)
            h = h + _Stamp.apply(y, bwd)
            self.moe_bwd.append(bwd)
        return h


def make_runtime(model: BenchModel, ps, mode: str, perf: dict, a) -> Optional[ProProphet]:
    layers = list(model.moes)
    if mode == "none":
        return None
    if mode == "heaviest_to_all":
        return ProProphet(layers, ps, schedule=True, planner=lambda c: heaviest_to_all(c, 2).replicas)
    model_kind = "overlap" if mode == "pro_prophet" else "plain"
    return ProProphet(
        layers, ps, schedule=mode == "pro_prophet", planner=lambda c: plan(c, perf[model_kind], a.alpha, a.n).replicas
    )


def run_mode(a, cfg: Config, ps, mode: str, skew: float, perf: dict) -> dict:
    """Warm up, measure; per-iteration lists (every rank holds the same numbers)."""
    model = BenchModel(cfg, ps, skew)
    runtime = make_runtime(model, ps, mode, perf, a)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    gen = torch.Generator(device="cpu").manual_seed(99 + ps.rank("ep"))
    E, n_ep, M = cfg.moe.num_experts, ps.size("ep"), cfg.model.hidden_size
    plain = Placement.of(E, n_ep, {})
    model_for = perf["overlap" if mode == "pro_prophet" else "plain"]
    rows = {k: [] for k in ("step", "moe", "std_before", "std_after", "predicted", "trans", "agg", "top")}
    log = CommLog().start()
    for it in range(a.warmup + a.iters):
        x = torch.randn(1, a.tokens, M, generator=gen, device="cpu").to(ps.device)
        used = [runtime.placement_of(m.layer_idx) if runtime else plain for m in model.moes]
        model.moe_s, model.moe_bwd = [], []
        dist.barrier()
        log.clear()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(x)
        out.float().pow(2).mean().backward()
        opt.step()
        step = time.perf_counter() - t0
        moe = sum(model.moe_s) + sum(b[1] - b[0] for b in model.moe_bwd if len(b) == 2)
        sent = {op: sum(e.sent for e in log.of(op)) for op in ("trans", "agg")}
        counts = gather_counts(ps, torch.stack([routed_counts(m) for m in model.moes]))  # [L, N_EP, E]
        if runtime is not None:
            runtime.end_iteration(it + 1, counts)
        if it < a.warmup:
            continue
        std = lambda v: statistics.pstdev(float(x) for x in v)  # noqa: E731
        rows["step"].append(1e3 * step)
        rows["moe"].append(1e3 * moe)
        rows["std_before"].append(statistics.mean(std(plain.computed_tokens(c.tolist())) for c in counts))
        rows["std_after"].append(statistics.mean(std(p.computed_tokens(c.tolist())) for p, c in zip(used, counts)))
        rows["predicted"].append(1e3 * sum(model_for.layer_time(c.tolist(), p.replicas) for p, c in zip(used, counts)))
        rows["trans"].append(sent["trans"])
        rows["agg"].append(sent["agg"])
        per_expert = counts.sum(dim=(0, 1))
        rows["top"].append(float(per_expert.max() / per_expert.sum()))
    log.stop()
    t = torch.tensor([rows["step"], rows["moe"]], dtype=torch.float64, device=ps.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    b = torch.tensor([rows["trans"], rows["agg"]], dtype=torch.float64, device=ps.device)
    dist.all_reduce(b)
    rows["step"], rows["moe"] = t[0].cpu().tolist(), t[1].cpu().tolist()
    rows["trans"], rows["agg"] = b[0].cpu().tolist(), b[1].cpu().tolist()
    return rows


def measure_perf(cfg: Config, ps, a) -> dict:
    """The performance model, plain (eq. (6)) and with the scheduler (eq. (8)), on measured constants."""
    M, H = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    expert = 2 * H * M + H + M
    constants = measure_constants(ps, M, expert, H, a.tokens * a.topk)
    return {
        "plain": PerfModel(constants, M, expert, expert),
        "overlap": PerfModel(constants, M, expert, expert, overlap=True),
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'skew':>5s} {'mode':22s} {'step ms':>8s} {'moe ms':>8s} {'pred ms':>8s} {'std before':>10s} "
        f"{'std after':>9s} {'trans MB':>8s} {'agg MB':>7s} {'top share':>9s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['skew']:5.2f} {r['mode']:22s} {r['step_ms_median']:8.1f} {r['moe_ms_median']:8.1f} "
            f"{r['predicted_ms']:8.1f} {r['load_std_before']:10.1f} {r['load_std_after']:9.1f} "
            f"{r['trans_bytes'] / 2**20:8.2f} {r['agg_bytes'] / 2**20:7.2f} {r['top_expert_share']:9.3f}"
        )
    return "\n".join(lines)


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
    for skew in a.skew:
        for mode in a.modes:
            r = run_mode(a, cfg, ps, mode, skew, perf)
            med = {k: statistics.median(v) for k, v in r.items()}
            row = {
                "mode": mode,
                "skew": skew,
                "step_ms_median": med["step"],
                "moe_ms_median": med["moe"],
                "load_std_before": statistics.mean(r["std_before"]),
                "load_std_after": statistics.mean(r["std_after"]),
                "predicted_ms": med["predicted"],
                "trans_bytes": med["trans"],
                "agg_bytes": med["agg"],
                "world_size": world,
                "top_expert_share": med["top"],
                "load_avg_1min": os.getloadavg()[0],
            }
            results.append(row)
            if rank == 0:
                print(
                    f"  skew {skew:g} {mode}: step {row['step_ms_median']:.1f} ms, moe {row['moe_ms_median']:.1f} ms, "
                    f"predicted {row['predicted_ms']:.1f} ms",
                    flush=True,
                )
    if rank == 0:
        print(table(results), flush=True)
        if a.json:
            atomic_write_json(a.json, results, sort_keys=False)
            print(f"wrote {a.json}", flush=True)


if __name__ == "__main__":
    main()
