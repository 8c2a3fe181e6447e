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
Every GEMM is a grouped GEMM in the compute dtype (`moe.grouped`): all experts in one call, over
row offsets per expert. The inputs the layer hands over:
  - a padded buffer [E_l, N, M] (`forward`): one batched GEMM per weight;
  - rows grouped by expert with device offsets (`forward_offsets`: one rank holding every expert,
    no host sync; rows after the last expert's are a dropped tail computed as zeros);
  - rows grouped by expert with host counts (`forward_ragged`: dropless, the kept rows of a padded
    buffer, Pro-Prophet's replicas through `forward_grouped`);
  - the kept rows of a received buffer where they lie (`forward_segments`), or of S1's zero-padded
    input (`forward_kept`): gathered into one grouped input and scattered back;
  - `forward_exchange`: the experts between the baseline's two all-to-alls, one local expert at a
    time, overlapping the transfers of the others.
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
from megatron_moe.moe import a2a
from megatron_moe.moe.grouped import (
    compute_dtype,
    expert_rows_mlp,
    grouped_mlp,
    mlp_backward,
    mlp_forward,
    stack_rows,
    to_device,
    wgrad,
)
from megatron_moe.moe.kept import KeptRows
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
        self.dw_queue, self.dw_prefix = None, ""  # the same queue, for the kept-row paths (`_deferral`)

    def relayout(self, local: dict[str, torch.Tensor], num_local: int) -> None:
        """Hold another set of experts (Lina's expert packing, `moe.packing`): `local` maps fc_w,
        fc_b, proj_w, proj_b to this rank's new slices [num_local, ...]. The parameters stay the
        same objects (the optimizer, gradient hooks and schedulers keep them), with new data and
        no gradient. Call it between iterations, when no autograd graph that used the experts is
        alive (a live graph keeps each parameter's gradient accumulator, which remembers the old
        shape: its next backward would fail on the shape)."""
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
    def forward(
        self,
        x_ENM: torch.Tensor,
        grad_scale: float = 1.0,
        counts: Optional[list[int]] = None,
        kept: Optional[KeptRows] = None,
        segments: Optional[Segments] = None,
    ) -> torch.Tensor:
        """`grad_scale` scales the weight gradients (1/N_MP when MP ranks duplicate the work).
        With `counts` the input is ragged: x [R, M] -> partial y [R, M]; with `segments` the experts
        compute their row ranges of a buffer x [R, M] where they lie (`forward_segments`); with `kept`
        only the kept rows of x [E_l, N, M] are computed (module docstring). A dW queue (Lancet) takes
        the weight-gradient GEMMs of every path."""
        if segments is not None:
            return self.forward_segments(x_ENM, segments, grad_scale)
        if counts is not None:
            return self.forward_ragged(x_ENM, counts, grad_scale)
        if kept is not None:
            return self.forward_kept(x_ENM, kept, grad_scale)
        fc_b, proj_b = scale_grad(self.fc_b, grad_scale), scale_grad(self.proj_b, grad_scale)
        if self.deferred_bmm is not None and torch.is_grad_enabled() and x_ENM.requires_grad:
            fc, proj = self.deferred_bmm
            h = gelu_tanh(fc(x_ENM, self.fc_w, fc_b[:, None, :].to(x_ENM.dtype), grad_scale))
            y = proj(h, self.proj_w, None, grad_scale)
        else:
            fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
            h = gelu_tanh(torch.baddbmm(fc_b[:, None, :].to(x_ENM.dtype), x_ENM, fc_w.transpose(1, 2).to(x_ENM.dtype)))
            y = torch.bmm(h, proj_w.transpose(1, 2).to(h.dtype))
        M, m_l = y.size(-1), proj_b.size(1)
        bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - m_l))  # [E_l, M], zeros off our columns
        return y + bias[:, None, :].to(y.dtype)

    def forward_ragged(self, x_RM: torch.Tensor, counts: list[int], grad_scale: float = 1.0) -> torch.Tensor:
        """x [R, M], rows grouped by local expert (`counts` [E_l], sum R) -> partial y [R, M]."""
        if len(counts) != self.num_local or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(x_RM, grad_scale)
        return self.forward_grouped(x_RM, counts, fc_w, fc_b, proj_w, proj_b, defer)

    @annotate("moe/experts")
    def forward_offsets(
        self, x_RM: torch.Tensor, offs: torch.Tensor, grad_scale: float = 1.0, tail: bool = False
    ) -> torch.Tensor:
        """x [R, M], rows grouped by local expert as device offsets (`moe.grouped`: expert e's rows end at
        offs[e]; with `tail`, rows after offs[-1] hold no token and give zeros) -> partial y [R, M]. The
        split never reaches the host."""
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(x_RM, grad_scale)
        return grouped_mlp(x_RM, offs, fc_w, fc_b, proj_w, self._bias(proj_b, x_RM.size(1)), tail, defer)

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

    def forward_segments(self, buf_RM: torch.Tensor, segments: Segments, grad_scale: float = 1.0) -> torch.Tensor:
        """The experts on row ranges of a buffer where the rows lie (a received all-to-all buffer,
        `moe.kept.KeptRows.segments`): buf [R, M] -> partial y [R, M] on those rows (the other rows of y
        are zeros). The ranges' rows are gathered into one grouped input and their outputs scattered back."""
        if len(segments) != self.num_local or any(hi > buf_RM.size(0) for segs in segments for _, hi in segs):
            raise ValueError(
                f"expert row ranges do not fit the buffer of {buf_RM.size(0)} rows for {self.num_local} experts"
            )
        rows = segment_rows(segments, buf_RM.device)
        counts = [sum(hi - lo for lo, hi in segs) for segs in segments]
        y_KM = self.forward_ragged(buf_RM.index_select(0, rows), counts, grad_scale)
        return y_KM.new_zeros(buf_RM.size(0), y_KM.size(1)).index_copy(0, rows, y_KM)

    def forward_exchange(
        self, buf_LRM: torch.Tensor, kept: KeptRows, group, grad_scale: float = 1.0, windows: tuple[str, str] = ("", "")
    ) -> torch.Tensor:
        """The experts between the two all-to-alls of `group`, pipelined by local expert (`_ExchangedMLP`):
        buf [E_l, D*B, M] (slice e, block d: rank d's local expert e) -> the same layout holding the
        partial outputs of the rows that hold a token (`kept`, rows of the received [E_l, D*B, M]).
        With a dW queue its backward runs the dW windows (combine, dispatch) = `windows` of the two
        gradient all-to-alls, and this layer's expert dW GEMMs go to the queue."""
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(buf_LRM, grad_scale)
        dt = compute_dtype(buf_LRM)
        args = (fc_w.to(dt), fc_b, proj_w.to(dt), self._bias(proj_b, buf_LRM.size(-1)), kept, group, defer, windows)
        return _ExchangedMLP.apply(buf_LRM, *args)

    def forward_kept(self, x_ENM: torch.Tensor, kept: KeptRows, grad_scale: float = 1.0) -> torch.Tensor:
        """Padded x [E_l, N, M] -> partial y [E_l, N, M] computed on the `kept` rows only (zeros elsewhere)."""
        E_l, N, M = x_ENM.shape
        if E_l != self.num_local:
            raise ValueError(f"kept rows do not fit the expert input of shape {tuple(x_ENM.shape)}")
        y_KM = self.forward_ragged(x_ENM.reshape(E_l * N, M).index_select(0, kept.rows), kept.counts, grad_scale)
        return y_KM.new_zeros(E_l * N, M).index_copy(0, kept.rows, y_KM).view(E_l, N, M)


Segments = list[list[tuple[int, int]]]  # per expert, the row ranges [lo, hi) of the input it computes


def segment_rows(segments: Segments, device: torch.device) -> torch.Tensor:
    """The rows [K] int64 of every expert's ranges, in order (grouped by expert)."""
    rows = [r for segs in segments for lo, hi in segs for r in range(lo, hi)]
    return to_device(torch.tensor(rows, dtype=torch.int64, device="cpu"), device)


class _ExchangedMLP(torch.autograd.Function):
    """All-to-all in, experts, all-to-all back, one local expert at a time and overlapped: expert e's
    input travels while expert e-1 computes, and its output goes back while expert e+1 computes.

    buf [E_l, D*B, M]: row block d of slice e goes to rank d of `group` and holds the rows of its
    local expert e; the same slice of the result holds what rank d computed on them. segs[e]: the row
    ranges of the received [D*B, M] that hold a kept token; they are gathered, computed as one group
    (`moe.grouped`, in the dtype of fc_w / proj_w) and scattered back (the rest of the result is
    zeros: the senders read only their kept rows). Backward is the same pipeline on the gradients."""

    @staticmethod
    def forward(ctx, buf_LRM, fc_w, fc_b, proj_w, bias, kept, group, defer=None, windows=("", "")):
        E_l, N, M = buf_LRM.shape
        recv = [a2a.start_raw(buf_LRM[e], group) for e in range(E_l)]
        segments = kept.segments  # waits for the count exchange while the tokens travel
        if segments is None:
            raise ValueError("the exchanged experts need the kept rows as segments (`moe.kept.padded_kept_rows`)")
        dev, dt = buf_LRM.device, fc_w.dtype
        rows = [segment_rows([[(lo - e * N, hi - e * N) for lo, hi in s]], dev) for e, s in enumerate(segments)]
        saved, back, out = [], [], torch.empty_like(buf_LRM)
        for e in range(E_l):
            x = a2a.wait_raw(recv[e], group).index_select(0, rows[e]).to(dt)
            offs = torch.full((1,), x.size(0), dtype=torch.int32, device=dev)
            ws = (fc_w[e : e + 1], fc_b[e : e + 1], proj_w[e : e + 1], bias[e : e + 1])
            y, s = mlp_forward(x, offs, *ws, tail=False)
            full = buf_LRM.new_zeros(N, M).index_copy_(0, rows[e], y.to(buf_LRM.dtype))
            back.append(a2a.start_raw(full, group, out[e]))
            saved.append(s)
        ctx.saved, ctx.rows, ctx.group, ctx.defer, ctx.windows = saved, rows, group, defer, windows
        for w in back:
            a2a.wait_raw(w, group)
        return out

    @staticmethod
    def backward(ctx, g_LRM):
        group, rows, defer = ctx.group, ctx.rows, ctx.defer
        E_l = len(rows)
        g_LRM = g_LRM.contiguous()
        recv = [a2a.start_raw(g_LRM[e], group) for e in range(E_l)]
        if defer is not None:  # the dW runnable under the gradient's first all-to-all, before waiting
            defer.window(ctx.windows[0])
        back, g_buf = [], torch.empty_like(g_LRM)
        d_fc_b, d_bias, fc1, fc2 = [], [], [], []
        for e in range(E_l):
            gy = a2a.wait_raw(recv[e], group).index_select(0, rows[e])
            dx, gb1, gb2, r1, r2 = mlp_backward(gy, ctx.saved[e])
            d_fc_b.append(gb1)
            d_bias.append(gb2)
            fc1.append(r1)
            fc2.append(r2)
            full = g_LRM.new_zeros(g_LRM.size(1), g_LRM.size(2)).index_copy_(0, rows[e], dx.to(g_LRM.dtype))
            back.append(a2a.start_raw(full, group, g_buf[e]))
        del ctx.saved
        d_fc_w = d_proj_w = None
        if defer is not None:  # the dW GEMMs while the last returns fly
            defer.submit(stack_rows(fc2), stack_rows(fc1))
            defer.window(ctx.windows[1])
        else:
            d_fc_w, d_proj_w = torch.cat([wgrad(r) for r in fc1]), torch.cat([wgrad(r) for r in fc2])
        for w in back:
            a2a.wait_raw(w, group)
        return g_buf, d_fc_w, torch.cat(d_fc_b), d_proj_w, torch.cat(d_bias), None, None, None, None


def expert_flops(tokens: int, hidden: int, ffn_hidden: int) -> int:
    """Forward FLOPs of one expert MLP on `tokens` tokens (2 GEMMs)."""
    return 4 * tokens * hidden * ffn_hidden
