"""The MoE layer in four stages: Router -> TokenDispatcher -> Experts -> combine.

Legend: B batch, T sequence, M model dim, G routing groups in this call,
S tokens per group (S_l = S / N_MP: one MP slice), E experts, C capacity.

A routing group is one data-parallel rank's micro-batch (identical on every MP
rank of it). A one-process reference passes `routing_groups = DP` so it routes
each data-parallel shard of the global batch separately, as the parallel run
does. The schedule (--moe-schedule) picks the dispatcher and whether MP ranks
split the tokens first:
  baseline  every MP rank routes all tokens; PaddedDispatcher("baseline")
  s2        every MP rank routes all tokens; PaddedDispatcher("s2")
  s1        MP split, S1 routing (`moe.parm`), UnevenDispatcher, MP all-gather
  auto      Parm's Algorithm 1 per layer, decided by `optimizations.apply` on the
            real groups (`use_schedule`); until then the layer runs the baseline.
Every schedule returns the same values.

Dropless (--moe-dropless): the router keeps every choice and the layer always uses
the UnevenDispatcher with a ragged expert input (only real tokens travel, experts
compute only them). baseline: every MP rank routes and sends all tokens (expert
weight gradients scaled by 1/N_MP); s1: as above; auto resolves to the dropless
baseline; s2 (a padded buffer by construction) is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from megatron_moe.config import DROPLESS_S2_ERROR
from megatron_moe.distributed.collectives import gather_from_group, scatter_to_group
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.moe.dispatcher import PaddedDispatcher, PaddedPlan, TokenDispatcher, UnevenDispatcher, UnevenPlan
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.parm import route_s1
from megatron_moe.moe.pipelined import DROPLESS_ERROR, pipelined_moe
from megatron_moe.moe.router import Router
from megatron_moe.profiling import annotate

if TYPE_CHECKING:
    from megatron_moe.config import Config
    from megatron_moe.moe.cost_model import Choice
    from megatron_moe.parallel_state import ParallelState

SCHEDULES = ("baseline", "s1", "s2")


class MoELayer(nn.Module):
    """x [B, T, M] (replicated over MP) -> (y [B, T, M], aux loss scalar).

    The aux loss is coeff * load-balancing loss + z-loss, averaged over routing
    groups; `last_stats` (the router's) holds counts for logging.
    """

    def __init__(
        self,
        cfg: "Config",
        ps: "ParallelState",
        seed: int,
        name: str,
        layer_idx: int,
        routing_groups: int = 1,
        device: torch.device | None = None,
    ):
        super().__init__()
        m, moe = cfg.model, cfg.moe
        self.ps, self.layer_idx, self.routing_groups = ps, layer_idx, routing_groups
        self.num_experts = moe.num_experts
        self.router = Router(cfg, ps, seed, name, layer_idx, routing_groups, device=device)
        proj_std = m.init_method_std / (2 * m.num_layers) ** 0.5
        self.experts = Experts(
            moe.num_experts,
            m.hidden_size,
            m.ffn_hidden_size,
            ps,
            seed,
            f"{name}.experts",
            m.init_method_std,
            proj_std,
            device=device,
        )
        self.saa, self.s1_local_capacity = moe.moe_saa, moe.moe_s1_local_capacity
        self.requested, self.dropless, self.kept_only = moe.moe_schedule, moe.moe_dropless, moe.moe_kept_only
        self.schedule_choice: Optional["Choice"] = None  # Algorithm 1's decision under auto
        self.path_flag = moe.moe_expert_path  # the experts' path (`expert_path`): auto or a fixed one
        self.path_last = ""  # the path of the last forward with a padded dispatcher
        self._s2_fallback: Optional[tuple] = (
            None  # ((SAA chunks, dispatcher id), the S2 dispatcher) of `dispatcher_for`
        )
        self.pipeline_chunks = 1  # Lina's all-to-all micro-ops (`set_pipeline_chunks`)
        # dropless with every expert on this rank and no replicas: nothing travels, so the one-rank plan
        # (`moe.dispatcher.local_plan`: no host sync) serves it; Pro-Prophet's replicas need the uneven one
        self.dropless_local = (
            self.dropless and ps.size("ep") * ps.size("esp") == 1 and not getattr(cfg.opts, "pro_prophet", False)
        )
        self.use_schedule("baseline" if moe.moe_schedule == "auto" else moe.moe_schedule)

    def use_schedule(self, schedule: str, saa_chunks: int = SAA_CHUNKS, choice: Optional["Choice"] = None) -> None:
        """Pick the dispatcher of `schedule` (baseline / s1 / s2); `choice`: Algorithm 1's, under auto."""
        if schedule not in SCHEDULES:
            raise ValueError(f"--moe-schedule must be one of {SCHEDULES} or auto, got {schedule!r}")
        if self.dropless and schedule == "s2":
            raise ValueError(DROPLESS_S2_ERROR)
        self.schedule, self.schedule_choice = schedule, choice
        old = getattr(self, "dispatcher", None)
        self.dispatcher: TokenDispatcher
        if self.dropless_local and schedule == "baseline":
            self.dispatcher = PaddedDispatcher(
                self.ps, self.num_experts, self.layer_idx, "baseline", self.saa, saa_chunks
            )
        elif self.dropless:
            scale = 1.0 / self.ps.size("mp") if schedule == "baseline" else 1.0
            self.dispatcher = UnevenDispatcher(self.ps, self.num_experts, self.layer_idx, scale, ragged=True)
        elif schedule == "s1":
            self.dispatcher = UnevenDispatcher(self.ps, self.num_experts, self.layer_idx)
        else:
            self.dispatcher = PaddedDispatcher(
                self.ps, self.num_experts, self.layer_idx, schedule, self.saa, saa_chunks
            )
        if old is not None:  # keep what optimizations attached to the dispatcher
            self.dispatcher.set_dw_queue(old.dw)
            self.dispatcher.set_placement(old.placement if self.dropless else None)
            self.dispatcher.set_counts_sink(old.counts_sink)
            self.dispatcher.listeners = old.listeners

    def set_pipeline_chunks(self, chunks: int) -> None:
        """Split the all-to-alls into `chunks` token-chunk micro-ops pipelined with the experts
        (Lina, `moe.pipelined`; 1: off)."""
        if chunks < 1:
            raise ValueError(f"--lina-pipeline-chunks must be >= 1, got {chunks}")
        if chunks > 1 and self.dropless:
            raise ValueError(DROPLESS_ERROR)
        self.pipeline_chunks = chunks

    def expert_path(self, d: PaddedDispatcher) -> str:
        """How the padded dispatcher `d`'s experts compute (`moe.kept.PATHS`; --moe-kept-only,
        --moe-expert-path). auto: with one rank holding every expert, kept rows (`moe.dispatcher.local_plan`:
        the tokens go straight to a grouped GEMM over their experts' rows, no buffer and no host sync);
        with several, the padded buffer: one batched GEMM per expert weight in the compute dtype and no
        host sync, where kept rows need every source's counts on the host (one sync per layer) to skip
        the empty slots. Dropless on one rank (`dropless_local`) is the kept-rows plan with nothing dropped."""
        if self.dropless:
            return "kept"
        if not self.kept_only:
            return "padded"
        if self.path_flag != "auto":
            return self.path_flag
        return "kept" if d.local_only else "padded"

    @property
    def last_stats(self) -> dict:
        """Counts of the last forward: {"counts": [E] kept per expert, "dropped", "choices"}."""
        return self.router.last_stats

    def splits_tokens(self, num_tokens: int) -> bool:
        """True when MP ranks route disjoint slices of a group of `num_tokens` tokens (S1)."""
        if self.schedule != "s1":
            return False
        if num_tokens % self.ps.size("mp") == 0:
            return True
        if self.schedule_choice is not None:
            return False  # auto: these tokens do not split evenly; S2 instead
        raise ValueError(
            f"--moe-schedule s1 needs the tokens of a micro-batch ({num_tokens} = --micro-batch-size "
            f"x --seq-length) divisible by --tensor-model-parallel-size {self.ps.size('mp')}"
        )

    # ------------------------------------------------------------------ the four stages
    def route(self, x_GSM: torch.Tensor, split: bool):
        """Router: (routes of this rank's tokens, aux loss, the tokens [G*S', M] they refer to)."""
        G, S, M = x_GSM.shape
        with annotate("moe/router"):
            if split:
                x_l = scatter_to_group(x_GSM, self.ps.group("mp"), dim=1)  # [G, S_l, M]
                routes, aux, kept = route_s1(self.router, x_l, S, self.s1_local_capacity)
                self.router.record(routes, kept, G * S * self.router.k)
                return routes, aux, x_l.reshape(-1, M)
            xs = [x_GSM.view(S, M)] if G == 1 else x_GSM.unbind(0)  # a view: no zero-filled gradient
            routes = [self.router.route(x_g, g) for g, x_g in enumerate(xs)]
            self.router.record(routes)
            return routes, torch.stack([self.router.aux(r) for r in routes]).mean(), x_GSM.reshape(G * S, M)

    def forward(self, x_BTM: torch.Tensor):
        """The stages in order: enter (routing groups, Pro-Prophet's Trans), route, plan, dispatch,
        experts, combine, leave. Lina's chunks and the overlap path run dispatch -> experts -> combine
        as one pipeline instead."""
        B, T, M = x_BTM.shape
        x_GSM, placed = self.enter(x_BTM)
        split = self.splits_tokens(x_GSM.size(1))
        d = self.dispatcher_for(split)
        routes, aux, tokens = self.route(x_GSM, split)
        if self.pipeline_chunks > 1:  # Lina: all-to-all micro-ops pipelined with the experts
            return self.leave(pipelined_moe(d, self.experts, tokens, routes, self.pipeline_chunks), split, B, T), aux
        plan = self.plan(d, routes)
        if isinstance(plan, PaddedPlan) and plan.exchange:  # all-to-alls and experts pipelined by local expert
            return self.leave(d.exchange(tokens, plan, self.experts), False, B, T), aux
        with annotate("moe/dispatch"):  # one range per forward (the plan is routing metadata, before it)
            x_in = d.dispatch(tokens, plan)
        y_partial = self.compute_experts(x_in, plan, d.grad_scale, placed)
        with annotate("moe/combine"):
            y = d.combine(y_partial, plan)
        return self.leave(y, split, B, T), aux

    def enter(self, x_BTM: torch.Tensor):
        """(tokens [G, S, M] by routing group, Pro-Prophet's placed layer or None); with replicas their
        parameters' Trans starts here (and their gradients' Agg is waited here in backward)."""
        B, T, M = x_BTM.shape
        G = self.routing_groups
        if B % G:
            raise ValueError(f"batch {B} is not divisible into {G} routing groups")
        placed = self.dispatcher.placement  # Pro-Prophet replicas (moe.placement.PlacedLayer) or None
        if placed is not None:
            x_BTM = placed.layer_input(x_BTM)
        return self.dispatcher.track_input(x_BTM).reshape(G, (B // G) * T, M), placed

    def dispatcher_for(self, split: bool) -> TokenDispatcher:
        """This forward's dispatcher: the schedule's, or, under auto's S1 when the tokens do not split
        evenly over MP, an S2 dispatcher made once and kept (it holds the same dW queue)."""
        if self.schedule != "s1" or split:
            return self.dispatcher
        assert self.schedule_choice is not None  # a fixed s1 that cannot split raised in `splits_tokens`
        key = (self.schedule_choice.saa_chunks, id(self.dispatcher))
        if self._s2_fallback is None or self._s2_fallback[0] != key:
            d = PaddedDispatcher(self.ps, self.num_experts, self.layer_idx, "s2", self.saa, key[0])
            self._s2_fallback = (key, d)
        d = self._s2_fallback[1]
        d.set_dw_queue(self.dispatcher.dw)
        return d

    def plan(self, d: TokenDispatcher, routes):
        """The dispatcher's plan of these routes (a padded dispatcher's on the layer's expert path)."""
        if isinstance(d, PaddedDispatcher):
            self.path_last = self.expert_path(d)
            return d.plan(routes, self.path_last)
        self.path_last = ""
        return d.plan(routes)

    def compute_experts(self, x_in: torch.Tensor, plan, grad_scale: float, placed) -> torch.Tensor:
        """The experts on the dispatched input, as the plan lays it out: one rank's grouped rows (device
        offsets), owned experts and replicas (Pro-Prophet), rows grouped by expert (host counts: dropless
        and kept rows), kept rows where they lie in the received buffer, S1's zero-padded input with its
        kept rows, or the padded buffer."""
        if isinstance(plan, PaddedPlan) and plan.offs is not None:  # one rank, every expert: no host sync
            return self.experts.forward_offsets(x_in, plan.offs, grad_scale, tail=True)
        if placed is not None:
            return placed.run_experts(x_in, plan.expert_rows, grad_scale)
        if plan.expert_rows is not None:
            return self.experts.forward_ragged(x_in, plan.expert_rows, grad_scale)
        if isinstance(plan, PaddedPlan) and plan.expert_segments is not None:
            return self.experts.forward_segments(x_in, plan.expert_segments, grad_scale)
        if isinstance(plan, UnevenPlan) and self.kept_only and plan.kept is not None:
            return self.experts.forward_kept(x_in, plan.kept, grad_scale)
        return self.experts(x_in, grad_scale=grad_scale)

    def leave(self, y: torch.Tensor, split: bool, B: int, T: int) -> torch.Tensor:
        """y [G*S', M] -> [B, T, M]: S1's MP slices gathered back, and the layer's output marked for the
        listeners of its backward (Lina)."""
        M = y.size(-1)
        if split:
            y = gather_from_group(y.view(self.routing_groups, -1, M), self.ps.group("mp"), dim=1)
        return self.dispatcher.track_output(y.reshape(B, T, M))
