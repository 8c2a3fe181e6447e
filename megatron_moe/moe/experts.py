"""Experts: GPT-2 MLPs (fc -> tanh-GELU -> proj), E per layer, hidden dim sharded over ESP.

Legend: E experts (E_l = E / N_EP local ones), N tokens per expert buffer,
M model dim, H ffn hidden dim (H_l = H / N_ESP per ESP rank).

Full parameters and their splits (dim 0 over EP, the H dim over ESP):
  fc_w   [E, H, M]   fc_b   [E, H]
  proj_w [E, M, H]   proj_b [E, M]  (split over ESP along M: ESP rank j adds
                                     bias columns j*M/N_ESP.. to its partial
                                     output, so the sum of partials carries the
                                     bias exactly once and each piece has one owner)
The forward returns each ESP rank's *partial* output; schedules sum them.
Dropless MoE gives a ragged input x [R, M] instead of [E_l, N, M]: the R rows
grouped by local expert, `counts` [E_l] rows each; each expert computes its own
row range (no padding rows, no FLOPs on them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.distributed.collectives import scale_grad
from megatron_moe.layers.fused import gelu_tanh
from megatron_moe.layers.sharding import InitSpec, ShardSpec
from megatron_moe.layers.tensor_parallel import make_param
from megatron_moe.profiling import annotate

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


class Experts(nn.Module):
    """The local experts of one MoE layer. x [E_l, N, M] -> partial y [E_l, N, M]."""

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, ps: "ParallelState", seed: int, name: str,
                 std: float = 0.02, proj_std: float = 0.02, device: torch.device | None = None):
        super().__init__()
        self.esp_rank, self.esp_size = ps.rank("esp"), ps.size("esp")
        E, H, M = num_experts, ffn_hidden, hidden
        ep_esp = lambda *d: ShardSpec(tuple(d), expert=True)  # noqa: E731
        self.fc_w = make_param((E, H, M), ep_esp((0, "ep"), (1, "esp")), InitSpec("normal", std), ps, seed,
                               f"{name}.fc_w", device)
        self.fc_b = make_param((E, H), ep_esp((0, "ep"), (1, "esp")), InitSpec("zeros"), ps, seed, f"{name}.fc_b", device)
        self.proj_w = make_param((E, M, H), ep_esp((0, "ep"), (2, "esp")), InitSpec("normal", proj_std), ps,
                                 seed, f"{name}.proj_w", device)
        self.proj_b = make_param((E, M), ep_esp((0, "ep"), (1, "esp")), InitSpec("zeros"), ps, seed,
                                 f"{name}.proj_b", device)
        self.m_lo = self.esp_rank * (M // self.esp_size)
        self.num_local = E // ps.size("ep")
        # (fc, proj) batched linears of a dW queue that defer the weight-gradient GEMMs:
        # fn(x, weight, bias [E_l, 1, O] or None, grad_scale) (`set_dw_queue`)
        self.deferred_bmm = None

    def set_dw_queue(self, queue, prefix: str) -> None:
        """Hand both weight-gradient GEMMs to `queue` (Lancet's WgradRuntime) as prefix + "fc1.dW" /
        "fc2.dW"; None: plain autograd."""
        self.deferred_bmm = None if queue is None else (queue.bmm(prefix + "fc1.dW"), queue.bmm(prefix + "fc2.dW"))

    @annotate("moe/experts")
    def forward(self, x_ENM: torch.Tensor, grad_scale: float = 1.0,
                counts: Optional[list[int]] = None) -> torch.Tensor:
        """`grad_scale` scales the weight gradients (1/N_MP when MP ranks duplicate the work).
        With `counts` the input is ragged: x [R, M] -> partial y [R, M] (module docstring)."""
        if counts is not None:
            return self.forward_ragged(x_ENM, counts, grad_scale)
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        if self.deferred_bmm is not None and torch.is_grad_enabled() and x_ENM.requires_grad:
            fc, proj = self.deferred_bmm
            h = gelu_tanh(fc(x_ENM, self.fc_w, fc_b[:, None, :].to(x_ENM.dtype), grad_scale))
            y = proj(h, self.proj_w, None, grad_scale)
        else:
            fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
            h = gelu_tanh(torch.baddbmm(fc_b[:, None, :].to(x_ENM.dtype), x_ENM,
                                        fc_w.transpose(1, 2).to(x_ENM.dtype)))
            y = torch.bmm(h, proj_w.transpose(1, 2).to(h.dtype))
        M, m_l = y.size(-1), proj_b.size(1)
        bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - m_l))        # [E_l, M], zeros off our columns
        return y + bias[:, None, :].to(y.dtype)

    def forward_ragged(self, x_RM: torch.Tensor, counts: list[int], grad_scale: float = 1.0) -> torch.Tensor:
        """x [R, M], rows grouped by local expert (`counts` [E_l], sum R) -> partial y [R, M].

        One GEMM pair per local expert over its own rows (an expert with no rows: empty GEMMs)."""
        if len(counts) != self.num_local or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        return self.forward_weights(x_RM, counts, self.expert_weights(grad_scale))

    def expert_weights(self, grad_scale: float = 1.0) -> list[tuple[torch.Tensor, ...]]:
        """(fc_w [H_l, M], fc_b [H_l], proj_w [M, H_l], proj_b [M_l]) of each local expert, their
        gradients scaled by `grad_scale`."""
        fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        return [(fc_w[e], fc_b[e], proj_w[e], proj_b[e]) for e in range(self.num_local)]

    def forward_weights(self, x_RM: torch.Tensor, counts: list[int], weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """x [R, M] grouped by expert (`counts[i]` rows for `weights[i]`, an `expert_weights` tuple of
        a local expert or of a Pro-Prophet replica) -> partial y [R, M]."""
        if len(counts) != len(weights) or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        if self.deferred_bmm is not None:
            raise ValueError("--moe-dropless cannot be combined with --lancet-wgrad")
        M = x_RM.size(1)
        outs, start = [], 0
        for (fc_w, fc_b, proj_w, proj_b), n in zip(weights, counts):   # n = 0: empty GEMMs (zero grads, no FLOPs)
            x = x_RM[start:start + n]
            bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - proj_b.size(0)))   # [M], zeros off our columns
            h = gelu_tanh(torch.addmm(fc_b.to(x.dtype), x, fc_w.t().to(x.dtype)))
            outs.append(torch.addmm(bias.to(h.dtype), h, proj_w.t().to(h.dtype)))
            start += n
        return torch.cat(outs)


def expert_flops(tokens: int, hidden: int, ffn_hidden: int) -> int:
    """Forward FLOPs of one expert MLP on `tokens` tokens (2 GEMMs)."""
    return 4 * tokens * hidden * ffn_hidden

