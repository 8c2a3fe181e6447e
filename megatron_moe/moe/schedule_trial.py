"""Parm `auto` for one layer: the cost model ranks the schedules, `choose.measure` times them on the layer.

Algorithm 1 on the fitted cost model (`comm_profile.choose_for_layer`) predicts baseline, S1 and S2.
Where they differ (more than one MP rank), each candidate runs forward + backward of the layer on a
fixed input of the training shape (S1 only where a routing group's tokens split evenly over MP); the
simplest of baseline, S2, S1 is kept unless a less simple one is faster by more than `choose.MARGIN`
(`choose.measure`). `--measure-iters 0` keeps the model's choice. Measuring leaves the run as it was:
weight gradients come from `torch.autograd.grad` (nothing reaches `.grad`, no hook fires), the RNG
states and the router's call counter are restored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from megatron_moe import choose
from megatron_moe.moe.comm_profile import choose_for_layer
from megatron_moe.moe.cost_model import Choice

if TYPE_CHECKING:
    from megatron_moe.config import Config
    from megatron_moe.moe.layer import MoELayer
    from megatron_moe.parallel_state import ParallelState

SIMPLEST_FIRST = ("baseline", "s2", "s1")  # S2 keeps the padded buffer; S1 reads counts on the host
INPUT_SEED = 8191  # the measurement's input: drawn on the host from its own generator (no global RNG)


def candidates(tokens_per_group: int, n_mp: int) -> list[str]:
    """The schedules worth timing, simplest first (S1 only when the group's tokens split over MP)."""
    return [s for s in SIMPLEST_FIRST if s != "s1" or tokens_per_group % n_mp == 0]


def measure_schedules(
    layer: "MoELayer", ps: "ParallelState", choice: Choice, micro_batch: int, seq_length: int, iters: int
) -> tuple[Choice, choose.Decision]:
    """Time the candidate schedules on `layer` and install the one `choose` keeps (collective)."""
    w = layer.experts.fc_w
    dev, M, G = w.device, w.shape[-1], layer.routing_groups
    if micro_batch % G:
        raise ValueError(f"--micro-batch-size {micro_batch} is not divisible into {G} routing groups")
    g = torch.Generator(device="cpu").manual_seed(INPUT_SEED)  # the same tokens on every rank
    x = (
        torch.randn(micro_batch, seq_length, M, generator=g, device="cpu")
        .to(device=dev, dtype=w.dtype)
        .requires_grad_()
    )
    gy = torch.randn(x.shape, generator=g, device="cpu").to(device=dev, dtype=w.dtype)
    params = [p for p in layer.parameters() if p.requires_grad]

    def run(schedule: str):
        def one_pass() -> None:
            layer.use_schedule(schedule, choice.saa_chunks, choice)
            y, aux = layer(x)
            outs, grads = ([y, aux], [gy, torch.ones_like(aux)]) if aux.requires_grad else ([y], [gy])
            torch.autograd.grad(outs, [x, *params], grads, allow_unused=True)

        return one_pass

    names = candidates((micro_batch // G) * seq_length, ps.size("mp"))
    cpu_rng, calls = torch.get_rng_state(), layer.router.calls
    cuda_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
    try:
        decision = choose.measure(
            f"parm layer {layer.layer_idx}", {s: run(s) for s in names}, ps.group("world"), dev, iters
        )
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)
        layer.router.calls = calls
    out = replace(choice, schedule=decision.pick)
    layer.use_schedule(out.schedule, out.saa_chunks, out)
    return out, decision


def auto_schedule(cfg: "Config", ps: "ParallelState", layer: "MoELayer") -> tuple[Choice, choose.Decision]:
    """`--moe-schedule auto` for one layer with more than one MP rank: the model's choice, confirmed by
    measurement unless --measure-iters is 0; installed on `layer` (collective)."""
    choice = choose_for_layer(cfg, ps, layer.layer_idx)
    iters = cfg.opts.measure_iters
    if iters == 0:
        decision = choose.untimed(f"parm layer {layer.layer_idx}", SIMPLEST_FIRST, choice.schedule, "cost model")
        choice = replace(choice, schedule=decision.pick)
        layer.use_schedule(choice.schedule, choice.saa_chunks, choice)
        return choice, decision
    return measure_schedules(layer, ps, choice, cfg.train.micro_batch_size, cfg.model.seq_length, iters)
