"""The MoE layer in four stages: Router -> TokenDispatcher -> Experts -> combine.

Legend: B batch, T sequence, M model dim, G routing groups in this call,
S tokens per group (S_l = S / N_MP: one MP slice), E experts, C capacity.

A routing group is one data-parallel rank's micro-batch (identical on every MP rank
of it); a one-process reference passes `routing_groups = DP` to route each shard of
the global batch as the parallel run does. The schedule (--moe-schedule) picks the
dispatcher and whether MP ranks split the tokens first; all return the same values:
  baseline  every MP rank routes all tokens; PaddedDispatcher("baseline")
  s2        every MP rank routes all tokens; PaddedDispatcher("s2")
  s1        MP split, S1 routing (`moe.parm`), UnevenDispatcher, MP all-gather
  auto      Parm's Algorithm 1 per layer, decided by `optimizations.apply` on the
            real groups (`use_schedule`); until then the layer runs the baseline.
Dropless (--moe-dropless): the router keeps every choice, carried by the UnevenDispatcher
unless one rank holds every expert without replicas (baseline: expert weight gradients
scaled by 1/N_MP; auto resolves to the baseline; s2, a padded buffer, is refused).

The experts' input follows the path (`moe.dispatcher`): one rank holding every expert,
the tokens grouped by expert with device offsets (`local_plan`, no host sync); several
ranks, the capacity-padded buffer (no host sync); the UnevenDispatcher (dropless, S1,
Lancet's parts, Pro-Prophet's replicas), ragged rows grouped by expert, with one host
read of the counts per layer forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from megatron_moe.config import DROPLESS_S2_ERROR
from megatron_moe.distributed.collectives import gather_from_group, scatter_to_group
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.moe.dispatcher import PaddedDispatcher, PaddedPlan, TokenDispatcher, UnevenDispatcher
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
        self.requested, self.dropless = moe.moe_schedule, moe.moe_dropless
        self.schedule_choice: Optional["Choice"] = None  # Algorithm 1's decision under auto
        self.pipeline_chunks = 1  # Lina's all-to-all micro-ops (`set_pipeline_chunks`)
        # dropless on one rank without replicas: the one-rank plan (`local_plan`, no host sync) serves it
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
        if self.dropless and not (self.dropless_local and schedule == "baseline"):
            scale = 1.0 / self.ps.size("mp") if schedule == "baseline" else 1.0
            self.dispatcher = UnevenDispatcher(self.ps, self.num_experts, self.layer_idx, scale)
        elif schedule == "s1":
            self.dispatcher = UnevenDispatcher(self.ps, self.num_experts, self.layer_idx)
        else:
            self.dispatcher = PaddedDispatcher(
                self.ps, self.num_experts, self.layer_idx, schedule, self.saa, saa_chunks
            )
        # auto's S1 on tokens that do not split evenly over MP runs S2 (`dispatcher_for`)
        self.s2_fallback = None
        if schedule == "s1" and choice is not None:
            self.s2_fallback = PaddedDispatcher(self.ps, self.num_experts, self.layer_idx, "s2", self.saa, saa_chunks)
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
        """enter (routing groups, Pro-Prophet's Trans), route, dispatch, experts, combine, leave. Lina's
        chunks run dispatch -> experts -> combine as one pipeline instead."""
        x_GSM, placed = self.enter(x_BTM)
        split = self.splits_tokens(x_GSM.size(1))
        d = self.dispatcher_for(split)
        routes, aux, tokens = self.route(x_GSM, split)
        if self.pipeline_chunks > 1:  # Lina: all-to-all micro-ops pipelined with the experts
            y = pipelined_moe(d, self.experts, tokens, routes, self.pipeline_chunks)
        else:
            plan = d.plan(routes)  # routing metadata, before the dispatch range
            x_in = self.dispatch(d, tokens, plan)
            y = self.combine(d, self.compute_experts(x_in, plan, d.grad_scale, placed), plan)
        return self.leave(y, split, x_BTM.shape), aux

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
        evenly over MP, the S2 dispatcher made in `use_schedule` (with the same dW queue)."""
        if split or self.s2_fallback is None:  # a fixed s1 that cannot split raised in `splits_tokens`
            return self.dispatcher
        self.s2_fallback.set_dw_queue(self.dispatcher.dw)
        return self.s2_fallback

    @staticmethod
    def dispatch(d: TokenDispatcher, tokens: torch.Tensor, plan) -> torch.Tensor:
        """The experts' input, as the dispatcher's plan lays it out."""
        with annotate("moe/dispatch"):
            return d.dispatch(tokens, plan)

    def compute_experts(self, x_in: torch.Tensor, plan, grad_scale: float, placed=None) -> torch.Tensor:
        """The experts on the dispatched input: one rank's rows grouped by expert with device offsets, the
        padded buffer, or the uneven dispatcher's rows grouped by expert (with Pro-Prophet's replicas)."""
        if isinstance(plan, PaddedPlan):
            if plan.offs is not None:
                return self.experts.forward_offsets(x_in, plan.offs, grad_scale)
            return self.experts(x_in, grad_scale)
        if placed is not None:
            return placed.run_experts(x_in, plan.expert_rows, grad_scale)
        with annotate("moe/experts"):
            return self.experts.forward_ragged(x_in, plan.expert_rows, grad_scale)

    @staticmethod
    def combine(d: TokenDispatcher, y_partial: torch.Tensor, plan) -> torch.Tensor:
        """y [T, M]: each token's expert outputs, weighted and summed."""
        with annotate("moe/combine"):
            return d.combine(y_partial, plan)

    def leave(self, y: torch.Tensor, split: bool, shape: torch.Size) -> torch.Tensor:
        """y [G*S', M] -> [B, T, M]: S1's MP slices gathered back, and the layer's output marked for the
        listeners of its backward (Lina)."""
        M = y.size(-1)
        if split:
            y = gather_from_group(y.view(self.routing_groups, -1, M), self.ps.group("mp"), dim=1)
        return self.dispatcher.track_output(y.reshape(shape))
