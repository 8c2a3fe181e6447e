"""Parm's S1 routing (Pan et al., INFOCOM 2024): each MP rank routes 1/N_MP of a group's tokens.

Legend: G routing groups in the call, S tokens per group, S_l = S / N_MP tokens of
one MP slice, E experts, k choices per token, C capacity.

S1 and S2 pause MP inside the MoE layer and use one all-to-all over the EP x ESP group
(`moe.dispatcher`: S2 is the padded dispatcher's "s2" mode, S1 the uneven dispatcher). Both
process every token once (no MP duplicates), so expert weight gradients are not scaled.

S1's slots stay those of the whole group: an all-gather of per-expert choice counts over MP gives
each rank the counts of the ranks before it (offsets) and the first-choice totals (top-2), and
`Router.route_slice` places the slice with them ("capacity passing"), so kept and dropped tokens
are exactly the baseline's. Batch-prioritized routing needs the group's importance order instead:
the ranks all-gather each token's importance and choices, 4 * (1 + k) * S_l bytes per rank
instead of 8 * k * E. Gate gradients are summed over MP; the aux and z losses use the group's sums
(one MP all-reduce of E + 1 floats per group). The layer output is all-gathered over MP after
combine. `--moe-s1-local-capacity` routes each slice as its own group with capacity C(S_l)
(Parm's original S1): fewer collectives, but NOT equivalent to the baseline.
"""

from __future__ import annotations

import torch

from megatron_moe.distributed.collectives import all_gather_raw, reduce_from_group
from megatron_moe.moe.router import Router, choice_counts, count_per_expert, finish_route, slot_positions


def _s1_slots(router: Router, gates: list, experts: list, S: int, local_capacity: bool):
    """Routes of this rank's slices, first-choice totals [G, E] and kept counts [G, E] of the groups."""
    ps, E = router.ps, router.num_experts
    G, S_l, r = len(experts), experts[0].size(0), ps.rank("mp")
    if local_capacity:
        routes = [router.route_slice(gt, e, S_l) for gt, e in zip(gates, experts)]
        mine = torch.stack([torch.stack([choice_counts(e, E)[0], rt.counts]) for e, rt in zip(experts, routes)])
        both = all_gather_raw(mine[None].contiguous(), ps.group("mp"), dim=0)  # [N_MP, G, 2, E]
        return routes, both[:, :, 0].sum(dim=0), both[:, :, 1].sum(dim=0)
    cap = router.capacity(S)
    if router.policy == "batch_prioritized":
        # the group's importance order decides the slots: gather importance and choices
        packed = torch.stack([torch.cat([gt.gather(1, e[:, :1]), e.float()], dim=1) for gt, e in zip(gates, experts)])
        full = all_gather_raw(packed.detach().contiguous(), ps.group("mp"), dim=1)  # [G, S, 1 + k]
        routes, first, kept = [], [], []
        for g in range(G):
            e_full = full[g, :, 1:].long()
            pos_full = slot_positions(e_full, E, torch.sort(-full[g, :, 0], stable=True).indices)
            routes.append(
                finish_route(
                    gates[g], experts[g], pos_full[r * S_l : (r + 1) * S_l], cap, *[gates[g].new_zeros(())] * 2
                )
            )
            first.append(count_per_expert(e_full[:, 0], E))
            kept.append(count_per_expert(e_full, E, pos_full < cap))
        return routes, torch.stack(first), torch.stack(kept)
    counts = torch.stack([choice_counts(e, E) for e in experts])  # [G, k, E]
    every = all_gather_raw(counts[None].contiguous(), ps.group("mp"), dim=0)  # [N_MP, G, k, E]
    offset, totals = every[:r].sum(dim=0), every.sum(dim=0)  # [G, k, E]: before this rank, the whole group
    first, total = totals[:, 0], totals.sum(dim=1)
    routes = [router.route_slice(gt, e, S, offset[g], totals[g]) for g, (gt, e) in enumerate(zip(gates, experts))]
    # an expert's choices hold positions 0 .. total-1 in the group, so min(total, C) are kept
    return routes, first, total.clamp(max=cap)


def route_s1(router: Router, x_l_GSM: torch.Tensor, S: int, local_capacity: bool = False):
    """Route this rank's slices [G, S_l, M] of groups of S tokens with the whole groups' slots.

    Returns (routes of the slices, aux loss, kept counts [E] of the whole groups)."""
    ps, E = router.ps, router.num_experts
    G, S_l, _ = x_l_GSM.shape
    start = ps.rank("mp") * S_l
    logits = [router.logits(x_l_GSM[g], split_over_mp=True) for g in range(G)]
    chosen = [router.choose(lg, g, start, S) for g, lg in enumerate(logits)]
    gates, experts = [c[0] for c in chosen], [c[1] for c in chosen]
    routes, first, kept = _s1_slots(router, gates, experts, S, local_capacity)
    # aux and z losses from the groups' sums: reduce_from_group keeps the gradient local,
    # so the MP sum of gate-weight gradients (copy_to_group in logits) counts it once
    terms = [torch.stack([gt.sum(dim=0) for gt in gates])]  # [G, E]
    if router.z_coeff:
        terms.append(torch.stack([torch.logsumexp(lg.float(), dim=-1).pow(2).sum() for lg in logits])[:, None])
    summed = reduce_from_group(torch.cat(terms, dim=1), ps.group("mp"))
    aux = torch.stack(
        [
            router.aux_of_sums(summed[g, :E], first[g].float(), summed[g, E] if router.z_coeff else None, S)
            for g in range(G)
        ]
    ).mean()
    return routes, aux, kept.sum(dim=0)
