"""Router: GShard / DeepSpeed-MoE gating without noise, by index (no one-hot [S, E, C]).

Legend: S tokens of one routing group, E experts, k experts per token,
C expert capacity, M model dim.

Semantics (docs/DESIGN.md "Router semantics"):
  gates_SE = softmax(logits_SE) in fp32
  top-1: C = max(ceil(cf * S / E), min_capacity); expert = argmax; slot = the
         token's position among tokens of that expert; weight = gate value;
         aux = E * sum_e mean_s(gates[s, e]) * frac(argmax == e)
  top-2: C = max(ceil(2 * cf * S / E), min_capacity); second expert = argmax
         with the first masked out; second slot = position among second
         choices of that expert + number of first choices of that expert
         (before dropping); kept weights renormalized to sum to 1;
         aux = E * E * mean_e(me_e * ce_e), ce from the first choice
  top-k, 2 < k <= E (fine-grained experts, as Megatron-Core and torchtitan
         allow): choice j = argmax with choices < j masked out; its slot =
         position among choice-j tokens of that expert + the choices < j of
         that expert in the group (before dropping): the top-2 rule, repeated;
         C = max(ceil(k * cf * S / E), min_capacity); kept weights renormalized;
         aux as top-2.
  slot >= C is dropped (slot = -1, weight = 0).
  dropless (--moe-dropless): C = S, the most choices one expert can get in a
         group (a token picks an expert at most once), so nothing is dropped;
         same experts and aux loss, weights (k >= 2) renormalized over all choices.
  policy "position": positions in token order; "batch_prioritized": in order
  of descending top gate value (ties by token order); "random": experts drawn
  uniformly (seeded generator), positions in token order.

The pieces are separate functions so that schedules splitting a routing group
(Parm S1, Lancet's partitions) compute the same slots from per-part counts:
`choose_experts` -> `slot_positions` (with offsets) -> `finish_route`. `Router`
owns the gate: `route` for a whole group, `route_slice` for a slice given
per-expert offsets ("capacity passing"), `record` for the stats of a forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from megatron_moe import kernels
from megatron_moe.distributed.collectives import copy_to_group
from megatron_moe.layers.sharding import InitSpec, ShardSpec
from megatron_moe.layers.tensor_parallel import make_param

if TYPE_CHECKING:
    from megatron_moe.config import Config
    from megatron_moe.parallel_state import ParallelState

POLICIES = ("position", "batch_prioritized", "random")


@dataclass
class RouteResult:
    """Routing of one group: expert/slot/weight [S, k], capacity C, losses, kept counts [E]."""

    expert: torch.Tensor  # [S, k] int64
    slot: torch.Tensor  # [S, k] int64, -1 where dropped
    weight: torch.Tensor  # [S, k] fp32 combine weights (0 where dropped), differentiable
    capacity: int
    aux_loss: torch.Tensor  # scalar, differentiable
    z_loss: torch.Tensor  # scalar, differentiable (0 if not requested)
    counts: torch.Tensor  # [E] kept tokens per expert (all k choices)
    gates: torch.Tensor  # [S, E] fp32 softmax

    @property
    def num_dropped(self) -> int:
        return int((self.slot < 0).sum())  # a host read: for tests and tools, not the training step

    def detached(self) -> "RouteResult":
        """The same routing without autograd history (what is kept past the forward)."""
        return replace(
            self,
            weight=self.weight.detach(),
            aux_loss=self.aux_loss.detach(),
            z_loss=self.z_loss.detach(),
            gates=self.gates.detach(),
        )


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """C = max(ceil(k * cf * S / E), min_capacity) (DeepSpeed-MoE's _capacity)."""
    return max(int(math.ceil(k * capacity_factor * num_tokens / num_experts)), int(min_capacity))


def choose_experts(
    logits_SE: torch.Tensor, k: int, policy: str = "position", generator: Optional[torch.Generator] = None
):
    """Pick k experts per token. Returns (gates_SE fp32, expert_Sk int64)."""
    if policy not in POLICIES:
        raise ValueError(f"--moe-router-policy must be one of {POLICIES}, got {policy!r}")
    gates = torch.softmax(logits_SE.float(), dim=-1)
    S, E = gates.shape
    if not 1 <= k <= E:
        raise ValueError(f"--moe-router-topk must be between 1 and --num-experts {E}, got {k}")
    if policy == "random":
        # k distinct experts per token, uniformly, from the seeded generator (drawn on CPU
        # so CPU and CUDA runs draw the same numbers)
        keys = torch.rand((S, E), generator=generator, device="cpu").to(gates.device)
        expert = keys.topk(k, dim=-1).indices
        return gates, expert
    first = gates.argmax(dim=-1)
    if k == 1:
        return gates, first[:, None]
    # choice j: the argmax with the earlier choices masked out (GShard's second expert, repeated)
    chosen, masked = [first], logits_SE.float()
    for _ in range(1, k):
        masked = masked.scatter(1, chosen[-1][:, None], float("-inf"))
        chosen.append(masked.argmax(dim=-1))
    return gates, torch.stack(chosen, dim=1)


def choose_experts_slice(
    logits_lE: torch.Tensor, k: int, policy: str, generator: Optional[torch.Generator], start: int, group_tokens: int
):
    """`choose_experts` for rows [start, start + S_l) of a routing group of `group_tokens` tokens (a group
    split across ranks or parts): random routing draws the whole group's keys [group_tokens, E] (the
    numbers `choose_experts` draws) and keeps the slice's rows, so every token gets the expert it gets
    when routed whole. Returns (gates_lE fp32, expert_lk int64)."""
    if policy != "random":
        return choose_experts(logits_lE, k, policy, generator)
    if k not in (1, 2):
        raise ValueError(f"--moe-router-topk must be 1 or 2, got {k}")
    S_l, E = logits_lE.shape
    gates = torch.softmax(logits_lE.float(), dim=-1)
    keys = torch.rand((group_tokens, E), generator=generator, device="cpu")[start : start + S_l].to(gates.device)
    return gates, keys.topk(k, dim=-1).indices


def token_order(gates_SE: torch.Tensor, expert_Sk: torch.Tensor, policy: str) -> torch.Tensor:
    """Order [S] in which tokens claim slots: token order, or descending top gate value."""
    S = gates_SE.size(0)
    if policy != "batch_prioritized":
        return torch.arange(S, device=gates_SE.device)
    importance = gates_SE.gather(1, expert_Sk[:, :1]).squeeze(1)
    return torch.sort(-importance, stable=True).indices


def slot_positions(
    expert_Sk: torch.Tensor,
    num_experts: int,
    order_S: Optional[torch.Tensor] = None,
    offset_kE: Optional[torch.Tensor] = None,
    totals_kE: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Slot of every choice before dropping, [S, k] int64: choice j's position among choice-j tokens
    of its expert in `order_S`, + `offset_kE[j, e]` (earlier parts), + sum over i < j of
    `totals_kE[i, e]` (the group's choice-i tokens of e; default this part's counts).
    """
    S, k = expert_Sk.shape
    dev = expert_Sk.device
    ordered = expert_Sk if order_S is None else expert_Sk[order_S]
    one_hot = one_hot_of(ordered, num_experts)  # [S, k, E]; S*k*E ints
    pos_ordered = (one_hot.cumsum(dim=0) - 1).gather(2, ordered[..., None]).squeeze(2)  # [S, k]
    if offset_kE is not None:
        pos_ordered = pos_ordered + offset_kE.to(dev).gather(1, ordered.t()).t()
    if k >= 2:
        totals = one_hot.sum(dim=0) if totals_kE is None else totals_kE.to(dev)  # [k, E]
        before = totals.cumsum(dim=0) - totals  # choices i < j of each expert
        pos_ordered = pos_ordered + before.gather(1, ordered.t()).t()
    if order_S is None:
        return pos_ordered
    pos = torch.empty_like(pos_ordered)
    pos[order_S] = pos_ordered
    return pos


def one_hot_of(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    """`F.one_hot` without its host-side range check (a device-to-host sync on CUDA): int64 [..., C]."""
    out = torch.zeros(*index.shape, num_classes, dtype=torch.int64, device=index.device)
    return out.scatter_(-1, index[..., None], 1)


def count_per_expert(expert: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[E] int64: how many entries of `expert` (any shape) name each expert, counting only where `keep`
    (same shape, bool) holds. `torch.bincount` would read the maximum on the host (a sync on CUDA)."""
    ones = torch.ones_like(expert) if keep is None else keep.to(torch.int64)
    return expert.new_zeros(num_experts).index_add_(0, expert.reshape(-1), ones.reshape(-1))


def choice_counts(expert_Sk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[k, E] number of tokens whose j-th choice is e (before dropping)."""
    return torch.stack([count_per_expert(expert_Sk[:, j], num_experts) for j in range(expert_Sk.size(1))])


def aux_loss_terms(gates_SE: torch.Tensor, expert_Sk: torch.Tensor):
    """Sums needed by the aux loss: (sum_s gates [E], count of first choice [E], S)."""
    E = gates_SE.size(1)
    return gates_SE.sum(dim=0), count_per_expert(expert_Sk[:, 0], E).float(), gates_SE.size(0)


def aux_loss_from_terms(gate_sum_E: torch.Tensor, first_count_E: torch.Tensor, S: int, k: int) -> torch.Tensor:
    """top-1: E * sum(me * ce); top-2: E * E * mean(me * ce) -- equal formulas, kept as DeepSpeed writes them."""
    E = gate_sum_E.numel()
    me, ce = gate_sum_E / S, first_count_E / S
    return E * torch.sum(me * ce) if k == 1 else E * E * torch.mean(me * ce)


def finish_route(
    gates_SE: torch.Tensor,
    expert_Sk: torch.Tensor,
    pos_Sk: torch.Tensor,
    cap: int,
    aux_loss: torch.Tensor,
    z_loss: torch.Tensor,
) -> RouteResult:
    """Drop positions >= cap, compute combine weights and kept counts."""
    E = gates_SE.size(1)
    k = expert_Sk.size(1)
    kept = pos_Sk < cap
    slot = torch.where(kept, pos_Sk, torch.full_like(pos_Sk, -1))
    g = gates_SE.gather(1, expert_Sk) * kept  # [S, k]
    if k >= 2:
        denom = g.sum(dim=1, keepdim=True).clamp(min=torch.finfo(g.dtype).eps)
        g = g / denom
    counts = count_per_expert(expert_Sk, E, kept)
    return RouteResult(expert_Sk, slot, g, cap, aux_loss, z_loss, counts, gates_SE)


def z_loss_of(logits_SE: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE)."""
    return torch.logsumexp(logits_SE.float(), dim=-1).pow(2).mean()


def route(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    policy: str = "position",
    generator: Optional[torch.Generator] = None,
    z_loss_coeff: float = 0.0,
    dropless: bool = False,
) -> RouteResult:
    """Route one group of S tokens (logits [S, E]) to k of E experts with capacity
    (`dropless`: C = S, every choice kept).

    `aux_loss` is the unscaled load-balancing loss (multiply by the aux
    coefficient); `z_loss` is already multiplied by `z_loss_coeff`.
    """
    S, E = logits.shape
    cap = S if dropless else capacity(S, E, k, capacity_factor, min_capacity)
    z = z_loss_of(logits) * z_loss_coeff if z_loss_coeff else logits.new_zeros((), dtype=torch.float32)
    if policy == "position" and k <= 2 and kernels.use_triton(logits):  # CUDA + triton: fused gating
        gates, expert, slot, weight = kernels.topk_gating(logits, k, cap)
        aux = aux_loss_from_terms(*aux_loss_terms(gates, expert)[:2], S, k)
        return RouteResult(expert, slot, weight, cap, aux, z, count_per_expert(expert, E, slot >= 0), gates)
    gates, expert = choose_experts(logits, k, policy, generator)
    pos = slot_positions(expert, E, token_order(gates, expert, policy))
    aux = aux_loss_from_terms(*aux_loss_terms(gates, expert)[:2], S, k)
    return finish_route(gates, expert, pos, cap, aux, z)


class Router(nn.Module):
    """The gate of one MoE layer: fp32 gate weight [E, M] (replicated) and routing rule. Random
    routing draws depend on (seed, layer, call, routing group) only. `calls` counts finished
    forwards (checkpointed); `last_stats` / `last_routes` describe the last one (`record`).
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
        self.ps, self.seed, self.layer_idx, self.routing_groups = ps, seed, layer_idx, routing_groups
        self.num_experts, self.k, self.cf, self.min_cap = (
            moe.num_experts,
            moe.moe_router_topk,
            moe.moe_expert_capacity_factor,
            moe.moe_min_capacity,
        )
        self.policy, self.aux_coeff, self.z_coeff = moe.moe_router_policy, moe.moe_aux_loss_coeff, moe.moe_z_loss_coeff
        self.dropless = moe.moe_dropless
        self.gate_w = make_param(
            (moe.num_experts, m.hidden_size),
            ShardSpec(),
            InitSpec("normal", m.init_method_std),
            ps,
            seed,
            f"{name}.gate_w",
            device,
        )
        self.calls = 0
        self.device_stats: Optional[tuple[torch.Tensor, int]] = None  # (kept per expert [E], choices)
        self.last_routes: list[RouteResult] = []

    @property
    def last_stats(self) -> dict:
        """The last forward's {"counts": [E] kept per expert (host), "dropped", "choices"}: a host read
        of `device_stats` (the trainer sums those on the device and reads them once per step)."""
        if self.device_stats is None:
            return {}
        counts, choices = self.device_stats[0].cpu(), self.device_stats[1]
        return {"counts": counts, "dropped": choices - int(counts.sum()), "choices": choices}

    def capacity(self, num_tokens: int) -> int:
        """C of a routing group of `num_tokens` tokens (dropless: `num_tokens`, nothing dropped)."""
        if self.dropless:
            return num_tokens
        return capacity(num_tokens, self.num_experts, self.k, self.cf, self.min_cap)

    def generator(self, g: int) -> Optional[torch.Generator]:
        """Seeded generator of routing group g of this call (random routing only)."""
        if self.policy != "random":
            return None
        gid = self.ps.rank("dp") * self.routing_groups + g
        gen = torch.Generator(device="cpu")  # host generator: same draws on every device
        gen.manual_seed((self.seed * 1_000_003 + self.layer_idx * 10_007 + self.calls * 101 + gid) & 0x7FFF_FFFF)
        return gen

    def logits(self, x_SM: torch.Tensor, split_over_mp: bool = False) -> torch.Tensor:
        """fp32 logits [S, E]. When MP ranks hold different tokens, gate grads are summed over MP."""
        w = copy_to_group(self.gate_w, self.ps.group("mp")) if split_over_mp else self.gate_w
        with torch.autocast(device_type=x_SM.device.type, enabled=False):
            return x_SM.float() @ w.float().t()

    def route(self, x_SM: torch.Tensor, g: int = 0) -> RouteResult:
        """Route a whole routing group x [S, M] (group g of this call)."""
        return route(
            self.logits(x_SM),
            self.k,
            self.cf,
            self.min_cap,
            self.policy,
            self.generator(g),
            self.z_coeff,
            self.dropless,
        )

    def choose(self, logits_sE: torch.Tensor, g: int, start: int, group_tokens: int):
        """Experts of rows [start, start + s) of group g (logits [s, E]): (gates [s, E], expert [s, k])."""
        return choose_experts_slice(logits_sE, self.k, self.policy, self.generator(g), start, group_tokens)

    def route_slice(
        self,
        gates_sE: torch.Tensor,
        expert_sk: torch.Tensor,
        group_tokens: int,
        offset_kE: Optional[torch.Tensor] = None,
        totals_kE: Optional[torch.Tensor] = None,
    ) -> RouteResult:
        """Capacity passing: the route of a slice of a group of `group_tokens` tokens (experts from
        `choose`) with the slots it holds in the whole group, given the choice-j tokens of each expert
        before the slice (`offset_kE` [k, E]) and, for k >= 2, the group's choice-j totals [k, E].
        The losses are left at zero: the caller computes them from the group's sums (`aux_of_sums`)."""
        pos = slot_positions(
            expert_sk, self.num_experts, token_order(gates_sE, expert_sk, self.policy), offset_kE, totals_kE
        )
        zero = gates_sE.new_zeros((), dtype=torch.float32)
        return finish_route(gates_sE, expert_sk, pos, self.capacity(group_tokens), zero, zero)

    def aux(self, r: RouteResult) -> torch.Tensor:
        """The loss a routed group adds: coeff * load balancing + z-loss."""
        return self.aux_coeff * r.aux_loss + r.z_loss

    def aux_of_sums(
        self, gate_sum_E: torch.Tensor, first_count_E: torch.Tensor, z_sum: Optional[torch.Tensor], group_tokens: int
    ) -> torch.Tensor:
        """`aux` of a group from sums over its slices: gates [E], first choices [E], logsumexp^2 (or None)."""
        lb = aux_loss_from_terms(gate_sum_E, first_count_E, group_tokens, self.k)
        z = z_sum / group_tokens * self.z_coeff if self.z_coeff and z_sum is not None else lb.new_zeros(())
        return self.aux_coeff * lb + z

    def record(
        self, routes: list[RouteResult], kept_E: Optional[torch.Tensor] = None, choices: Optional[int] = None
    ) -> None:
        """End of a forward: keep the routes of this rank's tokens and the stats of the whole groups.

        Without `kept_E` / `choices` the routes cover whole groups; S1 passes the groups' kept
        counts [E] and number of choices (its routes are this rank's slices)."""
        if kept_E is None:
            kept_E = torch.stack([r.counts for r in routes]).sum(0)
            choices = sum(r.slot.numel() for r in routes)
        # kept on the device: read on the host only when someone asks (`last_stats`), not per forward
        self.device_stats = (kept_E.detach(), int(choices))
        # detached: kept past the step, their graph would hold its activations and the gradient accumulators
        # of the old expert shapes (Lina's packing changes them between steps)
        self.last_routes = [r.detached() for r in routes]
        self.calls += 1
