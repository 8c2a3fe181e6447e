"""Token dispatchers: how routed tokens reach their experts' ranks and come back.

Legend: G routing groups, S tokens per group (S_l: this rank's slice), T tokens this rank
dispatches (G*S or G*S_l), M model dim, E experts (E_l = E / N_EP local), k choices per
token, C capacity, K kept choices, D = N_EP * N_ESP ranks of the EP x ESP group, N rows per
local expert in the expert input.

Steps, in order: plan(routes) -> plan; dispatch(x, plan) -> experts' input; combine(y, plan)
-> y [T, M]. `grad_scale`: factor of the experts' weight gradients (1/N_MP when the MP ranks
push identical tokens).

PaddedDispatcher (no host sync): one rank with every expert (`local_plan`) gathers tokens by
expert, rows ending at device offsets; else the capacity-padded buffer [E_l, N, M].
  "baseline" (DeepSpeed-MoE, Parm Fig. 3a): ESP all-gather, EP all-to-all, experts on their
    H/N_ESP slice, ESP all-reduce, EP all-to-all back, ESP split.
  "s2" (Parm S2): MP rank r keeps slots [r*C_mp, (r+1)*C_mp) of each expert; local dump, one
    EP x ESP all-to-all, experts, return all-to-all with local combine and MP all-gather,
    chunk-overlapped (SAA, `distributed.saa`) in forward and backward unless --no-moe-saa.
UnevenDispatcher (dropless, Parm S1, Lancet, Pro-Prophet): only kept tokens travel, as ragged
rows [R, M] grouped by expert (`UnevenPlan.expert_rows`), one host read of the exchanged
counts per layer forward. Launch and wait are split (`dispatch_start`/`_finish`,
`combine_start`/`_finish`). With a placement (`set_placement`) rows are grouped by the experts
the receiver computes (owned and replicas).

All-to-alls are `moe.a2a` handles "L{l}.moe.a2a_dispatch" / "a2a_combine"; `set_dw_queue`
runs deferred dW under their backward (Lancet). `track_input` / `track_output` tell listeners
(Lina) when the backward's combine step starts and when the layer's backward ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from megatron_moe import kernels
from megatron_moe.distributed import observer
from megatron_moe.distributed.collectives import all_gather, all_reduce, all_to_all_raw
from megatron_moe.distributed.saa import SAA_CHUNKS, a2a_combine_gather
from megatron_moe.moe import a2a
from megatron_moe.moe.router import RouteResult, count_per_expert

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


@dataclass
class DispatchIndex:
    """Kept choices: token index [K], buffer row e*C + c [K], weight [K]. `dropped`: every choice
    listed (no host sync), a dropped one at row -1 / weight 0, sent to a spare row and read as zero."""

    token: torch.Tensor
    row: torch.Tensor
    weight: torch.Tensor
    dropped: bool = False


def dispatch_index(
    route: RouteResult, capacity: Optional[int] = None, slot_base: int = 0, every_choice: bool = False
) -> DispatchIndex:
    """Kept choices of a routing result as flat buffer rows (`capacity`: row stride per expert,
    default the route's; `slot_base` shifts every slot: several groups side by side). `every_choice`:
    all S*k choices, dropped ones at row -1 (`DispatchIndex.dropped`), found without a host sync;
    otherwise the kept ones only, found with `nonzero` (a host sync on CUDA)."""
    cap = route.capacity if capacity is None else capacity
    k = route.slot.size(1)
    expert, slot = route.expert.reshape(-1), route.slot.reshape(-1)
    if every_choice:
        token = torch.arange(slot.numel(), device=slot.device).div(k, rounding_mode="floor")
        row = torch.where(slot >= 0, expert * cap + slot + slot_base, -1)
        return DispatchIndex(token, row, route.weight.reshape(-1), dropped=True)
    flat = (slot >= 0).nonzero().squeeze(1)  # kept choices in (token, choice) order, found once
    row = expert.index_select(0, flat) * cap + slot.index_select(0, flat)
    return DispatchIndex(
        flat.div(k, rounding_mode="floor"),
        row + slot_base if slot_base else row,
        route.weight.reshape(-1).index_select(0, flat),
    )


def dispatch(x_SM: torch.Tensor, idx: DispatchIndex, num_rows: int) -> torch.Tensor:
    """buf [num_rows, M] with x[token] at each kept row, zeros elsewhere (differentiable)."""
    row, rows = idx.row, num_rows
    if idx.dropped:  # dropped choices land in a spare row past the buffer, cut off below
        row, rows = torch.where(row >= 0, row, num_rows), num_rows + 1
    if kernels.use_triton(x_SM):  # CUDA + triton: the fused permute (kernels/permute.py)
        buf = kernels.permute(x_SM, idx.token, row, rows)
    else:
        buf = x_SM.new_zeros(rows, x_SM.size(1)).index_copy_(0, row, x_SM.index_select(0, idx.token))
    return buf[:num_rows] if idx.dropped else buf


def combine(buf_RM: torch.Tensor, idx: DispatchIndex, num_tokens: int) -> torch.Tensor:
    """y [S, M] = weighted sum of each token's kept rows of buf [R, M]. A dropped choice
    (`DispatchIndex.dropped`) reads row 0 with weight 0: it adds nothing."""
    row = torch.where(idx.row >= 0, idx.row, 0) if idx.dropped else idx.row
    if kernels.use_triton(buf_RM):  # CUDA + triton: the fused unpermute (kernels/permute.py)
        return kernels.unpermute(buf_RM, idx.token, row, idx.weight, num_tokens)
    return _Combine.apply(buf_RM, row, idx.token, idx.weight, num_tokens)


class _Combine(torch.autograd.Function):
    """`combine` as one autograd node (same values as gather, multiply, scatter). `row` None: choice i
    reads buffer row i."""

    @staticmethod
    def forward(ctx, buf_RM, row, token, weight, num_tokens):
        ctx.buf_shape = buf_RM.shape
        picked = buf_RM if row is None else buf_RM.index_select(0, row)
        rows = picked * weight[:, None].to(buf_RM.dtype)
        ctx.save_for_backward(picked, row, token, weight)
        return buf_RM.new_zeros(num_tokens, buf_RM.size(1)).index_add_(0, token, rows)

    @staticmethod
    def backward(ctx, g_SM):
        picked, row, token, weight = ctx.saved_tensors
        g_KM = g_SM.contiguous().index_select(0, token)
        d_buf = d_weight = None
        if ctx.needs_input_grad[0]:
            d_buf = g_KM * weight[:, None].to(g_KM.dtype)
            if row is not None:  # the rows no choice reads get zeros (what autograd's index_select backward gives)
                d_buf = g_KM.new_zeros(ctx.buf_shape).index_add_(0, row, d_buf)
        if ctx.needs_input_grad[3]:
            d_weight = (g_KM * picked).sum(1, keepdim=True).to(weight.dtype).squeeze(1)
        return d_buf, None, None, d_weight, None


class _PermuteRows(torch.autograd.Function):
    """x [R, M] -> x[perm] for a row permutation; backward g[inv]: one gather each way, no scatter."""

    @staticmethod
    def forward(ctx, x_RM, perm, inv):
        ctx.save_for_backward(inv)
        return x_RM.index_select(0, perm)

    @staticmethod
    def backward(ctx, g_RM):
        (inv,) = ctx.saved_tensors
        return g_RM.contiguous().index_select(0, inv), None, None


def combine_rows(y_KM: torch.Tensor, idx: DispatchIndex, num_tokens: int) -> torch.Tensor:
    """y [S, M] = weighted sum of each token's rows of y [K, M], row i belonging to kept choice i of `idx`."""
    return _Combine.apply(y_KM, None, idx.token, idx.weight, num_tokens)


class _Notify(torch.autograd.Function):
    """Identity forward; backward calls `fn()` (a point where backward tells listeners something)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


class _Listening:
    """Removes a listener from a dispatcher (what `add_listener` returns)."""

    def __init__(self, owner: "TokenDispatcher", listener):
        self.owner, self.listener = owner, listener

    def remove(self) -> None:
        if self.listener in self.owner.listeners:
            self.owner.listeners.remove(self.listener)


class TokenDispatcher:
    """What every dispatcher shares: groups, names of its all-to-alls, dW queue, listeners."""

    def __init__(self, ps: "ParallelState", num_experts: int, layer_idx: int, grad_scale: float):
        self.ps, self.num_experts, self.layer_idx, self.grad_scale = ps, num_experts, layer_idx, grad_scale
        self.n_ep, self.n_esp, self.n_mp = ps.size("ep"), ps.size("esp"), ps.size("mp")
        self.num_local = num_experts // self.n_ep
        self.dw = None
        self.listeners: list = []
        self.placement = None  # Pro-Prophet replicas of this iteration (`set_placement`)
        self.counts_sink = None  # Pro-Prophet's runtime: routed counts ride the count exchange

    @property
    def crosses_ranks(self) -> bool:
        """True when tokens leave this rank (there are all-to-alls to wait for)."""
        return self.n_ep * self.n_esp > 1

    def set_dw_queue(self, dw) -> None:
        """Run the deferred dW of a weight-gradient queue under this dispatcher's backward all-to-alls."""
        self.dw = dw

    def set_placement(self, placement) -> None:
        """Replicas for the next forwards (a `moe.placement.PlacedLayer`; None: every expert at its
        owner). Only the dropless UnevenDispatcher uses it."""
        self.placement = placement

    def set_counts_sink(self, sink) -> None:
        """Pro-Prophet: routed counts [E] ride on the count exchange; calls `sink.add_counts(layer,
        counts [D, E])`, then `sink.dispatch_in_flight(layer)` during the token all-to-all. None: off."""
        self.counts_sink = sink

    def a2a_name(self, step: str) -> str:
        return f"L{self.layer_idx}.moe.a2a_{step}"

    def add_listener(self, listener) -> _Listening:
        """`listener.a2a_imminent()` fires when backward reaches the combine step and
        `listener.moe_backward_done()` when the layer's backward is over; returns a handle to remove it."""
        self.listeners.append(listener)
        return _Listening(self, listener)

    def _imminent(self) -> None:
        for listener in list(self.listeners):
            listener.a2a_imminent()
        observer.a2a_queued()

    def _done(self) -> None:
        for listener in list(self.listeners):
            listener.moe_backward_done()

    def track_input(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's input: its gradient means the layer's backward (and its all-to-alls) is over."""
        if not (self.listeners and torch.is_grad_enabled() and x.requires_grad):
            return x
        return _Notify.apply(x, self._done)

    def track_output(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output: its gradient means backward reached the combine step."""
        if not (self.listeners and torch.is_grad_enabled() and y.requires_grad):
            return y
        return _Notify.apply(y, self._imminent)


# ----------------------------------------------------------------------------- padded buffer


@dataclass
class PaddedPlan:
    """Index of kept choices into the buffer [E, G*Cs]; Cs = slots per group (C, or N_MP*C_mp in S2).
    offs: one rank holds every expert (`local_plan`): no buffer, `idx` lists every choice sorted by buffer
    row and each local expert's rows end at offs[e] ([E] int32, on the device); None: the padded buffer."""

    idx: DispatchIndex
    groups: int
    slots: int
    tokens: int
    offs: Optional[torch.Tensor] = None


def local_plan(routes: list[RouteResult], num_experts: int, Cs: int) -> PaddedPlan:
    """Plan of one rank holding every expert, no host sync: all G*S*k choices, kept ones first in
    (expert, group, slot) order, dropped after (weight 0); `offs` [E] ends each expert's kept rows."""
    G, (S, k) = len(routes), routes[0].slot.shape
    dev = routes[0].slot.device
    GC = G * Cs
    keys, weights = [], []
    for g, r in enumerate(routes):
        kept = r.slot >= 0
        keys.append(torch.where(kept, r.expert * GC + g * Cs + r.slot, num_experts * GC).reshape(-1))
        weights.append(r.weight.reshape(-1))
    key = torch.cat(keys)
    order = torch.argsort(key, stable=True)  # kept rows ascending, then the dropped in choice order
    token = order.div(k, rounding_mode="floor")  # choice (g*S + s)*k + j belongs to token g*S + s
    counts = torch.stack([r.counts for r in routes]).sum(0)
    idx = DispatchIndex(token, key.index_select(0, order), torch.cat(weights).index_select(0, order))
    offs = torch.cumsum(counts, 0, dtype=torch.int32).to(dev)
    return PaddedPlan(idx, G, Cs, G * S, offs)


class PaddedDispatcher(TokenDispatcher):
    """Capacity-padded dispatch, "baseline" or "s2", or one rank's `local_plan` (module docstring)."""

    def __init__(
        self,
        ps: "ParallelState",
        num_experts: int,
        layer_idx: int,
        mode: str = "baseline",
        saa: bool = True,
        saa_chunks: int = SAA_CHUNKS,
    ):
        if mode not in ("baseline", "s2"):
            raise ValueError(f"unknown padded dispatch mode {mode!r}")
        super().__init__(ps, num_experts, layer_idx, 1.0 / ps.size("mp") if mode == "baseline" else 1.0)
        self.mode, self.saa, self.saa_chunks = mode, saa, saa_chunks

    def slots_per_group(self, capacity: int) -> int:
        """Buffer slots of one group: C, or C rounded up to a multiple of N_MP (S2)."""
        return capacity if self.mode == "baseline" else -(-capacity // self.n_mp) * self.n_mp

    @property
    def local_only(self) -> bool:
        """True when one rank holds every expert and the tokens are not split over MP: nothing travels, and
        the tokens go to the experts grouped by expert with no buffer (`local_plan`)."""
        return self.n_ep * self.n_esp == 1 and (self.mode == "baseline" or self.n_mp == 1)

    def plan(self, routes: list[RouteResult]) -> PaddedPlan:
        """`local_plan` when one rank holds every expert, else `padded_plan`."""
        if self.local_only:
            return local_plan(routes, self.num_experts, self.slots_per_group(routes[0].capacity))
        return self.padded_plan(routes)

    def padded_plan(self, routes: list[RouteResult]) -> PaddedPlan:
        """One index over the buffer holding every group side by side; every choice listed (a dropped one
        reads a zero row at weight 0), so no host sync."""
        G, S = len(routes), routes[0].slot.size(0)
        Cs = self.slots_per_group(routes[0].capacity)
        idxs = [dispatch_index(r, G * Cs, g * Cs, every_choice=True) for g, r in enumerate(routes)]
        if G == 1:
            return PaddedPlan(idxs[0], G, Cs, G * S)
        token = torch.cat([i.token + g * S for g, i in enumerate(idxs)])
        idx = DispatchIndex(token, torch.cat([i.row for i in idxs]), torch.cat([i.weight for i in idxs]), True)
        return PaddedPlan(idx, G, Cs, G * S)

    def dispatch(self, x_TM: torch.Tensor, plan: PaddedPlan) -> torch.Tensor:
        """Expert input: padded [E_l, N, M], or the tokens grouped by expert [G*S*k, M] (`local_plan`)."""
        if plan.offs is not None:
            return x_TM.index_select(0, plan.idx.token)
        E, M, GC = self.num_experts, x_TM.size(1), plan.groups * plan.slots
        buf = dispatch(x_TM, plan.idx, E * GC)
        if self.mode == "s2":
            ctx = _S2Ctx(self, plan.groups, plan.slots // self.n_mp)
            buf = buf.view(E, plan.groups, self.n_mp, ctx.C_mp, M)
            return a2a.dw_window(lambda b: _S2Dispatch.apply(b, ctx), buf, self.dw, self.a2a_name("dispatch"))
        E_l, n_ep, n_esp = self.num_local, self.n_ep, self.n_esp
        gathered = all_gather(buf.view(1, E, GC, M), self.ps.group("esp"), dim=0)  # [N_ESP, E, GC, M]
        send = gathered.transpose(0, 1).reshape(n_ep, E_l, n_esp, GC, M)  # by destination EP rank
        recv = a2a.run(send, a2a.A2AHandle(self.ps.group("ep"), name=self.a2a_name("dispatch"), dw=self.dw))
        return recv.permute(1, 0, 2, 3, 4).reshape(E_l, n_ep * n_esp * GC, M)

    def combine(self, y_LNM: torch.Tensor, plan: PaddedPlan) -> torch.Tensor:
        """y [T, M] from the experts' output (padded [E_l, N, M], or the `local_plan` rows)."""
        if plan.offs is not None:
            return combine_rows(y_LNM, plan.idx, plan.tokens)
        E, M, GC = self.num_experts, y_LNM.size(-1), plan.groups * plan.slots
        if self.mode == "s2":
            ctx = _S2Ctx(self, plan.groups, plan.slots // self.n_mp)
            out = a2a.dw_window(lambda y: _S2Return.apply(y, ctx), y_LNM, self.dw, self.a2a_name("combine"))
            return combine(out.reshape(E * GC, M), plan.idx, plan.tokens)
        E_l, n_ep, n_esp = self.num_local, self.n_ep, self.n_esp
        full = all_reduce(y_LNM, self.ps.group("esp"))  # sum of the H slices
        back = full.reshape(E_l, n_ep, n_esp, GC, M).permute(1, 0, 2, 3, 4).contiguous()
        ret = a2a.run(back, a2a.A2AHandle(self.ps.group("ep"), name=self.a2a_name("combine"), dw=self.dw))
        if n_esp > 1:
            ret = ret.reshape(E, n_esp, GC, M)[:, self.ps.rank("esp")]  # ESP split: our buffer
        return combine(ret.reshape(E * GC, M), plan.idx, plan.tokens)


class _S2Ctx:
    """What S2's all-to-alls need: groups, sizes, this rank's MP index, SAA switch."""

    def __init__(self, d: PaddedDispatcher, G: int, C_mp: int):
        self.a2a_group, self.mp_group = d.ps.group("ep_esp"), d.ps.group("mp")
        self.n_ep, self.n_esp, self.n_mp, self.r = d.n_ep, d.n_esp, d.n_mp, d.ps.rank("mp")
        self.E, self.G, self.C_mp, self.saa, self.chunks = d.num_experts, G, C_mp, d.saa, d.saa_chunks

    def dump_a2a(self, own_EGCM: torch.Tensor) -> torch.Tensor:
        """This rank's slots [E, G, C_mp, M] -> local dump -> all-to-all -> expert input [E_l, D*G*C_mp, M]."""
        E_l, M, GC = self.E // self.n_ep, own_EGCM.size(-1), self.G * self.C_mp
        own = own_EGCM.reshape(self.n_ep, 1, E_l, GC, M)
        send = own.expand(self.n_ep, self.n_esp, E_l, GC, M).reshape(self.n_ep * self.n_esp, E_l, GC, M)
        recv = all_to_all_raw(send.contiguous(), self.a2a_group)  # [D src, E_l, GC, M]
        return recv.permute(1, 0, 2, 3).reshape(E_l, -1, M)

    def a2a_gather(self, x_LRM: torch.Tensor) -> torch.Tensor:
        """Expert rows [E_l, D*G*C_mp, M] -> return all-to-all, local combine, MP all-gather
        -> the full buffer [E, G, N_MP, C_mp, M]."""
        E_l, _, M = x_LRM.shape
        send = x_LRM.reshape(E_l, self.n_ep * self.n_esp, self.G * self.C_mp, M).permute(1, 0, 2, 3).contiguous()
        full = a2a_combine_gather(
            send, self.a2a_group, self.mp_group, self.n_esp, overlap=self.saa, chunks=self.chunks
        )  # each all-to-all in it is a "moe/all_to_all" range
        return full.view(self.n_mp, self.E, self.G, self.C_mp, M).permute(1, 2, 0, 3, 4).contiguous()


class _S2Dispatch(torch.autograd.Function):
    """fwd: keep own slots (MP split), local dump, all-to-all; bwd: all-to-all, ESP sum, MP all-gather (SAA)."""

    @staticmethod
    def forward(ctx, buf_EGnCM, s2):
        ctx.s2 = s2
        return s2.dump_a2a(buf_EGnCM[:, :, s2.r])

    @staticmethod
    def backward(ctx, grad):
        return ctx.s2.a2a_gather(grad.contiguous()), None


class _S2Return(torch.autograd.Function):
    """fwd: return all-to-all, local combine, MP all-gather (SAA); bwd: own slots, local dump,
    all-to-all (the MP ranks combine alike, so this rank's slot gradient is complete here)."""

    @staticmethod
    def forward(ctx, partial_LRM, s2):
        ctx.s2 = s2
        return s2.a2a_gather(partial_LRM.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.s2.dump_a2a(grad[:, :, ctx.s2.r].contiguous()), None


# ----------------------------------------------------------------------------- uneven


def _host_counts(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list, list]]:
    """The (sent, received) count tensors [D, X'] of one or more plans as host lists of rows, read in one
    device-to-host copy (`tolist` of one tensor)."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for pair in pairs for t in pair]).tolist()
    out, at = [], 0
    for pair in pairs:
        rows = []
        for t in pair:
            D, W = t.shape
            rows.append([flat[at + d * W : at + (d + 1) * W] for d in range(D)])
            at += D * W
        out.append((rows[0], rows[1]))
    return out


@dataclass
class UnevenPlan:
    """Kept choices sorted by (expert, group, slot): token row [K], weight [K]; dump [R_send] (kept row
    of each send row, once per ESP shard); recv_row [R_recv] (row of each received token in the expert
    input [R_recv, M], a permutation) and recv_order its inverse; expert_rows: rows of each local (or,
    with a placement, compute) expert in that input; the handles of the two all-to-alls once started."""

    token: torch.Tensor
    weight: torch.Tensor
    dump: torch.Tensor
    recv_row: torch.Tensor
    recv_order: torch.Tensor
    expert_rows: list[int]
    tokens: int
    out: a2a.A2AHandle
    back: a2a.A2AHandle
    in_flight: Optional[torch.Tensor] = field(default=None, repr=False)


@dataclass
class _LocalPlan:
    """What `UnevenDispatcher._sort` computes before the counts travel, all on the device: every choice's
    token row and weight in send order (the kept ones first, the dropped after them), the counts [D, X] to
    send (+ [D, E] routed, with the counts sink), X columns per rank, and the routed tokens."""

    token: torch.Tensor
    weight: torch.Tensor
    send_counts: torch.Tensor
    X: int
    tokens: int


class UnevenDispatcher(TokenDispatcher):
    """Only kept tokens travel. `group_kind`: the token all-to-all group; `counts_group`: where the
    counts are exchanged (default that group); one host copy of the counts per plan."""

    def __init__(
        self,
        ps: "ParallelState",
        num_experts: int,
        layer_idx: int,
        grad_scale: float = 1.0,
        group_kind: str = "ep_esp",
        counts_group=None,
    ):
        super().__init__(ps, num_experts, layer_idx, grad_scale)
        self.group = ps.group(group_kind)
        self.counts_group = self.group if counts_group is None else counts_group

    @property
    def sinks_counts(self) -> bool:
        """True when the routed counts go to Pro-Prophet's counts sink with the count exchange (dropless)."""
        return self.counts_sink is not None

    def plan(self, routes: list[RouteResult]) -> UnevenPlan:
        """Sort the kept choices of every route (one per group of s tokens) and exchange counts (collective)."""
        local = self._sort(routes)
        recv = a2a.exchange_counts(local.send_counts, self.counts_group)
        ((sent, got),) = _host_counts([(local.send_counts, recv)])
        return self._complete(local, recv, sent, got)

    def plan_parts(self, parts: list[list[RouteResult]]) -> list[UnevenPlan]:
        """`plan` of each part (Lancet's partitions of one range) with one count exchange for all of them
        (collective): a count exchange per part would queue behind the previous part's tokens on the link.
        With the counts sink (Pro-Prophet) each part is planned on its own (one message per plan)."""
        if self.sinks_counts:
            return [self.plan(r) for r in parts]
        local = [self._sort(r) for r in parts]
        recv = a2a.exchange_counts(torch.cat([lp.send_counts for lp in local], dim=1), self.counts_group)
        widths = [lp.send_counts.size(1) for lp in local]
        pairs = list(zip([lp.send_counts for lp in local], recv.split(widths, dim=1)))
        host = _host_counts(pairs)  # one read for every part
        return [self._complete(lp, rc, s, g) for lp, (_, rc), (s, g) in zip(local, pairs, host)]

    def _sort(self, routes: list[RouteResult]) -> "_LocalPlan":
        """The part of `plan` that needs no other rank: every choice sorted by destination column (the kept
        ones by (column, group, slot), the dropped ones after them), and the counts to send."""
        G, (s, k) = len(routes), routes[0].slot.shape
        cap, E, n_esp = routes[0].capacity, self.num_experts, self.n_esp
        dev = routes[0].expert.device
        # column of each expert: destination EP rank * X + its place among the destination's experts
        # (no placement: the owner, X = E_l, column = expert); a placement may send to a replica
        col, X = (
            (torch.arange(E, device=dev), self.num_local)
            if self.placement is None
            else self.placement.columns(self.ps.rank("ep"), dev)
        )
        cols = self.n_ep * X
        keys, columns, weights = [], [], []
        for g, r in enumerate(routes):
            kept = r.slot >= 0
            c = col[r.expert]
            keys.append(torch.where(kept, c * (G * cap) + g * cap + r.slot, cols * G * cap).reshape(-1))
            columns.append(torch.where(kept, c, cols).reshape(-1))  # dropped: a column past the last
            weights.append(r.weight.reshape(-1))
        order = torch.argsort(torch.cat(keys), stable=True)
        per_col = count_per_expert(torch.cat(columns), cols + 1)[:cols]
        send_counts = per_col.view(self.n_ep, X).repeat_interleave(n_esp, dim=0)  # [D, X]
        if self.sinks_counts:  # this rank's routed counts [E] to every rank, in the same message
            routed_E = sum(count_per_expert(r.expert, E, r.slot >= 0) for r in routes)
            send_counts = torch.cat([send_counts, routed_E.expand(send_counts.size(0), E)], dim=1)
        token = order.div(k, rounding_mode="floor")  # choice (g*s + i)*k + j is token g*s + i's
        return _LocalPlan(token, torch.cat(weights).index_select(0, order), send_counts, X, G * s)

    def _complete(self, lp: "_LocalPlan", recv: torch.Tensor, sent_h: list, got_h: list) -> UnevenPlan:
        """The rest of `plan` once the counts [D, X] (+ [D, E] routed, with the sink) have arrived: `recv` on
        the device, `sent_h` / `got_h` the sent and received counts on the host (lists of rows)."""
        X, n_esp, dev = lp.X, self.n_esp, lp.token.device
        if self.sinks_counts:
            self.counts_sink.add_counts(
                self.layer_idx, torch.tensor([r[X:] for r in got_h], dtype=torch.int64, device="cpu")
            )
            recv, got_h, sent_h = recv[:, :X], [r[:X] for r in got_h], [r[:X] for r in sent_h]
        K_ep = [sum(sent_h[ep * n_esp]) for ep in range(self.n_ep)]  # kept choices for each EP rank
        K = sum(K_ep)
        starts = [sum(K_ep[:ep]) for ep in range(self.n_ep)]
        dump = torch.cat([torch.arange(a, a + n, device=dev) for a, n in zip(starts, K_ep) for _ in range(n_esp)])
        recv = recv.to(device=dev, dtype=torch.int64)
        per_expert_h = [sum(r[x] for r in got_h) for x in range(X)]  # rows received per column, on the host
        total = sum(per_expert_h)
        per_expert = recv.sum(dim=0)
        expert_base = per_expert.cumsum(0) - per_expert  # first row of each local expert: after experts < e
        flat = recv.reshape(-1)  # (source, expert) blocks
        block_pos = (recv.cumsum(dim=0) - recv).reshape(-1)  # rows of earlier sources

        def spread(t: torch.Tensor) -> torch.Tensor:  # each block's value on each of its rows
            return torch.repeat_interleave(t, flat, output_size=total)

        row = spread(expert_base.repeat(recv.size(0))) + spread(block_pos) + torch.arange(total, device=dev)
        row = row - spread(flat.cumsum(0) - flat)
        out = a2a.A2AHandle(
            self.group,
            [K_ep[ep] for ep in range(self.n_ep) for _ in range(n_esp)],
            [sum(r) for r in got_h],
            self.a2a_name("dispatch"),
            self.dw,
        )
        return UnevenPlan(
            lp.token[:K],
            lp.weight[:K],
            dump,
            row,
            torch.argsort(row),
            per_expert_h if self.placement is None else self.placement.expert_rows(per_expert_h),
            lp.tokens,
            out,
            out.reverse(self.a2a_name("combine")),
        )

    def dispatch_start(self, x_TM: torch.Tensor, plan: UnevenPlan) -> None:
        """Local dump of the kept tokens and launch of the all-to-all."""
        plan.in_flight = a2a.start(x_TM.index_select(0, plan.token.index_select(0, plan.dump)), plan.out)

    def dispatch_finish(self, plan: UnevenPlan) -> torch.Tensor:
        """Wait for the tokens; the expert input [R, M]: the received rows regrouped by expert (a permutation)."""
        recv, plan.in_flight = a2a.finish(plan.in_flight, plan.out), None
        return _PermuteRows.apply(recv, plan.recv_order, plan.recv_row)

    def combine_start(self, y_RM: torch.Tensor, plan: UnevenPlan) -> None:
        """Launch the return all-to-all of the experts' rows y [R, M], back in the received order."""
        plan.in_flight = a2a.start(_PermuteRows.apply(y_RM, plan.recv_row, plan.recv_order), plan.back)

    def combine_finish(self, plan: UnevenPlan) -> torch.Tensor:
        """Wait for the outputs; local combine of the N_ESP partials, then the weighted sum y [T, M]."""
        ret, plan.in_flight = a2a.finish(plan.in_flight, plan.back), None
        rows = ret.new_zeros(plan.token.numel(), ret.size(1)).index_add(0, plan.dump, ret)
        weighted = rows * plan.weight[:, None].to(ret.dtype)
        return ret.new_zeros(plan.tokens, ret.size(1)).index_add(0, plan.token, weighted)

    def dispatch(self, x_TM: torch.Tensor, plan: UnevenPlan) -> torch.Tensor:
        self.dispatch_start(x_TM, plan)
        if self.sinks_counts:  # Pro-Prophet plans under the all-to-all
            self.counts_sink.dispatch_in_flight(self.layer_idx)
        return self.dispatch_finish(plan)

    def combine(self, y_RM: torch.Tensor, plan: UnevenPlan) -> torch.Tensor:
        self.combine_start(y_RM, plan)
        return self.combine_finish(plan)
