"""Deferred weight gradients at runtime (Lancet's dW scheduling, Jiang et al., MLSys 2024).

Legend: N rows (tokens), I input features, O output features, E_l local experts.

A linear layer's backward computes dX = g W (needed at once) and dW = g^T x (needed only by gradient
sync and the optimizer). The modules owning the weights take the runtime as their dW queue
(`set_dw_queue`): ColumnParallelLinear / RowParallelLinear call `linear(name)`, Experts `bmm(name)`
(padded) and `experts(prefix, ...)` (grouped). Their backward computes dX and the bias gradient in
autograd and hands the dW GEMM over under its IR name (e.g. "L1.moe.expert.fc2.dW", the names of
`wgrad_schedule.build_gpt_moe_backward`): a closure and, for the linears and grouped experts, row
operands (g, x). A partitioned range uses a weight k times: the runtime holds each use's rows until
the weight's last use and then accumulates every use's GEMM into one tensor (`_rows_grad`, no copy
of the rows); the controller installs it for that under partitioning alone too (empty assignment).

Where a dW runs (the assignment of Algorithm 1, `schedule_wgrad`):
  - assigned to an all-to-all a not yet started in this backward: it waits in a's queue; when a's
    backward all-to-all is launched the queue becomes runnable (`open_window`), and it runs just
    before that all-to-all is waited for (`fill`);
  - leftover, or its all-to-all already ran: at once, where the plain backward computes it;
  - still queued when backward ends: in `flush()`, which an end-of-backward callback also calls, so
    a plain `loss.backward()` leaves every gradient complete before gradient sync.
None of this depends on timing: when each gradient is final decides the order of grad-ready hooks
and of the gradient all-reduces they launch, which every rank must issue in the same order.

The weight is not an autograd input of these functions (a `WeightRef` carries it), so autograd never
touches its `.grad` or fires its hook early. After a parameter's last contribution the runtime
accumulates their sum through a one-node graph whose backward hands dW over (`_Handover`):
AccumulateGrad sets or adds `.grad` as in the plain run (taking dW without a copy when `.grad` is
unset) and the post-accumulate-grad hooks (GradSync, Lina) fire once, when the gradient is final.
Each dW GEMM is the plain autograd formula's call (`mm(g^T, x)` for F.linear, `bmm(x^T, g)^T` for
baddbmm), so gradients are bitwise the plain run's when each weight is used once.

Windows and streams: the dispatchers' asynchronous handles (`moe/a2a.py`) open a window after
launching the gradient's all-to-all, so `fill` enqueues the dW GEMMs behind the launch on the
caller's stream and they overlap it. S2's synchronous all-to-alls (`a2a.dw_window`) open it before
the launch: GEMMs enqueued then on the caller's stream would delay the all-to-all (NCCL waits for
everything enqueued at launch), so they run on the "lancet-dw" `Lane` (`start_window_async` /
`finish_window_async`): on CUDA a side stream (it waits for the caller's stream, the caller's stream
waits for it at the join, the results are record_stream-ed), on the CPU one worker thread (gloo
calls release the GIL). `window_ms` on CUDA is the host time to enqueue them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron_moe.distributed import streams
from megatron_moe.moe.grouped import GroupedRows, wgrad


@dataclass
class WeightRef:
    """The parameter of a deferrable GEMM, its dW instruction name and its gradient scale."""

    param: torch.nn.Parameter
    name: str
    runtime: "WgradRuntime"
    scale: float = 1.0


@dataclass
class DeferredDW:
    """One queued dW GEMM: `compute()` returns the parameter-shaped gradient contribution. rows (optional):
    the same GEMM as operands (`_rows_grad`), held until the parameter's last forward use: a k-way range
    then costs k GEMMs accumulating into one buffer, not k full-size buffers plus k - 1 sums."""

    name: str
    param: torch.nn.Parameter
    compute: Callable[[], torch.Tensor]
    rows: Optional[list | GroupedRows] = None
    scale: float = 1.0
    done: bool = False


@dataclass
class WgradStats:
    """Counters of one runtime: dW closures run per name, where they ran, time spent."""

    runs: dict = field(default_factory=lambda: defaultdict(int))  # name -> closures run
    in_window: int = 0  # closures run in an all-to-all window (before its wait)
    immediate: int = 0  # leftover closures run where the plain backward runs them
    flushed: int = 0  # closures run by flush() at the end of backward
    merged: int = 0  # dW GEMMs run once over the rows of several forward uses (partitioned ranges)
    window_ms: float = 0.0  # dW compute time spent inside all-to-all windows
    a2a_windows: int = 0
    helper_intervals: list = field(default_factory=list)  # (start, end) perf_counter s of helper-thread dW


def _rows_grad(p: torch.nn.Parameter, uses: list, scale: float) -> torch.Tensor:
    """p-shaped gradient from the row operands of one or more forward uses (`DeferredDW.rows`), cast to
    p's dtype, times `scale`. A use is either a `moe.grouped.GroupedRows` (the experts: every expert's
    g^T x in one grouped GEMM, [E_l, O, I]) or, for a 2-D p, one slot of (g, x) pairs (a linear: g^T x,
    several pairs summed with `addmm_`, no copy of the rows). The uses' results are summed in place."""
    d: Optional[torch.Tensor] = None
    for use in uses:
        if isinstance(use, GroupedRows):
            part = wgrad(use)
        else:
            pairs = [pr for slot in use for pr in (slot if isinstance(slot, list) else [slot])]
            (g, x), *rest = pairs
            part = g.t().mm(x)
            for g, x in rest:
                part.addmm_(g.t(), x)
        d = part if d is None else d.add_(part)
    assert d is not None, "a deferred dW with no uses"
    d = d.to(p.dtype)
    return d * scale if scale != 1.0 else d


def _autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b (F.linear); backward returns dX and db, queues dW = g^T x."""

    @staticmethod
    def forward(ctx, x, bias, ref: WeightRef):
        w: torch.Tensor = ref.param  # becomes a plain (cast) tensor below
        dt = _autocast_dtype(x)
        if dt is not None:  # do what autocast does to F.linear, and keep the cast tensors
            x, w = x.to(dt), w.to(dt)
            bias = None if bias is None else bias.to(dt)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, w, bias)
        ctx.save_for_backward(x, w)
        ctx.ref, ctx.has_bias = ref, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ref = ctx.ref
        g2 = g.reshape(-1, g.size(-1))
        x2 = x.reshape(-1, x.size(-1))
        dx = g2.mm(w).view(x.shape)  # what addmm / mm backward computes
        db = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        pdt = ref.param.dtype
        ref.runtime.submit(DeferredDW(ref.name, ref.param, lambda: g2.t().mm(x2).to(pdt), [(g2, x2)]))
        return dx, db, None


class _DeferredBmm(torch.autograd.Function):
    """y = baddbmm(b, x, W^T) (or bmm without b) for x [E_l, N, I], W [E_l, O, I]; dW queued, scaled."""

    @staticmethod
    def forward(ctx, x, bias_E1O, ref: WeightRef):
        w: torch.Tensor = ref.param  # becomes a plain (cast) tensor below
        dt = _autocast_dtype(x)
        if dt is not None:
            x, w = x.to(dt), w.to(dt)
            bias_E1O = None if bias_E1O is None else bias_E1O.to(dt)
        else:
            w = w.to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            wt = w.transpose(1, 2)
            y = torch.bmm(x, wt) if bias_E1O is None else torch.baddbmm(bias_E1O, x, wt)
        ctx.save_for_backward(x, w)
        ctx.ref, ctx.has_bias = ref, bias_E1O is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ref = ctx.ref
        dx = g.bmm(w)  # baddbmm: grad @ batch2^T
        db = g.sum(1, keepdim=True) if ctx.has_bias and ctx.needs_input_grad[1] else None
        scale, pdt = ref.scale, ref.param.dtype

        def dw() -> torch.Tensor:
            d = x.transpose(1, 2).bmm(g).transpose(1, 2)  # baddbmm: batch1^T @ grad, then W^T's transpose
            return (d * scale if scale != 1.0 else d).to(pdt)

        ref.runtime.submit(DeferredDW(ref.name, ref.param, dw))
        return dx, db, None


class ExpertDW:
    """One forward use of an expert MLP's two weights whose dW GEMMs the runtime runs (the grouped GEMMs
    of `moe.experts`): `submit(fc2, fc1)` queues the closures, each returning the [E_l, ...] gradient in
    the GEMMs' dtype (cast to the parameter's and scaled here, as the plain backward's cast and
    `scale_grad` do)."""

    def __init__(
        self, runtime: "WgradRuntime", prefix: str, fc_w: torch.nn.Parameter, proj_w: torch.nn.Parameter, scale: float
    ):
        self.runtime, self.prefix, self.fc_w, self.proj_w, self.scale = runtime, prefix, fc_w, proj_w, scale

    def _item(self, name: str, p: torch.nn.Parameter, rows: GroupedRows) -> DeferredDW:
        return DeferredDW(name, p, lambda: _rows_grad(p, [rows], self.scale), rows, self.scale)

    def submit(self, proj_rows: GroupedRows, fc_rows: GroupedRows) -> None:
        """Queue fc2's (proj_w: gy, h) and fc1's (fc_w: da, x) dW GEMMs as grouped rows, in the IR's order
        (fc2 first); d W[e] = g_e^T x_e over expert e's rows."""
        rt = self.runtime
        rt.submit(self._item(self.prefix + "fc2.dW", self.proj_w, proj_rows))
        rt.submit(self._item(self.prefix + "fc1.dW", self.fc_w, fc_rows))


class _Handover(torch.autograd.Function):
    """A scalar that depends on `p`; its backward hands p the gradient held in `box` (and drops it there)."""

    @staticmethod
    def forward(ctx, p, box):
        ctx.box = box
        return p.new_empty(())

    @staticmethod
    def backward(ctx, _g):
        return ctx.box.pop(), None


class WgradRuntime:
    """Queue of deferred dW GEMMs for one model, driven by Algorithm 1's `WgradSchedule.assignment`
    (all-to-all name -> dW names; a dW assigned to no all-to-all runs at once)."""

    def __init__(self, assignment: Mapping[str, Sequence[str]]):
        self.assignment = {a: list(ws) for a, ws in assignment.items()}
        self.owner = {w: a for a, ws in self.assignment.items() for w in ws}
        self.stats = WgradStats()
        self._queue: dict[str, list[DeferredDW]] = defaultdict(list)  # all-to-all -> waiting closures
        self._pool: list[DeferredDW] = []  # closures whose all-to-all was launched, not run yet
        self._started: set[str] = set()  # all-to-alls whose window opened in this backward
        self._uses: dict[torch.nn.Parameter, int] = defaultdict(int)  # forward uses not yet reduced
        self._acc: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._held: dict[torch.nn.Parameter, list[list | GroupedRows]] = defaultdict(list)  # rows to multiply
        self._held_scale: dict[torch.nn.Parameter, float] = {}
        self._flushing = False
        self._callback_queued = False
        self._lane: Optional[streams.Lane] = None  # where S2-window dW runs (side stream / worker thread)

    # ------------------------------------------------------------------ forward side
    def linear(self, name: str) -> Callable:
        """An F.linear(x, weight, bias) replacement deferring dW under `name` (ColumnParallelLinear etc.)."""

        def fn(x: torch.Tensor, weight: torch.nn.Parameter, bias: Optional[torch.Tensor] = None):
            if not self._defers(x, weight):
                return F.linear(x, weight, bias)
            self._uses[weight] += 1
            return _DeferredLinear.apply(x, bias, WeightRef(weight, name, self))

        return fn

    def bmm(self, name: str) -> Callable:
        """(x [E_l,N,I], weight [E_l,O,I], bias [E_l,1,O] or None, scale) -> x W^T + b with dW deferred."""

        def fn(x: torch.Tensor, weight: torch.nn.Parameter, bias_E1O: Optional[torch.Tensor], scale: float):
            if not self._defers(x, weight):  # no weight gradient to defer: the plain GEMM
                wt = weight.transpose(1, 2).to(x.dtype)
                return torch.bmm(x, wt) if bias_E1O is None else torch.baddbmm(bias_E1O, x, wt)
            self._uses[weight] += 1
            return _DeferredBmm.apply(x, bias_E1O, WeightRef(weight, name, self, scale))

        return fn

    def experts(self, prefix: str, fc_w: torch.nn.Parameter, proj_w: torch.nn.Parameter, scale: float) -> ExpertDW:
        """A forward use of grouped experts (`moe.experts`) whose dW GEMMs this runtime runs under
        `prefix` + "fc1.dW" / "fc2.dW" (call only when backward will reach them)."""
        self._uses[fc_w] += 1
        self._uses[proj_w] += 1
        return ExpertDW(self, prefix, fc_w, proj_w, scale)

    @staticmethod
    def _defers(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Defer only when backward will reach this GEMM through x (the weight is no autograd input)."""
        return torch.is_grad_enabled() and weight.requires_grad and x.requires_grad

    def begin_iteration(self) -> None:
        """Forget which all-to-alls ran (call before each forward whose backward follows)."""
        self._started.clear()
        self._callback_queued = False  # a backward that raised never ran its callback

    # ------------------------------------------------------------------ backward side
    def submit(self, item: DeferredDW) -> None:
        """Called from a deferrable GEMM's backward: queue the dW or run it now."""
        a2a = self.owner.get(item.name)
        if a2a is None or a2a in self._started:
            self._run(item)
            self.stats.immediate += 1
            return
        self._queue[a2a].append(item)
        self._flush_at_end()

    def _flush_at_end(self) -> None:
        if not self._callback_queued and not self._flushing:
            # flush whatever is still queued when this backward ends (before gradient sync)
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._callback_queued = True

    def open_window(self, a2a: str) -> None:
        """All-to-all `a2a` was launched: its queued dW closures become runnable (the pool)."""
        self._started.add(a2a)
        self.stats.a2a_windows += 1
        self._pool += self._queue.pop(a2a, [])

    def run_window(self, a2a: str) -> None:
        """Open `a2a`'s window and run every runnable dW now, on this thread."""
        self.open_window(a2a)
        self.fill()

    def fill(self) -> int:
        """Run every runnable dW GEMM now, on this thread; returns how many ran. An all-to-all's backward
        calls it just before waiting, after autograd ran every node it ranks higher (other parts'
        compute). All of them, not "until the bytes arrive" (no timing: module docstring)."""
        t0, n = time.perf_counter(), len(self._pool)
        while self._pool:
            self._run(self._pool.pop(0))
        self.stats.in_window += n
        self.stats.window_ms += 1e3 * (time.perf_counter() - t0)
        return n

    def start_window_async(self, a2a: str):
        """Start the runnable dW GEMMs (with `a2a`'s) on the dW lane; `finish_window_async` joins."""
        self.open_window(a2a)
        items, self._pool = self._pool, []
        if not items:
            return None
        if self._lane is None:
            self._lane = streams.Lane(items[0].param.device, "lancet-dw")

        def compute_all():
            t0 = time.perf_counter()
            out = [item.compute() for item in items]
            t1 = time.perf_counter()
            self.stats.helper_intervals.append((t0, t1))
            return out, 1e3 * (t1 - t0)

        return items, self._lane.submit(compute_all)

    def finish_window_async(self, handle) -> None:
        """Join the dW lane's GEMMs (the caller's stream waits for them) and accumulate them (main thread)."""
        if handle is None:
            return
        items, pending = handle
        grads, ms = pending.wait()
        for item, d in zip(items, grads):
            self._accumulate(item, d)
        self.stats.in_window += len(items)
        self.stats.window_ms += ms

    def flush(self) -> None:
        """Run every queued dW and accumulate every partial sum: all gradients are final after it."""
        self._callback_queued, self._flushing = False, True
        try:
            for a2a in list(self._queue):
                self._pool += self._queue.pop(a2a)
            while self._pool:
                self._run(self._pool.pop(0))
                self.stats.flushed += 1
            for p in list(self._acc) + [q for q in self._held if q not in self._acc]:
                self._finalize(p)  # a forward use whose backward never came: close the sum
            self._uses.clear()
        finally:
            self._flushing = False

    def pending(self) -> int:
        """Number of dW closures queued and not run."""
        return sum(len(v) for v in self._queue.values()) + len(self._pool)

    def close(self) -> None:
        """Stop the dW lane's worker thread (if one was started)."""
        if self._lane is not None:
            self._lane.close()
            self._lane = None

    # ------------------------------------------------------------------ accumulation
    def _run(self, item: DeferredDW) -> None:
        """Run `item` on this thread; with row operands, hold them until the parameter's last use."""
        if item.rows is None:
            self._accumulate(item, item.compute())
            return
        self._mark(item)
        p = item.param
        self._held[p].append(item.rows)
        self._held_scale[p] = item.scale
        self._uses[p] -= 1
        if self._uses[p] <= 0:
            self._finalize(p)
        else:
            self._flush_at_end()  # its other uses' backward may never come: close the sum at the end

    def _mark(self, item: DeferredDW) -> None:
        if item.done:
            raise RuntimeError(f"deferred dW {item.name} ran twice")
        item.done = True
        self.stats.runs[item.name] += 1

    def _accumulate(self, item: DeferredDW, d: torch.Tensor) -> None:
        self._mark(item)
        p = item.param
        if p not in self._acc:  # a fresh tensor of the dW GEMM: the sum accumulates in place, no new buffers
            self._acc[p] = d
        else:
            self._acc[p].add_(d)
        self._uses[p] -= 1
        if self._uses[p] <= 0:
            self._finalize(p)

    def _finalize(self, p: torch.nn.Parameter) -> None:
        d = self._acc.pop(p, None)
        held = self._held.pop(p, None)
        if held:  # the GEMMs of every held use's rows, accumulated into one p-shaped tensor
            self.stats.merged += len(held) > 1
            merged = _rows_grad(p, held, self._held_scale.pop(p, 1.0))
            d = merged if d is None else d.add_(merged)
            del merged
        self._uses.pop(p, None)
        if d is None:
            return
        # AccumulateGrad: sets or adds .grad like the plain backward and fires grad-ready hooks once. Through
        # `_Handover`, whose backward returns the only reference to d: AccumulateGrad then takes d as .grad
        # (no copy); `torch.autograd.backward(p, d)` would clone it, since this frame still holds d
        box = [d]
        del d, held
        with torch.enable_grad():  # inside a backward grad mode is off: the node would not be recorded
            handover = _Handover.apply(p, box)
        torch.autograd.backward(handover, torch.ones((), device=p.device))
