"""Kept rows: which rows of a padded expert input hold a kept token, and which path the experts take.

Legend: G routing groups, E experts (E_l local ones), D = N_EP * N_ESP ranks of the EP x ESP group
(sources, in that group's rank order), Cs slots one source sends per (group, expert) block (C in
the baseline, C_mp in S2), N = D * G * Cs rows per local expert, K kept rows.

The capacity-padded dispatchers lay the expert input out as blocks of Cs rows, one block per
(source, group) and local expert. The router gives the kept choices of an expert slots 0, 1, ...
(a prefix of its capacity), so a source knows how many leading rows of each block it sends may hold
a token: `sent_rows` (the highest kept slot + 1, so the index stays exact even if a router left
holes). The sources exchange these [G, E] counts (`exchange_sent_rows`: one small all-gather over
the EP x ESP group, launched asynchronously in `plan`, waited for only once the dispatch all-to-all
is on the wire), and `padded_kept_rows` turns them into the kept rows of this rank's received
buffer, grouped by local expert. The dispatcher gathers exactly those rows for the experts
(`PaddedDispatcher.dispatch`) and scatters their outputs back into the padded return buffer: rows
that hold no token never reach a GEMM; their outputs are zero and never read (the combine reads
kept rows only), and their gradients are zero either way. With the counts in the dispatch all-to-all
and every block's kept slots leading it (`PaddedPlan.dense`: the router fills slots as a prefix), the
rows a receiver computes are exactly the rows its sender filled, so those rows of the travelling
buffers and of their gradients are left unwritten instead of zero-filled: nothing reads them.

Which path (PATHS: the padded compute, kept rows, or kept rows with the all-to-alls pipelined by
local expert) a layer takes is decided the same on every rank from the layout and the flags
(`MoELayer.expert_path`): kept rows need the counts on the host (a sync per layer), so with several
ranks the default is the padded compute; --moe-expert-path kept / overlap ask for kept rows.

With one ESP rank, the baseline sends the counts inside its dispatch all-to-all instead (no collective of
their own): every destination block of the send buffer ends with header rows holding the counts as
integers (`write_header`; `read_header` and `received_kept_rows` on the receiver).

The uneven dispatcher (S1) already knows where every received row lands: `uneven_kept_rows`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_moe.distributed import observer
from megatron_moe.distributed.collectives import group_size
from megatron_moe.moe.router import RouteResult


class KeptRows:
    """rows [K] flat indices into the expert input viewed as [E_l * N, M], ascending, so grouped
    by local expert; counts [E_l] rows of each local expert (sum K; derived from the segments when
    those are given); segments (when the rows come
    as runs of consecutive rows, as every padded layout's kept slots do): per local expert, its
    row ranges [lo, hi) in the same flat coordinates, in the rows' order. The experts then multiply
    those row ranges where they lie (`Experts.forward_segments`) instead of gathering them. Either
    given, or computed on first use by `resolve()` (which waits for the count exchange and returns a
    KeptRows). Rows given as segments only are built from them on first use of `rows`."""

    def __init__(
        self,
        rows: Optional[torch.Tensor] = None,
        counts: Optional[list[int]] = None,
        resolve: Optional[Callable[[], "KeptRows"]] = None,
        segments: Optional[list[list[tuple[int, int]]]] = None,
        device: Optional[torch.device] = None,
    ):
        self._rows, self._counts, self._resolve = rows, counts, resolve
        self._segments, self._device = segments, device

    def _ready(self) -> None:
        if self._resolve is not None:
            got = self._resolve()
            self._rows, self._counts, self._segments, self._device = got._rows, got._counts, got._segments, got._device
            self._resolve = None

    @property
    def rows(self) -> torch.Tensor:
        self._ready()
        if self._rows is None and self._segments is not None:
            dev = self._device if self._device is not None else torch.device("cpu")
            ranges = [torch.arange(lo, hi, dtype=torch.int64, device=dev) for segs in self._segments for lo, hi in segs]
            self._rows = torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.int64, device=dev)
        assert self._rows is not None, "KeptRows needs rows, segments or a resolve function"
        return self._rows

    @property
    def counts(self) -> list[int]:
        self._ready()
        if self._counts is None and self._segments is not None:
            self._counts = [sum(hi - lo for lo, hi in segs) for segs in self._segments]
        assert self._counts is not None, "KeptRows needs counts, segments or a resolve function"
        return self._counts

    @property
    def segments(self) -> Optional[list[list[tuple[int, int]]]]:
        """Per local expert, its kept rows as ranges [lo, hi) (None: only `rows` are known)."""
        self._ready()
        return self._segments


def block_segments(starts: list[int], lengths: list[int], num_local: int) -> list[list[tuple[int, int]]]:
    """Kept rows as runs: block b (local expert b // (len / num_local)) holds rows [starts[b], starts[b] +
    lengths[b]); empty blocks are left out."""
    per = len(starts) // num_local
    return [
        [(s, s + n) for s, n in zip(starts[e * per : (e + 1) * per], lengths[e * per : (e + 1) * per]) if n]
        for e in range(num_local)
    ]


def sent_rows(routes: list[RouteResult], lo: int = 0, width: int | None = None) -> torch.Tensor:
    """Rows of each (group, expert) block that a source sends which may hold a kept token, [G, E] int64.

    The block holds slots [lo, lo + width) of each expert (S2: an MP rank's share; default
    the whole capacity): highest kept slot + 1, minus lo, clipped to [0, width]."""
    width = routes[0].capacity if width is None else width
    out = []
    for r in routes:
        E = r.counts.numel()
        top = torch.full((E,), -1, dtype=torch.int64, device=r.slot.device)
        kept = r.slot >= 0
        top = top.scatter_reduce(0, r.expert[kept], r.slot[kept], reduce="amax")
        out.append((top + 1 - lo).clamp(min=0, max=width))
    return torch.stack(out)


def exchange_sent_rows(rows_GE: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """Launch the all-gather of every source's `sent_rows` over the EP x ESP group (int32; recorded by
    the collective observer); returns the wait: [D, G, E] int64 (group rank order), on CPU."""
    n = group_size(group)
    if n == 1:
        return lambda: rows_GE.cpu()[None]
    send = rows_GE.to(torch.int32).contiguous()
    parts = [torch.empty_like(send) for _ in range(n)]
    token = observer.begin("all_gather", group, send.numel() * 4, n * send.numel() * 4)
    work = dist.all_gather(parts, send, group=group, async_op=True)
    observer.end_when_complete(token, work)  # recorded as finished even if no one waits

    def wait() -> torch.Tensor:
        work.wait()
        return torch.stack(parts).to(torch.int64).cpu()

    return wait


def padded_kept_rows_later(
    wait: Callable[[], torch.Tensor],
    ep_rank: int,
    num_local: int,
    block: int,
    device: torch.device,
    n_esp: Optional[int] = None,
) -> KeptRows:
    """`padded_kept_rows` once the count exchange `wait` returns (on first use of the rows)."""

    return KeptRows(resolve=lambda: padded_kept_rows(wait(), ep_rank, num_local, block, device, n_esp))


def padded_kept_rows(
    rows_DGE: torch.Tensor,
    ep_rank: int,
    num_local: int,
    block: int,
    device: torch.device,
    n_esp: Optional[int] = None,
) -> KeptRows:
    """The kept rows of this rank's expert input from every source's `sent_rows` (experts
    ep_rank*E_l ... of each source's blocks), grouped by local expert, then source, group, slot.

    Rows index the expert input [E_l, D*G*block, M] (default), or, with `n_esp`, the baseline's
    received buffer [N_EP, E_l, N_ESP, G*block, M] as it comes off the all-to-all (source d =
    ep*N_ESP + esp), so the kept rows are gathered from it directly, with no reordering copy."""
    D, G, _ = rows_DGE.shape
    L = num_local
    n_LB = rows_DGE[:, :, ep_rank * L : (ep_rank + 1) * L].permute(2, 0, 1).reshape(-1)  # [E_l*D*G]
    host = n_LB.device
    if n_esp is None:  # block (e, d, g) of the expert input starts at ((e*D + d)*G + g) * block
        starts = torch.arange(n_LB.numel(), dtype=torch.int64, device=host) * block
    else:  # block (e, d = ep*N_ESP + esp, g) of the received buffer: (((ep*E_l + e)*N_ESP + esp)*G + g) * block
        e = torch.arange(L, dtype=torch.int64, device=host).view(L, 1, 1)
        d = torch.arange(D, dtype=torch.int64, device=host).view(1, D, 1)
        g = torch.arange(G, dtype=torch.int64, device=host).view(1, 1, G)
        starts = ((((d // n_esp) * L + e) * n_esp + d % n_esp) * G + g).reshape(-1) * block
    return KeptRows(segments=block_segments(starts.tolist(), n_LB.tolist(), L), device=device)


# Integer views of an expert input's element size: the header rows that carry the counts in the dispatch
# all-to-all hold them as integers of the tokens' own bytes (`write_header` / `read_header`).
HEADER_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def header_int(dtype: torch.dtype, block: int) -> Optional[torch.dtype]:
    """The integer dtype the counts travel as inside a buffer of `dtype` (None: they do not fit; use
    `exchange_sent_rows`). Counts are at most `block`."""
    itype = HEADER_INTS.get(dtype.itemsize)
    return itype if itype is not None and block <= torch.iinfo(itype).max else None


def header_rows(num_counts: int, width: int) -> int:
    """Rows of `width` elements that hold `num_counts` counts."""
    return -(-num_counts // width)


def write_header(buf_DRM: torch.Tensor, counts_DX: torch.Tensor, body: int, itype: torch.dtype) -> None:
    """Write counts [D, X] (row d: what destination d needs) into the rows after the first `body` rows of
    every destination block of buf [D, R, M], as `itype` integers in the buffer's own bytes (in place,
    before the buffer enters autograd)."""
    D, R, M = buf_DRM.shape
    flat = buf_DRM.view(itype).view(D, R * M)
    flat[:, body * M : body * M + counts_DX.size(1)].copy_(counts_DX)


def read_header(recv_DRM: torch.Tensor, body: int, num_counts: int, itype: torch.dtype) -> torch.Tensor:
    """The counts `write_header` put after the first `body` rows of every source block of recv [D, R, M]:
    [D, num_counts] int64 on CPU (row d: from source d)."""
    D, R, M = recv_DRM.shape
    flat = recv_DRM.detach().view(itype).view(D, R * M)
    return flat[:, body * M : body * M + num_counts].to(device="cpu", dtype=torch.int64)


def received_kept_rows(rows_DGL: torch.Tensor, block: int, stride: int, device: torch.device) -> KeptRows:
    """The kept rows of a received buffer laid out as D source blocks of `stride` rows, each holding
    [E_l, G, block] slots (then its header), from every source's leading rows per (group, local
    expert) `rows_DGL` [D, G, E_l]: flat row d*stride + (e*G + g)*block + i, grouped by local expert,
    then source, group, slot (the order of `padded_kept_rows`)."""
    D, G, L = rows_DGL.shape
    n_LB = rows_DGL.permute(2, 0, 1).reshape(-1)  # [E_l*D*G]
    host = n_LB.device
    e = torch.arange(L, dtype=torch.int64, device=host).view(L, 1, 1)
    d = torch.arange(D, dtype=torch.int64, device=host).view(1, D, 1)
    g = torch.arange(G, dtype=torch.int64, device=host).view(1, 1, G)
    starts = (d * stride + (e * G + g) * block).reshape(-1)
    return KeptRows(segments=block_segments(starts.tolist(), n_LB.tolist(), L), device=device)


def uneven_kept_rows(recv_row: torch.Tensor, per_expert: list[int]) -> KeptRows:
    """The received rows of a zero-padded uneven expert input (their rows, sorted: grouped by expert)."""
    return KeptRows(torch.sort(recv_row).values, list(per_expert))


# How a padded dispatcher's experts compute: the whole buffer, its kept rows, or its kept rows with the
# all-to-alls pipelined by local expert (`PaddedDispatcher.plan`).
PATHS = ("padded", "kept", "overlap")
