"""Lancet's operator partition pipelining around an MoE layer.

Legend: B batch, T sequence, M model dim, S = B*T tokens of the routing group
(one data-parallel rank's micro-batch), s tokens of one part, E experts,
E_l = E / N_EP local experts, K experts per token, C capacity of the whole
group, D ranks of the token all-to-all group (EP, or EP x ESP).

A `RangeSpec` names a range of ops around MoE block l, run as k parts along
the batch:
  start "attn"  block l's attention sub-block, ln2, the gate, ... (per-part gate)
        "ln2"   ln2, the gate, ...                                (per-part gate)
        "gate"  the gate on the whole batch, then dispatch, ...   (any gate)
  end   "block"     after the MoE output's residual add (block l's output)
        "next_attn" also block l+1's attention sub-block
Each part is cut into stages of consecutive compute or communication:
  A pre-ops, routing, dispatch pack | B token all-to-all | C experts |
  D return all-to-all | E combine and post-ops,
and the pipeline runs them stage by stage, parts in index order within a
stage (A0 A1 .. C0 C1 .. E0 E1 ..), the all-to-alls asynchronously, so part
i's messages are in flight while other parts compute (the order Lancet's
simulator assumes, `simulator.py`). Backward overlaps the same way: each
all-to-all's reverse is launched in one autograd node and waited for in a
later one (`irregular_a2a.py`).

Exactness:
  - capacity-passing gating: part i's choice-j slots of expert e start after
    the choice-j tokens of e in parts < i (`slot_positions(offset_kE=...)`),
    with C computed for the whole group, so every token gets the slot, and
    the drop, of the unpartitioned run. Top-2's second-choice slots add the
    whole group's first-choice count, and batch-prioritized slots follow the
    importance order of the whole group: both need every part's gate before
    part 0 can be dispatched, so those gates run on the whole batch and the
    range must start at the gate ("gate"). Random routing draws the keys of
    the whole group and keeps each part's rows (`choose_experts_slice`).
  - the irregular all-to-all sends each part's kept tokens only; experts
    run row-wise, so a token's expert output does not depend on which other
    tokens share its buffer;
  - the aux loss is computed from sums over all parts (gate means and
    first-choice counts of the whole group), the z-loss from the per-part
    sums of logsumexp^2.
Outputs and gradients equal the unpartitioned run to fp32 round-off; drops
and slots are identical. Dropout must be 0 for equality (parts draw their
masks separately).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_moe.lancet import irregular_a2a as ia
from megatron_moe.moe.dispatch import DispatchIndex, combine
from megatron_moe.profiling import annotate
from megatron_moe.moe.router import (RouteResult, aux_loss_from_terms, aux_loss_terms, capacity,
                                     choice_counts, choose_experts_slice, finish_route, slot_positions,
                                     token_order, z_loss_of)

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
    return layer.k == 2 or layer.policy == "batch_prioritized"


@dataclass
class _Part:
    """Per-part state between stages: the route, send/receive plans and messages in flight."""

    s: int
    route: RouteResult
    token: torch.Tensor          # [K_kept] kept choices' token index (token-major order)
    weight: torch.Tensor         # [K_kept] their combine weights (differentiable)
    combine_row: torch.Tensor    # [K_kept * n_esp] row of each (choice, ESP copy) in the returned rows
    recv_cnt: torch.Tensor = None    # [D, E_l] rows received from each source for each local expert
    op_in: ia.IrregularA2A = None
    op_out: ia.IrregularA2A = None
    recv: torch.Tensor = None
    back: torch.Tensor = None


class MoECall:
    """One forward of one MoE layer split into parts: routing, dispatch, experts, combine per part."""

    def __init__(self, layer, S: int, counts_group, wgrad=None):
        ps = layer.ps
        self.layer, self.S, self.counts_group, self.wgrad = layer, S, counts_group, wgrad
        self.E, self.K = layer.num_experts, layer.k
        self.n_ep, self.n_esp, self.n_mp = ps.size("ep"), ps.size("esp"), ps.size("mp")
        self.E_l = self.E // self.n_ep
        self.group = ps.group("ep") if self.n_esp == 1 else ps.group("ep_esp")
        self.D = self.n_ep * self.n_esp
        self.C = capacity(S, self.E, self.K, layer.cf, layer.min_cap)
        self.routes: list[RouteResult] = []
        self._offsets = torch.zeros(self.K, self.E, dtype=torch.int64)
        self._next_token = 0
        self._gate_sum = self._first_cnt = None
        self._z_sum = None
        self._whole: Optional[RouteResult] = None
        self._aux: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ routing
    def route_whole(self, h_SM: torch.Tensor) -> None:
        """Route the whole group at once, exactly as the baseline schedule does."""
        r = self.layer.route(self.layer.gate_logits(h_SM), 0)
        self._whole = r
        self._aux = torch.stack([self.layer.aux_of(r)]).mean()

    def part_route(self, s: int, h_sM: Optional[torch.Tensor] = None) -> RouteResult:
        """Route of the next part of s tokens: a slice of the whole route, or capacity-passing gating."""
        lo = self._next_token
        self._next_token += s
        if self._whole is not None:
            w = self._whole
            r = RouteResult(w.expert[lo:lo + s], w.slot[lo:lo + s], w.weight[lo:lo + s], w.capacity,
                            w.aux_loss, w.z_loss, w.counts, w.gates[lo:lo + s])
        else:
            r = self._route_part(h_sM, lo)
        self.routes.append(r)
        return r

    def _route_part(self, h_sM: torch.Tensor, lo: int) -> RouteResult:
        layer = self.layer
        if needs_whole_batch_gate(layer):
            raise ValueError(f"layer {layer.layer_idx}: top-{layer.k} {layer.policy} routing needs the whole "
                             "batch's gate; a partitioned range must start at the gate")
        logits = layer.gate_logits(h_sM)
        # a fresh generator per part: every part draws the whole group's keys and keeps its rows
        gates, expert = choose_experts_slice(logits, self.K, layer.policy, layer.generator(0), lo, self.S)
        pos = slot_positions(expert, self.E, token_order(gates, expert, layer.policy), offset_kE=self._offsets)
        self._offsets += choice_counts(expert, self.E).cpu()
        zero = logits.new_zeros((), dtype=torch.float32)
        r = finish_route(gates, expert, pos, self.C, zero, zero)
        gate_sum, first_cnt, _ = aux_loss_terms(gates, expert)
        self._gate_sum = gate_sum if self._gate_sum is None else self._gate_sum + gate_sum
        self._first_cnt = first_cnt if self._first_cnt is None else self._first_cnt + first_cnt
        if layer.z_coeff:
            z = z_loss_of(logits) * h_sM.size(0)            # sum over the part's tokens
            self._z_sum = z if self._z_sum is None else self._z_sum + z
        return r

    def aux(self) -> torch.Tensor:
        """The layer's aux loss (coeff * load balancing + z-loss) over the whole group."""
        if self._aux is not None:
            return self._aux
        layer = self.layer
        lb = aux_loss_from_terms(self._gate_sum, self._first_cnt, self.S, self.K)
        z = self._z_sum / self.S * layer.z_coeff if self._z_sum is not None else lb.new_zeros(())
        return layer.aux_coeff * lb + z

    def finish_stats(self) -> torch.Tensor:
        """Record counts/drops on the layer like the baseline; returns the slots [S, K] of the group."""
        if self._whole is not None:
            self.layer.record_stats([self._whole])
            return self._whole.slot.detach()
        self.layer.record_stats(self.routes)
        return torch.cat([r.slot for r in self.routes]).detach()

    # ------------------------------------------------------------------ stage A end: pack and send
    @annotate("lancet/part")
    def dispatch(self, x_sM: torch.Tensor, r: RouteResult) -> _Part:
        """Pack the part's kept tokens by destination, exchange counts, launch the token all-to-all."""
        s, K = r.slot.shape
        E_l, n_ep, n_esp, C = self.E_l, self.n_ep, self.n_esp, self.C
        kept = r.slot >= 0
        token = torch.arange(s, device=r.slot.device)[:, None].expand(s, K)[kept]
        expert = r.expert[kept]
        order = torch.argsort(expert * C + r.slot[kept])            # by (expert, slot): rows are unique
        cnt_E = torch.bincount(expert, minlength=self.E).cpu()
        cnt_ep = cnt_E.view(n_ep, E_l).sum(1)                        # [N_EP] rows per destination EP rank
        ep_start = cnt_ep.cumsum(0) - cnt_ep
        send_splits = cnt_ep.repeat_interleave(n_esp)                # every ESP rank of an EP rank gets them
        dup_start = send_splits.cumsum(0) - send_splits
        sorted_tok = token[order]
        if n_esp == 1:
            send_index = sorted_tok
        else:
            send_index = torch.cat([sorted_tok[ep_start[e]:ep_start[e] + cnt_ep[e]]
                                    for e in range(n_ep) for _ in range(n_esp)])
        # where each kept choice (token-major order, like dispatch_index) comes back
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        ep_of = expert // E_l
        within = inv - ep_start.to(inv.device)[ep_of]
        combine_row = torch.cat([dup_start.to(inv.device)[ep_of * n_esp + j] + within for j in range(n_esp)])
        part = _Part(s, r, token, r.weight[kept], combine_row)
        recv_cnt = ia.exchange_counts(cnt_E.view(n_ep, E_l).repeat_interleave(n_esp, dim=0), self.counts_group)
        l = self.layer.layer_idx
        part.op_in = ia.IrregularA2A(self.group, send_splits.tolist(), recv_cnt.sum(1).tolist(),
                                     max_rows=self.D * E_l * C, name=f"L{l}.moe.a2a_dispatch", wgrad=self.wgrad)
        part.recv_cnt = recv_cnt
        part.recv = ia.start(x_sM.index_select(0, send_index.to(x_sM.device)), part.op_in)
        return part

    # ------------------------------------------------------------------ stage C: experts
    @annotate("lancet/part")
    def run_experts(self, part: _Part) -> None:
        """Wait for the part's tokens, run the local experts on them, launch the return all-to-all."""
        rows = ia.finish(part.recv, part.op_in)
        cnt = part.recv_cnt                                           # [D, E_l] from source d for expert e
        E_l, M = self.E_l, rows.size(1)
        per_expert = cnt.sum(0)
        N = int(per_expert.max()) if per_expert.numel() else 0
        flat = cnt.flatten()                                         # rows arrive (source, expert, slot)-sorted
        e_of_row = torch.arange(E_l).repeat(self.D).repeat_interleave(flat)
        base = (cnt.cumsum(0) - cnt).flatten().repeat_interleave(flat)
        block_start = (flat.cumsum(0) - flat).repeat_interleave(flat)
        q = torch.arange(int(flat.sum())) - block_start
        dest = (e_of_row * N + base + q).to(rows.device)
        x_in = rows.new_zeros(E_l * N, M).index_copy(0, dest, rows).view(E_l, N, M)
        partial = self.layer.experts(x_in, grad_scale=1.0 / self.n_mp)    # [E_l, N, M]
        back_send = partial.reshape(E_l * N, M).index_select(0, dest)
        l = self.layer.layer_idx
        part.op_out = ia.IrregularA2A(self.group, part.op_in.recv_splits, part.op_in.send_splits,
                                      max_rows=self.n_esp * part.s * self.K, name=f"L{l}.moe.a2a_combine",
                                      wgrad=self.wgrad)
        part.recv = None
        part.back = ia.start(back_send, part.op_out)

    # ------------------------------------------------------------------ stage E: combine
    @annotate("lancet/part")
    def combine(self, part: _Part) -> torch.Tensor:
        """Wait for the part's expert outputs and combine them into y [s, M]."""
        back = ia.finish(part.back, part.op_out)
        n = self.n_esp
        idx = DispatchIndex(part.token.repeat(n).to(back.device), part.combine_row.to(back.device),
                            part.weight.repeat(n))
        part.back = None
        return combine(back, idx, part.s)


# ---------------------------------------------------------------------- block forwards

def attn_residual(block, x: torch.Tensor) -> torch.Tensor:
    """The attention sub-block of a pre-LN Block: x + drop(attn(ln1(x)))."""
    return x + block.drop(block.attn(block.ln1(x)))


def ffn_residual(block, x: torch.Tensor):
    """The second half of a Block: (x + drop(ffn(ln2(x))), aux or None)."""
    h = block.ln2(x)
    if block.is_moe:
        y, aux = block.moe(h)
    else:
        y, aux = block.mlp(h), None
    return x + block.drop(y), aux


def skip_attn_forward(block, x: torch.Tensor):
    """A Block whose attention sub-block already ran in the previous block's range."""
    return ffn_residual(block, x)


def partitioned_block_forward(block, nxt, spec: RangeSpec, skip_attn: bool, counts_group, wgrad,
                              timings: Optional[list], x: torch.Tensor):
    """Run MoE block `block` (and, for end 'next_attn', `nxt`'s attention) as spec.k batch parts.

    x [B, T, M] -> (out [B, T, M], aux). `skip_attn`: block's attention already
    ran (the previous range ended with it). Appends the wall time in ms to `timings`.
    """
    t0 = time.perf_counter()
    layer = block.moe
    if layer.routing_groups != 1:
        raise ValueError("Lancet partitioning needs one routing group per rank (routing_groups == 1)")
    if spec.start == "attn" and skip_attn:
        raise ValueError(f"range of layer {spec.layer} starts at its attention, which the previous range ran")
    B, T, M = x.shape
    k = min(spec.k, B)
    call = MoECall(layer, B * T, counts_group, wgrad)
    if spec.start != "attn":                      # ops before the start run on the whole batch
        x = x if skip_attn else attn_residual(block, x)
    x_parts = list(torch.tensor_split(x, k, dim=0))
    if spec.start == "gate":
        h = block.ln2(x)
        call.route_whole(h.reshape(B * T, M))
        h_parts = list(torch.tensor_split(h, k, dim=0))
    parts, res = [], []
    for i in range(k):                            # stage A, then B in flight
        xi = attn_residual(block, x_parts[i]) if spec.start == "attn" else x_parts[i]
        hi = h_parts[i] if spec.start == "gate" else block.ln2(xi)
        tok = hi.reshape(-1, M)
        r = call.part_route(tok.size(0), tok)
        res.append(xi)
        parts.append(call.dispatch(tok, r))
    for part in parts:                            # stage C, then D in flight
        call.run_experts(part)
    outs = []
    for i, part in enumerate(parts):              # stage E
        y = call.combine(part).view(res[i].shape)
        out = res[i] + block.drop(y)
        outs.append(attn_residual(nxt, out) if spec.end == "next_attn" else out)
    layer.lancet_last_slot = call.finish_stats()
    aux = call.aux()
    layer._calls += 1
    if timings is not None:
        timings.append(1e3 * (time.perf_counter() - t0))
    return torch.cat(outs, dim=0), aux
