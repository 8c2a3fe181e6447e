"""Lina's all-to-all micro-ops pipelined with the expert FFN (Lina section 4.2, Figure 8b).

Legend: E experts (E_l = E / N_EP local), G routing groups, C capacity, Cs slots per group,
GC = G * Cs buffer columns, w columns (or slots) of one chunk, M model dim, T tokens,
D = N_EP * N_ESP ranks of the token all-to-all.

The dispatch all-to-all is split into `chunks` micro-ops by token slots; every chunk's dispatch
is launched up front (`a2a.start`), then chunk by chunk: wait for chunk i, run the experts on it
while chunk i+1 is on the wire, and launch its return as soon as its FFN is done; the outputs are
waited for at the end. Backward mirrors it through the handles. Experts are row-wise, so splitting
by slots changes no value (fp32 sums in another order); routing (hence dropping) is done once,
before the split.

  baseline (PaddedDispatcher "baseline"): the buffer [E, GC, M] split into column
      ranges; per chunk ESP all-gather, EP all-to-all, experts, ESP all-reduce,
      EP all-to-all back; the ESP split after the concatenation.
  s2 (PaddedDispatcher "s2"): the buffer [E, G, N_MP, C_mp, M] split along C_mp;
      per chunk own MP slots (`scatter_to_group`), local dump, EP x ESP all-to-all,
      experts, return all-to-all, local combine (sum of the N_ESP partials), MP
      all-gather (`gather_from_group`). SAA's chunking is replaced by this one.
  s1 / uneven (UnevenDispatcher, rows grouped by expert): chunk j keeps the choices
      with slot in its range (the others count as dropped *for that chunk only*);
      each chunk has its own plan (a count exchange) and handles; the layer output
      is the sum of the chunks' combines (a token's k choices may sit in different chunks).
One rank holding every expert sends nothing: its chunks are the padded buffer's column ranges
(`PaddedDispatcher.padded_plan`). Dropless (`MoELayer.set_pipeline_chunks`) and Lancet's deferred dW
(`check_supported`) are refused.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_moe.distributed.collectives import all_gather, all_reduce, gather_from_group, scatter_to_group
from megatron_moe.moe import a2a
from megatron_moe.moe.dispatcher import PaddedDispatcher, TokenDispatcher, UnevenDispatcher, combine, dispatch
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.router import RouteResult
from megatron_moe.profiling import annotate

DROPLESS_ERROR = "--lina-pipeline-chunks cannot be combined with --moe-dropless"
DW_ERROR = "--lina-pipeline-chunks cannot be combined with --lancet-wgrad"


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """`min(n, chunks)` contiguous non-empty ranges covering [0, n), sizes differing by at most one."""
    c = max(1, min(n, chunks))
    edges = [n * j // c for j in range(c + 1)]
    return [(edges[j], edges[j + 1]) for j in range(c)]


def check_supported(d: TokenDispatcher) -> None:
    """Raise ValueError naming the flag when the dispatcher cannot be pipelined."""
    if d.dw is not None:
        raise ValueError(DW_ERROR)


def pipelined_moe(
    d: TokenDispatcher, experts: Experts, x_TM: torch.Tensor, routes: list[RouteResult], chunks: int
) -> torch.Tensor:
    """Dispatch -> experts -> combine of tokens x [T, M] routed by `routes`, in `chunks`
    pipelined micro-ops; returns y [T, M], the value of the unsplit layer."""
    check_supported(d)
    if isinstance(d, UnevenDispatcher):
        return _uneven(d, experts, x_TM, routes, chunks)
    if isinstance(d, PaddedDispatcher) and d.mode == "s2":
        return _s2(d, experts, x_TM, routes, chunks)
    if isinstance(d, PaddedDispatcher):
        return _baseline(d, experts, x_TM, routes, chunks)
    raise ValueError(f"--lina-pipeline-chunks: no pipelined form of dispatcher {type(d).__name__}")


def _baseline(
    d: PaddedDispatcher, experts: Experts, x_TM: torch.Tensor, routes: list[RouteResult], chunks: int
) -> torch.Tensor:
    plan = d.padded_plan(routes)
    E, M, GC = d.num_experts, x_TM.size(1), plan.groups * plan.slots
    E_l, n_ep, n_esp = d.num_local, d.n_ep, d.n_esp
    esp, ep = d.ps.group("esp"), d.ps.group("ep")
    with annotate("moe/dispatch"):
        buf = dispatch(x_TM, plan.idx, E * GC).view(E, GC, M)
        bounds = chunk_bounds(GC, chunks)
        sent = []
        for lo, hi in bounds:  # every chunk's dispatch goes on the wire now
            w = hi - lo
            gathered = all_gather(buf[:, lo:hi].reshape(1, E, w, M), esp, dim=0)  # [N_ESP, E, w, M]
            send = gathered.transpose(0, 1).reshape(n_ep, E_l, n_esp, w, M)  # by destination EP rank
            op = a2a.A2AHandle(ep)
            sent.append((a2a.start(send, op), op, w))
    back = []
    for recv, op, w in sent:  # experts on chunk i while chunk i+1 travels
        x_in = a2a.finish(recv, op).permute(1, 0, 2, 3, 4).reshape(E_l, n_ep * n_esp * w, M)
        y = all_reduce(experts(x_in, d.grad_scale), esp)  # sum of the H slices
        ret = y.reshape(E_l, n_ep, n_esp, w, M).permute(1, 0, 2, 3, 4).contiguous()
        rop = a2a.A2AHandle(ep)
        back.append((a2a.start(ret, rop), rop, w))
    with annotate("moe/combine"):
        outs = [a2a.finish(r, rop).reshape(E, n_esp, w, M)[:, d.ps.rank("esp")] for r, rop, w in back]
        out = torch.cat(outs, dim=1)  # [E, GC, M]
        return combine(out.reshape(E * GC, M), plan.idx, plan.tokens)


def _s2(
    d: PaddedDispatcher, experts: Experts, x_TM: torch.Tensor, routes: list[RouteResult], chunks: int
) -> torch.Tensor:
    plan = d.padded_plan(routes)
    E, M, G = d.num_experts, x_TM.size(1), plan.groups
    E_l, n_ep, n_esp, n_mp = d.num_local, d.n_ep, d.n_esp, d.n_mp
    C_mp = plan.slots // n_mp
    mp, group = d.ps.group("mp"), d.ps.group("ep_esp")
    with annotate("moe/dispatch"):
        buf = dispatch(x_TM, plan.idx, E * G * plan.slots).view(E, G, n_mp, C_mp, M)
        sent = []
        for lo, hi in chunk_bounds(C_mp, chunks):
            w = hi - lo
            own = scatter_to_group(buf[:, :, :, lo:hi], mp, dim=2)  # [E, G, 1, w, M]
            dump = own.reshape(n_ep, 1, E_l, G * w, M).expand(n_ep, n_esp, E_l, G * w, M)
            op = a2a.A2AHandle(group)
            sent.append((a2a.start(dump.reshape(n_ep * n_esp, E_l, G * w, M), op), op, w))
    back = []
    for recv, op, w in sent:
        x_in = a2a.finish(recv, op).permute(1, 0, 2, 3).reshape(E_l, -1, M)  # [E_l, D*G*w, M]
        y = experts(x_in, d.grad_scale)
        ret = y.reshape(E_l, n_ep * n_esp, G * w, M).permute(1, 0, 2, 3).contiguous()
        rop = a2a.A2AHandle(group)
        back.append((a2a.start(ret, rop), rop, w))
    with annotate("moe/combine"):
        outs = []
        for r, rop, w in back:
            part = a2a.finish(r, rop).view(n_ep, n_esp, E_l, G * w, M).sum(dim=1)  # local combine
            outs.append(gather_from_group(part.reshape(E, G, 1, w, M), mp, dim=2))  # [E, G, N_MP, w, M]
        out = torch.cat(outs, dim=3)  # [E, G, N_MP, C_mp, M]
        return combine(out.reshape(-1, M), plan.idx, plan.tokens)


def _uneven(
    d: UnevenDispatcher, experts: Experts, x_TM: torch.Tensor, routes: list[RouteResult], chunks: int
) -> torch.Tensor:
    with annotate("moe/dispatch"):
        plans = []
        for lo, hi in chunk_bounds(routes[0].capacity, chunks):  # slot ranges; one plan (count exchange) each
            part = [
                replace(r, slot=torch.where((r.slot >= lo) & (r.slot < hi), r.slot, torch.full_like(r.slot, -1)))
                for r in routes
            ]
            plans.append(d.plan(part))
        for plan in plans:
            d.dispatch_start(x_TM, plan)
    for plan in plans:
        with annotate("moe/experts"):
            d.combine_start(experts.forward_ragged(d.dispatch_finish(plan), plan.expert_rows, d.grad_scale), plan)
    with annotate("moe/combine"):
        y = d.combine_finish(plans[0])
        for plan in plans[1:]:
            y = y + d.combine_finish(plan)
        return y
