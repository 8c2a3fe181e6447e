"""Lancet's operator partition pipelining around an MoE layer, built from the layer's own stages.

Legend: B batch, T sequence, M model dim, S = B*T tokens of the routing group
(one data-parallel rank's micro-batch), s tokens of one part, E experts, k
experts per token, C capacity of the whole group.

A `RangeSpec` names a range of ops around MoE block l, run as `k` parts along the batch:
  start "dense"  the dense blocks before block l (back to the previous MoE block, or from the
                 embedding), then as "attn"
        "attn"   block l's attention half, ln2, the gate, ... (per-part gate)
        "ln2"    ln2, the gate, ...                         (per-part gate)
        "gate"   the gate on the whole batch, then dispatch, ...
  end   "block"           after the MoE output's residual add (block l's output)
        "next_attn"       also block l+1's attention half
        "dense"           also every dense block up to the next MoE block
        "dense_next_attn" also those and the next MoE block's attention half: everything between
                          two MoE layers (Lancet's iota = the whole span)
        "head"            the last MoE block: also every dense block after it and the loss head
                          (`GPT2MoE.head_losses`), part by part; installed as the model's loss
                          runner (`GPT2MoE.set_loss_runner`); without labels it ends like "dense".

`PartitionedRange` runs it stage by stage, parts in index order: pre-ops and routing; the parts'
dispatches launched back to back after one count exchange (with a per-part gate, part 0 first,
alone: one host sync for the others); each part's experts as its tokens arrive, its return
launched; then part by part its combine and post-ops while later returns are in flight (the order
Lancet's simulator assumes). Backward overlaps the same way through the dispatcher's handles.

Split axes come from CP-SAT (`RangeAxes`, `model_ir.range_axes`): the residual stream [B, T, M]
along its solved dim (the batch: the flatten to tokens maps only B to S, and attention cannot split
T), the router's tokens [S, M] along S, the dispatched buffers [E, C, M] along C (each part's own
slots). The runtime records the dim it used for every op (`used_axes`) and refuses a solution it
cannot run.

The layer's --moe-schedule holds inside the parts:
  baseline  uneven dispatch of each part's kept tokens (every MP rank, as the baseline);
  s1        the group is routed at once with S1 (MP split, global slots), then this rank's slice
            is cut into k parts with uneven, pipelined dispatch;
  s2        the group is routed at once, then each part runs S2's padded dispatch synchronously
            (no overlap: a part's buffer has the whole capacity).

Exactness: capacity passing (per-part gate) gives part i's choice-j slots of expert e after the
choice-j tokens of e in parts < i, with C of the whole group; top-2 and batch-prioritized routing
need every token's gate first, so those ranges start at the gate (or the schedule routes the whole
group). The aux loss uses the whole group's sums. Outputs and gradients equal the unpartitioned run
to fp32 round-off, drops and slots are identical. Dropout must be 0 (parts draw masks apart).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, MutableSequence, Optional, Sequence

import torch

from megatron_moe.distributed import streams
from megatron_moe.distributed.collectives import gather_from_group
from megatron_moe.moe.dispatcher import PaddedDispatcher, UnevenDispatcher
from megatron_moe.moe.router import RouteResult, aux_loss_terms, choice_counts, z_loss_of
from megatron_moe.profiling import annotate

if TYPE_CHECKING:
    from megatron_moe.model.gpt2 import Block

STARTS = ("dense", "attn", "ln2", "gate")
ENDS = ("block", "next_attn", "dense", "dense_next_attn", "head")


@dataclass(frozen=True)
class RangeSpec:
    """Ops of MoE block `layer` from `start` to `end` (module docstring) run as `k` batch parts."""

    layer: int
    start: str
    end: str
    k: int

    def __post_init__(self) -> None:
        if self.start not in STARTS or self.end not in ENDS:
            raise ValueError(
                f"range of layer {self.layer}: start {self.start!r} must be one of {STARTS}, "
                f"end {self.end!r} one of {ENDS}"
            )
        if self.k < 1:
            raise ValueError(f"range of layer {self.layer}: k must be >= 1 (--lancet-max-partitions), got {self.k}")


def leading_blocks(spec: RangeSpec, is_moe: list[bool]) -> list[int]:
    """The dense blocks before spec.layer a "dense" start runs whole (back to the previous MoE
    block, or from block 0); [] for the other starts. A "dense" start with none is a ValueError."""
    if spec.start != "dense":
        return []
    l = spec.layer
    first = l
    while first > 0 and not is_moe[first - 1]:
        first -= 1
    if first == l:
        raise ValueError(f"Lancet range {spec}: no dense block precedes MoE block {l}")
    return list(range(first, l))


def covered_blocks(spec: RangeSpec, is_moe: list[bool]) -> tuple[list[int], Optional[int]]:
    """(blocks after spec.layer the range runs whole, block whose attention half it runs or None),
    for a model whose block l is an MoE block when is_moe[l]; a range the model cannot hold is a
    ValueError naming it."""
    L, l = len(is_moe), spec.layer
    if not 0 <= l < L or not is_moe[l]:
        raise ValueError(f"Lancet range {spec} does not start in an MoE block")
    if spec.end == "block":
        return [], None
    if spec.end == "head":
        if any(is_moe[l + 1 :]):
            raise ValueError(f"Lancet range {spec} ends at the loss head, but an MoE block follows block {l}")
        return list(range(l + 1, L)), None
    if spec.end == "next_attn":
        if l + 1 >= L:
            raise ValueError(f"Lancet range {spec} ends in block {l + 1}, which does not exist")
        return [], l + 1
    dense = []
    n = l + 1
    while n < L and not is_moe[n]:
        dense.append(n)
        n += 1
    if not dense:
        raise ValueError(f"Lancet range {spec}: no dense block follows MoE block {l}")
    if spec.end == "dense":
        return dense, None
    if n >= L:
        raise ValueError(f"Lancet range {spec}: no MoE block follows the dense blocks {dense}")
    return dense, n


@dataclass(frozen=True)
class RangeAxes:
    """The CP-SAT solution of a range. ops: sim op name ("L1.attn.qkv") -> (first input tensor, its
    dims, the partitioned dim), in forward order; `x`: the same for the range's input [B, T, M].
    """

    x: tuple[str, tuple[str, ...], str]
    ops: dict

    def split_dim(self) -> int:
        """Index of the range input's solved dim (where the runtime splits it and joins the parts)."""
        _, dims, d = self.x
        return dims.index(d)

    def axis(self, op: str) -> str:
        """The solved partition dim of `op`'s first input (ValueError if `op` is not in the range)."""
        if op not in self.ops:
            raise ValueError(f"op {op!r} is not in the partitioned range ({sorted(self.ops)})")
        return self.ops[op][2]


def _sizes(n: int, k: int) -> list[int]:
    """Sizes of k parts of n, as `torch.tensor_split` makes them."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _split(x: torch.Tensor, k: int, d: int) -> tuple[torch.Tensor, ...]:
    """x in k parts along dim d (`_sizes`). One split: its backward concatenates the parts' gradients
    once, where k slices would each scatter into a zero tensor of x's size and sum the k of them."""
    return x.split(_sizes(x.size(d), k), dim=d)


def needs_whole_batch_gate(layer) -> bool:
    """True when the router needs every token of the group before any slot is known."""
    return layer.router.k >= 2 or layer.router.policy == "batch_prioritized"


def _rows(r: RouteResult, lo: int, hi: int) -> RouteResult:
    """Rows [lo, hi) of a route (slots keep their place in the whole group)."""
    return RouteResult(
        r.expert[lo:hi], r.slot[lo:hi], r.weight[lo:hi], r.capacity, r.aux_loss, r.z_loss, r.counts, r.gates[lo:hi]
    )


class _CapacityPassing:
    """Per-part routing of one group: each part's slots follow the earlier parts' choices."""

    def __init__(self, router, S: int):
        self.router, self.S = router, S
        self.offsets = torch.zeros(router.k, router.num_experts, dtype=torch.int64, device=router.gate_w.device)
        self.next_token = 0
        # running (sum of gates [E], first-choice counts [E], z-loss sum or None) over the parts so far
        self.sums: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None

    def part(self, h_sM: torch.Tensor) -> RouteResult:
        router, lo = self.router, self.next_token
        self.next_token += h_sM.size(0)
        logits = router.logits(h_sM)
        # a fresh generator per part: every part draws the whole group's keys and keeps its rows
        gates, expert = router.choose(logits, 0, lo, self.S)
        r = router.route_slice(gates, expert, self.S, self.offsets)
        self.offsets += choice_counts(expert, router.num_experts)  # on the router's device (CUDA: no host copy)
        gate_sum, first, _ = aux_loss_terms(gates, expert)
        z = z_loss_of(logits) * h_sM.size(0) if router.z_coeff else None
        if self.sums is None:
            self.sums = (gate_sum, first, z)
        else:
            g0, f0, z0 = self.sums
            # z is None for every part or for none (router.z_coeff is fixed)
            self.sums = (g0 + gate_sum, f0 + first, None if z0 is None or z is None else z0 + z)
        return r

    def aux(self) -> torch.Tensor:
        if self.sums is None:
            raise RuntimeError("capacity passing: aux() before any part was routed")
        return self.router.aux_of_sums(*self.sums, self.S)


class PartitionedRange:
    """MoE block `block` from spec.start, then `tail` (whole dense blocks) and `attn_next`'s
    attention half, as spec.k parts split along the dims of the CP-SAT solution `axes`.

    Call it with x [B, T, M] -> (out [B, T, M], aux); a range ending at the loss head (`head`:
    the model's `head_losses`) also as `losses(x, labels [B, T])` -> (per-token losses [B, T], aux).
    `skip_attn`: the block's attention already ran (the previous range ended with it).
    `dispatcher`: the parts' dispatcher (an UnevenDispatcher with handles; the layer's own for S2).
    `tail` / `attn_next` / `lead` (the dense blocks a "dense" start runs first): (block index,
    Block) pairs. Appends the wall time in ms to `timings`. After a call, `used_axes` maps every
    op of the range (model IR names, "L1.attn.qkv", ...) to the dim the runtime split its first
    input along ("B", "S", "C", ...), for the report.
    """

    def __init__(
        self,
        block: "Block",
        spec: RangeSpec,
        skip_attn: bool,
        dispatcher: UnevenDispatcher | PaddedDispatcher,
        timings: Optional[MutableSequence[float]] = None,
        tail: Sequence[tuple[int, "Block"]] = (),
        attn_next: Optional[tuple[int, "Block"]] = None,
        axes: Optional[RangeAxes] = None,
        stream_api: Any = streams,
        head: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        lead: Sequence[tuple[int, "Block"]] = (),
    ):
        self.block, self.spec, self.skip_attn = block, spec, skip_attn
        self.sx = stream_api  # the stream calls (the `streams` module; a test passes a recorder)
        self.dispatcher, self.timings = dispatcher, timings
        self.tail, self.attn_next, self.axes = list(tail), attn_next, axes
        self.head, self.lead = head, list(lead)
        if bool(self.lead) != (spec.start == "dense"):
            raise ValueError(f"Lancet range {spec}: leading dense blocks are given exactly when it starts at 'dense'")
        if (head is not None) != (spec.end == "head"):
            raise ValueError(f"Lancet range {spec}: a loss head is given exactly when the range ends at 'head'")
        self.used_axes: dict[str, str] = {}

    def _stream_dim(self) -> tuple[int, str]:
        """(index, name) of the dim the residual stream [B, T, M] is split along: the solution's."""
        if self.axes is None:
            return 0, "B"
        return self.axes.split_dim(), self.axes.x[2]

    def _check(self, op: str, runtime: str) -> None:
        """Record that the runtime split `op`'s input along `runtime`; it must be the solved dim."""
        if self.axes is not None and op in self.axes.ops and self.axes.axis(op) != runtime:
            raise ValueError(
                f"Lancet range {self.spec}: CP-SAT partitions {op} along {self.axes.axis(op)!r}, "
                f"the runtime can only split it along {runtime!r}"
            )
        self.used_axes[op] = runtime

    def __call__(self, x: torch.Tensor):
        return self._run(x, None)

    def losses(self, x: torch.Tensor, labels: torch.Tensor):
        """The range through the loss head: per-token losses [B, T] (parts' rows) and the aux loss."""
        if self.head is None:
            raise ValueError(f"Lancet range {self.spec} does not end at the loss head")
        return self._run(x, labels)

    def _run(self, x: torch.Tensor, labels: Optional[torch.Tensor]):
        t0 = time.perf_counter()
        block, spec, layer = self.block, self.spec, self.block.moe
        if layer.routing_groups != 1:
            raise ValueError("Lancet partitioning needs one routing group per rank (routing_groups == 1)")
        B, T, M = x.shape
        p = f"L{spec.layer}."
        d, dname = self._stream_dim()
        if dname != "B":  # the MoE layer's tokens are the batch's rows: only a batch split keeps S contiguous
            raise ValueError(
                f"Lancet range {spec}: CP-SAT split the residual stream along {dname!r}; "
                "a range with an MoE layer must split it along the batch 'B'"
            )
        k = min(spec.k, x.size(d))
        self.used_axes = {}
        x = layer.dispatcher.track_input(x)  # Lina: the layer's backward ends here
        runs_attn = spec.start in ("dense", "attn")  # the parts run the block's attention
        if not runs_attn:  # ops before the start run on the whole batch
            x = x if self.skip_attn else block.attn_residual(x)
        res = list(_split(x, k, d))
        per_part = layer.schedule == "baseline" and spec.start != "gate"
        if per_part and needs_whole_batch_gate(layer):
            raise ValueError(
                f"layer {layer.layer_idx}: top-{layer.router.k} {layer.router.policy} routing needs "
                "the whole batch's gate; a partitioned range must start at the gate"
            )
        attn_ops = [p + o for o in ("ln1", "attn.qkv", "attn.core", "attn.proj")]
        for op in (attn_ops if runs_attn else []) + ([p + "ln2"] if spec.start != "gate" else []):
            self._check(op, dname)
        for l, _ in self.lead:
            for op in ("ln1", "attn.qkv", "attn.core", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2"):
                self._check(f"L{l}.{op}", dname)

        def pre(xi: torch.Tensor) -> torch.Tensor:  # a part's ops before ln2: dense blocks, attention
            for _, b in self.lead:
                xi = b(xi)[0]
            return block.attn_residual(xi) if runs_attn else xi

        split, started = False, []
        if per_part:  # stage A part by part: pre-ops and gate; part 0 launched at once, then the rest together
            cp = _CapacityPassing(layer.router, B * T)
            parts = []
            for i in range(k):
                with annotate("lancet/part"):
                    res[i] = pre(res[i])
                    hi = block.ln2(res[i]).reshape(-1, M)  # part i's rows of S (B split, d == 0)
                parts.append((hi, cp.part(hi)))
                if i == 0:  # parts 1.. compute their pre-ops and gate while part 0's tokens travel
                    started = self._start_all(parts)
            started += self._start_all(parts[1:])
            layer.router.record([p_[1] for p_ in started])
            aux = cp.aux()
        else:  # the layer's router stage on the whole group
            with annotate("lancet/part"):
                res = [pre(xi) for xi in res]
                h = torch.cat([block.ln2(xi) for xi in res], dim=d).view(1, B * T, M)
            split = layer.splits_tokens(B * T)
            if layer.schedule == "s1" and not split:
                raise ValueError(
                    f"--lancet-partition: layer {layer.layer_idx} cannot split {B * T} tokens over "
                    f"--tensor-model-parallel-size {layer.ps.size('mp')} for --moe-schedule s1"
                )
            (route,), aux, flat = layer.route(h, split)
            sizes = _sizes(flat.size(0), k) if split else [xi.numel() // M for xi in res]
            bounds = torch.tensor([0] + sizes, device="cpu").cumsum(0).tolist()  # host-side row bounds
            rows = flat.split(sizes)  # one split: one concatenation of the parts' gradients in backward
            started = self._start_all([(t, _rows(route, a, b)) for t, a, b in zip(rows, bounds, bounds[1:])])
        for op in ("moe.gate", "moe.dispatch"):  # tokens: each part a run of rows of [S, M]
            self._check(p + op, "S")
        for op in ("moe.a2a_dispatch", "moe.experts", "moe.a2a_combine", "moe.combine"):
            self._check(p + op, "C")  # each part's own slots of the [E, C, M] buffers
        for l, _ in self.tail:
            for op in ("ln1", "attn.qkv", "attn.core", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2"):
                self._check(f"L{l}.{op}", dname)
        if self.attn_next is not None:
            for op in ("ln1", "attn.qkv", "attn.core", "attn.proj"):
                self._check(f"L{self.attn_next[0]}.{op}", dname)
        side_end: list = []  # the side stream's point after the last part's experts (see _finish)
        ys = self._finish(started, x.device, side_end)
        if split:  # S1: this rank's slice -> every token
            whole = gather_from_group(torch.cat(list(ys))[None], layer.ps.group("mp"), dim=1)[0]
            ys = iter(_split(whole.view(B, T, M), k, d))
        if labels is not None:
            self._check("head", dname)
        lab = _split(labels, k, d) if labels is not None else [None] * k
        outs = []
        for xi, yi, li in zip(res, ys, lab):  # part i's post-ops run while part i+1's return flies
            with annotate("lancet/part"):
                out = xi + block.drop(yi.view(xi.shape))
                for _, b in self.tail:  # dense blocks, FFN included: (x, None)
                    out = b(out)[0]
                if li is not None and self.head is not None:  # the loss head on part i's rows
                    out = self.head(out, li)
                outs.append(self.attn_next[1].attn_residual(out) if self.attn_next is not None else out)
        for end in side_end:  # the caller's stream is after all of the side stream's work, once
            self.sx.wait_event(self.sx.current_stream(x.device), end)
        if self.timings is not None:
            self.timings.append(1e3 * (time.perf_counter() - t0))
        return layer.dispatcher.track_output(torch.cat(outs, dim=d)), aux

    def _start_all(self, parts: list[tuple[torch.Tensor, RouteResult]]) -> list:
        """Plan the given parts (tokens [s, M], route) with one count exchange (`UnevenDispatcher.plan_parts`)
        and launch their token all-to-alls back to back, in part order; S2's padded dispatcher runs each
        whole part now (synchronous)."""
        d = self.dispatcher
        if not parts:
            return []
        with annotate("moe/dispatch"):
            if isinstance(d, UnevenDispatcher):
                plans = d.plan_parts([[route] for _, route in parts])
                for (tok_sM, _), plan in zip(parts, plans):
                    d.dispatch_start(tok_sM, plan)
                return [(plan, route, None) for plan, (_, route) in zip(plans, parts)]
        started = []
        for tok_sM, route in parts:
            with annotate("moe/dispatch"):
                padded = d.plan([route])
                x_in = d.dispatch(tok_sM, padded)
            y = self.block.moe.compute_experts(x_in, padded, d.grad_scale)
            started.append((padded, route, d.combine(y, padded)))
        return started

    def _finish(self, started: list, device: torch.device, side_end: list):
        """Experts of each part as its tokens arrive (launching the returns), then each part's combine,
        yielded in part order (the caller's post-ops of part i overlap later returns).

        CUDA: experts and return launches run on side stream "lancet-parts" (after the caller's
        stream), so NCCL waits for that part's experts only; the caller waits for each return at
        `combine_finish` and for `side_end` once after the post-ops."""
        d, experts, sx = self.dispatcher, self.block.moe.experts, self.sx
        if not isinstance(d, UnevenDispatcher):
            yield from (y for _, _, y in started)
            return
        cur, side = sx.current_stream(device), sx.side_stream(device, "lancet-parts")
        sx.wait_stream(side, cur)
        with sx.use(side):
            for plan, _, _ in started:
                sx.record_stream(plan.in_flight, side)  # the received tokens, allocated at launch: read here
                with annotate("moe/experts"):  # the received rows, each expert's rows together
                    y = experts.forward_ragged(d.dispatch_finish(plan), plan.expert_rows, d.grad_scale)
                d.combine_start(y, plan)
        side_end.append(sx.record_event(side))
        for plan, _, _ in started:
            sx.record_stream(plan.in_flight, cur)  # the returned rows, allocated on the side stream: read here
            with annotate("moe/combine"):
                y = d.combine_finish(plan)
            yield y
