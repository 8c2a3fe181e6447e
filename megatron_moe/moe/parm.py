"""Parm's schedules S1 and S2 (Pan et al., INFOCOM 2024): pause MP inside the MoE layer.

Legend: G routing groups in the call, S tokens per group, S_l = S / N_MP tokens of
one MP slice, M model dim, E experts (E_l = E / N_EP per EP rank), k choices per
token, C capacity, C_mp = ceil(C / N_MP) slots per expert one MP rank keeps in
S2, K kept choices of this rank, D = N_EP * N_ESP ranks of the EP x ESP group.

Both schedules process every token once (no MP duplicates), so expert weight
gradients are not scaled, and both use one all-to-all over the EP x ESP group:
  local dump:    each token bound for expert e is copied once per ESP shard of
                 e into the send buffer (replaces the ESP all-gather);
  local combine: after the return all-to-all the N_ESP partial outputs of a
                 token are summed (replaces ESP all-reduce + EP all-to-all + ESP split).

S1: each MP rank routes its slice of S_l tokens. Slots stay those of the whole
group: an all-gather of per-expert choice counts over MP gives each rank the
counts of the ranks before it (offsets) and the first-choice totals (top-2), so
kept and dropped tokens are exactly the baseline's. Batch-prioritized routing
needs the group's importance order instead: the ranks all-gather each token's
importance and choices, 4 * (1 + k) * S_l bytes per rank instead of 8 * k * E.
Each rank sends only the tokens it holds (uneven all-to-all; one small
all-to-all of counts first tells receivers the split sizes); the layer output
is all-gathered over MP after combine. Gate gradients are summed over MP; the
aux and z losses use the group's sums (one MP all-reduce of E + 1 floats per group).
`--moe-s1-local-capacity` routes each slice as its own group with capacity
C(S_l) (Parm's original S1): fewer collectives, but NOT equivalent to the baseline.

S2: every MP rank gates all S tokens (same routing as the baseline); rank r keeps
slots [r*C_mp, (r+1)*C_mp) of every expert (C is padded to N_MP * C_mp when
N_MP does not divide it: the pad slots are empty and cost (C_mp*N_MP - C)/C extra
bytes, routing is unchanged); EP&ESP all-to-all of [E, C_mp] slots; experts;
return all-to-all, local combine and MP all-gather, overlapped chunk by chunk
(SAA, `megatron_moe.distributed.saa`) unless `--no-moe-saa`; combine.
The backward of S2's dispatch is the same all-to-all -> ESP sum -> MP all-gather,
so SAA serves there too.
"""
from __future__ import annotations

import torch

from megatron_moe.distributed.collectives import (all_gather_raw, all_to_all, all_to_all_raw, gather_from_group,
                                                  reduce_from_group, scatter_to_group)
from megatron_moe.distributed.saa import SAA_CHUNKS, a2a_combine_gather
from megatron_moe.moe.dispatch import combine, dispatch, route_groups
from megatron_moe.moe.router import (aux_loss_from_terms, capacity, choice_counts, choose_experts_slice,
                                     finish_route, slot_positions, token_order)

# ----------------------------------------------------------------------------- EP&ESP exchange (uneven)


class UnevenPlan:
    """Index plan of one uneven EP&ESP exchange for K kept choices sorted by expert.

    dump_idx [R_send]: kept-choice row of each send row (each row once per ESP shard);
    in_splits / out_splits: rows to / from each of the D peers;
    recv_row [R_recv]: row of each received token in the padded expert input [E_l * N, M].
    """

    def __init__(self, expert_sorted_K: torch.Tensor, num_experts: int, ps):
        group = ps.group("ep_esp")
        n_ep, n_esp = ps.size("ep"), ps.size("esp")
        E_l = num_experts // n_ep
        dev = expert_sorted_K.device                    # collectives run on the model's device (NCCL: CUDA)
        per_ep_E = torch.bincount(expert_sorted_K, minlength=num_experts).view(n_ep, E_l)
        K_ep = per_ep_E.sum(dim=1).tolist()
        start, dump = 0, []
        for ep in range(n_ep):
            block = torch.arange(start, start + K_ep[ep])
            dump += [block] * n_esp                  # one copy per ESP shard of these experts
            start += K_ep[ep]
        self.dump_idx = torch.cat(dump).to(dev)
        self.in_splits = [K_ep[ep] for ep in range(n_ep) for _ in range(n_esp)]
        # receivers learn how many rows of each local expert every peer sends
        send_counts = per_ep_E.repeat_interleave(n_esp, dim=0).contiguous()       # [D, E_l]
        recv_counts = all_to_all_raw(send_counts, group).cpu()                     # [D src, E_l]
        self.out_splits = recv_counts.sum(dim=1).tolist()
        self.rows_per_expert = max(1, int(recv_counts.sum(dim=0).max()))
        flat = recv_counts.reshape(-1)                                             # (src, expert) blocks
        block_expert = torch.arange(E_l).repeat(recv_counts.size(0))
        block_pos = (recv_counts.cumsum(dim=0) - recv_counts).reshape(-1)          # rows of earlier sources
        block_first = flat.cumsum(0) - flat
        total = int(flat.sum())
        within = torch.arange(total) - torch.repeat_interleave(block_first, flat)
        row = (torch.repeat_interleave(block_expert, flat) * self.rows_per_expert
               + torch.repeat_interleave(block_pos, flat) + within)
        self.recv_row = row.to(dev)
        self.num_local = E_l


def ep_esp_uneven(rows_KM: torch.Tensor, plan: UnevenPlan, layer) -> torch.Tensor:
    """Send kept-choice rows [K, M] to their experts' shards, run experts, return [K, M] outputs.

    Local dump, uneven all-to-all, experts on a zero-padded [E_l, N, M] input
    (padding rows get zero gradient and are never sent back), return all-to-all,
    local combine (index_add sums the N_ESP partials of each row).
    """
    group, M = layer.ps.group("ep_esp"), rows_KM.size(1)
    send = rows_KM.index_select(0, plan.dump_idx)
    recv = all_to_all(send, group, plan.out_splits, plan.in_splits)
    x_in = recv.new_zeros(plan.num_local * plan.rows_per_expert, M).index_copy(0, plan.recv_row, recv)
    partial = layer.experts(x_in.view(plan.num_local, plan.rows_per_expert, M))
    back = partial.reshape(-1, M).index_select(0, plan.recv_row)
    ret = all_to_all(back, group, plan.in_splits, plan.out_splits)
    return rows_KM.new_zeros(rows_KM.shape).index_add(0, plan.dump_idx, ret)

# ----------------------------------------------------------------------------- S1 routing


def _offsets_and_totals(experts, E: int, ps):
    """Position / random policy: MP all-gather of the [G, k, E] choice counts.

    Returns (offset [G, k, E] of this rank, first-choice totals [G, E], all choices [G, E]).
    """
    counts = torch.stack([choice_counts(e, E) for e in experts])                   # [G, k, E]
    every = all_gather_raw(counts[None].contiguous(), ps.group("mp"), dim=0)       # [N_MP, G, k, E]
    r = ps.rank("mp")
    return every[:r].sum(dim=0), every[:, :, 0].sum(dim=0), every.sum(dim=(0, 2))


def _s1_slots(layer, gates, experts, S: int):
    """Slots [S_l, k] per group, capacity, first-choice totals [G, E], kept counts [G, E] of the group."""
    ps, E, k, policy = layer.ps, layer.num_experts, layer.k, layer.policy
    G, S_l = len(experts), experts[0].size(0)
    if layer.s1_local_capacity:
        cap = capacity(S_l, E, k, layer.cf, layer.min_cap)
        pos = [slot_positions(e, E, token_order(gt, e, policy)) for gt, e in zip(gates, experts)]
        kept = torch.stack([torch.bincount(e[p < cap], minlength=E) for e, p in zip(experts, pos)])
        counts = torch.stack([choice_counts(e, E)[0] for e in experts])
        both = all_gather_raw(torch.stack([counts, kept], dim=1)[None].contiguous(), ps.group("mp"), dim=0)
        return pos, cap, both[:, :, 0].sum(dim=0), both[:, :, 1].sum(dim=0)
    cap = capacity(S, E, k, layer.cf, layer.min_cap)
    if policy == "batch_prioritized":
        # the group's importance order decides the slots: gather importance and choices
        packed = torch.stack([torch.cat([gt.gather(1, e[:, :1]), e.float()], dim=1) for gt, e in zip(gates, experts)])
        full = all_gather_raw(packed.detach().contiguous(), ps.group("mp"), dim=1)  # [G, S, 1 + k]
        r, pos, first, kept = ps.rank("mp"), [], [], []
        for g in range(G):
            e_full = full[g, :, 1:].long()
            pos_full = slot_positions(e_full, E, torch.sort(-full[g, :, 0], stable=True).indices)
            pos.append(pos_full[r * S_l:(r + 1) * S_l])
            first.append(torch.bincount(e_full[:, 0], minlength=E))
            kept.append(torch.bincount(e_full[pos_full < cap], minlength=E))
        return pos, cap, torch.stack(first), torch.stack(kept)
    offset, first, total = _offsets_and_totals(experts, E, ps)
    pos = [slot_positions(e, E, None, offset[g], first[g]) for g, e in enumerate(experts)]
    # an expert's choices hold positions 0 .. total-1 in the group, so min(total, C) are kept
    return pos, cap, first, total.clamp(max=cap)


def s1_route(layer, x_l_GSM: torch.Tensor, S: int):
    """Route this rank's slices [G, S_l, M] with the whole groups' slots.

    Returns (routes of the slices, aux loss) and sets `layer.last_stats` to the
    whole groups' counts.
    """
    ps, E, k = layer.ps, layer.num_experts, layer.k
    G, S_l, _ = x_l_GSM.shape
    start = ps.rank("mp") * S_l
    logits = [layer.gate_logits(x_l_GSM[g], split_over_mp=True) for g in range(G)]
    chosen = [choose_experts_slice(lg, k, layer.policy, layer.generator(g), start, S) for g, lg in enumerate(logits)]
    gates, experts = [c[0] for c in chosen], [c[1] for c in chosen]
    pos, cap, first, kept = _s1_slots(layer, gates, experts, S)
    # aux and z losses from the groups' sums: reduce_from_group keeps the gradient local,
    # so the MP sum of gate-weight gradients (copy_to_group in gate_logits) counts it once
    terms = [torch.stack([gt.sum(dim=0) for gt in gates])]                        # [G, E]
    if layer.z_coeff:
        terms.append(torch.stack([torch.logsumexp(lg.float(), dim=-1).pow(2).sum() for lg in logits])[:, None])
    summed = reduce_from_group(torch.cat(terms, dim=1), ps.group("mp"))
    aux, routes = [], []
    for g in range(G):
        aux_g = aux_loss_from_terms(summed[g, :E], first[g].float(), S, k)
        z_g = summed[g, E] / S * layer.z_coeff if layer.z_coeff else summed.new_zeros(())
        aux.append(layer.aux_coeff * aux_g + z_g)
        routes.append(finish_route(gates[g], experts[g], pos[g], cap, aux_g, z_g))
    counts = kept.sum(dim=0).detach().cpu()
    layer.last_stats = {"counts": counts, "dropped": G * S * k - int(counts.sum()), "choices": G * S * k}
    return routes, torch.stack(aux).mean()


def s1(layer, x_GSM: torch.Tensor):
    """Parm S1: MP split -> gate and route (global slots) -> EP&ESP all-to-all -> experts
    -> return all-to-all -> combine -> MP all-gather. x [G, S, M] -> (y [G, S, M], aux)."""
    ps = layer.ps
    G, S, M = x_GSM.shape
    n_mp = ps.size("mp")
    if S % n_mp:
        raise ValueError(f"--moe-schedule s1 needs the tokens of a micro-batch ({S} = --micro-batch-size x "
                         f"--seq-length) divisible by --tensor-model-parallel-size {n_mp}")
    S_l = S // n_mp
    x_l = scatter_to_group(x_GSM, ps.group("mp"), dim=1)                            # [G, S_l, M]
    routes, aux = s1_route(layer, x_l, S)
    cap = routes[0].capacity
    kept = [rt.slot >= 0 for rt in routes]
    token = torch.cat([torch.arange(S_l, device=x_GSM.device)[:, None].expand(S_l, layer.k)[m] + g * S_l
                       for g, m in enumerate(kept)])
    expert = torch.cat([rt.expert[m] for rt, m in zip(routes, kept)])
    key = torch.cat([rt.expert[m] * (G * cap) + g * cap + rt.slot[m] for g, (rt, m) in enumerate(zip(routes, kept))])
    weight = torch.cat([rt.weight[m] for rt, m in zip(routes, kept)])
    order = torch.argsort(key)                                                     # by expert, group, slot
    token, expert, weight = token[order], expert[order], weight[order]
    plan = UnevenPlan(expert, layer.num_experts, ps)
    x_flat = x_l.reshape(G * S_l, M)
    out = ep_esp_uneven(x_flat.index_select(0, token), plan, layer)
    y_l = x_flat.new_zeros(G * S_l, M).index_add(0, token, out * weight[:, None].to(out.dtype))
    return gather_from_group(y_l.view(G, S_l, M), ps.group("mp"), dim=1), aux

# ----------------------------------------------------------------------------- S2


class _S2Ctx:
    """What the S2 autograd functions need: groups, sizes, this rank's MP index, SAA switch."""

    def __init__(self, layer, G: int, C_mp: int):
        ps = layer.ps
        self.a2a_group, self.mp_group = ps.group("ep_esp"), ps.group("mp")
        self.n_ep, self.n_esp, self.n_mp, self.r = ps.size("ep"), ps.size("esp"), ps.size("mp"), ps.rank("mp")
        self.E, self.G, self.C_mp = layer.num_experts, G, C_mp
        self.saa = layer.saa
        self.chunks = getattr(layer, "saa_chunks", SAA_CHUNKS)

    def dump_a2a(self, own_EGCM: torch.Tensor) -> torch.Tensor:
        """This rank's slots [E, G, C_mp, M] -> local dump -> all-to-all -> expert input [E_l, D*G*C_mp, M]."""
        E_l, M = self.E // self.n_ep, own_EGCM.size(-1)
        GC = self.G * self.C_mp
        own = own_EGCM.reshape(self.n_ep, 1, E_l, GC, M)
        send = own.expand(self.n_ep, self.n_esp, E_l, GC, M).reshape(self.n_ep * self.n_esp, E_l, GC, M)
        recv = all_to_all_raw(send.contiguous(), self.a2a_group)                    # [D src, E_l, GC, M]
        return recv.permute(1, 0, 2, 3).reshape(E_l, -1, M)

    def a2a_gather(self, x_LRM: torch.Tensor) -> torch.Tensor:
        """Expert-side rows [E_l, D*G*C_mp, M] -> return all-to-all, local combine, MP all-gather
        -> the full buffer [E, G, N_MP, C_mp, M]."""
        E_l, _, M = x_LRM.shape
        D = self.n_ep * self.n_esp
        send = x_LRM.reshape(E_l, D, self.G * self.C_mp, M).permute(1, 0, 2, 3).contiguous()
        full = a2a_combine_gather(send, self.a2a_group, self.mp_group, self.n_esp, overlap=self.saa,
                                  chunks=self.chunks)
        return full.view(self.n_mp, self.E, self.G, self.C_mp, M).permute(1, 2, 0, 3, 4).contiguous()


class _S2DispatchAllToAll(torch.autograd.Function):
    """fwd: keep own slots (MP split), local dump, all-to-all; bwd: all-to-all, ESP sum, MP all-gather (SAA)."""

    @staticmethod
    def forward(ctx, buf_EGnCM, s2):
        ctx.s2 = s2
        return s2.dump_a2a(buf_EGnCM[:, :, s2.r])

    @staticmethod
    def backward(ctx, grad):
        return ctx.s2.a2a_gather(grad.contiguous()), None


class _S2ReturnAllToAll(torch.autograd.Function):
    """fwd: return all-to-all, local combine, MP all-gather (SAA); bwd: own slots, local dump, all-to-all.

    The gathered buffer feeds a combine that every MP rank computes alike, so the
    gradient of this rank's slots is complete here (gather_from_group semantics).
    """

    @staticmethod
    def forward(ctx, partial_LRM, s2):
        ctx.s2 = s2
        return s2.a2a_gather(partial_LRM.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.s2.dump_a2a(grad[:, :, ctx.s2.r].contiguous()), None


def s2(layer, x_GSM: torch.Tensor):
    """Parm S2: gate all tokens -> keep own 1/N_MP of every expert's slots -> EP&ESP all-to-all
    -> experts -> return all-to-all || MP all-gather (SAA) -> combine. x [G, S, M] -> (y [G, S, M], aux)."""
    G, S, M = x_GSM.shape
    n_mp, E = layer.ps.size("mp"), layer.num_experts
    C_mp = -(-capacity(S, E, layer.k, layer.cf, layer.min_cap) // n_mp)
    routes, idx, _, aux = route_groups(layer, x_GSM, slots_per_group=C_mp * n_mp)
    buf = dispatch(x_GSM.reshape(G * S, M), idx, E * G * C_mp * n_mp).view(E, G, n_mp, C_mp, M)
    s2ctx = _S2Ctx(layer, G, C_mp)
    x_in = _S2DispatchAllToAll.apply(buf, s2ctx)
    partial = layer.experts(x_in)
    out = _S2ReturnAllToAll.apply(partial, s2ctx)
    y = combine(out.reshape(E * G * C_mp * n_mp, M), idx, G * S)
    return y.view(G, S, M), aux
