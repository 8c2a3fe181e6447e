"""Irregular all-to-all for Lancet's partitioned MoE layer: only real tokens travel.

Legend: R rows (tokens) of a message, M model dim, D ranks of the all-to-all
group (destinations = sources), E_l local experts per rank.

A part of a batch routes a different number of tokens to each expert, so its
dispatch cannot be an even all-to-all of a capacity-padded buffer without
sending padding. Lancet's irregular all-to-all is two messages:
  1. `exchange_counts`: an even all-to-all of the per-(destination, local
     expert) counts [D, E_l] (int64), over a separate process group so it never
     queues behind token traffic of earlier parts;
  2. an uneven all-to-all of the real rows only; each rank receives into a
     buffer of fixed maximum shape [max_rows, M] (the most it can ever
     receive), filling the prefix the counts announce.

The token all-to-all is asynchronous in both directions and split into two
autograd functions so pipelined parts overlap it with compute:
  forward   `start`: launch, return the (still filling) receive view;
            `finish`: wait, return the rows.
  backward  `finish`'s backward launches the reverse all-to-all of the
            gradient and opens the window of the dW GEMMs Algorithm 1
            assigned to it (`WgradRuntime.open_window`); `start`'s backward
            runs the runnable dW while the bytes are in flight, then waits.
Autograd runs other ready nodes (other parts' compute) between the two.
Every message is recorded in the comm tracer (op "all_to_all", remote_sent =
bytes to other ranks) and in the event log / all-to-all listeners (Lina).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_moe.distributed import comm_errors, events
from megatron_moe.distributed.collectives import group_rank, group_size
from megatron_moe.distributed.tracer import group_name, record
from megatron_moe.profiling import annotate


@annotate("moe/all_to_all")
def _launch(send: torch.Tensor, out: torch.Tensor, group, send_splits: Sequence[int],
            recv_splits: Sequence[int]):
    """Async uneven all_to_all_single of `send` [R, ...] into `out` (contiguous); returns the work."""
    row = send.element_size() * int(torch.Size(send.shape[1:]).numel())
    remote = (int(sum(send_splits)) - int(send_splits[group_rank(group)])) * row
    record("all_to_all", group_name(group), send.numel() * send.element_size(),
           out.numel() * out.element_size(), remote)
    token = events.a2a_begin(group_name(group), send.numel() * send.element_size()) if events.ACTIVE else None
    work = dist.all_to_all_single(out, send, output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=group, async_op=True)
    return events.A2AWork(work, token) if token is not None else work


def exchange_counts(counts_DX: torch.Tensor, group) -> torch.Tensor:
    """Even all-to-all of counts [D, X] (row j goes to rank j); returns [D, X] (row j from rank j)."""
    if group_size(group) == 1:
        return counts_DX.clone()
    send = counts_DX.to(torch.int64).contiguous()
    out = torch.empty_like(send)
    comm_errors.wait(_launch(send, out, group, [1] * send.size(0), [1] * send.size(0)), "all_to_all", group)
    return out


@dataclass
class IrregularA2A:
    """One irregular token all-to-all and its reverse in backward.

    send_splits[j]: rows this rank sends to rank j; recv_splits[j]: rows it
    receives from rank j; max_rows: rows of the fixed receive buffer; name:
    the IR name of its backward all-to-all (for dW windows) or None.
    """

    group: object
    send_splits: list[int]
    recv_splits: list[int]
    max_rows: int
    name: Optional[str] = None
    wgrad: Optional[object] = None        # WgradRuntime
    _work: object = None
    _send: object = None                  # keeps the send buffer alive while the message is in flight
    _bwd: tuple = ()

    def __post_init__(self) -> None:
        if sum(self.recv_splits) > self.max_rows:
            raise ValueError(f"irregular all-to-all receives {sum(self.recv_splits)} rows, more than its "
                             f"fixed buffer of {self.max_rows}")


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_RM, op: IrregularA2A):
        ctx.op = op
        buf = send_RM.new_empty((op.max_rows, *send_RM.shape[1:]))      # fixed maximum shape
        recv = buf[:sum(op.recv_splits)]
        op._send = send_RM.contiguous()
        op._work = _launch(op._send, recv, op.group, op.send_splits, op.recv_splits)
        return recv

    @staticmethod
    def backward(ctx, _g):
        out, work, _ = ctx.op._bwd
        if ctx.op.wgrad is not None:
            ctx.op.wgrad.fill()                 # dW GEMMs while the gradient is on the wire
        comm_errors.wait(work, "all_to_all", ctx.op.group)
        ctx.op._bwd = ()
        return out, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv_RM, op: IrregularA2A):
        ctx.op = op
        comm_errors.wait(op._work, "all_to_all", op.group)
        op._work = op._send = None
        return recv_RM

    @staticmethod
    def backward(ctx, g):
        op = ctx.op
        g = g.contiguous()
        out = g.new_empty((sum(op.send_splits), *g.shape[1:]))
        op._bwd = (out, _launch(g, out, op.group, op.recv_splits, op.send_splits), g)
        if op.wgrad is not None and op.name is not None:
            op.wgrad.open_window(op.name)       # its dW may run from now on (`_Start.backward`)
        return g, None


def start(send_RM: torch.Tensor, op: IrregularA2A) -> torch.Tensor:
    """Launch the token all-to-all; the returned rows [sum(recv_splits), M] are valid after `finish`."""
    if group_size(op.group) == 1:
        return send_RM
    return _Start.apply(send_RM, op)


def finish(recv_RM: torch.Tensor, op: IrregularA2A) -> torch.Tensor:
    """Wait for the token all-to-all started by `start`; returns the received rows."""
    if group_size(op.group) == 1:
        if op.wgrad is not None and op.name is not None and recv_RM.requires_grad:
            recv_RM = _WindowOnly.apply(recv_RM, op)   # still a dW window, with nothing in flight
        return recv_RM
    return _Finish.apply(recv_RM, op)


class _WindowOnly(torch.autograd.Function):
    """Group of one: no message, but the backward still marks the all-to-all's place for dW."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        return x

    @staticmethod
    def backward(ctx, g):
        ctx.op.wgrad.run_window(ctx.op.name)
        return g, None
