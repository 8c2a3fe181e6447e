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
The capacity-padded schedules hand over only the rows that hold a kept token, as a ragged
input (the dispatcher gathers them, `moe.kept`); S1's zero-padded input [E_l, N, M] with `kept`
rows (`moe.kept.KeptRows`) is packed to those rows here and scattered back (zeros elsewhere):
the GEMMs never multiply padding. `forward_exchange` runs the experts between the baseline's two
all-to-alls, one local expert at a time, overlapping the transfers of the others.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_moe.distributed.collectives import scale_grad
from megatron_moe.layers.fused import gelu_tanh, gelu_tanh_backward, linear_gelu_tanh_out
from megatron_moe.layers.sharding import InitSpec, ShardSpec
from megatron_moe.layers.tensor_parallel import make_param
from megatron_moe.moe import a2a
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
        """x [R, M], rows grouped by local expert (`counts` [E_l], sum R) -> partial y [R, M].

        One GEMM pair per local expert over its own rows (an expert with no rows: empty GEMMs)."""
        if len(counts) != self.num_local or sum(counts) != x_RM.size(0):
            raise ValueError(f"ragged expert input of {x_RM.size(0)} rows does not match counts {counts}")
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(x_RM, grad_scale)
        return self.forward_grouped(x_RM, counts, fc_w, fc_b, proj_w, proj_b, defer)

    def _weights(self, x: torch.Tensor, grad_scale: float):
        """(fc_w, fc_b, proj_w, proj_b, defer) for a forward on x: gradients scaled by `grad_scale`; with a dW
        queue (`_deferral`) the weights are detached (the queue computes and scales their gradients)."""
        defer = self._deferral(x, grad_scale)
        if defer is None:
            fc_w, proj_w = scale_grad(self.fc_w, grad_scale), scale_grad(self.proj_w, grad_scale)
        else:
            fc_w, proj_w = self.fc_w.detach(), self.proj_w.detach()
        return fc_w, scale_grad(self.fc_b, grad_scale), proj_w, scale_grad(self.proj_b, grad_scale), defer

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
        y [R, M], one `_GroupedMLP`; `defer` (`_deferral`) takes the weights' dW GEMMs."""
        return self._grouped(x_RM, counts_segments(counts), fc_w, fc_b, proj_w, proj_b, defer)

    def _grouped(self, x_RM, segments: Segments, fc_w, fc_b, proj_w, proj_b, defer) -> torch.Tensor:
        M, dt = x_RM.size(1), x_RM.dtype
        bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - proj_b.size(1)))  # [X, M], zeros off our columns
        return _GroupedMLP.apply(x_RM, fc_w.to(dt), fc_b.to(dt), proj_w.to(dt), bias.to(dt), segments, defer)

    def forward_segments(self, buf_RM: torch.Tensor, segments: Segments, grad_scale: float = 1.0) -> torch.Tensor:
        """The experts on row ranges of a buffer where the rows lie (a received all-to-all buffer,
        `moe.kept.KeptRows.segments`): buf [R, M] -> partial y [R, M] on those rows; the other rows of y (and
        of buf's gradient) are left unwritten. No gather of the kept rows, no scatter of their outputs."""
        if len(segments) != self.num_local or any(hi > buf_RM.size(0) for segs in segments for _, hi in segs):
            raise ValueError(
                f"expert row ranges do not fit the buffer of {buf_RM.size(0)} rows for {self.num_local} experts"
            )
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(buf_RM, grad_scale)
        return self._grouped(buf_RM, _nonempty(segments), fc_w, fc_b, proj_w, proj_b, defer)

    def forward_exchange(
        self, buf_LRM: torch.Tensor, kept: KeptRows, group, grad_scale: float = 1.0, windows: tuple[str, str] = ("", "")
    ) -> torch.Tensor:
        """The experts between the two all-to-alls of `group`, pipelined by local expert (`_ExchangedMLP`):
        buf [E_l, D*B, M] (slice e, block d: rank d's local expert e) -> the same layout holding the
        partial outputs of the rows that hold a token (`kept`, rows of the received [E_l, D*B, M]).
        With a dW queue its backward runs the dW windows (combine, dispatch) = `windows` of the two
        gradient all-to-alls, and this layer's expert dW GEMMs go to the queue."""
        fc_w, fc_b, proj_w, proj_b, defer = self._weights(buf_LRM, grad_scale)
        M, dt = buf_LRM.size(-1), buf_LRM.dtype
        bias = F.pad(proj_b, (self.m_lo, M - self.m_lo - proj_b.size(1)))  # [E_l, M], zeros off our columns
        args = (fc_w.to(dt), fc_b.to(dt), proj_w.to(dt), bias.to(dt), kept, group, defer, windows)
        return _ExchangedMLP.apply(buf_LRM, *args)

    def forward_kept(self, x_ENM: torch.Tensor, kept: KeptRows, grad_scale: float = 1.0) -> torch.Tensor:
        """Padded x [E_l, N, M] -> partial y [E_l, N, M] computed on the `kept` rows only (zeros elsewhere)."""
        E_l, N, M = x_ENM.shape
        if E_l != self.num_local or (kept.rows.numel() and int(kept.rows[-1]) >= E_l * N):
            raise ValueError(f"kept rows do not fit the expert input of shape {tuple(x_ENM.shape)}")
        y_KM = self.forward_ragged(x_ENM.reshape(E_l * N, M).index_select(0, kept.rows), kept.counts, grad_scale)
        return y_KM.new_zeros(E_l * N, M).index_copy(0, kept.rows, y_KM).view(E_l, N, M)


Segments = list[list[tuple[int, int]]]  # per expert, the row ranges [lo, hi) of the input it computes


def counts_segments(counts: list[int]) -> Segments:
    """A ragged input's segments: expert e's `counts[e]` rows follow expert e-1's (each expert one range,
    possibly empty, so an expert without rows still gets its zero gradients written)."""
    ends = list(itertools.accumulate(counts))
    return [[(end - n, end)] for n, end in zip(counts, ends)]


def _nonempty(segments: Segments) -> Segments:
    """Every expert at least one range (an empty one when it has no rows): its gradients get written."""
    return [segs if segs else [(0, 0)] for segs in segments]


def _mlp_forward(x, fc_w, fc_b, proj_w, bias, a_out, h_out, y_out) -> None:
    """One expert on its rows x [n, M], into a_out / h_out [n, H] (pre- and post-activation), y_out [n, M]."""
    linear_gelu_tanh_out(x, fc_w, fc_b, a_out, h_out)
    torch.addmm(bias, h_out, proj_w.t(), out=y_out)


def _grad_mm(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out = g^T x, or out += g^T x (`accumulate`: an expert's later row ranges)."""
    if accumulate:
        out.addmm_(g.t(), x)
    else:
        torch.mm(g.t(), x, out=out)


def _grad_sum(g: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out = sum of g's rows, or out += it (`accumulate`)."""
    if accumulate:
        out.add_(g.sum(dim=0))
    else:
        torch.sum(g, dim=0, out=out)


def _mlp_backward(
    gy, x, a, h, fc_w, proj_w, d_fc_w, d_fc_b, d_proj_w, d_bias, dx_out=None, da_out=None, accumulate=False
) -> torch.Tensor:
    """One expert's weight and bias gradients (written into the given slices, or added to them with
    `accumulate`: the expert's later row ranges) from gy [n, M]; returns dx [n, M] (written into `dx_out`
    when given: no copy). `da_out` [n, H]: room for the activation's gradient (else new)."""
    _grad_mm(gy, h, d_proj_w, accumulate)
    dx, da = _mlp_backward_dx(gy, a, fc_w, proj_w, d_fc_b, d_bias, dx_out, da_out, accumulate)
    _grad_mm(da, x, d_fc_w, accumulate)
    return dx


def _mlp_backward_dx(
    gy, a, fc_w, proj_w, d_fc_b, d_bias, dx_out=None, da_out=None, accumulate=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_mlp_backward` without the weight gradients (a dW queue computes them later from gy, h and
    da, x): the bias gradients into (or, `accumulate`, added to) the given slices; returns (dx [n, M], da [n, H])."""
    _grad_sum(gy, d_bias, accumulate)
    dh = gy.mm(proj_w) if da_out is None else torch.mm(gy, proj_w, out=da_out)
    da = gelu_tanh_backward(dh, a, out=dh)  # in place, elementwise
    _grad_sum(da, d_fc_b, accumulate)
    return (da.mm(fc_w) if dx_out is None else torch.mm(da, fc_w, out=dx_out)), da


def _grads_like(fc_w, proj_w, like):
    """Uninitialized (d_fc_w, d_fc_b, d_proj_w, d_bias), every expert's slice written by `_mlp_backward`."""
    return (
        torch.empty_like(fc_w),
        like.new_empty(fc_w.shape[:2]),
        torch.empty_like(proj_w),
        like.new_empty(proj_w.shape[:2]),
    )


def _segments_forward(x, segs, c, fc_w, fc_b, proj_w, bias, a, h, y) -> int:
    """One expert (its weight slices given) on its row ranges `segs` of x, each into the same rows of y and
    into the next rows of the compact a / h from row c on; returns the next free row of a / h."""
    for lo, hi in segs:
        n = hi - lo
        _mlp_forward(x[lo:hi], fc_w, fc_b, proj_w, bias, a[c : c + n], h[c : c + n], y[lo:hi])
        c += n
    return c


def _segments_backward(gy, x, segs, c, a, h, fc_w, proj_w, grads, dx, da, defer_rows=None) -> int:
    """Backward of `_segments_forward`: dx into the rows of `segs`, the activation's gradient into the compact
    `da`, the expert's gradients `grads` (d_fc_w, d_fc_b, d_proj_w, d_bias slices) summed over its ranges in
    order. `defer_rows` (a dW queue's, as [proj pairs, fc pairs]): the weights' dW GEMMs are left to the
    queue, which gets each range's row operands. Returns the next free row of a / h / da."""
    d_fc_w, d_fc_b, d_proj_w, d_bias = grads
    for i, (lo, hi) in enumerate(segs):
        n = hi - lo
        r = slice(c, c + n)
        if defer_rows is None:
            _mlp_backward(gy[lo:hi], x[lo:hi], a[r], h[r], fc_w, proj_w, *grads, dx[lo:hi], da[r], i > 0)
        else:
            _mlp_backward_dx(gy[lo:hi], a[r], fc_w, proj_w, d_fc_b, d_bias, dx[lo:hi], da[r], i > 0)
            defer_rows[0].append((gy[lo:hi], h[r]))
            defer_rows[1].append((da[r], x[lo:hi]))
        c += n
    return c


def _defer_weight_grads(defer, rows: list) -> None:
    """Hand the experts' dW GEMMs to the queue as row operands, per local expert its [proj pairs, fc pairs]
    (d proj_w[e] = sum over its ranges of gy^T h, d fc_w[e] of da^T x: the calls `_mlp_backward` makes);
    an expert with one range gives its pair, several a list of pairs (`lancet.wgrad_runtime._rows_grad`)."""
    one = lambda pairs: pairs[0] if len(pairs) == 1 else pairs  # noqa: E731
    defer.submit([one(p) for p, _ in rows], [one(f) for _, f in rows])


class _GroupedMLP(torch.autograd.Function):
    """The experts' MLPs on row ranges of an input: x [R, M], `segments[e]` the ranges [lo, hi) of
    expert e -> y [R, M] = gelu(x W1_e^T + b1_e) W2_e^T + b2_e on those rows, with fc_w [E_l, H, M],
    fc_b [E_l, H], proj_w [E_l, M, H], bias [E_l, M]. A ragged input (`counts_segments`) is one range
    per expert covering every row; a received all-to-all buffer (`Experts.forward_segments`) has its
    kept rows where they landed, and the rows outside every range are left unwritten in y and in the
    input's gradient (nothing reads them).

    One expert at a time, forward and backward, every step of an expert (GEMM, activation, GEMM)
    on its rows while they are in cache, each writing into its rows of one preallocated output
    (forward) or its slice of one [E_l, ...] gradient (backward, summed over the expert's ranges):
    no per-expert gradient buffers to fill and add, no gather or scatter of the rows."""

    @staticmethod
    def forward(ctx, x_RM, fc_w, fc_b, proj_w, bias, segments, defer=None):
        M, H = x_RM.size(1), fc_w.size(1)
        K = sum(hi - lo for segs in segments for lo, hi in segs)
        a_KH, h_KH, y_RM = x_RM.new_empty(K, H), x_RM.new_empty(K, H), x_RM.new_empty(x_RM.size(0), M)
        c = 0
        for e, segs in enumerate(segments):
            c = _segments_forward(x_RM, segs, c, fc_w[e], fc_b[e], proj_w[e], bias[e], a_KH, h_KH, y_RM)
        ctx.segments, ctx.defer = segments, defer
        ctx.save_for_backward(x_RM, a_KH, h_KH, fc_w, proj_w)
        return y_RM

    @staticmethod
    def backward(ctx, gy_RM):
        x_RM, a_KH, h_KH, fc_w, proj_w = ctx.saved_tensors
        gy_RM = gy_RM.contiguous()
        d_fc_w, d_fc_b, d_proj_w, d_bias = _grads_like(fc_w, proj_w, gy_RM)
        dx_RM, da_KH = torch.empty_like(x_RM), torch.empty_like(a_KH)
        rows: list = []  # the dW queue's row operands per expert
        c = 0
        for e, segs in enumerate(ctx.segments):
            g = (d_fc_w[e], d_fc_b[e], d_proj_w[e], d_bias[e])
            mine = None if ctx.defer is None else ([], [])
            c = _segments_backward(gy_RM, x_RM, segs, c, a_KH, h_KH, fc_w[e], proj_w[e], g, dx_RM, da_KH, mine)
            rows.append(mine)
        if ctx.defer is not None:  # dX and bias gradients now, the weights' dW GEMMs by the queue
            _defer_weight_grads(ctx.defer, rows)
            return dx_RM, None, d_fc_b, None, d_bias, None, None
        return dx_RM, d_fc_w, d_fc_b, d_proj_w, d_bias, None, None


class _ExchangedMLP(torch.autograd.Function):
    """All-to-all in, experts, all-to-all back, one local expert at a time and overlapped: expert e's
    input travels while expert e-1 computes, and its output goes back while expert e+1 computes.

    buf [E_l, D*B, M]: row block d of slice e goes to rank d of `group` and holds the rows of its
    local expert e; the same slice of the result holds what rank d computed on them. segs[e]: the row
    ranges of the received [D*B, M] that hold a kept token, computed where they lie (the rest of the
    result is left unwritten: the senders read only their kept rows). Backward is the same pipeline on
    the gradients. Each expert makes the GEMM calls of `_GroupedMLP` on the same ranges, so both paths
    give the same bits."""

    @staticmethod
    def forward(ctx, buf_LRM, fc_w, fc_b, proj_w, bias, kept, group, defer=None, windows=("", "")):
        E_l, N = buf_LRM.size(0), buf_LRM.size(1)
        recv = [a2a.start_raw(buf_LRM[e], group) for e in range(E_l)]
        segments = kept.segments  # waits for the count exchange while the tokens travel
        if segments is None:
            raise ValueError("the exchanged experts need the kept rows as segments (`moe.kept.padded_kept_rows`)")
        segs = _nonempty([[(lo - e * N, hi - e * N) for lo, hi in s] for e, s in enumerate(segments)])
        ctx.segs, ctx.group, ctx.defer, ctx.windows = segs, group, defer, windows
        H, saved, back, out = fc_w.size(1), [], [], torch.empty_like(buf_LRM)
        for e, s in enumerate(segs):
            x = a2a.wait_raw(recv[e], group)
            K = sum(hi - lo for lo, hi in s)
            a, h, y = x.new_empty(K, H), x.new_empty(K, H), torch.empty_like(x)
            _segments_forward(x, s, 0, fc_w[e], fc_b[e], proj_w[e], bias[e], a, h, y)
            back.append(a2a.start_raw(y, group, out[e]))
            saved += [x, a, h]
        ctx.save_for_backward(fc_w, proj_w, *saved)
        for w in back:
            a2a.wait_raw(w, group)
        return out

    @staticmethod
    def backward(ctx, g_LRM):
        fc_w, proj_w, *saved = ctx.saved_tensors
        segs, group = ctx.segs, ctx.group
        g_LRM = g_LRM.contiguous()
        d_fc_w, d_fc_b, d_proj_w, d_bias = _grads_like(fc_w, proj_w, g_LRM)
        recv = [a2a.start_raw(g_LRM[e], group) for e in range(len(segs))]
        defer = ctx.defer
        if defer is not None:  # the dW runnable under the gradient's first all-to-all, before waiting
            defer.window(ctx.windows[0])
        back, g_buf, rows = [], torch.empty_like(g_LRM), []
        for e, s in enumerate(segs):
            gy = a2a.wait_raw(recv[e], group)
            x, a, h = saved[3 * e : 3 * e + 3]
            g = (d_fc_w[e], d_fc_b[e], d_proj_w[e], d_bias[e])
            dx, mine = torch.empty_like(gy), None if defer is None else ([], [])
            _segments_backward(gy, x, s, 0, a, h, fc_w[e], proj_w[e], g, dx, torch.empty_like(a), mine)
            rows.append(mine)
            back.append(a2a.start_raw(dx, group, g_buf[e]))
        if defer is not None:  # the dW GEMMs while the last returns fly
            _defer_weight_grads(defer, rows)
            defer.window(ctx.windows[1])
            d_fc_w = d_proj_w = None
        for w in back:
            a2a.wait_raw(w, group)
        return g_buf, d_fc_w, d_fc_b, d_proj_w, d_bias, None, None, None, None


def expert_flops(tokens: int, hidden: int, ffn_hidden: int) -> int:
    """Forward FLOPs of one expert MLP on `tokens` tokens (2 GEMMs)."""
    return 4 * tokens * hidden * ffn_hidden
