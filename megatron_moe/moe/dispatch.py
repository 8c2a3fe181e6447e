"""Index-based dispatch and combine (never a one-hot [S, E, C] einsum).

Legend: S tokens, E experts, C capacity, M model dim, k choices per token.

dispatch: buf[e, c] = x[s] for every kept choice (e = expert[s, j], c = slot[s, j]).
combine:  y[s] = sum_j weight[s, j] * buf[expert[s, j], slot[s, j]] over kept choices.
Both are differentiable (index_copy / index_add); memory is O(E*C*M + S*M).
`route_groups` routes several groups into one buffer side by side (every schedule uses it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_moe.moe.router import RouteResult
from megatron_moe.profiling import annotate


@dataclass
class DispatchIndex:
    """Flat positions of kept choices: token index [K], row e*C + c in the buffer [K], weight [K]."""

    token: torch.Tensor
    row: torch.Tensor
    weight: torch.Tensor


def dispatch_index(route: RouteResult, capacity: int | None = None, slot_base: int = 0) -> DispatchIndex:
    """Kept choices of a routing result as flat buffer rows.

    `capacity` is the row stride per expert (default the route's capacity);
    `slot_base` shifts every slot (several groups side by side in one buffer).
    """
    cap = route.capacity if capacity is None else capacity
    kept = route.slot >= 0
    S, k = route.slot.shape
    token = torch.arange(S, device=route.slot.device)[:, None].expand(S, k)[kept]
    row = route.expert[kept] * cap + route.slot[kept] + slot_base
    return DispatchIndex(token, row, route.weight[kept])


@annotate("moe/dispatch")
def dispatch(x_SM: torch.Tensor, idx: DispatchIndex, num_rows: int) -> torch.Tensor:
    """buf [num_rows, M] with x[token] at each kept row, zeros elsewhere."""
    buf = x_SM.new_zeros(num_rows, x_SM.size(1))
    return buf.index_copy(0, idx.row, x_SM.index_select(0, idx.token))


@annotate("moe/combine")
def combine(buf_RM: torch.Tensor, idx: DispatchIndex, num_tokens: int) -> torch.Tensor:
    """y [S, M] = weighted sum of each token's kept rows of buf [R, M]."""
    rows = buf_RM.index_select(0, idx.row) * idx.weight[:, None].to(buf_RM.dtype)
    y = buf_RM.new_zeros(num_tokens, buf_RM.size(1))
    return y.index_add(0, idx.token, rows)


@annotate("moe/router")
def route_groups(layer, x_GSM: torch.Tensor, slots_per_group: int | None = None):
    """Route every group; one DispatchIndex for a buffer [E, G*C'] holding all groups side by side.

    C' = `slots_per_group` (default the capacity C; S2 pads C to a multiple of N_MP).
    Returns (routes, index over tokens of x_GSM flattened to [G*S], C, aux).
    """
    G, S, _ = x_GSM.shape
    routes = [layer.route(layer.gate_logits(x_GSM[g]), g) for g in range(G)]
    C = routes[0].capacity
    Cs = C if slots_per_group is None else slots_per_group
    idxs = [dispatch_index(r, capacity=G * Cs, slot_base=g * Cs) for g, r in enumerate(routes)]
    idx = DispatchIndex(torch.cat([i.token + g * S for g, i in enumerate(idxs)]),
                        torch.cat([i.row for i in idxs]), torch.cat([i.weight for i in idxs]))
    layer.record_stats(routes)
    aux = torch.stack([layer.aux_of(r) for r in routes]).mean()
    return routes, idx, C, aux
