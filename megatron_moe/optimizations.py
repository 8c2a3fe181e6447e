"""The one place that applies the optimizations to a built model, in a fixed order.

    applied = apply(model, ps, cfg, grad_sync)     # every rank, after building model and GradSync
    for line in applied.changes: log(line)

1. Parm (--moe-schedule auto): per MoE layer, Algorithm 1 on collective costs profiled on the
   run's groups (or --comm-profile) ranks the schedules, then the layer times each
   (`moe.schedule_trial.auto_schedule`); every rank takes the same choice. With one MP rank the
   schedules coincide (baseline); under --moe-dropless auto is the dropless baseline.
2. Lina (--lina): gradient all-reduce in micro-ops of a `LinaScheduler` that yields to all-to-alls.
3. Lancet (--lancet-wgrad, --lancet-partition): plan and install through the modules' hooks
   (`lancet.controller.setup`); partitioned layers keep the schedule of step 1 inside the parts.
4. Pro-Prophet (--pro-prophet, dropless only): the replica runtime (`moe.placement.ProProphet`)
   with a fixed `pro_prophet_plan` or the planner on a performance model measured on the EP group
   and calibrated on the first iterations; kept only if measured faster (the trainer's trial).

Each step reports what it changed; the trainer logs the lines. A combination the code cannot run
(`UNSUPPORTED`) stops here with an error naming both flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_moe import choose
from megatron_moe.config import Config
from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.distributed.lina import LinaScheduler
from megatron_moe.lancet.controller import LancetController, setup as lancet_setup
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.arguments import validate_pro_prophet
from megatron_moe.moe.placement import Placement, ProProphet
from megatron_moe.moe.schedule_trial import auto_schedule
from megatron_moe.parallel_state import ParallelState
from megatron_moe.pro_prophet.calibration import Calibrator
from megatron_moe.pro_prophet.perf_model import PerfModel, measure_constants
from megatron_moe.pro_prophet.planner import plan as plan_placement

# (flag, value, flag, value) pairs that cannot run together; value None: the switch is on
UNSUPPORTED: tuple = (
    ("--moe-dropless", None, "--lancet-partition", None),
    ("--moe-dropless", None, "--lancet-wgrad", None),
    ("--moe-dropless", None, "--moe-schedule", "s2"),
    ("--lina-packing", None, "--lancet-wgrad", None),
    ("--lina-packing", None, "--lancet-partition", None),
    ("--lina-packing", None, "--pro-prophet", None),
    ("--compile", None, "--lancet-wgrad", None),  # Lancet swaps the linears' autograd for its dW queue
    ("--compile", None, "--lancet-partition", None),
)


@dataclass
class Applied:
    """What `apply` installed: log lines, the Lina scheduler and the Lancet controller (or None)."""

    changes: list[str] = field(default_factory=list)
    lina: Optional[LinaScheduler] = None
    lancet: Optional[LancetController] = None
    pro_prophet: Optional[ProProphet] = None
    decisions: list = field(default_factory=list)  # `choose.Decision`s taken while applying


def _flag_value(cfg: Config, flag: str):
    name = flag.lstrip("-").replace("-", "_")
    section = next(sec for sec in (cfg.moe, cfg.train, cfg.opts) if hasattr(sec, name))
    return getattr(section, name)


def check_combination(cfg: Config, unsupported: tuple = UNSUPPORTED) -> None:
    """Raise ValueError naming both flags of an unsupported combination."""
    for flag_a, val_a, flag_b, val_b in unsupported:
        a, b = _flag_value(cfg, flag_a), _flag_value(cfg, flag_b)
        if (a if val_a is None else a == val_a) and (b if val_b is None else b == val_b):
            raise ValueError(
                f"{flag_a}{'' if val_a is None else ' ' + str(val_a)} cannot be combined with "
                f"{flag_b}{'' if val_b is None else ' ' + str(val_b)}"
            )


def apply(
    model: GPT2MoE, ps: ParallelState, cfg: Config, grad_sync: GradSync, pro_prophet_plan: Optional[dict] = None
) -> Applied:
    """Parm's per-layer choice, then Lina, then Lancet, then Pro-Prophet (module docstring). Collective: every
    rank calls it. `pro_prophet_plan` ({expert: EP ranks holding a replica}): the placement in every MoE
    layer and iteration instead of planning (tests, fixed benchmarks)."""
    check_combination(cfg)
    out = Applied()
    auto = [layer for layer in model.moe_layers() if layer.requested == "auto"]
    if auto and auto[0].dropless:
        out.changes.append("parm: --moe-dropless: auto -> the dropless baseline (uneven all-to-all, ragged experts)")
    elif auto and ps.size("mp") == 1:  # no MP split: baseline, S1 and S2 are the same computation
        for layer in auto:
            layer.use_schedule("baseline")  # nothing decided: not logged
    else:
        for layer in auto:
            choice, decision = auto_schedule(cfg, ps, layer)  # the model's ranking, confirmed by measurement
            out.decisions.append(decision)
            out.changes.append(f"layer {layer.layer_idx}: Parm auto -> {choice.describe()}; {decision.line()}")
    opts = cfg.opts
    if opts.lina:
        # coalesced micro-ops (small tensors share one); 4 in flight, drain bound auto (the scheduler's defaults)
        out.lina = LinaScheduler(opts.lina_partition_mb, cfg.parallel.comm_timeout, coalesce=True)
        grad_sync.set_scheduler(out.lina, model)
        n = sum(layer.dispatcher.crosses_ranks for layer in model.moe_layers())
        out.changes.append(
            f"lina: gradient all-reduce in {opts.lina_partition_mb:g} MB micro-ops, "
            f"held back around the all-to-alls of {n} MoE layers"
        )
    if opts.lina_pipeline_chunks > 1:
        for flag, on in (("--lancet-wgrad", opts.lancet_wgrad), ("--lancet-partition", opts.lancet_partition)):
            if on:
                raise ValueError(f"--lina-pipeline-chunks cannot be combined with {flag}")
        model.set_pipeline_chunks(opts.lina_pipeline_chunks)
        out.changes.append(
            f"lina: all-to-alls of every MoE layer in {opts.lina_pipeline_chunks} token-chunk "
            f"micro-ops pipelined with the experts"
        )
    if opts.lancet_wgrad or opts.lancet_partition:
        out.lancet = lancet_setup(model, ps, opts, grad_sync=grad_sync)
        plan = out.lancet.plan
        if plan.selection:
            c = plan.selection["candidates"]
            times = ", ".join(f"{n} {v['measured_ms']:.1f} ms" for n, v in c.items())
            out.changes.append(f"lancet: measured {times}; kept {plan.selection['chosen']}")
        if plan.wgrad:
            n = sum(len(ws) for ws in plan.assignment.values())
            out.changes.append(f"lancet: {n} weight-gradient GEMMs deferred under all-to-alls")
        for r in plan.ranges:
            out.changes.append(
                f"layer {r.layer}: partitioned k={r.k} from {r.start} to {r.end} with "
                f"{model.blocks[r.layer].moe.schedule} inside"
            )
        if opts.lancet_partition and not plan.ranges:
            out.changes.append("lancet: the planner partitioned no range (not predicted or not measured faster)")
    if opts.pro_prophet:
        out.pro_prophet = pro_prophet_setup(model, ps, cfg, out.changes, pro_prophet_plan)
    return out


def pro_prophet_setup(
    model: GPT2MoE, ps: ParallelState, cfg: Config, changes: list[str], plan: Optional[dict] = None
) -> ProProphet:
    """The replica runtime with a fixed `plan`, or with Algorithm 1 on measured constants (collective)."""
    opts, m, moe = cfg.opts, cfg.model, cfg.moe
    validate_pro_prophet(cfg)
    layers = model.moe_layers()
    mode = "blocking Trans/Agg" if opts.pro_prophet_no_schedule else "Trans/Agg overlapped (Algorithm 2)"
    if plan is not None:
        runtime = ProProphet(layers, ps, schedule=not opts.pro_prophet_no_schedule, anchor=model.wte)
        fixed = Placement.of(moe.num_experts, ps.size("ep"), plan)
        runtime.set_plans({layer.layer_idx: fixed for layer in layers})
        changes.append(f"pro-prophet: fixed plan in every MoE layer: {fixed.describe()}; {mode}")
        return runtime
    M, H = m.hidden_size, m.ffn_hidden_size
    esp = ps.size("esp")
    expert = H // esp * M * 2 + H // esp + M // esp  # one expert's elements on one ESP shard
    tokens = cfg.train.micro_batch_size * m.seq_length * moe.moe_router_topk
    constants = measure_constants(ps, M, expert, H // esp, max(tokens, 32))
    perf = PerfModel(constants, M, expert, expert, overlap=not opts.pro_prophet_no_schedule)
    alpha, n = opts.pro_prophet_alpha, opts.pro_prophet_n
    calib = Calibrator(perf)  # the first iterations fit scale and overlap efficiency (pro_prophet.calibration)
    runtime = ProProphet(
        layers,
        ps,
        schedule=not opts.pro_prophet_no_schedule,
        planner=lambda counts: plan_placement(counts, calib.model, alpha, n).replicas,
        # the trial's third alternative: one more move of the same greedy order (kept if measured fastest)
        wider=lambda counts: plan_placement(counts, calib.model, alpha, n, extra=1).replicas,
        interval=opts.pro_prophet_interval,
        calibrator=calib,
        measure_iters=opts.measure_iters,  # placement kept only if measured faster (`moe.placement`)
        anchor=model.wte,  # the first MoE layer's Trans starts, and its Agg is waited, at the embedding
    )
    changes.append(
        f"pro-prophet: Algorithm 1 every {opts.pro_prophet_interval} iteration(s) from the last "
        f"iteration's counts (alpha {alpha:g}, n {n}); {mode}"
        + (
            f"; after the calibration, {opts.measure_iters} timed iterations each of plain, placed and one more "
            f"expert moved (turns of 2), the placement kept only if faster by more than {choose.MARGIN:.0%}"
            if opts.measure_iters
            else ""
        )
    )
    return runtime
