"""Gradient synchronization: dense parameters over DP, expert parameters over expert-DP.

Each data-parallel rank's loss is the mean over its own micro-batch, and the
global loss is the mean over data-parallel ranks, so every gradient is
(1/DP) * sum over ranks. Dense parameters: all-reduce over the DP group
(size P/N_MP). Expert parameters: every rank of an EP x ESP group already
accumulated the tokens of all routing groups of that group, so the sum runs
over expert-DP (size P/(N_EP*N_ESP)) and is still divided by DP.

`GradSync` starts bucketed all-reduces asynchronously from grad-ready hooks
(`register_post_accumulate_grad_hook`) so they overlap the rest of backward;
`finish()` waits and scales. `sync_gradients` is the blocking version.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_moe.distributed.collectives import all_reduce_raw


def grad_group_kind(p: torch.nn.Parameter) -> str:
    """'expert_dp' for expert parameters, 'dp' for everything else."""
    return "expert_dp" if getattr(p, "_shard", None) is not None and p._shard.expert else "dp"


def sync_gradients(model: torch.nn.Module, ps) -> None:
    """Blocking all-reduce of every gradient over its group, scaled by 1/DP."""
    dp = ps.size("dp")
    for p in model.parameters():
        if p.grad is None:
            continue
        all_reduce_raw(p.grad, ps.group(grad_group_kind(p)))
        if dp > 1:
            p.grad.div_(dp)


class GradSync:
    """Bucketed asynchronous gradient all-reduce started from grad-ready hooks.

    Parameters are bucketed in reverse registration order (the order backward
    produces them) per group kind, up to `bucket_mb` MB. A bucket is flattened
    and all-reduced as soon as all its gradients are ready. Call `finish()`
    after backward (and before clipping / the optimizer step).
    `scheduler` (Lina) may take over launching: it gets (kind, flat tensor, group).
    """

    def __init__(self, model: torch.nn.Module, ps, bucket_mb: float = 25.0, scheduler=None,
                 enabled_hooks: bool = True):
        self.ps, self.dp = ps, ps.size("dp")
        self.scheduler = scheduler
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[dict] = []
        limit = int(bucket_mb * 2 ** 20)
        for kind in ("dp", "expert_dp"):
            cur, size = [], 0
            for p in reversed(params):
                if grad_group_kind(p) != kind:
                    continue
                cur.append(p)
                size += p.numel() * 4
                if size >= limit:
                    self.buckets.append({"kind": kind, "params": cur})
                    cur, size = [], 0
            if cur:
                self.buckets.append({"kind": kind, "params": cur})
        self._bucket_of = {}
        for i, b in enumerate(self.buckets):
            for p in b["params"]:
                self._bucket_of[p] = i
        self._hooks = []
        if enabled_hooks:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self.accumulating = False     # True on micro-batches that only accumulate
        self.reset()

    def reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched: list[Optional[tuple]] = [None] * len(self.buckets)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.accumulating:
            return
        i = self._bucket_of[p]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]["params"]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        b = self.buckets[i]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b["params"]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        group = self.ps.group(b["kind"])
        if self.scheduler is not None:
            work = self.scheduler.submit(b["kind"], flat, group)
        else:
            work = all_reduce_raw(flat, group, async_op=True)
        self._launched[i] = (flat, work)

    def finish(self) -> None:
        """Launch buckets not launched yet, wait for all, copy back scaled by 1/DP."""
        for i in range(len(self.buckets)):
            if self._launched[i] is None:
                self._launch(i)
        if self.scheduler is not None:
            self.scheduler.drain()
        for i, b in enumerate(self.buckets):
            flat, work = self._launched[i]
            if work is not None and hasattr(work, "wait"):
                work.wait()
            if self.dp > 1:
                flat.div_(self.dp)
            off = 0
            for p in b["params"]:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[off:off + n].view_as(p))
                off += n
        self.reset()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
