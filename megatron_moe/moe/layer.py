"""The MoE layer: gate + router + a schedule that moves tokens to ESP-sharded experts.

Legend: B batch, T sequence, M model dim, G routing groups in this call,
S tokens per routing group, E experts, C capacity.

A routing group is one data-parallel rank's micro-batch (identical on every MP
rank of it). A one-process reference passes `routing_groups = DP` so it routes
each data-parallel shard of the global batch separately, as the parallel run
does. The schedule (baseline / S1 / S2, `megatron_moe.moe.schedules`) decides
how tokens travel; every schedule returns the same values.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from megatron_moe.distributed.collectives import copy_to_group
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.model.sharding import InitSpec, ShardSpec
from megatron_moe.model.tensor_parallel import make_param
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.router import RouteResult, route
from megatron_moe.moe.schedules import SCHEDULES


class MoELayer(nn.Module):
    """x [B, T, M] (replicated over MP) -> (y [B, T, M], aux loss scalar).

    The aux loss returned is coeff * load-balancing loss + z-loss, averaged
    over routing groups; `last_stats` holds counts for logging.
    """

    def __init__(self, cfg, ps, seed: int, name: str, layer_idx: int, routing_groups: int = 1):
        super().__init__()
        m, moe = cfg.model, cfg.moe
        self.ps, self.layer_idx, self.seed = ps, layer_idx, seed
        self.num_experts, self.hidden = moe.num_experts, m.hidden_size
        self.k, self.cf, self.min_cap = moe.moe_router_topk, moe.moe_expert_capacity_factor, moe.moe_min_capacity
        self.policy, self.aux_coeff, self.z_coeff = moe.moe_router_policy, moe.moe_aux_loss_coeff, moe.moe_z_loss_coeff
        self.routing_groups = routing_groups
        self.schedule = moe.moe_schedule
        self.saa_chunks = SAA_CHUNKS
        self.schedule_choice = None       # Algorithm 1's decision (cost_model.Choice) under auto
        if moe.moe_schedule == "auto":
            # collective over the world (profile or cached fit); the same answer on every rank
            from megatron_moe.moe.comm_profile import choose_for_layer
            self.schedule_choice = choose_for_layer(cfg, ps, layer_idx)
            self.schedule, self.saa_chunks = self.schedule_choice.schedule, self.schedule_choice.saa_chunks
        self.s1_local_capacity = moe.moe_s1_local_capacity
        self.saa = moe.moe_saa
        # the gate is replicated everywhere and kept in fp32
        self.gate_w = make_param((moe.num_experts, m.hidden_size), ShardSpec(), InitSpec("normal", m.init_method_std),
                                 ps, seed, f"{name}.gate_w")
        proj_std = m.init_method_std / (2 * m.num_layers) ** 0.5
        self.experts = Experts(moe.num_experts, m.hidden_size, m.ffn_hidden_size, ps, seed, f"{name}.experts",
                               m.init_method_std, proj_std)
        self._calls = 0
        self.last_stats: dict = {}

    # ------------------------------------------------------------------ pieces schedules use
    def group_id(self, g: int) -> int:
        """Global id of routing group g of this call (= the data-parallel shard it is)."""
        return self.ps.rank("dp") * self.routing_groups + g

    def generator(self, g: int) -> torch.Generator | None:
        """Seeded generator for random routing: depends on (seed, layer, call, group) only."""
        if self.policy != "random":
            return None
        gen = torch.Generator()
        gen.manual_seed((self.seed * 1_000_003 + self.layer_idx * 10_007 + self._calls * 101 + self.group_id(g))
                        & 0x7FFF_FFFF)
        return gen

    def gate_logits(self, x_SM: torch.Tensor, split_over_mp: bool = False) -> torch.Tensor:
        """fp32 logits [S, E]. When MP ranks hold different tokens, gate grads are summed over MP."""
        w = copy_to_group(self.gate_w, self.ps.group("mp")) if split_over_mp else self.gate_w
        with torch.autocast(device_type=x_SM.device.type, enabled=False):
            return x_SM.float() @ w.float().t()

    def route(self, logits_SE: torch.Tensor, g: int) -> RouteResult:
        return route(logits_SE, self.k, self.cf, self.min_cap, self.policy, self.generator(g), self.z_coeff)

    def aux_of(self, r: RouteResult) -> torch.Tensor:
        return self.aux_coeff * r.aux_loss + r.z_loss

    def record_stats(self, routes: list[RouteResult]) -> None:
        counts = torch.stack([r.counts for r in routes]).sum(0).detach().cpu()
        total = sum(r.slot.numel() for r in routes)
        dropped = sum(r.num_dropped for r in routes)
        self.last_stats = {"counts": counts, "dropped": dropped, "choices": total}

    # ------------------------------------------------------------------ forward
    def forward(self, x_BTM: torch.Tensor):
        B, T, M = x_BTM.shape
        G = self.routing_groups
        if B % G:
            raise ValueError(f"batch {B} is not divisible into {G} routing groups")
        x_GSM = x_BTM.reshape(G, (B // G) * T, M)
        name = self.schedule
        if name == "s1" and self.schedule_choice is not None and x_GSM.size(1) % self.ps.size("mp"):
            name = "s2"   # auto: these tokens do not split evenly over MP (same on every rank)
        y_GSM, aux = SCHEDULES[name](self, x_GSM)
        self._calls += 1
        return y_GSM.reshape(B, T, M), aux
