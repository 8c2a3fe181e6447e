"""Lancet at runtime: install a plan on a model and drive its backward.

Every rank calls `setup` at the same place (it profiles all-to-alls, broadcasts the plan and may
create a process group), after the model and its GradSync (`optimizations.apply`):

    ctl = controller.setup(model, ps, cfg.opts)
    for each micro-batch:
        lm, aux = model(ids, labels)
        ctl.backward(lm + aux)                   # loss.backward(), then flush deferred dW
    grad_sync.finish(); optimizer.step()
    ctl.write_report(measured_iter_ms=...)       # once, if --lancet-report PATH
    ctl.remove()                                 # restore the model (optional)

With --lancet-wgrad and --lancet-partition off, `setup` changes nothing. A plain `loss.backward()`
is also correct: an end-of-backward callback runs every dW still queued.

What `setup` installs (through the modules' own hooks; nothing is replaced):
  --lancet-wgrad      the runtime as dW queue of the column/row parallel linears, the experts and the
                      MoE layers' dispatchers (`wgrad_runtime.py`); a forward pre-hook on the model
                      starts each iteration.
  --lancet-partition  a `PartitionedRange` runner on each planned range's first block
                      (`GPT2MoE.set_block_runner`; also the model's loss runner for a range ending at
                      the loss head), with the layer's --moe-schedule inside the parts; a block the
                      range runs whole gets a runner passing its input on, a block whose attention it
                      ran runs its FFN half only. Every op splits along the dims CP-SAT solved
                      (`model_ir.range_axes`; the report lists solved and used dims per op). Needs
                      routing_groups == 1 and dropout 0.
The plan comes from `planner.make_plan`, or, with --measure-iters > 0, from `choose_plan` (the
planner's candidates, "none" among them, timed on the real model by `choose.measure`), or is
passed in (`plan=LancetPlan.manual(...)`).
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_moe import choose
from megatron_moe.distributed.collectives import group_size
from megatron_moe.fileio import atomic_write_json
from megatron_moe.lancet.model_ir import range_axes, token_group_kind
from megatron_moe.lancet.partitioned_moe import PartitionedRange, covered_blocks, leading_blocks
from megatron_moe.lancet.planner import (
    LancetPlan,
    candidate_plans,
    fit_contention,
    fitted_ms,
    forced_partitions,
    make_plan,
    overlapped_ms,
    top_candidates,
)
from megatron_moe.lancet.wgrad_runtime import WgradRuntime
from megatron_moe.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.dispatcher import PaddedDispatcher, TokenDispatcher, UnevenDispatcher
from megatron_moe.parallel_state import ParallelState


def counts_group(ps: ParallelState):
    """A gloo group with the token all-to-all group's ranks, for the count exchanges (collective).

    Counts are needed on the host, so they travel over gloo even when tokens use NCCL. Made
    once per ParallelState and kept among its groups, so `destroy_model_parallel` destroys it.
    """
    group = ps.group(token_group_kind(ps))
    if group_size(group) == 1 or not dist.is_initialized():
        return group
    if not ps.has_group("ep_counts"):
        kinds = ps.layout.ep_groups if ps.size("esp") == 1 else ps.layout.ep_esp_groups
        ps.new_groups("ep_counts", kinds, backend="gloo")  # with --comm-timeout, like the others
    return ps.group("ep_counts")


def _ranged_elsewhere(x: torch.Tensor):
    """Runner of a block that a partitioned range, set on an earlier block, already ran: passes its
    input on."""
    return x, None


class LancetController:
    """Owns what Lancet installed on a model; see the module docstring."""

    def __init__(self, model: GPT2MoE, ps: ParallelState, opts, plan: Optional[LancetPlan]):
        self.model, self.ps, self.opts, self.plan = model, ps, opts, plan
        self.wgrad: Optional[WgradRuntime] = None
        self.timings: dict[int, deque[float]] = {}  # MoE block -> forward ms of its partitioned range
        self.range_runners: dict[int, PartitionedRange] = {}
        self._handles: list = []
        self._runners: list[int] = []  # blocks given a runner
        self._queued: list = []  # modules given the dW queue
        self._loss_runner: Optional[int] = None  # the range ending at the loss head: the model's loss runner

    # ------------------------------------------------------------------ install / remove
    def install(self) -> "LancetController":
        """Install the plan on the model (module docstring); returns self."""
        plan = self.plan
        if plan is None:
            return self
        if plan.wgrad or plan.ranges:
            # partitioning alone: no dW is placed under an all-to-all (empty assignment), but the
            # runtime still runs each weight's dW as one GEMM over all parts' rows, not k of them
            self.wgrad = WgradRuntime(plan.assignment if plan.wgrad else {})
            self._install_wgrad(self.wgrad)
        if plan.ranges:
            self._install_partitions(plan)
        return self

    def part_dispatcher(self, layer) -> UnevenDispatcher | PaddedDispatcher:
        """The dispatcher of a partitioned layer's parts: its --moe-schedule's, with handles."""
        if layer.schedule == "s2":
            return layer.dispatcher
        ps, base = self.ps, layer.schedule == "baseline"
        d = UnevenDispatcher(
            ps,
            layer.num_experts,
            layer.layer_idx,
            1.0 / ps.size("mp") if base else 1.0,
            token_group_kind(ps) if base else "ep_esp",
            counts_group(ps),
        )
        d.set_dw_queue(self.wgrad)
        return d

    def _install_partitions(self, plan: LancetPlan) -> None:
        blocks = self.model.block_list()
        is_moe = [b.is_moe for b in blocks]
        if self.model.cfg.model.dropout and plan.ranges:
            raise ValueError("--lancet-partition needs --hidden-dropout 0 to stay equivalent")
        owner: dict[int, str] = {}  # block -> what runs it: "range" / "whole"
        skip: set[int] = set()  # blocks whose attention half a range ran
        cover = {}
        for r in sorted(plan.ranges, key=lambda r: r.layer):
            lead = leading_blocks(r, is_moe)
            tail, attn_next = covered_blocks(r, is_moe)
            cover[r.layer] = (lead, tail, attn_next)
            if r.start in ("dense", "attn") and r.layer in skip:
                raise ValueError(f"Lancet range {r} starts at an attention the previous range already runs")
            for l in lead + [r.layer] + tail + ([attn_next] if attn_next is not None else []):
                if l in owner or (l in lead and l in skip):
                    raise ValueError(f"Lancet range {r} runs block {l}, which another range already runs")
            owner.update({l: "whole" for l in lead[1:] + [r.layer] + tail})
            owner[lead[0] if lead else r.layer] = "range"  # the block where the range's runner sits
            if attn_next is not None:
                skip.add(attn_next)
        ranged = {r.layer: r for r in plan.ranges}
        axes = {l: range_axes(self.model, r) for l, r in ranged.items()}  # all solved before anything is set
        for l, r in ranged.items():
            lead, tail, attn_next = cover[l]
            first = lead[0] if lead else l
            self.timings[l] = deque(maxlen=1000)
            self.range_runners[l] = runner = PartitionedRange(
                blocks[l],
                r,
                l in skip,
                self.part_dispatcher(blocks[l].moe),
                self.timings[l],
                [(j, blocks[j]) for j in tail],
                (attn_next, blocks[attn_next]) if attn_next is not None else None,
                axes[l],
                head=self.model.head_losses if r.end == "head" else None,
                lead=[(j, blocks[j]) for j in lead],
            )
            self.model.set_block_runner(first, runner)
            self._runners.append(first)
            if r.end == "head":  # with labels the range runs through the loss
                self.model.set_loss_runner(first, runner.losses)
                self._loss_runner = first
        for l, block in enumerate(blocks):
            if owner.get(l) == "range":  # its range's runner, set above
                continue
            if owner.get(l) == "whole":
                self.model.set_block_runner(l, _ranged_elsewhere)
            elif l in skip:
                self.model.set_block_runner(l, block.ffn_residual)
            else:
                continue
            self._runners.append(l)

    def _install_wgrad(self, rt: WgradRuntime) -> None:
        for l, block in enumerate(self.model.block_list()):
            mods: list[tuple[ColumnParallelLinear | RowParallelLinear, str]] = [
                (block.attn.qkv, f"L{l}.attn.qkv.dW"),
                (block.attn.proj, f"L{l}.attn.proj.dW"),
            ]
            if block.is_moe:
                block.moe.experts.set_dw_queue(rt, f"L{l}.moe.expert.")
                block.moe.dispatcher.set_dw_queue(rt)
                self._queued += [block.moe.experts, block.moe.dispatcher]
            else:
                mods += [(block.mlp.fc, f"L{l}.mlp.fc1.dW"), (block.mlp.proj, f"L{l}.mlp.fc2.dW")]
            for mod, name in mods:
                mod.set_dw_queue(rt, name)
                self._queued.append(mod)
        self._handles.append(self.model.register_forward_pre_hook(lambda m, a: rt.begin_iteration()))

    def remove(self) -> None:
        """Undo everything `install` did (the model runs exactly as before)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for l in self._runners:
            self.model.set_block_runner(l, None)
        if self._loss_runner is not None:
            self.model.set_loss_runner(self._loss_runner, None)
            self._loss_runner = None
        for mod in self._queued:
            if isinstance(mod, TokenDispatcher):
                mod.set_dw_queue(None)
            else:
                mod.set_dw_queue(None, "")
        self._runners.clear()
        self._queued.clear()
        if self.wgrad is not None:
            self.wgrad.close()

    # ------------------------------------------------------------------ training-loop API
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), then every deferred dW (gradients final, grad-ready hooks fired)."""
        loss.backward()
        self.flush()

    def flush(self) -> None:
        """Run deferred dW still queued (no-op without dW scheduling)."""
        if self.wgrad is not None:
            self.wgrad.flush()

    def stats(self) -> dict:
        """Counters for logs and tests: dW runs by place, partitioned range timings."""
        out: dict = {"ranges": len(self.plan.ranges) if self.plan else 0}
        if self.wgrad is not None:
            s = self.wgrad.stats
            out.update(
                {
                    "dw_runs": dict(s.runs),
                    "dw_in_window": s.in_window,
                    "dw_immediate": s.immediate,
                    "dw_flushed": s.flushed,
                    "dw_merged": s.merged,
                    "dw_window_ms": s.window_ms,
                    "a2a_windows": s.a2a_windows,
                }
            )
        return out

    def report(self, measured_iter_ms: Optional[float] = None) -> dict:
        """The plan, its predictions and the measured times (median ms of each partitioned range)."""
        plan = self.plan or LancetPlan()
        d = plan.to_json()
        for r in d["ranges"]:
            t: Sequence[float] = self.timings.get(r["layer"], [])
            r["measured_forward_ms"] = statistics.median(t) if t else None
            runner = self.range_runners.get(r["layer"])
            if runner is not None and runner.axes is not None:  # CP-SAT's dim and the runtime's, per op
                r["axes"] = {
                    op: {"tensor": t_, "dims": list(dims), "solved": dim, "runtime": runner.used_axes.get(op)}
                    for op, (t_, dims, dim) in runner.axes.ops.items()
                }
        d["measured_iteration_ms"] = measured_iter_ms
        d["stats"] = self.stats()
        return d

    def write_report(self, path: Optional[str] = None, measured_iter_ms: Optional[float] = None) -> Optional[dict]:
        """Write `report()` as JSON to `path` (default --lancet-report) atomically; rank 0 only."""
        path = path or getattr(self.opts, "lancet_report", None)
        if not path:
            return None
        d = self.report(measured_iter_ms)
        if not dist.is_initialized() or dist.get_rank() == 0:
            atomic_write_json(path, json.loads(json.dumps(d, default=str)))
        return d


def measure_plans(
    model: GPT2MoE, ps: ParallelState, opts, plans: dict, names: list, B: int, T: int, iters: int, grad_sync=None
):
    """`choose.measure` over `names` (simplest first): each pass installs the plan, runs forward +
    backward of `model` on fixed token ids and removes it (collective). The model is left as it was:
    gradients None, the routers' call counters and the RNG states restored, `grad_sync`'s hooks held
    back (`accumulating`) while measuring."""
    dev = model.wte.weight.device
    g = torch.Generator(device="cpu").manual_seed(4321)  # host draw: the same ids on every rank
    ids = torch.randint(0, model.vocab_size, (B, T + 1), generator=g, device="cpu").to(dev)

    def run(plan: LancetPlan):
        def one_pass() -> None:
            ctl = LancetController(model, ps, opts, plan if (plan.ranges or plan.wgrad) else None).install()
            lm, aux = model(ids[:, :-1], ids[:, 1:])
            ctl.backward(lm + aux)
            ctl.remove()
            model.zero_grad(set_to_none=True)

        return one_pass

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
    calls = [layer.router.calls for layer in model.moe_layers()]
    held = grad_sync.accumulating if grad_sync is not None else None
    if grad_sync is not None:
        grad_sync.accumulating = True
    try:
        return choose.measure("lancet", {n: run(plans[n]) for n in names}, ps.group("world"), dev, iters)
    finally:
        if grad_sync is not None:
            grad_sync.accumulating = held
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, dev)
        for layer, c in zip(model.moe_layers(), calls):
            layer.router.calls = c


def choose_plan(model: GPT2MoE, ps: ParallelState, opts, plans: dict, B: int, T: int, grad_sync=None) -> LancetPlan:
    """Never slower: `choose.measure` times the top candidates ("none" first, `planner.top_candidates`)
    and keeps the simplest unless a less simple one is faster by more than `choose.MARGIN`; the kept
    plan's `selection` records every candidate's predicted, measured (median) and contention-fitted ms."""
    names = top_candidates(plans)
    decision = measure_plans(model, ps, opts, plans, names, B, T, max(1, opts.measure_iters), grad_sync)
    table = decision.medians
    fit = fit_contention([(plans[n].predicted["iteration_ms"], overlapped_ms(plans[n]), table[n]) for n in names])
    chosen = plans[decision.pick]
    chosen.selection = {
        "chosen": decision.pick,
        "decision": decision.as_dict(),
        "candidates": {
            n: {
                "predicted_ms": plans[n].predicted["iteration_ms"],
                "measured_ms": table[n],
                "fitted_ms": fitted_ms(plans[n], fit),
                "overlapped_ms": overlapped_ms(plans[n]),
            }
            for n in names
        },
        "contention": fit,
        "prediction_error": (chosen.predicted["iteration_ms"] - table[decision.pick]) / table[decision.pick],
        "fitted_error": (fitted_ms(chosen, fit) - table[decision.pick]) / table[decision.pick],
    }
    return chosen


def setup(
    model: GPT2MoE,
    ps: ParallelState,
    opts,
    *,
    plan: Optional[LancetPlan] = None,
    micro_batch: Optional[int] = None,
    seq_length: Optional[int] = None,
    grad_sync=None,
    **plan_kwargs,
) -> LancetController:
    """Plan (unless `plan` is given) and install Lancet on `model` per `opts` (OptimizationsConfig).

    With --measure-iters > 0 (and no forced part count, `planner.forced_partitions`) the plan is the
    fastest *measured* of the top candidates and "none" (`choose_plan`; `grad_sync`'s hooks are held
    back while measuring); with 0 it is `make_plan`'s. micro_batch / seq_length default to the model
    config's --micro-batch-size / --seq-length. Extra keyword arguments go to the planner (costs=,
    comm=, profiler=).
    """
    if plan is None and (opts.lancet_wgrad or opts.lancet_partition):
        cfg = model.cfg
        B = micro_batch or cfg.train.micro_batch_size
        T = seq_length or cfg.model.seq_length
        if opts.measure_iters > 0 and forced_partitions() <= 1:
            plans = candidate_plans(model, ps, opts, B, T, **plan_kwargs)
            plan = choose_plan(model, ps, opts, plans, B, T, grad_sync=grad_sync)
        else:
            plan = make_plan(model, ps, opts, B, T, **plan_kwargs)
    return LancetController(model, ps, opts, plan).install()
