"""Collectives: traced raw operations and autograd functions with the right backward.

Raw functions (`*_raw`) move data and report to the collective observer
(`observer.py`: bytes, group, launch and finish); they work on gloo (CPU) and
NCCL (CUDA) alike. Autograd functions wrap them:

  copy_to_group      fwd identity          bwd all-reduce       (Megatron's f)
  reduce_from_group  fwd all-reduce        bwd identity         (Megatron's g)
  scatter_to_group   fwd keep own chunk    bwd all-gather
  gather_from_group  fwd all-gather        bwd keep own chunk
  all_gather         fwd all-gather        bwd reduce-scatter (sum of every rank's grad)
  reduce_scatter     fwd reduce-scatter    bwd all-gather
  all_to_all         fwd all-to-all        bwd all-to-all with splits swapped

A group of size 1 is a no-op and records nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_moe.distributed import observer
from megatron_moe.distributed.comm_errors import guard
from megatron_moe.profiling import annotate


class _LocalGroup:
    """The group of one process: every collective on it is a no-op."""

    def __repr__(self) -> str:
        return "LOCAL_GROUP"


LOCAL_GROUP = _LocalGroup()


def group_size(group) -> int:
    if group is LOCAL_GROUP or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is LOCAL_GROUP or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- raw


def all_reduce_raw(t: torch.Tensor, group, async_op: bool = False, op: str = "sum"):
    """Reduce `t` in place over `group` (op 'sum' or 'max'); the work handle when async_op."""
    if group_size(group) == 1:
        return None
    rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    token = observer.begin("all_reduce", group, _nbytes(t), _nbytes(t))
    with guard("all_reduce", group):
        work = dist.all_reduce(t, op=rop, group=group, async_op=async_op)
    observer.end_when_complete(token, work if async_op else None)
    return work


def max_over_group(values: list[float], group, device: torch.device, what: str) -> list[float]:
    """`values` reduced element-wise with MAX over `group` (every rank passes as many): a decision taken
    from measured times is then the same on every rank. `what` names the collective in a timeout error."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group_size(group) > 1:
        with guard(what, group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def all_gather_raw(t: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (rank order)."""
    n = group_size(group)
    if n == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    token = observer.begin("all_gather", group, _nbytes(t), n * _nbytes(t))
    with guard("all_gather", group):
        dist.all_gather(parts, t, group=group)
    observer.end(token)
    return torch.cat(parts, dim=dim)


def reduce_scatter_raw(t: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum `t` over the group and keep this rank's 1/n chunk along `dim` (gloo has no reduce-scatter:
    an all-reduce and a local split there, observed as one reduce_scatter)."""
    n = group_size(group)
    if n == 1:
        return t
    if t.size(dim) % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.size(dim)} not divisible by {n}")
    r = group_rank(group)
    token = observer.begin("reduce_scatter", group, _nbytes(t), _nbytes(t) // n)
    if t.is_cuda and dim == 0:
        out = torch.empty((t.size(0) // n, *t.shape[1:]), dtype=t.dtype, device=t.device)
        with guard("reduce_scatter", group):
            dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    else:
        buf = t.contiguous().clone()
        with guard("reduce_scatter", group):
            dist.all_reduce(buf, group=group)
        out = buf.chunk(n, dim=dim)[r].contiguous()
    observer.end(token)
    return out


@annotate("moe/all_to_all")
def all_to_all_raw(
    t: torch.Tensor,
    group,
    out_splits: Optional[Sequence[int]] = None,
    in_splits: Optional[Sequence[int]] = None,
    async_op: bool = False,
    zeros: bool = False,
):
    """All-to-all along dim 0: chunk j of `t` (size in_splits[j]) goes to rank j. Returns the output
    [sum(out_splits), ...] (and the work handle if async_op), allocated empty (`zeros`: zero-filled).
    Even splits when both are None."""
    n = group_size(group)
    if n == 1:
        return (t, None) if async_op else t
    t = t.contiguous()
    row = t.element_size() * (int(torch.Size(t.shape[1:]).numel()))  # bytes per dim-0 row
    if out_splits is None:
        out = torch.zeros_like(t) if zeros else torch.empty_like(t)
        remote = _nbytes(t) - _nbytes(t) // n
    else:
        out = torch.empty((int(sum(out_splits)), *t.shape[1:]), dtype=t.dtype, device=t.device)
        remote = (int(sum(in_splits)) - int(in_splits[group_rank(group)])) * row
    # the observer also tells a2a listeners (Lina holds gradient all-reduce micro-ops back)
    token = observer.begin("all_to_all", group, _nbytes(t), _nbytes(out), remote)
    with guard("all_to_all", group):
        work = dist.all_to_all_single(
            out,
            t,
            output_split_sizes=None if out_splits is None else list(out_splits),
            input_split_sizes=None if in_splits is None else list(in_splits),
            group=group,
            async_op=async_op,
        )
    if async_op:
        return out, observer.Work(work, token)  # in flight until wait()
    observer.end(token)
    return out


# ----------------------------------------------------------------------------- autograd


def _identity(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    return t


def _summed(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """A summed copy of `t` over the group (the input is left alone: autograd may still need it)."""
    t = t.contiguous().clone()
    all_reduce_raw(t, group)
    return t


def _own_chunk(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    return t.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


class _Collective(torch.autograd.Function):
    """fwd(x, group, dim) forward, bwd(grad, group, dim) backward: every collective below but the
    all-to-all (whose autograd node name Lancet's hooks look for)."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return fwd(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g, ctx.group, ctx.dim), None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all_raw(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        return all_to_all_raw(g, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel op)."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, 0, _identity, _summed)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce forward; identity backward (output of a row-parallel op)."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, 0, _summed, _identity)


def scatter_to_group(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of `dim` forward; all-gather backward."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, dim, _own_chunk, all_gather_raw)


def gather_from_group(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward; keep own chunk backward (every rank holds the same grad)."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, dim, all_gather_raw, _own_chunk)


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """All-gather along `dim`; backward reduce-scatters (sums every rank's gradient)."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, dim, all_gather_raw, reduce_scatter_raw)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along `dim`; backward all-gathers."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, dim, reduce_scatter_raw, all_gather_raw)


def all_to_all(
    x: torch.Tensor, group, out_splits: Optional[Sequence[int]] = None, in_splits: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """All-to-all along dim 0 (even or uneven splits); backward is the reverse all-to-all."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(
        x, group, None if out_splits is None else list(out_splits), None if in_splits is None else list(in_splits)
    )


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over `group`, backward sums the gradients too: for ranks that go on to use *different*
    parts of the sum (ESP all-reduce, then split); `reduce_from_group` when all use all of it."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, 0, _summed, _summed)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by `scale` backward."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)
