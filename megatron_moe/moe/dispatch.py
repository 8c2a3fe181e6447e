"""Index-based dispatch and combine (never a one-hot [S, E, C] einsum).

Legend: S tokens, E experts, C capacity, M model dim, k choices per token.

dispatch: buf[e, c] = x[s] for every kept choice (e = expert[s, j], c = slot[s, j]).
combine:  y[s] = sum_j weight[s, j] * buf[expert[s, j], slot[s, j]] over kept choices.
Both are differentiable (index_copy / index_add); memory is O(E*C*M + S*M).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_moe.moe.router import RouteResult


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


def dispatch(x_SM: torch.Tensor, idx: DispatchIndex, num_rows: int) -> torch.Tensor:
    """buf [num_rows, M] with x[token] at each kept row, zeros elsewhere."""
    buf = x_SM.new_zeros(num_rows, x_SM.size(1))
    return buf.index_copy(0, idx.row, x_SM.index_select(0, idx.token))


def combine(buf_RM: torch.Tensor, idx: DispatchIndex, num_tokens: int) -> torch.Tensor:
    """y [S, M] = weighted sum of each token's kept rows of buf [R, M]."""
    rows = buf_RM.index_select(0, idx.row) * idx.weight[:, None].to(buf_RM.dtype)
    y = buf_RM.new_zeros(num_tokens, buf_RM.size(1))
    return y.index_add(0, idx.token, rows)
