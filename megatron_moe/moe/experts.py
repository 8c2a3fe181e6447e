"""Experts: GPT-2 MLPs (fc -> tanh-GELU -> proj), E per layer, hidden dim sharded over ESP.

Legend: E experts (E_l = E / N_EP local ones), N tokens per expert buffer,
M model dim, H ffn hidden dim (H_l = H / N_ESP per ESP rank).

Full parameters and their splits (dim 0 over EP, the H dim over ESP):
  fc_w   [E, H, M]   fc_b   [E, H]
  proj_w [E, M, H]   proj_b [E, M]  (split over ESP along M: ESP rank j adds
                                     bias columns j*M/N_ESP.. to its partial
                                     output, so the sum of partials carries the
                                     bias exactly once and each piece has one owner)
The forward returns each ESP rank's *partial* output; schedules sum them. One method per
input layout (`moe.dispatcher`):
  - `forward`: the padded buffer [E_l, N, M] (several ranks), one batched GEMM per weight;
  - `forward_offsets`: rows grouped by expert with device offsets (one rank; rows past the
    last expert's are the dropped tail and give zeros), grouped GEMMs (`moe.grouped`);
  - `forward_ragged`: rows grouped by expert with host counts (the uneven dispatcher;
    Pro-Prophet's replicas through `forward_grouped`), grouped GEMMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.distributed.collectives import scale_grad
from megatron_moe.layers.fused import gelu_tanh
from megatron_moe.layers.sharding import InitSpec, ShardSpec
from megatron_moe.layers.tensor_parallel import make_param
from megatron_moe.moe.grouped import expert_rows_mlp, grouped_mlp
from megatron_moe.profiling import annotate

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


class Experts(nn.Module):
    """The local experts of one MoE layer. x [E_l, N, M] -> partial y [E_l, N, M]."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn_hidden: int,
        ps: "ParallelState",
        seed: int,
        name: str,
        std: float = 0.02,
        proj_std: float = 0.02,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.esp_rank, self.esp_size = ps.rank("esp"), ps.size("esp")
        E, H, M = num_experts, ffn_hidden, hidden
        ep_esp = lambda *d: ShardSpec(tuple(d), expert=True)  # noqa: E731
        self.fc_w = make_param(
            (E, H, M), ep_esp((0, "ep"), (1, "esp")), InitSpec("normal", std), ps, seed, f"{name}.fc_w", device
        )
        self.fc_b = make_param(
            (E, H), ep_esp((0, "ep"), (1, "esp")), InitSpec("zeros"), ps, seed, f"{name}.fc_b", device
        )
        self.proj_w = make_param(
            (E, M, H), ep_esp((0, "ep"), (2, "esp")), InitSpec("normal", proj_std), ps, seed, f"{name}.proj_w", device
        )
        self.proj_b = make_param(
            (E, M), ep_esp((0, "ep"), (1, "esp")), InitSpec("zeros"), ps, seed, f"{name}.proj_b", device
        )
        self.m_lo = self.esp_rank * (M // self.esp_size)
        self.num_local = E // ps.size("ep")
        # (fc, proj) batched linears of a dW queue that defer the weight-gradient GEMMs:
        # fn(x, weight, bias [E_l, 1, O] or None, grad_scale) (`set_dw_queue`)
        self.deferred_bmm = None
        self.dw_queue, self.dw_prefix = None, ""  # the same queue, for the grouped GEMMs (`_deferral`)

    def relayout(self, local: dict[str, torch.Tensor], num_local: int) -> None:
        """Hold another set of experts (Lina's expert packing, `moe.packing`): `local` maps fc_w, fc_b,
        proj_w, proj_b to this rank's new slices [num_local, ...]; the parameters stay the same objects,
        with new data and no gradient. Call it between iterations: a live autograd graph that used the
        experts keeps gradient accumulators of the old shape, and its backward would fail."""
        with torch.no_grad():
            for name, p in (("fc_w", self.fc_w), ("fc_b", self.fc_b), ("proj_w", self.proj_w), ("proj_b", self.proj_b)):
                t = local[name]
                if t.shape[0] != num_local or t.shape[1:] != p.shape[1:]:
                    raise ValueError(
                        f"{name}: new slice {tuple(t.shape)} does not fit {num_local} experts like {tuple(p.shape)}"
                    )
                p.data = t.to(device=p.device, dtype=p.dtype).contiguous()
                p.grad = None
        self.num_local = num_local

    def set_dw_queue(self, queue, prefix: str) -> None:
        """Hand both weight-gradient GEMMs to `queue` (Lancet's WgradRuntime) as prefix + "fc1.dW" /
        "fc2.dW"; None: plain autograd."""
        self.deferred_bmm = None if queue is None else (queue.bmm(prefix + "fc1.dW"), queue.bmm(prefix + "fc2.dW"))
        self.dw_queue, self.dw_prefix = queue, prefix

    def _deferral(self, x: torch.Tensor, grad_scale: float):
        """The dW queue's handle of this forward use (`queue.experts`), or None: plain autograd."""
        if self.dw_queue is None or not (torch.is_grad_enabled() and x.requires_grad):
            return None
        return self.dw_queue.experts(self.dw_prefix, self.fc_w, self.proj_w, grad_scale)

    @annotate("moe/experts")
    def forward(self, x_ENM: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """Padded x [E_l, N, M] -> partial y [E_l, N, M]. `grad_scale` scales the weight gradients (1/N_MP
        when MP ranks duplicate the work); a dW queue (Lancet) takes the weight-gradient GEMMs."""
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        if self.deferred_bmm is not None and torch.is_grad_enabled() and x_ENM.requires_grad:
            fc, proj = self.deferred_bmm
            h = gelu_tanh(fc(x_ENM, self.fc_w, fc_b[:, None, :].to(x_ENM.dtype), grad_scale))
            y = proj(h, self.proj_w, None, grad_scale)
        else:
            fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
            h = gelu_tanh(torch.baddbmm(fc_b[:, None, :].to(x_ENM.dtype), x_ENM, fc_w.transpose(1, 2).to(x_ENM.dtype)))
            y = torch.bmm(h, proj_w.transpose(1, 2).to(h.dtype))
        return y + self._bias(proj_b, y.size(-1))[:, None, :].to(y.dtype)

    def forward_ragged(self, x_RM: torch.Tensor, counts: list[int], grad_scale: float = 1.0) -> torch.Tensor:
        """x [R, M], rows grouped by local expert (`counts` [E_l], sum R) -> partial y [R, M]."""
        if len(counts) != self.num_local or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(x_RM, grad_scale)
        return self.forward_grouped(x_RM, counts, fc_w, fc_b, proj_w, proj_b, defer)

    @annotate("moe/experts")
    def forward_offsets(self, x_RM: torch.Tensor, offs: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """x [R, M], rows grouped by local expert as device offsets (`moe.grouped`: expert e's rows end at
        offs[e]; rows after offs[-1] hold no token and give zeros) -> partial y [R, M]. The split never
        reaches the host."""
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(x_RM, grad_scale)
        return grouped_mlp(x_RM, offs, fc_w, fc_b, proj_w, self._bias(proj_b, x_RM.size(1)), True, defer)

    def _weights(self, x: torch.Tensor, grad_scale: float):
        """(fc_w, fc_b, proj_w, proj_b, defer) for a forward on x: gradients scaled by `grad_scale`; with a dW
        queue (`_deferral`) the weights are detached (the queue computes and scales their gradients)."""
        defer = self._deferral(x, grad_scale)
        if defer is None:
            fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
        else:
            fc_w, proj_w = self.fc_w.detach(), self.proj_w.detach()
        return fc_w, scale_grad(self.fc_b, grad_scale), proj_w, scale_grad(self.proj_b, grad_scale), defer

    def _bias(self, proj_b: torch.Tensor, M: int) -> torch.Tensor:
        """proj_b [X, M_l] -> [X, M], zeros off this ESP rank's columns."""
        return F.pad(proj_b, (self.m_lo, M - self.m_lo - proj_b.size(1)))

    def forward_grouped(
        self,
        x_RM: torch.Tensor,
        counts: list[int],
        fc_w: torch.Tensor,
        fc_b: torch.Tensor,
        proj_w: torch.Tensor,
        proj_b: torch.Tensor,
        defer=None,
    ) -> torch.Tensor:
        """x [R, M] grouped by expert (`counts[i]` rows for slice i of fc_w [X, H_l, M], fc_b [X, H_l],
        proj_w [X, M, H_l], proj_b [X, M_l]: this layer's experts or Pro-Prophet replicas) -> partial
        y [R, M], one grouped MLP (`moe.grouped`); `defer` (`_deferral`) takes the weights' dW GEMMs."""
        return expert_rows_mlp(x_RM, counts, fc_w, fc_b, proj_w, self._bias(proj_b, x_RM.size(1)), defer)
