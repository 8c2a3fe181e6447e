"""Parm `auto`, confirmed by measurement: the cost model ranks the schedules, the real layer times them.

`auto_schedule(cfg, ps, layer)` (every rank, collective over the world) is what `--moe-schedule auto`
does to one MoE layer:
  1. Algorithm 1 on the fitted cost model (`comm_profile.choose_for_layer`) ranks baseline, S1 and S2;
  2. with `--parm-auto-measure-iters N` > 0, `measure_schedules` runs the layer itself under each
     candidate (S1 only where the tokens of a routing group split over MP): WARMUP_ROUNDS untimed rounds,
     then N rounds of forward + backward on a fixed input of the training shape, the candidates taking turns
     in each round (round robin, so a slow spell of a shared machine hits all alike). Each pass is
     timed with `profiling.stamp` / `span_ms` (CUDA events on the compute stream, which waits for the
     collectives; on CPU the gloo collectives return when complete), after a barrier so every rank
     starts together. Every pass time is MAX-reduced over the world (the layer takes as long as its
     slowest rank), so every rank sees the same numbers and keeps the same schedule: the smallest
     median, ties to the model's ranking. N = 0 keeps the model's choice.
The schedules compute the same values, and the measurement leaves the run as it was: no optimizer step,
the weight gradients are returned by `torch.autograd.grad` (nothing reaches `.grad`, no gradient hook
fires), the CPU and CUDA RNG states, the router's call counter and the layer's last expert path
are restored; so the training curve (and a resumed run's) is the one of the chosen schedule.
The measured medians, the model's pick and a least-squares scale of the predictions onto the
measurements (`fit_scale`: predicted x scale is comparable with measured) go into the `Choice` and the log.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed.collectives import max_over_group
from megatron_moe.moe.comm_profile import choose_for_layer
from megatron_moe.moe.cost_model import Choice
from megatron_moe.profiling import span_ms, stamp

if TYPE_CHECKING:
    from megatron_moe.config import Config
    from megatron_moe.moe.layer import MoELayer
    from megatron_moe.parallel_state import ParallelState

log = logging.getLogger("megatron_moe.parm")

SCHEDULES = ("baseline", "s1", "s2")
WARMUP_ROUNDS = 2  # untimed rounds first: allocations, the groups' first collectives, caches
INPUT_SEED = 8191  # the measurement's input: drawn on the host from its own generator (no global RNG)


def candidates(choice: Choice, tokens_per_group: int, n_mp: int) -> list[str]:
    """The schedules to time, cheapest predicted first (S1 only when the group's tokens split over MP)."""
    names = [s for s in SCHEDULES if s != "s1" or tokens_per_group % n_mp == 0]
    return sorted(names, key=lambda s: (choice.times.get(s, float("inf")), SCHEDULES.index(s)))


def pick_fastest(medians: dict, ranked: list[str]) -> str:
    """The schedule of `ranked` with the smallest median [ms]; a tie goes to the one ranked first."""
    return min(ranked, key=lambda s: (medians[s], ranked.index(s)))


def fit_scale(predicted: dict, measured: dict) -> float:
    """Least-squares s minimizing sum (s p - m)^2 over the schedules in both dicts (p, m in the same unit)."""
    names = [s for s in measured if s in predicted]
    den = sum(predicted[s] ** 2 for s in names)
    return sum(predicted[s] * measured[s] for s in names) / den if den > 0 else 0.0


def _one_pass(layer: "MoELayer", x: torch.Tensor, gy: torch.Tensor, params: list, cuda: bool):
    """Forward + backward of `layer` on x; the gradients are returned and dropped (never in `.grad`)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    start = stamp(cuda)
    y, aux = layer(x)
    outs, grads = [y], [gy]
    if aux.requires_grad:
        outs.append(aux)
        grads.append(torch.ones_like(aux))
    torch.autograd.grad(outs, [x, *params], grads, allow_unused=True)
    return start, stamp(cuda)


def measure_schedules(
    layer: "MoELayer",
    ps: "ParallelState",
    choice: Choice,
    micro_batch: int,
    seq_length: int,
    iters: int,
    timings: Optional[Callable[[str, int], float]] = None,
    force_fastest: Optional[str] = None,
) -> Choice:
    """Time each candidate schedule on `layer` and install the fastest (module docstring); collective.

    Returns `choice` with the kept schedule, `measured` (median ms per candidate, max over ranks),
    `model_pick` and `scale`. timings (tests): ms of (schedule, round) replacing the measured time of that
    pass before the MAX over ranks (the passes still run); force_fastest (--parm-auto-force-fastest,
    tests): keep this schedule whatever the medians.
    """
    if iters < 1:
        raise ValueError(f"--parm-auto-measure-iters must be >= 1 to measure, got {iters}")
    w = layer.experts.fc_w
    dev, cuda = w.device, w.device.type == "cuda"
    M, G = w.shape[-1], layer.routing_groups
    if micro_batch % G:
        raise ValueError(f"--micro-batch-size {micro_batch} is not divisible into {G} routing groups")
    ranked = candidates(choice, (micro_batch // G) * seq_length, ps.size("mp"))
    if force_fastest is not None and force_fastest not in ranked:
        raise ValueError(f"--parm-auto-force-fastest {force_fastest}: not a candidate here ({', '.join(ranked)})")
    g = torch.Generator(device="cpu").manual_seed(INPUT_SEED)  # the same tokens on every rank
    x = torch.randn(micro_batch, seq_length, M, generator=g, device="cpu").to(device=dev, dtype=w.dtype)
    gy = torch.randn(x.shape, generator=g, device="cpu").to(device=dev, dtype=w.dtype)
    x.requires_grad_()
    params = [p for p in layer.parameters() if p.requires_grad]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(dev) if cuda else None
    calls = layer.router.calls
    path_last = layer.path_last
    spans: dict = {s: [] for s in ranked}
    try:
        for it in range(WARMUP_ROUNDS + iters):
            for j in range(len(ranked)):
                s = ranked[(it + j) % len(ranked)]
                layer.use_schedule(s, choice.saa_chunks, choice)
                span = _one_pass(layer, x, gy, params, cuda)
                if it >= WARMUP_ROUNDS:
                    spans[s].append(span)
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)
        layer.router.calls = calls
        layer.path_last = path_last
    flat = []
    for s in ranked:
        ms = span_ms(spans[s], cuda)
        flat += [timings(s, r) if timings is not None else v for r, v in enumerate(ms)]
    slowest = max_over_group(flat, ps.group("world"), dev, "parm auto measurement all_reduce")
    per = {s: slowest[i * iters : (i + 1) * iters] for i, s in enumerate(ranked)}
    medians = {s: float(statistics.median(v)) for s, v in per.items()}
    pick = force_fastest if force_fastest is not None else pick_fastest(medians, ranked)
    predicted_ms = {s: 1e3 * choice.times[s] for s in ranked if s in choice.times}
    out = replace(
        choice, schedule=pick, measured=medians, model_pick=choice.schedule, scale=fit_scale(predicted_ms, medians)
    )
    layer.use_schedule(pick, out.saa_chunks, out)
    return out


def auto_schedule(
    cfg: "Config", ps: "ParallelState", layer: "MoELayer", timings: Optional[Callable[[str, int], float]] = None
) -> Choice:
    """`--moe-schedule auto` for one layer: the model's choice, confirmed by measurement unless
    --parm-auto-measure-iters is 0; installs it on `layer` and logs it on rank 0 (collective)."""
    choice = choose_for_layer(cfg, ps, layer.layer_idx)
    iters = cfg.moe.parm_auto_measure_iters
    if iters == 0:
        layer.use_schedule(choice.schedule, choice.saa_chunks, choice)
        return choice
    out = measure_schedules(
        layer,
        ps,
        choice,
        cfg.train.micro_batch_size,
        cfg.model.seq_length,
        iters,
        timings=timings,
        force_fastest=cfg.moe.parm_auto_force_fastest,
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("parm: layer %d measured over %d rounds -> %s", layer.layer_idx, iters, out.describe())
    return out
