"""Lancet's operator partition pipelining around an MoE layer, built from the layer's own stages.

Legend: B batch, T sequence, M model dim, S = B*T tokens of the routing group
(one data-parallel rank's micro-batch), s tokens of one part, E experts, k
experts per token, C capacity of the whole group.

A `RangeSpec` names a range of ops around MoE block l, run as `k` parts along
the batch:
  start "attn"  block l's attention half, ln2, the gate, ... (per-part gate)
        "ln2"   ln2, the gate, ...                         (per-part gate)
        "gate"  the gate on the whole batch, then dispatch, ...
  end   "block"     after the MoE output's residual add (block l's output)
        "next_attn" also block l+1's attention half
`PartitionedRange` runs it from `Block.attn_residual`, the layer's `Router`, a
dispatcher and `Experts`: stage by stage, parts in index order within a stage
(pre-ops and routing, then each part's dispatch is launched; experts of each part
as its tokens arrive, each return launched; combine and post-ops), so part i's
messages are in flight while other parts compute (the order Lancet's simulator
assumes). Backward overlaps the same way through the dispatcher's handles.

The layer's --moe-schedule holds inside the parts:
  baseline  uneven dispatch of each part's kept tokens (every MP rank, as the baseline);
  s1        the group is routed at once with S1 (MP split, global slots), then this
            rank's slice is cut into k parts with uneven, pipelined dispatch;
  s2        the group is routed at once, then each part runs S2's padded dispatch
            synchronously (no overlap: a part's buffer has the whole capacity).

Exactness: capacity passing (per-part gate) gives part i's choice-j slots of
expert e after the choice-j tokens of e in parts < i, with C of the whole group;
top-2 and batch-prioritized routing need every token's gate first, so those ranges
start at the gate (or the schedule routes the whole group). The aux loss uses the
whole group's sums. Outputs and gradients equal the unpartitioned run to fp32
round-off, drops and slots are identical. Dropout must be 0 (parts draw masks apart).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from megatron_moe.distributed.collectives import gather_from_group
from megatron_moe.moe.dispatcher import TokenDispatcher, UnevenDispatcher
from megatron_moe.moe.router import RouteResult, aux_loss_terms, choice_counts, z_loss_of
from megatron_moe.profiling import annotate

if TYPE_CHECKING:
    from megatron_moe.model.gpt2 import Block

STARTS = ("attn", "ln2", "gate")
ENDS = ("block", "next_attn")


@dataclass(frozen=True)
class RangeSpec:
    """Ops of MoE block `layer` from `start` to `end` (module docstring) run as `k` batch parts."""

    layer: int
    start: str
    end: str
    k: int

    def __post_init__(self) -> None:
        if self.start not in STARTS or self.end not in ENDS:
            raise ValueError(f"range of layer {self.layer}: start {self.start!r} must be one of {STARTS}, "
                             f"end {self.end!r} one of {ENDS}")
        if self.k < 1:
            raise ValueError(f"range of layer {self.layer}: k must be >= 1 (--lancet-max-partitions), got {self.k}")


def needs_whole_batch_gate(layer) -> bool:
    """True when the router needs every token of the group before any slot is known."""
    return layer.router.k == 2 or layer.router.policy == "batch_prioritized"


def _rows(r: RouteResult, lo: int, hi: int) -> RouteResult:
    """Rows [lo, hi) of a route (slots keep their place in the whole group)."""
    return RouteResult(r.expert[lo:hi], r.slot[lo:hi], r.weight[lo:hi], r.capacity, r.aux_loss, r.z_loss,
                       r.counts, r.gates[lo:hi])


class _CapacityPassing:
    """Per-part routing of one group: each part's slots follow the earlier parts' choices."""

    def __init__(self, router, S: int):
        self.router, self.S = router, S
        self.offsets = torch.zeros(router.k, router.num_experts, dtype=torch.int64, device=router.gate_w.device)
        self.next_token, self.sums = 0, None

    def part(self, h_sM: torch.Tensor) -> RouteResult:
        router, lo = self.router, self.next_token
        self.next_token += h_sM.size(0)
        logits = router.logits(h_sM)
        # a fresh generator per part: every part draws the whole group's keys and keeps its rows
        gates, expert = router.choose(logits, 0, lo, self.S)
        r = router.route_slice(gates, expert, self.S, self.offsets)
        self.offsets += choice_counts(expert, router.num_experts).cpu()
        gate_sum, first, _ = aux_loss_terms(gates, expert)
        z = z_loss_of(logits) * h_sM.size(0) if router.z_coeff else None
        new = (gate_sum, first, z)
        self.sums = new if self.sums is None else tuple(None if a is None else a + b for a, b in zip(self.sums, new))
        return r

    def aux(self) -> torch.Tensor:
        return self.router.aux_of_sums(*self.sums, self.S)


class PartitionedRange:
    """Block `block` (and, for end 'next_attn', `nxt`'s attention half) as spec.k batch parts.

    Call it with x [B, T, M] -> (out [B, T, M], aux). `skip_attn`: the block's attention
    already ran (the previous range ended with it). `dispatcher`: the parts' dispatcher (an
    UnevenDispatcher with handles; the layer's own for S2). Appends the wall time in ms to `timings`.
    """

    def __init__(self, block: "Block", nxt: Optional["Block"], spec: RangeSpec, skip_attn: bool,
                 dispatcher: TokenDispatcher, timings: Optional[list] = None):
        self.block, self.nxt, self.spec, self.skip_attn = block, nxt, spec, skip_attn
        self.dispatcher, self.timings = dispatcher, timings

    def __call__(self, x: torch.Tensor):
        t0 = time.perf_counter()
        block, spec, layer = self.block, self.spec, self.block.moe
        if layer.routing_groups != 1:
            raise ValueError("Lancet partitioning needs one routing group per rank (routing_groups == 1)")
        B, T, M = x.shape
        k = min(spec.k, B)
        x = layer.dispatcher.track_input(x)            # Lina: the layer's backward ends here
        if spec.start != "attn":                       # ops before the start run on the whole batch
            x = x if self.skip_attn else block.attn_residual(x)
        res = list(torch.tensor_split(x, k, dim=0))
        per_part = layer.schedule == "baseline" and spec.start != "gate"
        if per_part and needs_whole_batch_gate(layer):
            raise ValueError(f"layer {layer.layer_idx}: top-{layer.router.k} {layer.router.policy} routing needs "
                             "the whole batch's gate; a partitioned range must start at the gate")
        split, started = False, []
        if per_part:                                   # stage A part by part: pre-ops, gate, launch
            cp = _CapacityPassing(layer.router, B * T)
            for i in range(k):
                with annotate("lancet/part"):
                    res[i] = block.attn_residual(res[i]) if spec.start == "attn" else res[i]
                    hi = block.ln2(res[i]).reshape(-1, M)
                started.append(self._start(hi, cp.part(hi)))
            layer.router.record([p[1] for p in started])
            aux = cp.aux()
        else:                                          # the layer's router stage on the whole group
            with annotate("lancet/part"):
                res = [block.attn_residual(xi) for xi in res] if spec.start == "attn" else res
                h = torch.cat([block.ln2(xi) for xi in res]).view(1, B * T, M)
            split = layer.splits_tokens(B * T)
            if layer.schedule == "s1" and not split:
                raise ValueError(f"--lancet-partition: layer {layer.layer_idx} cannot split {B * T} tokens over "
                                 f"--tensor-model-parallel-size {layer.ps.size('mp')} for --moe-schedule s1")
            (route,), aux, flat = layer.route(h, split)
            sizes = [t.size(0) for t in torch.tensor_split(flat, k)] if split else [xi.numel() // M for xi in res]
            bounds = torch.tensor([0] + sizes, device="cpu").cumsum(0).tolist()     # host-side row bounds
            started = [self._start(flat[a:b], _rows(route, a, b)) for a, b in zip(bounds, bounds[1:])]
        ys = self._finish(started, M)
        if split:                                      # S1: this rank's slice -> every token
            ys = list(torch.tensor_split(gather_from_group(torch.cat(ys)[None], layer.ps.group("mp"), dim=1)[0]
                                         .view(B, T, M), k, dim=0))
        outs = []
        with annotate("lancet/part"):
            for xi, yi in zip(res, ys):
                out = xi + block.drop(yi.view(xi.shape))
                outs.append(self.nxt.attn_residual(out) if spec.end == "next_attn" else out)
        if self.timings is not None:
            self.timings.append(1e3 * (time.perf_counter() - t0))
        return layer.dispatcher.track_output(torch.cat(outs, dim=0)), aux

    def _start(self, tok_sM: torch.Tensor, route: RouteResult):
        """Plan a part and launch its dispatch (S2's padded dispatcher runs the whole part now)."""
        d = self.dispatcher
        with annotate("moe/dispatch"):
            plan = d.plan([route])
            if isinstance(d, UnevenDispatcher):
                d.dispatch_start(tok_sM, plan)
                return plan, route, None
            x_in = d.dispatch(tok_sM, plan)
        return plan, route, d.combine(self.block.moe.experts(x_in, grad_scale=d.grad_scale), plan)

    def _finish(self, started: list, M: int) -> list:
        """Experts of each part as its tokens arrive (launching the returns), then combine each."""
        d, experts = self.dispatcher, self.block.moe.experts
        if not isinstance(d, UnevenDispatcher):
            return [y for _, _, y in started]
        for plan, _, _ in started:                     # Experts.forward is the "moe/experts" range
            d.combine_start(experts(d.dispatch_finish(plan, M), grad_scale=d.grad_scale), plan)
        with annotate("moe/combine"):
            return [d.combine_finish(plan) for plan, _, _ in started]
