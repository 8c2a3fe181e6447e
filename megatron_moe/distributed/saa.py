"""SAA: Parm's overlapped "all-to-all, then all-gather" (S2's return path).

Legend: D = N_EP * N_ESP all-to-all peers (ranks of the EP x ESP group, ESP fastest), E_l local
experts, E = N_EP * E_l experts, N slots per expert held by this rank, M model dim, N_MP size of
the MP group.

`a2a_combine_gather(send [D, E_l, N, M])`, the rank's partial expert outputs by destination:

  1. the return all-to-all over the EP x ESP group: block d goes to peer d; from every peer
     (ep, j) this rank receives the partials [E_l, N, M] ESP shard j of EP rank ep computed;
  2. the local combine: the sum of the N_ESP partials of each expert -> [E, N, M];
  3. the MP all-gather of that buffer -> [N_MP, E, N, M] (rank order).

`overlap=True` (SAA) cuts the slot dim N into chunks: chunk i+1's all-to-all is in flight while
chunk i is combined and all-gathered, so the inter-node all-to-all and the intra-node all-gather
share the time. `overlap=False` (AAS): one all-to-all, then one all-gather. Both give bit-identical
results and move the same bytes.

CPU (gloo): async collectives on two process groups (each with its own worker thread). CUDA: the
all-to-all chunk is a batch of isend/irecv (NCCL's point-to-point stream), the all-gather an async
collective; the whole pipeline is issued on the side stream "saa" (`streams.on_side`, which first
waits for the caller's stream), and the caller's stream waits on it once at the end rather than at
every chunk, so no chunk's wait stalls compute. Tensors allocated inside live and die on the side
stream; `out` (allocated on the caller's stream) is read only after that final wait. `p2p=True`
forces isend/irecv on CPU too.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed import observer, streams
from megatron_moe.distributed.collectives import all_to_all_raw, group_rank, group_size
from megatron_moe.distributed.comm_errors import guard
from megatron_moe.profiling import annotate

SAA_CHUNKS = 4  # pipeline depth: enough to hide one operation behind the other, few extra latencies


def _wait(work, collective: str, group) -> None:
    """Wait for one work or a list of them; a timeout or lost peer becomes a CommError."""
    if work is None:
        return
    with guard(collective, group):
        for w in work if isinstance(work, list) else [work]:
            w.wait()


def all_gather_start(t: torch.Tensor, group):
    """Start an all-gather of `t` over `group`; returns (parts list in rank order, work or None)."""
    n = group_size(group)
    if n == 1:
        return [t], None
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    nbytes = t.numel() * t.element_size()
    token = observer.begin("all_gather", group, nbytes, n * nbytes)
    return parts, observer.Work(dist.all_gather(parts, t, group=group, async_op=True), token)


@annotate("moe/all_to_all")
def all_to_all_p2p_start(t: torch.Tensor, group):
    """Start an even all-to-all along dim 0 as one batch of isend/irecv; returns (out, works).

    Observed as an all_to_all with the same byte counts as `all_to_all_raw`
    (Lina sees it in flight until `wait`).
    """
    n = group_size(group)
    if n == 1:
        return t, None
    t = t.contiguous()
    out = torch.empty_like(t)
    me = group_rank(group)
    nbytes = t.numel() * t.element_size()
    send, recv = t.chunk(n), out.chunk(n)
    recv[me].copy_(send[me])
    ops = []
    for i in range(n):
        if i != me:
            peer = dist.get_global_rank(group, i)
            ops.append(dist.P2POp(dist.isend, send[i], peer, group))
            ops.append(dist.P2POp(dist.irecv, recv[i], peer, group))
    token = observer.begin("all_to_all", group, nbytes, nbytes, nbytes - nbytes // n)
    return out, observer.Work(dist.batch_isend_irecv(ops), token)  # one interval, ended after the last


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    step = -(-n // parts)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def a2a_combine_gather(
    send_DLNM: torch.Tensor,
    a2a_group,
    mp_group,
    n_esp: int,
    overlap: bool = True,
    chunks: int = SAA_CHUNKS,
    p2p: Optional[bool] = None,
) -> torch.Tensor:
    """[D, E_l, N, M] partials by destination -> [N_MP, E, N, M] combined, MP-gathered outputs.

    See the module docstring. `p2p` None: isend/irecv on CUDA, a collective on CPU.
    """
    D, E_l, N, M = send_DLNM.shape
    if D % n_esp:
        raise ValueError(f"{D} all-to-all peers are not a multiple of N_ESP {n_esp}")
    n_ep, n_mp = D // n_esp, group_size(mp_group)
    if p2p is None:
        p2p = send_DLNM.is_cuda
    out = send_DLNM.new_empty(n_mp, n_ep * E_l, N, M)

    def start_a2a(a: int, b: int):
        piece = send_DLNM[:, :, a:b].contiguous()
        if p2p:
            return all_to_all_p2p_start(piece, a2a_group)
        return all_to_all_raw(piece, a2a_group, async_op=True)

    def start_gather(recv: torch.Tensor, a: int, b: int):
        # local combine: sum the N_ESP partial outputs of each expert (no ESP all-reduce)
        combined = recv.view(n_ep, n_esp, E_l, b - a, M).sum(dim=1).reshape(n_ep * E_l, b - a, M)
        return all_gather_start(combined, mp_group)

    bounds = _chunks(N, chunks) if overlap else [(0, N)]
    if N == 0:
        bounds = [(0, 0)]
    dev = send_DLNM.device
    with streams.on_side(dev, "saa") as side:
        pending = start_a2a(*bounds[0])
        gathers = []
        for i, (a, b) in enumerate(bounds):
            recv, work = pending
            _wait(work, "all_to_all", a2a_group)  # on CUDA: the side stream waits, not the host
            if i + 1 < len(bounds):
                pending = start_a2a(*bounds[i + 1])  # chunk i+1 travels while ...
            gathers.append((start_gather(recv, a, b), a, b))  # ... chunk i goes to the MP peers
        for (parts, work), a, b in gathers:
            _wait(work, "all_gather", mp_group)
            out[:, :, a:b] = torch.stack(parts)
    streams.wait_stream(streams.current_stream(dev), side)  # the caller reads `out` after the pipeline
    return out
