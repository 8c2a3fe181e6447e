"""Candidates of a cluster and their predicted step time and peak memory per GPU.

A candidate is a layout (MP, EP, ESP; DP is the rest) plus the switches: Parm's schedule (what
`--moe-schedule auto` picks: Algorithm 1 on the cluster's collective costs, the baseline at one MP
rank), Lancet's weight-gradient scheduling, Lina's prioritized all-reduce and, for dropless runs
with a stated skew, Pro-Prophet. Enumeration applies the trainer's own checks
(`arguments.validate`, `optimizations.check_combination`), so every candidate the plan emits is one
the trainer accepts and every rejected one carries the trainer's message.

Step time, per rank and iteration (n micro-batches of b samples of s tokens, t = b s tokens):
  compute      n x (forward + backward) of one micro-batch: measured per layout by a profile, or
               FLOPs / throughput (dense FLOPs / MP from `training.model_flops_per_token`; the experts'
               rows from Parm's `expert_flops`: padded buffers, or the most loaded rank dropless),
               plus the step's gradient clipping and optimizer update once per iteration: measured per
               layout by a profile, or the optimizer's bytes per parameter at the memory bandwidth
  MoE          n x Parm's forward + backward collective time of the chosen schedule per MoE layer
               (`moe.cost_model`), each message priced by the cluster at its size (`ClusterComm`)
  MP           n x all-reduces of t x M: forward and backward of every attention and dense MLP, the
               embedding's output and the LM head's input gradient
  DP           the gradients' all-reduce (dense over DP, experts over expert-DP) in GradSync's buckets:
               the last bucket of each kind launches as backward ends and is exposed whole; the
               earlier ones overlap the last backward, and without Lina, while they share a link
               class with the backward all-to-alls, each runs at half rate (the all-to-alls slow down
               by up to 2x; Lina's paper measured a median 1.83x); with Lina the all-to-alls go first
               and the early micro-ops fill the backward's compute only
  Lancet       Lancet's Algorithm 1 (`lancet.wgrad_schedule`) on the backward IR with these costs:
               the dW GEMMs it assigns hide that much of the backward all-to-alls
  Pro-Prophet  Pro-Prophet's planner and performance model (eqs. 1-8) on Zipf counts of the
               stated skew: the predicted layer-time saving, on the dropless layers
Memory per rank: parameters, gradients and optimizer state counted like the model shards them,
the bf16 autocast copies of the weights, and the activations one micro-batch keeps for backward
(`activation_bytes`), including the MoE layers' dispatch buffers at the capacity factor or,
dropless, at the stated skew.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_moe.arguments import validate
from megatron_moe.config import Config
from megatron_moe.distributed.grad_sync import GradSync
from megatron_moe.lancet.wgrad_schedule import build_gpt_moe_backward, exposed_comm_ms, schedule_wgrad
from megatron_moe.moe.cost_model import AlphaBeta, CommModel, MoEShape, choose_schedule, expert_flops
from megatron_moe.moe.cost_model import time_baseline, time_s1, time_s2
from megatron_moe.optimizations import check_combination
from megatron_moe.parallel_state import rank_layout
from megatron_moe.planner.cluster import OPTIMIZER_BYTES_PER_PARAM, Cluster, layout_key
from megatron_moe.planner.memory import GRAD_BYTES, memory, params_per_rank
from megatron_moe.pro_prophet.perf_model import PerfConstants, PerfModel
from megatron_moe.pro_prophet.planner import plan as pro_prophet_plan
from megatron_moe.training import model_flops_per_token

PARM_GROUPS = ("mp", "ep", "esp", "ep_esp")
# Bytes per element of the MoE layer's collectives under bf16 autocast, as the observer measured them
# on gloo (tests/test_planner.py): the dispatch side carries the LayerNorm output and its gradient,
# which autocast leaves fp32; the combine side carries the experts' bf16 output and its gradient. An
# all-to-all runs once each way per pass (mean 3 bytes); the ESP all-gather / reduce-scatter move the
# dispatch buffer (4), the ESP all-reduce the combine buffer (2).
BF16_MOE_BYTES = {"all_to_all": 3.0, "all_gather": 4.0, "reduce_scatter": 4.0, "all_reduce": 2.0}
NO_OPTS = {"lancet": False, "lina": False, "pro_prophet": False}
# GradSync's bucket size (its default, which the trainer keeps): buckets fill per kind in reverse
# registration order and one launches when its last gradient is ready, so the last bucket of a kind
# (the one holding the embedding, or the first MoE layer's experts) launches as backward ends
GRAD_BUCKET_BYTES = int(inspect.signature(GradSync.__init__).parameters["bucket_mb"].default * 2**20)


def last_bucket_bytes(nbytes: float, bucket: float = GRAD_BUCKET_BYTES) -> float:
    """Bytes of the bucket (GradSync's, or Lina's coalesced micro-op) launched last, at the end of
    backward, out of `nbytes` of gradients."""
    if nbytes <= 0:
        return 0.0
    return nbytes - bucket * math.floor((nbytes - 1) / bucket)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Candidate:
    mp: int
    ep: int
    esp: int
    dp: int
    opts: dict = field(default_factory=lambda: dict(NO_OPTS))
    schedule: str = "baseline"  # the MoE schedule the run would use
    step_s: float = 0.0
    breakdown: dict = field(default_factory=dict)  # seconds per term
    links: dict = field(default_factory=dict)  # group kind -> link class
    memory: dict = field(default_factory=dict)  # bytes per term
    rejected: str = ""

    @property
    def name(self) -> str:
        on = [k.replace("_", "-") for k, v in self.opts.items() if v]
        return f"MP{self.mp} EP{self.ep} ESP{self.esp} DP{self.dp}" + (" + " + " + ".join(on) if on else "")

    def flags(self) -> list[str]:
        out = [
            "--tensor-model-parallel-size", str(self.mp),
            "--expert-model-parallel-size", str(self.ep),
            "--expert-sharding-parallel-size", str(self.esp),
        ]  # fmt: skip
        if self.opts.get("lancet"):
            out.append("--lancet-wgrad")
        if self.opts.get("lina"):
            out.append("--lina")
        if self.opts.get("pro_prophet"):
            out.append("--pro-prophet")
        return out

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "mp": self.mp,
            "ep": self.ep,
            "esp": self.esp,
            "dp": self.dp,
            "opts": self.opts,
            "schedule": self.schedule,
            "step_s": self.step_s,
            "breakdown_s": self.breakdown,
            "links": self.links,
            "memory_bytes": self.memory,
            "fits": not self.rejected,
            "rejected": self.rejected,
        }


def candidate_config(cfg: Config, c: Candidate, world: int) -> Config:
    """A copy of `cfg` with the candidate's layout and switches, validated like the trainer does
    (raises the trainer's ValueError)."""
    out = copy.deepcopy(cfg)
    p, o = out.parallel, out.opts
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_sharding_parallel_size = c.mp, c.ep, c.esp
    o.lancet_wgrad, o.lina, o.pro_prophet = c.opts["lancet"], c.opts["lina"], c.opts["pro_prophet"]
    if out.train.global_batch_size is None:
        raise ValueError("--global-batch-size is needed to compare layouts (it fixes the work of a step)")
    validate(out, world)
    check_combination(out)
    if out.padded_vocab_size % c.mp:
        raise ValueError(
            f"padded vocabulary {out.padded_vocab_size} is not divisible by --tensor-model-parallel-size {c.mp}"
        )
    return out


def enumerate_candidates(cfg: Config, world: int, skew: Optional[float]) -> tuple[list, list]:
    """(accepted, rejected) candidates: every MP, EP, ESP whose product structure divides the world,
    with every switch combination; a rejected one carries the trainer's error."""
    E = cfg.moe.num_experts
    opt_names = ["lancet", "lina"] + (["pro_prophet"] if cfg.moe.moe_dropless and skew is not None else [])
    ok, bad = [], []
    for mp in divisors(world):
        for ep in divisors(world) if E else [1]:
            for esp in divisors(world // ep) if E else [1]:
                if (world // (ep * esp)) * ep * esp != world:
                    continue
                for flags in itertools.product((False, True), repeat=len(opt_names)):
                    opts = dict(NO_OPTS, **dict(zip(opt_names, flags)))
                    c = Candidate(mp, ep, esp, world // mp, opts)
                    try:
                        candidate_config(cfg, c, world)
                        ok.append(c)
                    except ValueError as e:
                        c.rejected = str(e)
                        bad.append(c)
    return ok, bad


# ----------------------------------------------------------------------------- time


def zipf_shares(E: int, skew: float) -> list[float]:
    """Expert e's share of the routed choices, proportional to 1 / (e + 1)^skew."""
    w = [1.0 / (e + 1) ** skew for e in range(E)]
    return [x / sum(w) for x in w]


def zipf_counts(devices: int, experts: int, tokens: int, skew: float) -> list[list[int]]:
    """[D, E] counts: each rank routes `tokens` choices by `zipf_shares` (largest-remainder rounding,
    ties to the lower expert)."""
    exact = [tokens * x for x in zipf_shares(experts, skew)]
    row = [int(x) for x in exact]
    for e in sorted(range(experts), key=lambda j: (-(exact[j] - row[j]), j))[: tokens - sum(row)]:
        row[e] += 1
    return [list(row) for _ in range(devices)]


def rank_load(E: int, ep: int, skew: Optional[float]) -> float:
    """The most loaded EP rank's routed choices over the mean (experts placed in blocks of E / EP)."""
    if not skew or ep == 1:
        return 1.0
    shares = zipf_shares(E, skew)
    per = E // ep
    return max(sum(shares[r * per : (r + 1) * per]) for r in range(ep)) * ep


class ClusterComm(CommModel):
    """Parm's CommModel whose `t` asks the cluster for each message: a measured link's rate depends
    on the size, which one alpha-beta line per collective would fix at a single size."""

    def __init__(self, predictor: "Predictor", layout, only: Optional[str] = None) -> None:
        super().__init__({}, "cluster")
        self.predictor, self.layout, self.only = predictor, layout, only
        self.memo: dict = {}

    def t(self, op: str, group: str, n: float) -> float:
        if group not in PARM_GROUPS or (self.only and group != self.only):
            return 0.0
        key = (op, group, n)
        if key not in self.memo:
            groups = getattr(self.layout, f"{group}_groups")
            self.memo[key] = self.predictor._worst(op, groups, n * self.predictor.moe_elem(op))
        return self.memo[key]


class Predictor:
    """Predicts candidates of one model on one cluster; `skew`: the dropless routing skew (Zipf
    exponent) or None."""

    def __init__(self, cfg: Config, cluster: Cluster, skew: Optional[float] = None) -> None:
        self.cfg, self.cluster, self.skew = cfg, cluster, skew
        self.elem = 2 if cfg.optim.bf16 else 4
        self.H = int(cfg.model.ffn_hidden_size or 4 * cfg.model.hidden_size)
        if cfg.train.global_batch_size is None:
            raise ValueError("--global-batch-size is needed to compare layouts (it fixes the work of a step)")
        self.global_batch = int(cfg.train.global_batch_size)

    def moe_elem(self, op: str) -> float:
        """Bytes per element of an MoE collective `op` (BF16_MOE_BYTES under bf16, else fp32)."""
        return BF16_MOE_BYTES[op] if self.cfg.optim.bf16 else 4.0

    def mp_all_reduces(self, n_moe: int) -> int:
        """MP all-reduces of t x M per micro-batch: forward and backward of every attention and dense MLP,
        the vocabulary-parallel embedding's output (forward) and the LM head's input gradient (backward)."""
        m = self.cfg.model
        return 2 * (m.num_layers + (m.num_layers - n_moe)) + 2

    def _worst(self, op: str, groups: list[list[int]], nbytes: float) -> float:
        return max(self.cluster.collective(op, g, nbytes) for g in groups)

    def comm_model(self, layout, only: Optional[str] = None) -> CommModel:
        """Parm's CommModel for the layout, priced by the cluster at each message's size (the
        slowest group of a kind); `only`: that group kind's collectives alone."""
        return ClusterComm(self, layout, only)

    def shape(self, c: Candidate) -> MoEShape:
        m, moe = self.cfg.model, self.cfg.moe
        f = moe.moe_expert_capacity_factor
        if moe.moe_dropless:
            f = rank_load(moe.num_experts, c.ep, self.skew)
        return MoEShape(
            self.cfg.train.micro_batch_size,
            m.seq_length,
            m.hidden_size,
            moe.num_experts,
            moe.moe_router_topk,
            f,
            c.mp,
            c.ep,
            c.esp,
            0 if moe.moe_dropless else moe.moe_min_capacity,
            self.H,
        )

    def _moe_times(self, c: Candidate, layout) -> tuple[str, dict, float]:
        """(schedule, per-group forward+backward communication of one MoE layer, expert FLOPs)."""
        moe, sh = self.cfg.moe, self.shape(c)
        full = self.comm_model(layout)
        if moe.moe_schedule != "auto":
            sched = moe.moe_schedule
        elif c.mp == 1 or moe.moe_dropless:
            sched = "baseline"
        else:
            sched = choose_schedule(full, sh, s1="kept", flops_per_s=self.cluster.flops).schedule
        timer = {"baseline": time_baseline, "s1": lambda m, s: time_s1(m, s, "kept"), "s2": time_s2}[sched]
        per_group = {g: timer(self.comm_model(layout, g), sh) for g in PARM_GROUPS}
        if moe.moe_dropless:  # the most loaded rank's rows, k S N_ESP x the skew's load (S1: / N_MP;
            H = sh.H or sh.M  # the baseline repeats them on every MP rank)
            rows = sh.k * sh.S * sh.n_esp * sh.f / (sh.n_mp if sched == "s1" else 1)
            return sched, per_group, rows * 3 * 2 * 2 * sh.M * H / sh.n_esp
        flops = expert_flops(sh, sched, "kept", kept=c.ep * c.esp * c.mp == 1)
        return sched, per_group, flops

    def predict(self, c: Candidate) -> Candidate:
        cfg, cl = self.cfg, self.cluster
        m, t_cfg = cfg.model, cfg.train
        layout = rank_layout(cl.world, c.mp, c.ep, c.esp)
        n_moe = sum(cfg.is_moe_layer(i) for i in range(m.num_layers))
        n_micro = self.global_batch // (t_cfg.micro_batch_size * c.dp)
        tokens = t_cfg.micro_batch_size * m.seq_length
        M, H, k = m.hidden_size, self.H, cfg.moe.moe_router_topk
        sched, moe_groups, x_flops = self._moe_times(c, layout) if n_moe else ("baseline", {}, 0.0)
        c.schedule = sched
        # compute of one micro-batch
        expert_per_token = 6 * n_moe * k * (2 * M * H + H + M)
        dense_flops = tokens * (model_flops_per_token(cfg) - expert_per_token) / c.mp
        key = layout_key(c.mp, c.ep, c.esp, t_cfg.micro_batch_size, sched)
        dense_p, expert_p = params_per_rank(cfg, c.mp, c.ep, c.esp)
        if key in cl.compute:
            fwd, bwd = cl.compute[key]["forward"], cl.compute[key]["backward"]
            optimizer = cl.compute[key].get("optimizer", 0.0)
            compute_src = "measured"
        else:
            total = (dense_flops + n_moe * x_flops) / cl.flops
            fwd, bwd = total / 3, 2 * total / 3
            optimizer = (
                (dense_p + expert_p) * OPTIMIZER_BYTES_PER_PARAM / cl.memory_bandwidth if cl.memory_bandwidth else 0.0
            )
            compute_src = "FLOPs"
        # MP all-reduces of attention and dense MLPs (2 forward + 2 backward each... per half-block)
        mp_ar = self.mp_all_reduces(n_moe) * self._worst("all_reduce", layout.mp_groups, tokens * M * self.elem)
        moe_comm = {g: n_moe * v for g, v in moe_groups.items()}
        moe_total = sum(moe_comm.values())
        a2a_bwd = n_moe * (moe_groups.get("ep", 0.0) + moe_groups.get("ep_esp", 0.0)) / 2
        # Lancet: dW GEMMs under the backward all-to-alls
        lancet_hidden = 0.0
        if c.opts["lancet"] and n_moe and a2a_bwd > 0:
            lancet_hidden = self._lancet_hidden(c, bwd, a2a_bwd / n_moe, x_flops)
        # Pro-Prophet on dropless layers
        pp_saving = 0.0
        if c.opts["pro_prophet"]:
            pp_saving = n_moe * self._pro_prophet_saving(c, layout, fwd + bwd, n_moe)
        # DP gradient all-reduce: the last bucket of each kind (GradSync's; Lina's coalesced micro-op)
        # launches when backward ends, after its all-to-alls, so it is exposed whole and slows no
        # all-to-all; only the earlier buckets overlap the backward
        ar_dp = self._worst("all_reduce", layout.dp_groups, dense_p * GRAD_BYTES)
        ar_edp = self._worst("all_reduce", layout.expert_dp_groups, expert_p * GRAD_BYTES)
        ar = ar_dp + ar_edp
        dp_cls = {cl.link_class(g) for g in layout.dp_groups + layout.expert_dp_groups} - {""}
        a2a_cls = {cl.link_class(g) for g in layout.ep_groups + layout.ep_esp_groups} - {""}
        last_a2a = max(0.0, a2a_bwd - lancet_hidden)
        shared = bool(dp_cls & a2a_cls) and ar > 0
        bucket = cfg.opts.lina_partition_mb * 2**20 if c.opts["lina"] else GRAD_BUCKET_BYTES
        tail = self._worst("all_reduce", layout.dp_groups, last_bucket_bytes(dense_p * GRAD_BYTES, bucket))
        tail += self._worst("all_reduce", layout.expert_dp_groups, last_bucket_bytes(expert_p * GRAD_BYTES, bucket))
        early = max(0.0, ar - tail)
        if c.opts["lina"]:  # the all-to-alls go first: the early micro-ops fill the backward's compute
            slowdown = 0.0
            ops = max(1, math.ceil((dense_p + expert_p) * GRAD_BYTES / bucket))
            early += ops * cl.inter.latency if "inter" in dp_cls else ops * cl.intra.latency
            dp_exposed = tail + max(0.0, early - bwd)
        else:  # early buckets share the link with the backward all-to-alls at half rate each
            slowdown = min(early, last_a2a) if shared else 0.0
            dp_exposed = tail + max(0.0, early - (bwd + last_a2a))
        ar = tail + early
        compute = n_micro * (fwd + bwd) + optimizer
        exposed = n_micro * (mp_ar + moe_total - lancet_hidden) + slowdown + dp_exposed
        c.step_s = compute + exposed - n_micro * pp_saving
        c.breakdown = {
            "compute": compute,
            "exposed_comm": exposed,
            "optimizer_step": optimizer,
            "compute_source": compute_src,
            "mp_all_reduce": n_micro * mp_ar,
            **{f"moe_{g}": n_micro * v for g, v in moe_comm.items() if v},
            "lancet_hidden": -n_micro * lancet_hidden,
            "pro_prophet_saved": -n_micro * pp_saving,
            "dp_all_reduce_exposed": dp_exposed,
            "dp_all_reduce_total": ar,
            "a2a_slowdown_under_all_reduce": slowdown,
            "micro_batches": n_micro,
        }
        c.links = {
            kind: sorted({cl.link_class(g) for g in getattr(layout, f"{kind}_groups")} - {""}) or ["none"]
            for kind in ("mp", "dp", "ep", "esp", "ep_esp", "expert_dp")
        }
        per_link: dict[str, float] = {}
        dp_kinds = [("dp", dp_exposed * ar_dp / ar), ("expert_dp", dp_exposed * ar_edp / ar)] if ar else []
        a2a_kind = [("ep_esp" if c.links["ep_esp"] != ["none"] else "ep", slowdown)]
        for kind, v in (
            [("mp", n_micro * mp_ar)] + [(g, n_micro * x) for g, x in moe_comm.items()] + dp_kinds + a2a_kind
        ):
            for cls in c.links[kind]:
                if cls != "none" and v:
                    per_link[cls] = per_link.get(cls, 0.0) + v / len(c.links[kind])
        c.breakdown["exposed_comm_by_link"] = per_link
        load = self.shape(c).f if cfg.moe.moe_dropless else max(cfg.moe.moe_expert_capacity_factor, 1.0)
        c.memory = memory(cfg, c, load)
        if c.memory["total"] > cl.memory:
            c.rejected = (
                f"needs {c.memory['total'] / 2**30:.1f} GiB per GPU, above the {cl.memory / 2**30:g} GiB "
                f"of --gpu-memory-gib (activations {c.memory['activations'] / 2**30:.1f} GiB: lower "
                f"--micro-batch-size)"
            )
        return c

    def volumes(self, c: Candidate) -> dict:
        """Bytes this rank sends per step, per "op@group kind", by the same formulas as the times:
        Parm's functions on a model that charges one second per element of one key (S2 without the
        SAA pipeline, which moves the same messages), the MP all-reduces, the gradient all-reduces.
        Sizes follow each op's convention (module docstring of `moe.cost_model`)."""
        cfg, m, t_cfg = self.cfg, self.cfg.model, self.cfg.train
        layout = rank_layout(self.cluster.world, c.mp, c.ep, c.esp)
        n_moe = sum(cfg.is_moe_layer(i) for i in range(m.num_layers))
        n_micro = self.global_batch // (t_cfg.micro_batch_size * c.dp)
        out: dict[str, float] = {}
        if n_moe:
            sched, _, _ = self._moe_times(c, layout)
            sh = self.shape(c)
            for kind in PARM_GROUPS:
                for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                    count = CommModel({f"{op}@{kind}": AlphaBeta(0.0, 1.0)}, "count")
                    if sched == "baseline":
                        n = time_baseline(count, sh)
                    elif sched == "s1":
                        n = time_s1(count, sh, "kept")
                    else:
                        n = time_s2(count, sh, saa=False)
                    if n:
                        out[f"{op}@{kind}"] = n_micro * n_moe * n * self.moe_elem(op)
        if c.mp > 1:
            tokens = t_cfg.micro_batch_size * m.seq_length
            out["all_reduce@mp"] = (
                out.get("all_reduce@mp", 0.0)
                + n_micro * self.mp_all_reduces(n_moe) * tokens * m.hidden_size * self.elem
            )
        dense_p, expert_p = params_per_rank(cfg, c.mp, c.ep, c.esp)
        if c.dp > 1:
            out["all_reduce@dp"] = dense_p * GRAD_BYTES
        if layout.expert_dp > 1 and expert_p:
            out["all_reduce@expert_dp"] = expert_p * GRAD_BYTES
        return out

    def _lancet_hidden(self, c: Candidate, bwd: float, a2a_bwd_layer: float, x_flops: float) -> float:
        """Seconds of backward all-to-all Lancet's Algorithm 1 hides under dW GEMMs in one micro-batch."""
        m = self.cfg.model
        M, H, t = m.hidden_size, self.H, self.cfg.train.micro_batch_size * m.seq_length
        fl = self.cluster.flops
        ms = lambda flops: 1e3 * flops / fl  # noqa: E731
        lin = lambda i, o: ms(2 * t * i * o / c.mp)  # noqa: E731  one GEMM of a linear, forward
        x_gemm = x_flops / 6 / 2  # one expert GEMM's forward FLOPs (two GEMMs, fwd + 2x bwd)
        costs = {
            "attn.proj.dX": lin(M, M), "attn.proj.dW": lin(M, M), "attn.core.dX": ms(4 * t * m.seq_length * M / c.mp),
            "attn.qkv.dX": lin(M, 3 * M), "attn.qkv.dW": lin(M, 3 * M), "ln1.dX": 0.0, "ln1.dW": 0.0,
            "mlp.fc2.dX": lin(H, M), "mlp.fc2.dW": lin(H, M), "mlp.fc1.dX": lin(M, H), "mlp.fc1.dW": lin(M, H),
            "ln2.dX": 0.0, "ln2.dW": 0.0, "moe.combine.dX": 0.0, "moe.dispatch.dX": 0.0,
            "moe.gate.dX": ms(2 * t * M * self.cfg.moe.num_experts), "moe.gate.dW": 0.0,
            "moe.a2a_combine": 1e3 * a2a_bwd_layer / 2, "moe.a2a_dispatch": 1e3 * a2a_bwd_layer / 2,
            "moe.expert.fc2.dX": ms(x_gemm), "moe.expert.fc2.dW": ms(x_gemm),
            "moe.expert.fc1.dX": ms(x_gemm), "moe.expert.fc1.dW": ms(x_gemm),
        }  # fmt: skip
        moe_layers = [i for i in range(m.num_layers) if self.cfg.is_moe_layer(i)]
        graph = build_gpt_moe_backward(m.num_layers, moe_layers, costs)
        sched = schedule_wgrad(graph)
        total = sum(a.cost_ms for a in graph.of_kind("a2a"))
        return (total - exposed_comm_ms(graph, sched.assignment)) / 1e3

    def _pro_prophet_saving(self, c: Candidate, layout, block_s: float, n_moe: int) -> float:
        """Seconds one dropless MoE layer saves with Pro-Prophet's plan (its performance model, eq. 8)."""
        m, moe, o = self.cfg.model, self.cfg.moe, self.cfg.opts
        E, M, H = moe.num_experts, m.hidden_size, self.H
        tokens = self.cfg.train.micro_batch_size * m.seq_length * moe.moe_router_topk
        counts = zipf_counts(c.ep, E, tokens, self.skew or 0.0)
        # eqs. (1)-(5) are linear: the lines through the cluster's times at this layer's sizes
        sent, params_n = tokens * M, (2 * M * H + H + M) // c.esp
        a2a_a = self._worst("all_to_all", layout.ep_groups, 1e-9)
        a2a_b = (self._worst("all_to_all", layout.ep_groups, sent * self.moe_elem("all_to_all")) - a2a_a) / sent
        bc_a = self._worst("all_gather", layout.ep_groups, 1e-9)
        bc_b = (self._worst("all_gather", layout.ep_groups, params_n * 4) - bc_a) / params_n
        const = PerfConstants(a2a_a, a2a_b, bc_a, bc_b, 0.0, 4 * M * H / c.esp / self.cluster.flops)
        params = (2 * M * H + H + M) // c.esp
        non_expert = block_s / max(1, m.num_layers) * 2 / 3
        model = PerfModel(const, M, params, params, non_expert / 3, 2 * non_expert / 3, overlap=True)
        p = pro_prophet_plan(counts, model, alpha=o.pro_prophet_alpha, n=o.pro_prophet_n)
        none = model.layer_time(counts)
        return max(0.0, none - (p.predicted_s if p.predicted_s is not None else none))


def rank(candidates: list) -> list:
    """Fitting candidates first, fastest first; ties by the simpler layout (fewer switches, lower MP)."""
    return sorted(
        candidates, key=lambda c: (bool(c.rejected), round(c.step_s, 12), sum(c.opts.values()), c.mp, c.esp, c.ep)
    )
