"""Top-k softmax gating with capacity slots as Triton kernels (the router's `route`, policy
"position"), forward and backward.

Legend: S tokens of one routing group, E experts, k choices (1 or 2), C capacity.

  topk_gating(logits [S, E], k, C) -> gates [S, E] fp32, expert [S, k], slot [S, k] (-1: dropped),
                                      weight [S, k] fp32

Forward: softmax + top-k and the combine weights (parallel over token blocks); capacity slots by
one program scanning the tokens in order (positions in token order, as `moe/router.py` defines
them). Backward (`gating_backward`, one kernel from the saved gates and choices): the weights'
gradient onto the kept gates (through the top-2 renormalization), then the softmax's backward;
`gating_weights` is the same math in torch, the tests' reference.
"""

from __future__ import annotations

import torch

from megatron_moe.kernels import _triton as tk

BLOCK_S = 64


def gating_weights(logits_SE: torch.Tensor, expert_Sk: torch.Tensor, slot_Sk: torch.Tensor):
    """(gates [S, E] fp32, weight [S, k]) from logits and the choices, in torch (the backward's graph):
    the same formulas as `moe/router.py`'s `choose_experts` / `finish_route`."""
    gates = torch.softmax(logits_SE.float(), dim=-1)
    g = gates.gather(1, expert_Sk) * (slot_Sk >= 0)
    if expert_Sk.size(1) == 2:
        g = g / g.sum(dim=1, keepdim=True).clamp(min=torch.finfo(g.dtype).eps)
    return gates, g


def gating_backward(
    gates_SE: torch.Tensor, expert_Sk: torch.Tensor, slot_Sk: torch.Tensor, g_gates_SE: torch.Tensor, g_weight_Sk
) -> torch.Tensor:
    """The logits' gradient [S, E] fp32 of `gating_weights` (gates fp32 [S, E] = its first output,
    expert / slot [S, k] int64) given the gradients of its outputs (gates [S, E], weight [S, k])."""
    S, E = gates_SE.shape
    k = expert_Sk.size(1)
    dx = torch.empty((S, E), dtype=torch.float32, device=gates_SE.device)
    if S:
        inputs = [t.contiguous() for t in (gates_SE, expert_Sk, slot_Sk, g_gates_SE, g_weight_Sk)]
        tk.jitted().gating_backward[(-(-S // BLOCK_S),)](
            *inputs, dx, S, E, torch.finfo(torch.float32).eps, K=k, BLOCK_S=BLOCK_S, BLOCK_E=tk.next_power_of_2(E)
        )
    return dx


class _TopkGating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_SE, k: int, cap: int):
        logits_SE = logits_SE.contiguous()
        S, E = logits_SE.shape
        dev = logits_SE.device
        gates = torch.empty((S, E), dtype=torch.float32, device=dev)
        expert = torch.empty((S, k), dtype=torch.int64, device=dev)
        slot = torch.empty((S, k), dtype=torch.int64, device=dev)
        weight = torch.empty((S, k), dtype=torch.float32, device=dev)
        if S:
            kern, block_e, blocks = tk.jitted(), tk.next_power_of_2(E), (-(-S // BLOCK_S),)
            kern.softmax_topk[blocks](logits_SE, gates, expert, S, E, K=k, BLOCK_S=BLOCK_S, BLOCK_E=block_e)
            kern.capacity_slots[(1,)](expert, slot, S, cap, K=k, BLOCK_S=BLOCK_S, BLOCK_E=block_e)
            kern.combine_weights[blocks](
                gates, expert, slot, weight, S, E, torch.finfo(torch.float32).eps, K=k, BLOCK_S=BLOCK_S
            )
        ctx.save_for_backward(gates, expert, slot)
        ctx.logits_dtype = logits_SE.dtype
        ctx.mark_non_differentiable(expert, slot)
        return gates, expert, slot, weight

    @staticmethod
    def backward(ctx, g_gates, _g_expert, _g_slot, g_weight):
        gates, expert, slot = ctx.saved_tensors
        return gating_backward(gates, expert, slot, g_gates, g_weight).to(ctx.logits_dtype), None, None


def topk_gating(logits_SE: torch.Tensor, k: int, capacity: int):
    """(gates [S, E] fp32, expert [S, k] int64, slot [S, k] int64 with -1 where dropped, weight [S, k]
    fp32): the router's top-k gating with capacity `capacity`, policy "position" (differentiable in
    the logits through gates and weight)."""
    if k not in (1, 2):
        raise ValueError(f"the fused gating kernel routes top-1 or top-2, got k={k} (the router uses torch for more)")
    return _TopkGating.apply(logits_SE, k, int(capacity))
