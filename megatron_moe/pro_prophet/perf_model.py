"""Pro-Prophet's performance model of one MoE layer under a lightweight expert placement.

Legend: D devices (ranks of the EP group, 0..D-1), E experts, expert e owned by rank e // (E / D),
`counts_DE[d, e]` tokens (routed choices) device d sends to expert e in one iteration. A placement
gives each expert a (possibly empty) set of replica ranks; a replica rank computes its own tokens
for e locally, every other rank sends them to the owner (the runtime's semantics).

Per device i (`loads`):
  H_i  tokens computed on i    = sum over e owned by i of the tokens of ranks not replicating e
                                 + sum over e replicated on i of counts[i, e]
  R_i  tokens i receives from other devices (all-to-all) = the part of H_i for owned experts
                                 that comes from ranks other than i
  G_i  expert weight sets i computes with (owned experts + replicas)

Equations (the paper's (1)-(8), with an alpha term added where a measurement has a latency;
alpha = 0 gives the paper's form exactly):
  (1) T_A2A   = a2a_alpha + a2a_beta * token_elements * max_i R_i
  (2) T_FEC   = max_i (expert_alpha * G_i + expert_beta * H_i)        expert_beta = 1 / t
  (3) T_BEC   = 2 * T_FEC
  (4) T_Trans = sum over moved experts e of bcast_alpha + bcast_beta * param_elements * (|rep_e| + 1) / D
  (5) T_Agg   = the same with grad_elements
      ((|rep_e| + 1) = D - n when e is sent to every device but n: the paper's s (D - n) / D)
  (6) T'      = 4 T_A2A + 3 T_FEC + T_Trans + T_Agg
  (8) T'      = 4 T_A2A + 3 T_FEC + max(0, T_Trans - T_FEC - fnec_s) + max(0, T_Agg - T_BEC - bnec_s)
                (with the scheduler: Trans hides behind the previous block's forward compute,
                Agg behind the next backward compute; fnec_s / bnec_s: non-expert compute of a block)

Departure from the paper (`Calibration`, fitted by `pro_prophet.calibration`): `scale` multiplies
the all-to-all and expert compute terms and eq. (8)'s windows, `comm` the exposed Trans / Agg, `eta`
in [0, 1] the share of a window that hides a transfer, `overhead` [s] the fixed cost of a layer with
replicas. The defaults (1, 1, 1, 0) give the paper's form.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_moe.moe.comm_profile import fit_sizes, profile_sizes, time_collective
from megatron_moe.moe.cost_model import fit_alpha_beta

if TYPE_CHECKING:
    from megatron_moe.parallel_state import ParallelState

# A placement: replicas[e] = ranks (other than the owner) holding a replica of expert e.
Replicas = Sequence[Sequence[int]]


@dataclass(frozen=True)
class PerfConstants:
    """Machine constants [s]. a2a: beta per element a rank receives from the others. bcast: one
    expert's Trans (or Agg), beta per element reaching all D ranks (scaled by reached / D). expert:
    alpha per expert GEMM pair on a device, beta per token (the paper's 1 / t).
    """

    a2a_alpha: float
    a2a_beta: float
    bcast_alpha: float
    bcast_beta: float
    expert_alpha: float
    expert_beta: float

    def __post_init__(self) -> None:
        for name in ("a2a_alpha", "a2a_beta", "bcast_alpha", "bcast_beta", "expert_alpha", "expert_beta"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"PerfConstants.{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class Calibration:
    """The calibration (module docstring): scale > 0, comm >= 0, eta in [0, 1], overhead >= 0 [s]."""

    scale: float = 1.0
    comm: float = 1.0
    eta: float = 1.0
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if not np.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"Calibration.scale must be a finite number > 0, got {self.scale!r}")
        if not np.isfinite(self.comm) or self.comm < 0:
            raise ValueError(f"Calibration.comm must be a finite number >= 0, got {self.comm!r}")
        if not np.isfinite(self.eta) or not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"Calibration.eta must be in [0, 1], got {self.eta!r}")
        if not np.isfinite(self.overhead) or self.overhead < 0:
            raise ValueError(f"Calibration.overhead must be a finite number >= 0, got {self.overhead!r}")


@dataclass(frozen=True)
class LayerTerms:
    """One layer's terms under one placement [s]: base = 4 T_A2A + 3 T_FEC, Trans, Agg, the compute
    windows eq. (8) hides them behind (fwd = T_FEC + fnec_s, bwd = T_BEC + bnec_s), and whether the
    layer runs with replicas (`placed`: at least one moved expert)."""

    base: float
    trans: float
    agg: float
    fwd_window: float
    bwd_window: float
    placed: bool = False

    def exposed(self, overlap: bool, eta: float, comm: float = 1.0, window_scale: float = 1.0) -> float:
        """Trans + Agg time not hidden, the transfers taking `comm` x their modelled time: all of it
        (eq. (6)), or what exceeds eta x the windows, whose compute takes `window_scale` x its modelled
        time (eq. (8))."""
        if not overlap:
            return comm * (self.trans + self.agg)
        w = eta * window_scale
        return max(0.0, comm * self.trans - w * self.fwd_window) + max(0.0, comm * self.agg - w * self.bwd_window)

    def time(self, overlap: bool, cal: Calibration) -> float:
        """T'' of the layer (eq. (6) or (8), calibrated, eq. (8)'s windows scaled like the layer's
        compute; the fixed overhead when placed)."""
        fixed = cal.overhead if self.placed else 0.0
        return cal.scale * self.base + self.exposed(overlap, cal.eta, cal.comm, cal.scale) + fixed


@dataclass(frozen=True)
class PerfModel:
    """Constants plus layer sizes for eqs. (1)-(8): token_elements (hidden size M), param_elements /
    grad_elements (one expert's), fnec_s / bnec_s (non-expert compute of a block [s], eq. (8) only),
    overlap (eq. (8) instead of (6)), calibration (default: none).
    """

    constants: PerfConstants
    token_elements: int
    param_elements: int
    grad_elements: int
    fnec_s: float = 0.0
    bnec_s: float = 0.0
    overlap: bool = False
    calibration: Calibration = Calibration()

    def __post_init__(self) -> None:
        for name in ("token_elements", "param_elements", "grad_elements"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"PerfModel.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.fnec_s < 0 or self.bnec_s < 0:
            raise ValueError(f"PerfModel.fnec_s / bnec_s must be >= 0, got {self.fnec_s!r} / {self.bnec_s!r}")

    def terms(self, counts_DE, replicas: Replicas | None = None) -> LayerTerms:
        """The `LayerTerms` of one layer for the counts [D, E] under `replicas` (None: no placement)."""
        counts = check_counts(counts_DE)
        d, e = counts.shape
        reps = normalize_replicas(replicas, d, e)
        h, r, g = loads(counts, reps)
        reached = [len(rs) + 1 for rs in reps if rs]  # ranks each moved expert spans (owner + replicas)
        c = self.constants
        t_a2a = c.a2a_alpha + c.a2a_beta * self.token_elements * float(int(r.max()))  # eq. (1)
        hg = zip(h.tolist(), g.tolist())
        t_fec = max(c.expert_alpha * float(gi) + c.expert_beta * float(hi) for hi, gi in hg)  # eq. (2)
        t_trans = sum(c.bcast_alpha + c.bcast_beta * self.param_elements * n / d for n in reached)  # eq. (4)
        t_agg = sum(c.bcast_alpha + c.bcast_beta * self.grad_elements * n / d for n in reached)  # eq. (5)
        fwd, bwd = t_fec + self.fnec_s, 2 * t_fec + self.bnec_s  # eq. (3): T_BEC = 2 T_FEC
        return LayerTerms(4 * t_a2a + 3 * t_fec, t_trans, t_agg, fwd, bwd, bool(reached))

    def layer_time(self, counts_DE, replicas: Replicas | None = None) -> float:
        """T'' of one MoE layer (eq. (6), or (8) when `overlap`; calibrated) for the counts [D, E]."""
        return self.terms(counts_DE, replicas).time(self.overlap, self.calibration)


# -- loads ---------------------------------------------------------------------------------
def check_counts(counts_DE) -> np.ndarray:
    """The counts as an int64 [D, E] array; a clear error for a bad shape or values."""
    a = np.asarray(counts_DE.detach().cpu() if isinstance(counts_DE, torch.Tensor) else counts_DE)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"pro-prophet counts must be a [devices, experts] matrix, got shape {a.shape}")
    if a.dtype.kind not in "iu" and not (a.dtype.kind == "f" and np.all(a == np.round(a))):
        raise ValueError("pro-prophet counts must be integers (tokens per device and expert)")
    if np.any(a < 0):
        raise ValueError("pro-prophet counts must be >= 0")
    d, e = a.shape
    if e % d:
        raise ValueError(f"pro-prophet: {e} experts do not divide over {d} devices")
    return a.astype(np.int64)


def owner_of(expert: int, num_devices: int, num_experts: int) -> int:
    """The EP rank owning `expert` (experts are laid out contiguously: E / D per rank)."""
    return expert // (num_experts // num_devices)


def normalize_replicas(replicas: Replicas | None, num_devices: int, num_experts: int) -> tuple[tuple[int, ...], ...]:
    """`replicas` as E sorted tuples of ranks; an error for a wrong length, a bad rank or the owner."""
    if replicas is None:
        return tuple(() for _ in range(num_experts))
    if len(replicas) != num_experts:
        raise ValueError(f"pro-prophet placement: {len(replicas)} entries for {num_experts} experts")
    out = []
    for e, rs in enumerate(replicas):
        ranks = tuple(sorted(int(r) for r in rs))
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < num_devices for r in ranks):
            raise ValueError(f"pro-prophet placement: expert {e} has bad replica ranks {ranks}")
        if owner_of(e, num_devices, num_experts) in ranks:
            raise ValueError(f"pro-prophet placement: expert {e} lists its owner as a replica")
        out.append(ranks)
    return tuple(out)


def loads(counts_DE: np.ndarray, replicas: Replicas) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(H computed tokens [D], R tokens received from others [D], G expert sets used [D]) for the
    int counts [D, E] under `replicas` (E sequences of non-owner ranks; module docstring)."""
    d, e = counts_DE.shape
    per = e // d
    local_DE = np.zeros((d, e), dtype=bool)
    for x, ranks in enumerate(replicas):
        local_DE[list(ranks), x] = True
    owner_E = np.arange(e) // per
    to_owner_E = np.where(local_DE, 0, counts_DE).sum(axis=0)  # tokens computed by each owner
    own_E = counts_DE[owner_E, np.arange(e)]  # the owner's own tokens (never local)
    h = np.where(local_DE, counts_DE, 0).sum(axis=1) + to_owner_E.reshape(d, per).sum(axis=1)
    r = (to_owner_E - own_E).reshape(d, per).sum(axis=1)
    g = per + local_DE.sum(axis=1)
    return h.astype(np.int64), r.astype(np.int64), g.astype(np.int64)


# -- fitting -------------------------------------------------------------------------------
def fit_constants(
    a2a: tuple[Sequence[float], Sequence[float]],
    bcast: tuple[Sequence[float], Sequence[float]],
    expert: tuple[Sequence[float], Sequence[float]],
) -> PerfConstants:
    """Least-squares constants (`cost_model.fit_alpha_beta`) from (sizes, times [s]) samples: a2a
    (elements a rank receives from the others, all-to-all time), bcast (expert elements reaching all D
    ranks, Trans time), expert (tokens, forward time of one expert GEMM pair)."""
    fits = [fit_alpha_beta(list(s), list(t)) for s, t in (a2a, bcast, expert)]
    return PerfConstants(fits[0].alpha, fits[0].beta, fits[1].alpha, fits[1].beta, fits[2].alpha, fits[2].beta)


def time_expert_ffn(tokens: int, hidden: int, ffn_hidden: int, device: torch.device, reps: int = 3) -> float:
    """Median wall time [s] of one fp32 expert FFN forward (x[T, M] @ W1[M, F], GeLU, @ W2[F, M]) on
    `device`, after one warm-up run."""
    shapes = ((tokens, hidden), (hidden, ffn_hidden), (ffn_hidden, hidden))
    x, w1, w2 = (torch.full(shape, 0.01, device=device, dtype=torch.float32) for shape in shapes)
    samples = []
    with torch.no_grad():
        for i in range(1 + reps):
            if x.is_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch.nn.functional.gelu(x @ w1) @ w2
            if x.is_cuda:
                torch.cuda.synchronize(device)
            if i >= 1:
                samples.append(time.perf_counter() - t0)
    return float(sorted(samples)[len(samples) // 2])


def expert_token_sizes(max_tokens: int) -> list[int]:
    """Token counts the expert compute is timed at: 16, 64, ... up to max_tokens (at least two)."""
    sizes, n = [], 16
    top = max(int(max_tokens), 32)
    while n < top:
        sizes.append(n)
        n *= 4
    return sizes + [top]


def measure_constants(
    ps: "ParallelState",
    token_elements: int,
    param_elements: int,
    ffn_hidden: int,
    max_tokens: int,
    group_kind: str = "ep",
    reps: int = 3,
    max_timed_tokens: int = 2048,
) -> PerfConstants:
    """Measured constants on the `group_kind` group (collective over the world): all-to-all and an
    all-gather of up to `param_elements` per rank (Trans/Agg) via `time_collective`, the expert FFN
    via `time_expert_ffn`. Timings are MAX-reduced and rank 0's fit is broadcast, so every rank holds
    bit-identical constants (and Algorithm 1 makes the same plan everywhere).
    """
    d = ps.size(group_kind)
    if d < 2:
        raise ValueError(f"pro-prophet needs an expert-parallel group of 2 or more ranks ({group_kind} has {d})")
    group, device = ps.group(group_kind), ps.device
    a2a_sizes = profile_sizes(max_tokens * token_elements)
    ag_sizes = profile_sizes(param_elements)
    tok_sizes = expert_token_sizes(min(max_tokens, max_timed_tokens))
    rows = [
        [time_collective("all_to_all", group, n, reps, 1, device) for n in a2a_sizes],
        [time_collective("all_gather", group, n, reps, 1, device) for n in ag_sizes],
        [time_expert_ffn(t, token_elements, ffn_hidden, device, reps) for t in tok_sizes],
    ]
    width = max(len(x) for x in rows)
    padded = [x + [0.0] * (width - len(x)) for x in rows]
    times = torch.tensor(padded, dtype=torch.float64, device=device).reshape(3, width)
    if dist.is_initialized():
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    t = times.cpu().tolist()
    received = [n * (d - 1) / d for n in fit_sizes("all_to_all", d, a2a_sizes)]
    per_rank = [n // d for n in fit_sizes("all_gather", d, ag_sizes)]  # the input time_collective used
    fit = fit_constants(
        (received, t[0][: len(a2a_sizes)]), (per_rank, t[1][: len(ag_sizes)]), (tok_sizes, t[2][: len(tok_sizes)])
    )
    if not dist.is_initialized():
        return fit
    # rank 0's fit everywhere: a least-squares solve on another machine's BLAS could differ in the
    # last bit, and one differing plan would hang the run
    fitted = [fit.a2a_alpha, fit.a2a_beta, fit.bcast_alpha, fit.bcast_beta, fit.expert_alpha, fit.expert_beta]
    vals = torch.tensor(fitted, dtype=torch.float64, device=device)
    dist.broadcast(vals, src=0)
    return PerfConstants(*(float(v) for v in vals.cpu().tolist()))
