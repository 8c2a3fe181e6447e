"""The MoE layer at inference under an expert placement: Lina's two-phase scheduling.

Legend: R tokens of this rank, E experts, k choices, D ranks of the EP group (N in the paper),
M model dim, H ffn hidden dim.

Every rank keeps a read-only copy of every expert of every MoE layer (`gather_experts`, once per
engine, shareable by runners), so any rank can run any expert and a replica costs no weight
transfer per batch (Lina keeps every expert resident in host memory too). Per MoE layer m:

  route (dropless)  -> local choice counts [E]
  one all-gather over the EP group of [counts E | estimate for layer m+1 E | R | 4 measured sums
    (`rates`)]: the count exchange dropless dispatch needs anyway, carrying phase 1's estimate
    for the next layer; every rank then knows every rank's counts and plans alike
  placement of layer m:
    none      the trained layout (expert e on rank e // (E / D))
    phase1    `popularity.plan_placement` of the estimate carried by layer m-1's exchange (layer 0:
              the profile's overall distribution), eq. (1) scaled to sum to D
    phase1_2  phase 1, then, when the top-2k experts of the actual counts differ from those of the
              estimate (`phase2_triggered`), `popularity.traffic_aware_replan` priced with the
              measured rates (s per expert row, s per dispatch row the busiest rank sends), summed
              over earlier calls and carried in the all-gather so every rank prices alike
  dispatch: the choices of expert e, in (source rank, token) order, split evenly over its
    replicas; one uneven all-to-all there, the experts on the received rows, one back, weighted
    combine. Every choice meets the same expert weights as in the trained layout, so the output
    equals the plain layer's.

`gate_bias` (per MoE layer [E]; benchmarks) is added to the router logits; `record_into` counts the
routed paths into a profile. Per call the runner records its times and bytes (`reset_stats`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from megatron_moe.distributed.collectives import all_gather_raw, all_to_all_raw
from megatron_moe.layers.fused import gelu_tanh
from megatron_moe.model.gpt2 import Block
from megatron_moe.moe.router import route
from megatron_moe.inference.engine import InferenceEngine
from megatron_moe.inference.popularity import (
    Placement,
    PathProfile,
    device_rows,
    devices_per_expert,
    link_rows,
    model_fingerprint,
    plan_placement,
    static_placement,
    top_experts,
    traffic_aware_replan,
)

MODES = ("none", "phase1", "phase1_2")
# phase 2: "traffic" prices compute and link (traffic_aware_replan); "compute" re-plans for compute
# balance alone (benchmarks compare the two)
PRICINGS = ("traffic", "compute")
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class ScheduledMoE:
    """An `InferenceEngine.ffn_runner` running MoE blocks under a placement (module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        profile: Optional[PathProfile],
        mode: str = "phase1_2",
        max_per_rank: int = 4,
        gate_bias: Optional[list[torch.Tensor]] = None,
        record_into: Optional[PathProfile] = None,
        weights: Optional[list[ExpertWeights]] = None,
        phase2_pricing: str = "traffic",
    ):
        if mode not in MODES:
            raise ValueError(f"scheduling mode must be one of {MODES}, got {mode!r}")
        if phase2_pricing not in PRICINGS:
            raise ValueError(f"phase-2 pricing must be one of {PRICINGS}, got {phase2_pricing!r}")
        self.phase2_pricing = phase2_pricing
        if mode != "none" and profile is None:
            raise ValueError(f"mode {mode} needs a profile (--lina-inference)")
        ps = engine.ps
        if ps.size("esp") != 1:
            raise ValueError("--lina-inference needs --expert-sharding-parallel-size 1 (whole experts per rank)")
        self.engine, self.profile, self.mode, self.max_per_rank = engine, profile, mode, max_per_rank
        self.group, self.D, self.me = ps.group("ep"), ps.size("ep"), ps.rank("ep")
        self.blocks, self.E, self.k = engine.moe_blocks, engine.cfg.moe.num_experts, engine.cfg.moe.moe_router_topk
        self.layer_of = {b: m for m, b in enumerate(self.blocks)}
        self.gate_bias, self.record_into = gate_bias, record_into
        self._choices: list[torch.Tensor] = []
        self.weights = weights if weights is not None else gather_experts(engine)
        self.reset_stats()
        self.history: list[torch.Tensor] = []  # first choices of this forward's earlier MoE layers
        self.next_estimate: Optional[list[float]] = None
        self._guess: Optional[torch.Tensor] = None  # estimated top expert of each token at the next layer

    def reset_stats(self) -> None:
        """Forget the per-call records (benchmarks: after the warm-up)."""
        self.phase2_triggered: list[bool] = []
        self.estimated: list[Optional[list[float]]] = []
        self.actual: list[list[float]] = []
        self.plan_s: list[float] = []  # planning: the next layer's estimate, eq. (1), the placement
        self.call_s: list[float] = []  # wall time of each MoE layer call
        self.comm_s: list[float] = []  # exchange_s + a2a_s (waits for slower ranks included)
        self.expert_s: list[float] = []  # time in this call's expert GEMMs
        self.rows: list[list[int]] = []  # expert rows each rank computed, per call
        self.a2a_s: list[float] = []  # time in this call's two all-to-alls
        self.exchange_s: list[float] = []  # time in this call's count all-gather
        self.a2a_bytes: list[int] = []  # bytes this rank sent to other ranks in both all-to-alls
        self.phase2_choice: list[Optional[str]] = []  # what a triggered phase 2 did (traffic_aware_replan)
        # measured rates, summed over calls: (dispatch all-to-all s, busiest sender's rows), (expert s, rows)
        self.link_meas = [0.0, 0.0]
        self.expert_meas = [0.0, 0.0]
        self.hits = self.predicted = 0  # tokens whose estimated top expert was right

    # ------------------------------------------------------------------ estimation
    def _estimate_next(self, m: int, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token popularity [E] for layer m+1, each token's estimated top expert [R] or -1)."""
        R = first.size(0)
        if self.profile is None or self.mode == "none" or m + 1 >= len(self.blocks):
            return torch.zeros(self.E, dtype=torch.float64, device="cpu"), torch.full((R,), -1, device="cpu")
        p = self.profile.path_len(m + 1)
        hist = self.history[m + 1 - p : m + 1]
        paths = (
            torch.stack([h.cpu() for h in hist], dim=1) if p else torch.zeros((R, 0), dtype=torch.long, device="cpu")
        )
        pop = self.profile.token_popularity(m + 1, paths)
        guess = pop.argmax(dim=1) if R else torch.zeros((0,), dtype=torch.long, device="cpu")
        return pop.sum(dim=0), guess

    def _first_layer_estimate(self) -> list[float]:
        assert self.profile is not None
        dist = torch.tensor(self.profile.distribution(0, ()), dtype=torch.float64, device="cpu")
        top = torch.topk(dist, self.k).indices
        keep = torch.zeros_like(dist)
        keep[top] = dist[top]
        return [self.D * float(x) for x in keep]

    # ------------------------------------------------------------------ one MoE block
    def __call__(self, block_idx: int, block: Block, x_1RM: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        m = self.layer_of[block_idx]
        if m == 0:
            self.history, self._guess, self._choices = [], None, []
        x = x_1RM[0]
        R, M = x.shape
        layer = block.moe
        h = block.ln2(x)
        logits = layer.router.logits(h)
        if self.gate_bias is not None:
            logits = logits + self.gate_bias[m].to(logits.device)
        rt = layer.router
        r = route(logits, rt.k, rt.cf, rt.min_cap, rt.policy, None, 0.0, dropless=True)
        expert, weight = r.expert, r.weight  # [R, k]
        first = expert[:, 0]
        if m == 0 and self.profile is not None and self.mode != "none":
            self.next_estimate = self._first_layer_estimate()
        est_here = self.next_estimate
        if self._guess is not None and self._guess.numel() == R:
            self.hits += int((self._guess == first.cpu()).sum())
            self.predicted += R
        self.history.append(first)
        self._choices.append(expert)
        if self.record_into is not None and m + 1 == len(self.blocks):
            self.record_into.add(self.history, self._choices)
        t_est = time.perf_counter()
        pop_next, self._guess = self._estimate_next(m, first)
        est_s = time.perf_counter() - t_est
        counts = torch.bincount(expert.reshape(-1), minlength=self.E).to(torch.float64).cpu()
        meas = [float(R), *self.link_meas, *self.expert_meas]
        msg = torch.cat([counts, pop_next, torch.tensor(meas, dtype=torch.float64, device="cpu")])
        t_comm = time.perf_counter()
        table = all_gather_raw(msg.to(x.device)[None], self.group, dim=0).cpu()  # [D, 2E+5]
        self.exchange_s.append(time.perf_counter() - t_comm)
        self.comm_s.append(self.exchange_s[-1])
        counts_DE = table[:, : self.E].round().long()
        t0 = time.perf_counter()
        placement = self._placement(m, est_here, counts_DE, rates(table[:, 2 * self.E + 1 :].sum(dim=0).tolist()))
        total_tokens = float(table[:, 2 * self.E].sum())
        self.next_estimate = (
            devices_per_expert(table[:, self.E : 2 * self.E].sum(dim=0), int(total_tokens), self.D)
            if self.mode != "none" and m + 1 < len(self.blocks)
            else None
        )
        self.plan_s.append(time.perf_counter() - t0 + est_s)
        self.rows.append(device_rows(placement, counts_DE.sum(dim=0).tolist(), self.D))
        y = self._dispatch_compute_combine(m, x, h, expert, weight, counts_DE, placement)
        out = (x + block.drop(y))[None]
        self.call_s.append(time.perf_counter() - start)
        return out

    def _placement(
        self, m: int, estimate: Optional[list[float]], counts_DE: torch.Tensor, rate: tuple[float, float]
    ) -> Placement:
        """The placement of layer m for this mode (phase 2: `traffic_aware_replan` from the actual counts,
        priced with `rate` = (s per expert row, s per link row), the same on every rank)."""
        actual = counts_DE.sum(dim=0).tolist()
        self.actual.append([float(a) for a in actual])
        self.estimated.append(estimate)
        if self.mode == "none" or estimate is None:
            self.phase2_triggered.append(False)
            self.phase2_choice.append(None)
            return static_placement(self.E, self.D)
        # eq. (1) counts only each path's top-k probabilities, so its n_e sum to less than D: packing
        # them into devices of capacity 1 would crowd experts onto too few devices; plan with the
        # same proportions over all D devices (phase 2's n_e from the counts sum to D already)
        total_est = sum(estimate)
        placement = plan_placement(
            [self.D * x / total_est for x in estimate] if total_est > 0 else estimate, self.D, self.max_per_rank
        )
        trigger, choice = False, None
        if self.mode == "phase1_2":
            n = min(2 * self.k, self.E)
            trigger = top_experts(estimate, n) != top_experts([float(a) for a in actual], n)
            if trigger and self.phase2_pricing == "compute":
                total = max(sum(actual), 1)
                placement = plan_placement([self.D * a / total for a in actual], self.D, self.max_per_rank)
                choice = "replan"
            elif trigger:
                placement, choice = traffic_aware_replan(placement, counts_DE.tolist(), self.max_per_rank, *rate)
        self.phase2_triggered.append(trigger)
        self.phase2_choice.append(choice)
        return placement

    # ------------------------------------------------------------------ the all-to-alls
    def _dispatch_compute_combine(
        self,
        m: int,
        x: torch.Tensor,
        h: torch.Tensor,
        expert: torch.Tensor,
        weight: torch.Tensor,
        counts_DE: torch.Tensor,
        placement: Placement,
    ) -> torch.Tensor:
        dev = x.device
        R, M = h.shape
        E, D, me = self.E, self.D, self.me
        total_E = counts_DE.sum(dim=0)
        before_E = counts_DE[:me].sum(dim=0)  # choices of earlier ranks
        # this rank's choices sorted by (expert, token): global index of each within its expert
        flat_e = expert.reshape(-1)
        order = torch.argsort(
            flat_e * max(R, 1) + torch.arange(R, device=dev)[:, None].expand_as(expert).reshape(-1), stable=True
        )
        e_sorted = flat_e[order]
        token = order // expert.size(1)
        start = torch.cumsum(counts_DE[me], 0) - counts_DE[me]
        within = torch.arange(e_sorted.numel(), device="cpu") - start[e_sorted.cpu()]
        gidx = before_E[e_sorted.cpu()] + within  # index among expert e's choices
        # replica j of expert e (r_e hosts, c_e choices) takes indices [j c_e // r_e, (j + 1) c_e // r_e):
        # the replica of index g is ((g + 1) r_e - 1) // c_e
        e_cpu = e_sorted.cpu()
        n_hosts = torch.tensor([len(h) for h in placement.hosts], dtype=torch.long, device="cpu")
        first_host = torch.cumsum(n_hosts, 0) - n_hosts
        host_list = torch.tensor([d for h in placement.hosts for d in h], dtype=torch.long, device="cpu")
        r_e = n_hosts[e_cpu]
        j = ((gidx + 1) * r_e - 1) // total_E[e_cpu].clamp(min=1)
        dest = host_list[first_host[e_cpu] + j]
        send_order = torch.argsort(dest * (E + 1) + e_cpu, stable=True)  # by (dest, expert, token)
        send_tok = token.cpu()[send_order]
        send_counts = torch.bincount(dest, minlength=D).tolist()
        # what every source sends me, per expert: my replica's share of [before, before + count)
        recv_blocks = []  # (source, expert, rows)
        for s in range(D):
            lo_E = counts_DE[:s].sum(dim=0)
            for e in placement.experts_of(me):
                hosts = placement.hosts[e]
                rep = hosts.index(me)  # my replica of expert e
                c = int(total_E[e])
                a, b = (rep * c) // len(hosts), ((rep + 1) * c) // len(hosts)
                lo, hi = int(lo_E[e]), int(lo_E[e]) + int(counts_DE[s, e])
                n = max(0, min(b, hi) - max(a, lo))
                if n:
                    recv_blocks.append((s, e, n))
        recv_counts = [sum(n for s2, _, n in recv_blocks if s2 == s) for s in range(D)]
        send_x = h.index_select(0, send_tok.to(dev))
        t_comm = time.perf_counter()
        recv_x = all_to_all_raw(send_x, self.group, recv_counts, send_counts)
        t_exp = time.perf_counter()
        # measured: the rows that crossed to other ranks (dispatch, and the same back), in bytes
        row_bytes = M * h.element_size()
        self.a2a_bytes.append((sum(send_counts) - send_counts[me] + sum(recv_counts) - recv_counts[me]) * row_bytes)
        busiest = max(link_rows(placement, counts_DE.tolist())[0], default=0)
        if busiest:  # the dispatch starts in step after the all-gather: its time is the link's
            self.link_meas[0] += t_exp - t_comm
            self.link_meas[1] += busiest
        recv_exp = torch.repeat_interleave(
            torch.tensor([e for _, e, _ in recv_blocks], dtype=torch.long, device="cpu"),
            torch.tensor([n for _, _, n in recv_blocks], dtype=torch.long, device="cpu"),
        )
        out = self._experts(m, recv_x, recv_exp)
        t_back = time.perf_counter()
        back = all_to_all_raw(out, self.group, send_counts, recv_counts)  # in my send order
        self.a2a_s.append((t_exp - t_comm) + (time.perf_counter() - t_back))
        self.comm_s[-1] += self.a2a_s[-1]
        self.expert_s.append(t_back - t_exp)
        if recv_x.size(0):
            self.expert_meas[0] += t_back - t_exp
            self.expert_meas[1] += recv_x.size(0)
        y = torch.zeros((R, M), dtype=h.dtype, device=dev)
        w = weight.reshape(-1)[order][send_order.to(dev)].to(h.dtype)
        return y.index_add(0, send_tok.to(dev), back * w[:, None])

    def _experts(self, m: int, x_NM: torch.Tensor, exp_N: torch.Tensor) -> torch.Tensor:
        """Each row through its expert's (replica) weights, one GEMM pair per expert present."""
        fc_w, fc_b, proj_w, proj_b = self.weights[m]
        out = torch.empty_like(x_NM)
        for e in torch.unique(exp_N).tolist():
            rows = (exp_N == e).nonzero().squeeze(1).to(x_NM.device)
            xe = x_NM.index_select(0, rows)
            he = gelu_tanh(torch.addmm(fc_b[e].to(xe.dtype), xe, fc_w[e].t().to(xe.dtype)))
            out[rows] = torch.addmm(proj_b[e].to(he.dtype), he, proj_w[e].t().to(he.dtype))
        return out


def rates(sums: list[float]) -> tuple[float, float]:
    """(s per expert row, s per link row) from the summed measurements [link s, link rows, expert s,
    expert rows] of every rank (`ScheduledMoE.link_meas`, `expert_meas`); an unmeasured rate is taken
    equal to the other, both 1 before any measurement (then only their ratio matters)."""
    link_s, link_n, exp_s, exp_n = sums
    row = exp_s / exp_n if exp_n > 0 and exp_s > 0 else None
    link = link_s / link_n if link_n > 0 and link_s > 0 else None
    if row is None:
        row = link if link is not None else 1.0
    return row, (link if link is not None else row)


def gather_experts(engine: InferenceEngine) -> list[ExpertWeights]:
    """Per MoE layer, every expert's (fc_w [E, H, M], fc_b [E, H], proj_w [E, M, H], proj_b [E, M]) gathered
    over the EP group, detached and only read (on a group of one: the parameters themselves). Collective;
    once per engine, shareable by runners."""
    group = engine.ps.group("ep")
    out = []
    with torch.no_grad():
        for b in engine.moe_blocks:
            ex = engine.block(b).moe.experts
            parts = [all_gather_raw(t.detach(), group, dim=0) for t in (ex.fc_w, ex.fc_b, ex.proj_w, ex.proj_b)]
            out.append((parts[0], parts[1], parts[2], parts[3]))
    return out


def gate_fingerprint(engine: InferenceEngine) -> dict:
    """The model fingerprint a profile must carry (popularity.model_fingerprint)."""
    gates: list[torch.Tensor] = [engine.block(b).moe.router.gate_w for b in engine.moe_blocks]
    return model_fingerprint(engine.cfg, gates)
