"""Alpha-beta cost model of the MoE layer's collectives, and Parm's schedule choice (Algorithm 1).

Every collective on a group costs t(n) = alpha + beta * n seconds for a message
of n fp32 elements, n being what one rank puts in (the observer's "sent"):
the send buffer of an all-to-all, the input of an all-gather, the tensor of an
all-reduce, the full input of a reduce-scatter. alpha and beta are fitted per
(collective, group kind) from timings on the run's real groups
(`megatron_moe.moe.comm_profile`).

Per-rank messages of one MoE layer, S = B * L tokens per routing group,
C = max(ceil(k f S / E), min_capacity), C_mp = ceil(C / N_MP) (elements, forward;
the backward moves the same messages, so every time below is forward + backward):
  baseline  all_gather@esp E C M; all_to_all@ep N_ESP E C M (x2);
            all_reduce@esp N_ESP E C M; backward: reduce_scatter@esp instead of the all-gather
  S1        all_gather@mp 2 k E (int64 counts); all_to_all@ep_esp 2 N_ESP E (counts);
            all_reduce@mp E + 1 (aux sums); all_to_all@ep_esp N_ESP min(k S, E C) M / N_MP
            (x2: only the rank's kept choices travel; balanced routing assumed);
            all_gather@mp S M / N_MP (output; backward: the input gradient);
            backward all_reduce@mp E M (gate gradient)
  S2        all_to_all@ep_esp N_ESP E C_mp M; then the return all-to-all of the same
            size overlapped with all_gather@mp E C_mp M (SAA); the backward repeats both
Parm's Algorithm 1 (our rendition): predict T_S1 and T_S2 from these messages and
the fitted model and take the smaller (S1 on a tie: it moves fewer bytes); S1 is
impossible when N_MP does not divide S. SAA with c chunks is a pipeline:
  T_saa = a + (c - 1) * max(a, g) + g,  a = t_a2a(V / c), g = t_ag(W / c),
with c in {1, 2, 4, 8} (at most the slots) chosen to minimize it, so for tiny
messages (alpha-bound) c = 1 and S2 pays no extra latency, and for large ones
the all-gather hides behind the all-to-all. Hence with N_ESP = 1 the choice is
S2 as the sequence shrinks (S1 pays three more small collectives) and S1 as it
grows when k f > 1 (S2's all-gather carries k f times S1's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SAA_CHUNK_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class AlphaBeta:
    """t(n) = alpha + beta * n seconds for n elements."""

    alpha: float
    beta: float

    def time(self, n: float) -> float:
        """Seconds for a message of n elements."""
        return self.alpha + self.beta * n


def fit_alpha_beta(sizes, times) -> AlphaBeta:
    """Least-squares fit of times [s] against sizes [elements], weighted by 1/time.

    Relative weighting lets the small sizes pin alpha and the large ones beta
    when the sizes span decades. Negative estimates (noise) are clamped to 0.
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.size < 2 or np.unique(n).size < 2:
        raise ValueError("fit_alpha_beta needs timings at two or more distinct sizes")
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if beta < 0:
        beta, alpha = 0.0, float(np.median(t))
    return AlphaBeta(max(float(alpha), 0.0), float(beta))


@dataclass
class CommModel:
    """Fitted alpha-beta per 'op@group' (e.g. 'all_to_all@ep_esp'); missing entries cost nothing."""

    costs: dict = field(default_factory=dict)
    source: str = "none"          # 'profile', 'cache', 'given' or 'none'

    def t(self, op: str, group: str, n: float) -> float:
        """Seconds of collective `op` on group kind `group` for an n-element message."""
        ab = self.costs.get(f"{op}@{group}")
        return 0.0 if ab is None else ab.time(n)


@dataclass(frozen=True)
class MoEShape:
    """What Algorithm 1 looks at: B samples of L tokens, model dim M, E experts, top-k,
    capacity factor f, min capacity, and the MP / EP / ESP degrees."""

    B: int
    L: int
    M: int
    E: int
    k: int
    f: float
    n_mp: int = 1
    n_ep: int = 1
    n_esp: int = 1
    min_capacity: int = 0

    @property
    def S(self) -> int:
        """Tokens per routing group."""
        return self.B * self.L

    @property
    def C(self) -> int:
        """Expert capacity (the router's formula)."""
        return max(int(math.ceil(self.k * self.f * self.S / self.E)), int(self.min_capacity))

    @property
    def C_mp(self) -> int:
        """Slots per expert one MP rank holds in S2 (C padded to a multiple of N_MP)."""
        return -(-self.C // self.n_mp)

    def largest_message(self) -> int:
        """Largest per-rank message (elements) any schedule sends for this shape."""
        return max(self.n_esp * self.E * self.C * self.M, self.S * self.M // self.n_mp,
                   self.n_esp * self.E * self.C_mp * self.M, self.E * self.M)


def _sized(model: CommModel, sh: MoEShape, op: str, group: str, n: float) -> float:
    size = {"mp": sh.n_mp, "ep": sh.n_ep, "esp": sh.n_esp, "ep_esp": sh.n_ep * sh.n_esp}[group]
    return 0.0 if size == 1 else model.t(op, group, n)


def time_baseline(model: CommModel, sh: MoEShape) -> float:
    """Forward + backward communication time of the baseline schedule [s]."""
    buf = sh.E * sh.C * sh.M
    t = lambda op, g, n: _sized(model, sh, op, g, n)  # noqa: E731
    a2a = t("all_to_all", "ep", sh.n_esp * buf)
    ar = t("all_reduce", "esp", sh.n_esp * buf)
    return (t("all_gather", "esp", buf) + 2 * a2a + ar) + (2 * a2a + ar + t("reduce_scatter", "esp", sh.n_esp * buf))


def time_s1(model: CommModel, sh: MoEShape) -> float:
    """Forward + backward communication time of S1 [s]."""
    t = lambda op, g, n: _sized(model, sh, op, g, n)  # noqa: E731
    a2a = t("all_to_all", "ep_esp", sh.n_esp * min(sh.k * sh.S, sh.E * sh.C) * sh.M / sh.n_mp)
    small = (t("all_gather", "mp", 2 * sh.k * sh.E) + t("all_to_all", "ep_esp", 2 * sh.n_esp * sh.E)
             + t("all_reduce", "mp", sh.E + 1))
    gather = t("all_gather", "mp", sh.S * sh.M // sh.n_mp)
    return (small + 2 * a2a + gather) + (2 * a2a + gather + t("all_reduce", "mp", sh.E * sh.M))


def saa_time(model: CommModel, sh: MoEShape, chunks: int) -> float:
    """Return all-to-all + MP all-gather of S2 pipelined in `chunks` chunks [s] (one direction)."""
    a = _sized(model, sh, "all_to_all", "ep_esp", sh.n_esp * sh.E * sh.C_mp * sh.M / chunks)
    g = _sized(model, sh, "all_gather", "mp", sh.E * sh.C_mp * sh.M / chunks)
    return a + (chunks - 1) * max(a, g) + g


def best_saa_chunks(model: CommModel, sh: MoEShape) -> int:
    """The SAA chunk count in SAA_CHUNK_CHOICES (at most the slots) with the smallest predicted time."""
    options = [c for c in SAA_CHUNK_CHOICES if c <= max(1, sh.C_mp)]
    return min(options, key=lambda c: (saa_time(model, sh, c), c))


def time_s2(model: CommModel, sh: MoEShape, saa: bool = True, chunks: int | None = None) -> float:
    """Forward + backward communication time of S2 [s]; `saa=False`: all-to-all then all-gather."""
    a2a = _sized(model, sh, "all_to_all", "ep_esp", sh.n_esp * sh.E * sh.C_mp * sh.M)
    if saa:
        tail = saa_time(model, sh, chunks if chunks is not None else best_saa_chunks(model, sh))
    else:
        tail = a2a + _sized(model, sh, "all_gather", "mp", sh.E * sh.C_mp * sh.M)
    return 2 * (a2a + tail)


@dataclass(frozen=True)
class Choice:
    """Algorithm 1's decision for one layer: schedule, predicted times [s], SAA chunks for S2."""

    schedule: str
    times: dict
    saa_chunks: int

    def describe(self) -> str:
        ms = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.times.items())
        return f"{self.schedule} (predicted fwd+bwd communication: {ms}; SAA chunks {self.saa_chunks})"


def choose_schedule(model: CommModel, sh: MoEShape, saa: bool = True) -> Choice:
    """Parm's Algorithm 1: S1 or S2 for a layer of shape `sh`, from the fitted model."""
    chunks = best_saa_chunks(model, sh) if saa else 1
    times = {"baseline": time_baseline(model, sh), "s1": time_s1(model, sh), "s2": time_s2(model, sh, saa, chunks)}
    if sh.S % sh.n_mp:
        return Choice("s2", times, chunks)           # S1 cannot split the tokens evenly over MP
    return Choice("s1" if times["s1"] <= times["s2"] else "s2", times, chunks)


# ----------------------------------------------------------------------------- the paper's grid (simulator)

# Parm Table III: P, N_MP, N_ESP, B, L, M / N_ESP (= H / N_ESP), f
PAPER_GRID = {"P": (8, 16, 32), "n_mp": (1, 2, 4), "n_esp": (1, 2, 4), "B": (2, 4, 8), "L": (512, 1024, 2048),
              "m": (1024, 2048, 4096), "f": (1.2, 2.4)}
# the paper's fitted MP all-gather on its 8-GPU server: alpha [s], beta [s per element]
PAPER_ALLGATHER = AlphaBeta(6.64e-4, 5.38e-10)
MODEL_KEYS = ("all_to_all@ep_esp", "all_gather@mp", "all_reduce@mp", "all_to_all@ep", "all_gather@esp",
              "all_reduce@esp", "reduce_scatter@esp")


def uniform_model(ab: AlphaBeta, **overrides: AlphaBeta) -> CommModel:
    """Every collective of MODEL_KEYS costs `ab`, except those in overrides ('all_to_all' -> every all-to-all,
    'all_gather@mp' -> one entry)."""
    costs = {}
    for key in MODEL_KEYS:
        op = key.split("@")[0]
        costs[key] = overrides.get(key, overrides.get(op, ab))
    return CommModel(costs, "given")


def simulate_grid(model: CommModel, k: int = 1, saa: bool = True, grid: dict | None = None) -> dict:
    """Predicted communication speedups over the baseline, averaged per (N_MP, N_ESP) like Parm's Table IV.

    Every configuration of `grid` (default PAPER_GRID) with N_MP * N_ESP <= P gets
    M = N_ESP * m, one expert per EP rank (E = N_EP = P / N_ESP; E cancels out of
    the volumes except for rounding), top-k. The alpha-beta costs do not depend on
    the group size here (a first-order what-if). Returns {(n_mp, n_esp):
    {"s1", "s2", "parm", "picked_s1" (fraction), "configs"}}; "parm" uses
    Algorithm 1's pick per configuration.
    """
    g = PAPER_GRID if grid is None else grid
    acc: dict = {}
    for P in g["P"]:
        for n_mp in g["n_mp"]:
            for n_esp in g["n_esp"]:
                if n_mp * n_esp > P or P % n_esp:
                    continue
                for B in g["B"]:
                    for L in g["L"]:
                        for m in g["m"]:
                            for f in g["f"]:
                                n_ep = P // n_esp
                                sh = MoEShape(B, L, n_esp * m, n_ep, k, f, n_mp, n_ep, n_esp)
                                c = choose_schedule(model, sh, saa)
                                base = c.times["baseline"]
                                row = acc.setdefault((n_mp, n_esp), {"s1": 0.0, "s2": 0.0, "parm": 0.0,
                                                                     "picked_s1": 0.0, "configs": 0})
                                row["s1"] += base / c.times["s1"]
                                row["s2"] += base / c.times["s2"]
                                row["parm"] += base / c.times[c.schedule]
                                row["picked_s1"] += c.schedule == "s1"
                                row["configs"] += 1
    for row in acc.values():
        for key in ("s1", "s2", "parm", "picked_s1"):
            row[key] /= row["configs"]
    return acc
