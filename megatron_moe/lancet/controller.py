"""Lancet at runtime: install a plan on a model and drive its backward.

API for the training loop (every rank calls `setup`, in the same place: it profiles
all-to-alls, broadcasts the plan and may create a process group):

    ctl = lancet.setup(model, ps, cfg.opts)     # after building the model and its GradSync
    for each micro-batch:
        lm, aux = model(ids, labels)
        ctl.backward(lm + aux)                   # loss.backward(), then flush deferred dW
    grad_sync.finish(); optimizer.step()
    ctl.write_report(measured_iter_ms=...)       # once, if --lancet-report PATH
    ctl.remove()                                 # restore the model (optional)

`setup` returns a controller whatever the switches; with --lancet-wgrad and
--lancet-partition both off it changes nothing and `backward` is
`loss.backward()`. A plain `loss.backward()` is also correct: an
end-of-backward callback runs every dW still queued, so gradients are final
(and every grad-ready hook has fired, once) when backward returns.

What `setup` installs:
  --lancet-wgrad      column/row parallel linears get a `linear_fn` and experts a
                      `deferred_bmm` that defer dW (`wgrad_runtime.py`); the
                      all-to-alls of layers Lancet does not partition (baseline,
                      S1, S2 schedules) get node hooks that run their assigned
                      dW on a helper thread while the all-to-all runs; a forward
                      pre-hook on the model starts each iteration.
  --lancet-partition  each planned range's MoE block gets a partitioned forward
                      (`partitioned_moe.py`); a block whose attention the previous
                      range ran skips it. Needs routing_groups == 1 and dropout 0.
The plan comes from `planner.make_plan` (profiled, broadcast from rank 0) or
is passed in (`plan=LancetPlan.manual(...)`).
"""
from __future__ import annotations

import json
import statistics
from collections import deque
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_moe.distributed.collectives import group_size
from megatron_moe.lancet.cost import atomic_write_json
from megatron_moe.lancet.model_ir import a2a_group
from megatron_moe.lancet.partitioned_moe import partitioned_block_forward, skip_attn_forward
from megatron_moe.lancet.planner import LancetPlan, make_plan
from megatron_moe.lancet.wgrad_runtime import WgradRuntime, hook_foreign_a2a


def _counts_group(ps):
    """A gloo group with the token all-to-all group's ranks, for the count exchanges (collective).

    Counts are needed on the host, so they travel over gloo even when tokens use NCCL. Made
    once per ParallelState and kept among its groups, so `destroy_model_parallel` destroys it.
    """
    group = a2a_group(ps)
    if group_size(group) == 1 or not dist.is_initialized():
        return group
    if "ep_counts" in ps._groups:
        return ps._groups["ep_counts"]
    layout = ps.layout
    kinds = layout.ep_groups if ps.size("esp") == 1 else layout.ep_esp_groups
    return ps.new_groups("ep_counts", kinds, backend="gloo")    # with --comm-timeout, like the others


class LancetController:
    """Owns what Lancet installed on a model; see the module docstring."""

    def __init__(self, model, ps, opts, plan: Optional[LancetPlan]):
        self.model, self.ps, self.opts, self.plan = model, ps, opts, plan
        self.wgrad: Optional[WgradRuntime] = None
        self.timings: dict[int, deque] = {}          # MoE block -> forward ms of its partitioned range
        self._handles: list = []
        self._patched: list = []                     # (object, attribute) to restore
        self._counts = None

    # ------------------------------------------------------------------ install / remove
    def install(self) -> "LancetController":
        """Install the plan on the model (module docstring); returns self."""
        plan = self.plan
        if plan is None:
            return self
        if plan.wgrad:
            self.wgrad = WgradRuntime(plan.assignment)
            self._install_wgrad(plan)
        if plan.ranges:
            self._install_partitions(plan)
        return self

    def _install_partitions(self, plan: LancetPlan) -> None:
        blocks = self.model.blocks
        self._counts = _counts_group(self.ps)
        ranged = {r.layer: r for r in plan.ranges}
        skip = {r.layer + 1 for r in plan.ranges if r.end == "next_attn"}
        for r in plan.ranges:
            if not blocks[r.layer].is_moe:
                raise ValueError(f"Lancet range {r} does not start in an MoE block")
            if r.end == "next_attn" and r.layer + 1 >= len(blocks):
                raise ValueError(f"Lancet range {r} ends in block {r.layer + 1}, which does not exist")
            if r.start == "attn" and r.layer in skip:
                raise ValueError(f"Lancet range {r} starts at an attention the previous range already runs")
            if self.model.cfg.model.dropout:
                raise ValueError("--lancet-partition needs --hidden-dropout 0 to stay equivalent")
        for l, block in enumerate(blocks):
            if l in ranged:
                r = ranged[l]
                nxt = blocks[l + 1] if r.end == "next_attn" else None
                self.timings[l] = deque(maxlen=1000)
                fwd = partial(partitioned_block_forward, block, nxt, r, l in skip, self._counts,
                              self.wgrad, self.timings[l])
            elif l in skip:
                fwd = partial(skip_attn_forward, block)
            else:
                continue
            block.forward = fwd
            self._patched.append((block, "forward"))

    def _install_wgrad(self, plan: LancetPlan) -> None:
        rt = self.wgrad
        partitioned = {r.layer for r in plan.ranges}
        for l, block in enumerate(self.model.blocks):
            for mod, name in ((block.attn.qkv, "attn.qkv"), (block.attn.proj, "attn.proj")):
                mod.linear_fn = rt.linear(f"L{l}.{name}.dW")
                self._patched.append((mod, "linear_fn"))
            if block.is_moe:
                ex = block.moe.experts
                ex.deferred_bmm = (rt.bmm(f"L{l}.moe.expert.fc1.dW"), rt.bmm(f"L{l}.moe.expert.fc2.dW"))
                self._patched.append((ex, "deferred_bmm"))
                if l not in partitioned:     # another schedule's all-to-alls (Lancet's open their own windows)
                    self._handles.append(block.moe.register_forward_hook(partial(self._hook_a2a, l)))
            else:
                for mod, name in ((block.mlp.fc, "mlp.fc1"), (block.mlp.proj, "mlp.fc2")):
                    mod.linear_fn = rt.linear(f"L{l}.{name}.dW")
                    self._patched.append((mod, "linear_fn"))
        self._handles.append(self.model.register_forward_pre_hook(lambda m, a: rt.begin_iteration()))

    def _hook_a2a(self, layer_idx: int, module, args, out) -> None:
        y = out[0]
        if torch.is_grad_enabled() and y.requires_grad:
            hook_foreign_a2a(self.wgrad, layer_idx, y, args[0])

    def remove(self) -> None:
        """Undo everything `install` did (the model runs exactly as before)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for obj, attr in self._patched:
            if attr == "forward":
                del obj.forward
            elif attr == "linear_fn":
                obj.linear_fn = F.linear
            else:
                setattr(obj, attr, None)
        self._patched.clear()
        if self.wgrad is not None:
            self.wgrad.close()

    # ------------------------------------------------------------------ training-loop API
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), then every deferred dW (gradients final, grad-ready hooks fired)."""
        loss.backward()
        self.flush()

    def flush(self) -> None:
        """Run deferred dW still queued (no-op without dW scheduling)."""
        if self.wgrad is not None:
            self.wgrad.flush()

    def stats(self) -> dict:
        """Counters for logs and tests: dW runs by place, partitioned range timings."""
        out: dict = {"ranges": len(self.plan.ranges) if self.plan else 0}
        if self.wgrad is not None:
            s = self.wgrad.stats
            out.update({"dw_runs": dict(s.runs), "dw_in_window": s.in_window, "dw_immediate": s.immediate,
                        "dw_flushed": s.flushed, "dw_window_ms": s.window_ms, "a2a_windows": s.a2a_windows})
        return out

    def report(self, measured_iter_ms: Optional[float] = None) -> dict:
        """The plan, its predictions and the measured times (median ms of each partitioned range)."""
        plan = self.plan or LancetPlan()
        d = plan.to_json()
        for r in d["ranges"]:
            t = self.timings.get(r["layer"], [])
            r["measured_forward_ms"] = statistics.median(t) if t else None
        d["measured_iteration_ms"] = measured_iter_ms
        d["stats"] = self.stats()
        return d

    def write_report(self, path: Optional[str] = None, measured_iter_ms: Optional[float] = None) -> Optional[dict]:
        """Write `report()` as JSON to `path` (default --lancet-report) atomically; rank 0 only."""
        path = path or getattr(self.opts, "lancet_report", None)
        if not path:
            return None
        d = self.report(measured_iter_ms)
        if not dist.is_initialized() or dist.get_rank() == 0:
            atomic_write_json(path, json.loads(json.dumps(d, default=str)))
        return d


def setup(model, ps, opts, *, plan: Optional[LancetPlan] = None, micro_batch: Optional[int] = None,
          seq_length: Optional[int] = None, **plan_kwargs) -> LancetController:
    """Plan (unless `plan` is given) and install Lancet on `model` per `opts` (OptimizationsConfig).

    micro_batch / seq_length default to the model config's --micro-batch-size / --seq-length.
    Extra keyword arguments go to `planner.make_plan` (costs=, comm=, profiler=).
    """
    if plan is None and (opts.lancet_wgrad or opts.lancet_partition):
        cfg = model.cfg
        B = micro_batch or cfg.train.micro_batch_size
        T = seq_length or cfg.model.seq_length
        plan = make_plan(model, ps, opts, B, T, **plan_kwargs)
    return LancetController(model, ps, opts, plan).install()
