"""The dispatchers' token all-to-all as a handle: launched in one step, waited for in another.

Legend: R rows (tokens) of a message, M model dim, D ranks of the all-to-all group.

`start(send, op)` launches an all-to-all (even, or uneven with `op.send_splits` /
`op.recv_splits`) asynchronously and returns the receive rows, valid after
`finish(recv, op)`; between the two a pipeline may compute (Lancet's parts).
Backward mirrors it: `finish`'s backward launches the reverse all-to-all of the
gradient and opens the dW window `op.name` of the weight-gradient queue `op.dw`
(`WgradRuntime.open_window`); `start`'s backward runs the runnable dW while the
bytes are in flight (`fill`), then waits. Every message is recorded by the
collective observer (which also tells Lina that an all-to-all is in flight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed import comm_errors, observer
from megatron_moe.distributed.collectives import all_to_all_raw, group_rank, group_size
from megatron_moe.profiling import annotate


@annotate("moe/all_to_all")
def _launch(
    send: torch.Tensor, out: torch.Tensor, group, send_splits: Optional[list[int]], recv_splits: Optional[list[int]]
):
    """Async all_to_all_single of `send` [R, ...] into `out`; returns the work (observed until `wait`)."""
    row = send.element_size() * int(torch.Size(send.shape[1:]).numel())
    mine = send.size(0) // group_size(group) if send_splits is None else send_splits[group_rank(group)]
    token = observer.begin(
        "all_to_all",
        group,
        send.numel() * send.element_size(),
        out.numel() * out.element_size(),
        (send.size(0) - mine) * row,
    )
    work = dist.all_to_all_single(
        out, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group, async_op=True
    )
    if token is not None and token.event is not None:  # the logged finish is the transfer's, not the wait's
        work.get_future().then(lambda _f: observer.stamp_finish(token.event))
    return observer.Work(work, token)


def exchange_counts(counts_DX: torch.Tensor, group) -> torch.Tensor:
    """Even all-to-all of counts [D, X] (row j goes to rank j); returns [D, X] (row j from rank j), on the
    counts' device (the caller reads them on the host once, with the counts it sent)."""
    if group_size(group) == 1:
        return counts_DX.clone()
    # received into zeros: a rank whose peers send nothing (a fake process group) plans for no tokens
    return all_to_all_raw(counts_DX.to(torch.int64).contiguous(), group, zeros=True)


@dataclass
class A2AHandle:
    """One token all-to-all of a dispatcher and its reverse in backward.

    send_splits[j] / recv_splits[j]: rows sent to / received from rank j (None: even);
    name: the IR name of its backward all-to-all, the dW window it opens in `dw`.
    """

    group: object
    send_splits: Optional[list[int]] = None
    recv_splits: Optional[list[int]] = None
    name: Optional[str] = None
    dw: Optional[object] = None  # a weight-gradient queue (lancet.wgrad_runtime.WgradRuntime)
    _work: object = None
    _send: object = None  # keeps the send buffer alive while the message is in flight
    _bwd: tuple = ()

    def reverse(self, name: Optional[str] = None) -> "A2AHandle":
        """The handle of the all-to-all that sends the received rows back."""
        return A2AHandle(self.group, self.recv_splits, self.send_splits, name, self.dw)

    def _out_rows(self, send: torch.Tensor, splits: Optional[list[int]]) -> torch.Tensor:
        n = send.size(0) if splits is None else sum(splits)
        return send.new_empty((n, *send.shape[1:]))


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_RM, op: A2AHandle):
        ctx.op = op
        op._send = send_RM.contiguous()
        recv = op._out_rows(op._send, op.recv_splits)
        op._work = _launch(op._send, recv, op.group, op.send_splits, op.recv_splits)
        return recv

    @staticmethod
    def backward(ctx, _g):
        out, work, _ = ctx.op._bwd
        if ctx.op.dw is not None:
            ctx.op.dw.fill()  # dW GEMMs while the gradient is on the wire
        comm_errors.wait(work, "all_to_all", ctx.op.group)
        ctx.op._bwd = ()
        return out, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv_RM, op: A2AHandle):
        ctx.op = op
        comm_errors.wait(op._work, "all_to_all", op.group)
        op._work = op._send = None
        return recv_RM

    @staticmethod
    def backward(ctx, g):
        op = ctx.op
        g = g.contiguous()
        out = op._out_rows(g, op.send_splits)
        op._bwd = (out, _launch(g, out, op.group, op.recv_splits, op.send_splits), g)
        if op.dw is not None and op.name is not None:
            op.dw.open_window(op.name)  # its dW may run from now on (`_Start.backward`)
        return g, None


class _WindowOnly(torch.autograd.Function):
    """Group of one: no message, but the backward still marks the all-to-all's place for dW."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        return x

    @staticmethod
    def backward(ctx, g):
        ctx.op.dw.run_window(ctx.op.name)
        return g, None


def start(send_RM: torch.Tensor, op: A2AHandle) -> torch.Tensor:
    """Launch the all-to-all; the returned rows are valid after `finish`."""
    if group_size(op.group) == 1:
        return send_RM
    return _Start.apply(send_RM, op)


def finish(recv_RM: torch.Tensor, op: A2AHandle) -> torch.Tensor:
    """Wait for the all-to-all started by `start`; returns the received rows."""
    if group_size(op.group) == 1:
        if op.dw is not None and op.name is not None and recv_RM.requires_grad:
            recv_RM = _WindowOnly.apply(recv_RM, op)
        return recv_RM
    return _Finish.apply(recv_RM, op)


def run(send_RM: torch.Tensor, op: A2AHandle) -> torch.Tensor:
    """`start` then `finish`: the synchronous all-to-all."""
    return finish(start(send_RM, op), op)


class _OpenAsync(torch.autograd.Function):
    """Backward (runs first): start the dW of window `name` on the queue's worker thread."""

    @staticmethod
    def forward(ctx, x, dw, name, box):
        ctx.dw, ctx.name, ctx.box = dw, name, box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.box.append(ctx.dw.start_window_async(ctx.name))
        return g, None, None, None


class _CloseAsync(torch.autograd.Function):
    """Backward (runs after the wrapped all-to-all's backward): join the worker thread's dW."""

    @staticmethod
    def forward(ctx, x, dw, box):
        ctx.dw, ctx.box = dw, box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.box:
            ctx.dw.finish_window_async(ctx.box.pop())
        return g, None, None


def dw_window(fn, x: torch.Tensor, dw, name: Optional[str]) -> torch.Tensor:
    """y = fn(x) for a synchronous communicating step (S2's all-to-alls), with the dW of window
    `name` running on a worker thread while its backward communicates."""
    if dw is None or name is None or not (torch.is_grad_enabled() and x.requires_grad):
        return fn(x)
    box: list = []
    return _OpenAsync.apply(fn(_CloseAsync.apply(x, dw, box)), dw, name, box)
