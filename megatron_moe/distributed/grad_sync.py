"""Gradient synchronization: dense parameters over DP, expert parameters over expert-DP.

Every gradient becomes (1/DP) * its sum over ranks (each rank's loss is the mean over its
micro-batch, the global loss the mean over DP). Expert parameters: every rank of an EP x ESP group
already accumulated the tokens of all its routing groups, so the sum runs over expert-DP
(P/(N_EP*N_ESP) ranks) and is still divided by DP.

`GradSync` starts bucketed async all-reduces from grad-ready hooks, so they overlap the rest of
backward; `finish()` waits and scales. `sync_gradients` is the blocking version.

With a scheduler (Lina, `lina.py`) there are no buckets: each parameter's gradient is handed over
on its own, reduced in place, in one fixed order on every rank (reverse registration order, dp and
expert-dp interleaved; a gradient ready early waits for those before it), over Lina's dedicated
communicators (`make_lina_groups`): NCCL needs every rank to issue a communicator's operations in
one order, which the launcher thread and the main thread sharing a group would not guarantee.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from megatron_moe.distributed import comm_errors, observer
from megatron_moe.distributed.collectives import LOCAL_GROUP, all_reduce_raw

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState


def grad_group_kind(p: torch.nn.Parameter) -> str:
    """'expert_dp' for expert parameters, 'dp' for everything else."""
    return "expert_dp" if getattr(p, "_shard", None) is not None and p._shard.expert else "dp"


LINA_GROUPS = {"dp": "lina_dp", "expert_dp": "lina_expert_dp"}  # group kind -> Lina's communicator


def make_lina_groups(ps: "ParallelState") -> None:
    """Create Lina's dedicated communicator of each gradient group kind ('dp', 'expert_dp'): a group
    over the same ranks (`ps.new_groups`, kinds "lina_dp" / "lina_expert_dp"; a later
    `ps.relayout_experts` remakes "lina_expert_dp" with its base). Collective on the first call
    (every rank, same order); later calls find them. Nothing for a one-process state."""
    for kind, name in LINA_GROUPS.items():
        if ps.group(kind) is not LOCAL_GROUP and not ps.has_group(name):
            ps.new_groups(name, getattr(ps.layout, f"{kind}_groups"))


def lina_group(ps: "ParallelState", kind: str):
    """The communicator Lina's micro-ops of `kind` go through now: its dedicated one (looked up
    at each call: a relayout replaces it), or the kind's own group in a one-process state."""
    name = LINA_GROUPS[kind]
    return ps.group(name) if ps.has_group(name) else ps.group(kind)


def sync_gradients(model: torch.nn.Module, ps: "ParallelState") -> None:
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

    Parameters are bucketed per group kind in reverse registration order (the order backward
    produces them), up to `bucket_mb` MB; a bucket is all-reduced once all its gradients are ready.
    Call `finish()` after backward, before clipping and the optimizer step. A `scheduler` (Lina) is
    attached to the model, gets each parameter's flat gradient in the fixed order instead, and is
    drained in `finish()`.
    """

    def __init__(self, model: torch.nn.Module, ps: "ParallelState", bucket_mb: float = 25.0, scheduler=None):
        self.ps, self.dp = ps, ps.size("dp")
        self.scheduler = scheduler
        if scheduler is not None:
            make_lina_groups(ps)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[dict] = []
        limit = int(bucket_mb * 2**20)
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
        # scheduler path: one global order, the order backward usually produces gradients
        self._order = [(p, grad_group_kind(p)) for p in reversed(params)]
        self._position = {p: i for i, (p, _) in enumerate(self._order)}
        if scheduler is not None and hasattr(scheduler, "attach"):
            scheduler.attach(model)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.accumulating = False  # True on micro-batches that only accumulate
        self.reset()

    def set_scheduler(self, scheduler, model: torch.nn.Module) -> None:
        """Hand gradients to `scheduler` (Lina) from now on (before the first backward); attaches it.
        Collective (creates Lina's communicators on the first call)."""
        self.scheduler = scheduler
        make_lina_groups(self.ps)
        scheduler.attach(model)

    def use_scheduler(self, scheduler) -> None:
        """Between iterations: hand gradients to `scheduler` (one `set_scheduler` attached before), or with
        None go back to the bucketed all-reduces. Refused while an iteration's gradients are being
        synced or the scheduler being left still has micro-ops (it must be drained)."""
        if self._next or self._submitted or any(x is not None for x in self._launched) or any(self._ready):
            raise RuntimeError("GradSync.use_scheduler: gradients of this iteration are being synced")
        if self.scheduler is not None and not self.scheduler.idle:
            raise RuntimeError("GradSync.use_scheduler: the scheduler being left still has micro-ops")
        self.scheduler = scheduler

    def reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched: list[Optional[tuple]] = [None] * len(self.buckets)
        self._param_ready = [False] * len(self._order)
        self._next = 0  # first parameter not handed over yet
        self._submitted: list[tuple] = []  # (param, flat reduced in place, handle)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.accumulating:
            return
        if self.scheduler is not None:
            self._param_ready[self._position[p]] = True
            self._submit_in_order()
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
        with observer.tagged("grad", bucket=i):
            work = all_reduce_raw(flat, group, async_op=True)
        self._launched[i] = (flat, work)

    def _submit_in_order(self) -> None:
        """Hand every ready gradient to the scheduler, stopping at the first one not ready."""
        while self._next < len(self._order) and self._param_ready[self._next]:
            p, kind = self._order[self._next]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            flat = p.grad.view(-1) if p.grad.is_contiguous() else p.grad.contiguous().view(-1)
            self._submitted.append((p, flat, self.scheduler.submit(kind, flat, lina_group(self.ps, kind))))
            self._next += 1

    def _finish_scheduled(self) -> None:
        self._param_ready = [True] * len(self._order)  # unused parameters: zero gradients
        self._submit_in_order()
        self.scheduler.drain()
        for p, flat, handle in self._submitted:
            handle.wait()
            if self.dp > 1:
                flat.div_(self.dp)
            if flat.data_ptr() != p.grad.data_ptr():  # reduced a contiguous copy
                p.grad.copy_(flat.view_as(p.grad))
        self.reset()

    def finish(self) -> None:
        """Launch buckets not launched yet, wait for all, copy back scaled by 1/DP."""
        if self.scheduler is not None:
            self._finish_scheduled()
            return
        for i in range(len(self.buckets)):
            if self._launched[i] is None:
                self._launch(i)
        for i, b in enumerate(self.buckets):
            flat, work = self._launched[i]
            comm_errors.wait(work, "gradient all_reduce", self.ps.group(b["kind"]))
            if self.dp > 1:
                flat.div_(self.dp)
            off = 0
            for p in b["params"]:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[off : off + n].view_as(p))
                off += n
        self.reset()

    def remove(self) -> None:
        """Remove the hooks; close the scheduler (which logs its summary) if there is one."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.scheduler is not None and hasattr(self.scheduler, "close"):
            self.scheduler.close()
