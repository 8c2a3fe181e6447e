"""Alpha-beta cost model of the MoE layer's collectives, and Parm's schedule choice (Algorithm 1).

A collective on a group costs t(n) = alpha + beta * n seconds for n fp32 elements, n as Parm
defines it: the send buffer of an all-to-all, the *gathered output* of an all-gather (AG_MP(B L M)
is the full [B L, M] result), the tensor of an all-reduce, the full input of a reduce-scatter.
alpha and beta are fitted per (collective, group kind) on the run's groups (`moe.comm_profile`).

Notation (Parm): S = B * L tokens per routing group, T = C = max(ceil(k f S / E), min_capacity)
slots per expert, C_mp = ceil(C / N_MP). Per-rank messages of one MoE layer (elements, forward;
the backward moves the same, so every time is forward + backward):
  baseline  all_gather@esp N_ESP E C M (the dispatch buffer); all_to_all@ep N_ESP E C M (x2);
            all_reduce@esp N_ESP E C M; backward: reduce_scatter@esp instead of the all-gather.
            paper=True: eq. (1), the ESP all-gather takes the tokens, N_ESP S M.
  S1        "padded" (the paper's, eq. (11)/(13)): 2 x all_to_all@ep_esp E T M N_ESP / N_MP +
            all_gather@mp S M. "kept" (the runtime's): only kept choices travel, N_ESP min(k S, E C)
            M / N_MP per all-to-all (balanced routing assumed), plus all_gather@mp 2 k E N_MP
            (counts), all_to_all@ep_esp 2 N_ESP E (counts), all_reduce@mp E + 1 (aux sums) and,
            in backward, all_reduce@mp E M (gate gradient).
  S2        eq. (14): all_to_all@ep_esp V, V = N_ESP E C_mp M, then the return all-to-all
            overlapped with the MP all-gather (SAA): Overlap(V) + all_gather@mp E C_mp M N_MP, with
            Overlap(V) = alpha_o + beta_o V fitted from measured SAA steps (`fit_overlap`). Without
            a fitted overlap, a c-chunk pipeline, c in SAA_CHUNK_CHOICES minimizing
              T_saa = a + (c - 1) * max(a, g) + g,  a = t_a2a(V / c), g = t_ag(E C_mp M N_MP / c).
Algorithm 1 (`choose_schedule`): S1 if t_D1 <= t_D2, else S2 (S2 when N_MP does not divide S);
`auto` also takes the baseline when it is strictly cheaper than that pick (small layers, where
S1's and S2's extra latencies dominate), and the runtime keeps the fastest schedule measured on
the real layer (`moe.schedule_trial`). `expert_flops` is the compute term.
"""

from __future__ import annotations

import itertools
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
    """Least-squares fit of times [s] against sizes [elements], weighted by 1/time (so the small sizes
    pin alpha and the large ones beta across decades); negative estimates (noise) are clamped to 0."""
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


OVERLAP_KEY = "saa@ep_esp_mp"  # (alpha_o, beta_o) of eq. (14), sized by the all-to-all's V


def fit_overlap(sizes, times, all_gather: AlphaBeta | None, gather_ratio: float) -> AlphaBeta:
    """(alpha_o, beta_o) of eq. (14) from measured SAA steps, least squares weighted by 1/time.

    sizes: V, the all-to-all's send elements of each sample (E T M N_ESP / N_MP); times: measured
    seconds of the overlapped all-to-all + MP all-gather step; all_gather: the fitted MP all-gather
    (gathered output), None to fit the whole step; gather_ratio: gathered elements per element of V
    (N_MP / N_ESP). Eq. (14) adds AG_MP(E T M) to Overlap(V), so Overlap(V) = t(V) - AG(gather_ratio
    V). Not clamped: a negative alpha_o or beta_o means the overlap hides more of the all-gather than
    the all-to-all adds.
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.size != t.size:
        raise ValueError(f"fit_overlap: {n.size} sizes but {t.size} times")
    if n.size < 2 or np.unique(n).size < 2:
        raise ValueError("fit_overlap needs timings at two or more distinct sizes")
    ag = np.zeros_like(n) if all_gather is None else all_gather.alpha + all_gather.beta * gather_ratio * n
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, (t - ag) * w, rcond=None)
    return AlphaBeta(float(alpha), float(beta))


@dataclass
class CommModel:
    """Fitted alpha-beta per 'op@group' (e.g. 'all_to_all@ep_esp'); missing entries cost nothing."""

    costs: dict = field(default_factory=dict)
    source: str = "none"  # 'profile', 'cache', 'given' or 'none'

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
    H: int = 0  # expert FFN hidden size (0: H = M); only the compute term uses it

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
        return max(
            self.n_esp * self.E * self.C * self.M,
            self.S * self.M,
            self.n_esp * self.E * self.C_mp * self.M,
            self.E * self.C_mp * self.M * self.n_mp,
            self.E * self.M,
        )


def _sized(model: CommModel, sh: MoEShape, op: str, group: str, n: float) -> float:
    size = {"mp": sh.n_mp, "ep": sh.n_ep, "esp": sh.n_esp, "ep_esp": sh.n_ep * sh.n_esp}[group]
    return 0.0 if size == 1 else model.t(op, group, n)


def time_baseline(model: CommModel, sh: MoEShape, paper: bool = False) -> float:
    """Forward + backward communication time of the baseline schedule [s]; the ESP all-gather carries the
    dispatch buffer (the runtime), or with paper=True the N_ESP S M tokens (Parm's eq. (1))."""
    buf = sh.n_esp * sh.E * sh.C * sh.M
    gathered = sh.n_esp * sh.S * sh.M if paper else buf
    t = lambda op, g, n: _sized(model, sh, op, g, n)  # noqa: E731
    a2a = t("all_to_all", "ep", buf)
    ar = t("all_reduce", "esp", buf)
    return (t("all_gather", "esp", gathered) + 2 * a2a + ar) + (2 * a2a + ar + t("reduce_scatter", "esp", gathered))


S1_TRANSFERS = ("kept", "padded")


def s1_a2a_elements(sh: MoEShape, transfer: str = "kept") -> float:
    """Send elements of one S1 all-to-all: "padded" E T M N_ESP / N_MP (eq. (13)),
    "kept" N_ESP min(k S, E C) M / N_MP (kept choices only, balanced routing)."""
    if transfer == "padded":
        return sh.E * sh.C * sh.M * sh.n_esp / sh.n_mp
    if transfer == "kept":
        return sh.n_esp * min(sh.k * sh.S, sh.E * sh.C) * sh.M / sh.n_mp
    raise ValueError(f"S1 transfer must be one of {S1_TRANSFERS}, got {transfer!r}")


def s2_a2a_elements(sh: MoEShape) -> int:
    """Send elements V of one S2 all-to-all: N_ESP E C_mp M (E T M N_ESP / N_MP, T padded to N_MP C_mp)."""
    return sh.n_esp * sh.E * sh.C_mp * sh.M


def s2_gather_elements(sh: MoEShape) -> int:
    """Gathered (output) elements of S2's MP all-gather: E C_mp M N_MP (the paper's E T M)."""
    return sh.E * sh.C_mp * sh.M * sh.n_mp


def time_s1(model: CommModel, sh: MoEShape, transfer: str = "kept") -> float:
    """Forward + backward communication time of S1 [s]: "padded", eq. (13) each way; "kept", the runtime's
    transfer plus its count, aux and gate-gradient collectives (module docstring)."""
    t = lambda op, g, n: _sized(model, sh, op, g, n)  # noqa: E731
    a2a = t("all_to_all", "ep_esp", s1_a2a_elements(sh, transfer))
    gather = t("all_gather", "mp", sh.S * sh.M)
    if transfer == "padded":
        return 2 * (2 * a2a + gather)
    small = (
        t("all_gather", "mp", 2 * sh.k * sh.E * sh.n_mp)
        + t("all_to_all", "ep_esp", 2 * sh.n_esp * sh.E)
        + t("all_reduce", "mp", sh.E + 1)
    )
    return (small + 2 * a2a + gather) + (2 * a2a + gather + t("all_reduce", "mp", sh.E * sh.M))


def saa_time(model: CommModel, sh: MoEShape, chunks: int) -> float:
    """Return all-to-all + MP all-gather of S2 modelled as a pipeline of `chunks` chunks [s] (one direction)."""
    a = _sized(model, sh, "all_to_all", "ep_esp", s2_a2a_elements(sh) / chunks)
    g = _sized(model, sh, "all_gather", "mp", s2_gather_elements(sh) / chunks)
    return a + (chunks - 1) * max(a, g) + g


def best_saa_chunks(model: CommModel, sh: MoEShape) -> int:
    """The SAA chunk count in SAA_CHUNK_CHOICES (at most the slots) with the smallest predicted time."""
    options = [c for c in SAA_CHUNK_CHOICES if c <= max(1, sh.C_mp)]
    return min(options, key=lambda c: (saa_time(model, sh, c), c))


def time_s2(model: CommModel, sh: MoEShape, saa: bool = True, chunks: int | None = None) -> float:
    """Forward + backward communication time of S2 [s]: saa=True, eq. (14) with the fitted overlap when the
    model has OVERLAP_KEY, else the chunk pipeline (`chunks`, default the best); saa=False, the return
    all-to-all and the all-gather one after the other."""
    V = s2_a2a_elements(sh)
    a2a = _sized(model, sh, "all_to_all", "ep_esp", V)
    ag = _sized(model, sh, "all_gather", "mp", s2_gather_elements(sh))
    overlap = model.costs.get(OVERLAP_KEY)
    if not saa:
        tail = a2a + ag
    elif overlap is not None and sh.n_mp > 1:
        tail = overlap.time(V) + ag  # eq. (14): Overlap(V) + AG_MP(E T M)
    else:
        tail = saa_time(model, sh, chunks if chunks is not None else best_saa_chunks(model, sh))
    return 2 * (a2a + tail)


@dataclass(frozen=True)
class Choice:
    """Algorithm 1's decision for one layer: schedule, predicted times [s], SAA chunks for S2."""

    schedule: str
    times: dict
    saa_chunks: int
    priced: str = "communication"  # what `times` add up: "communication" or "communication + expert compute"

    def describe(self) -> str:
        """The choice and its predicted times."""
        ms = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.times.items())
        return f"{self.schedule} (predicted fwd+bwd {self.priced}: {ms}; SAA chunks {self.saa_chunks})"


def choose_schedule(
    model: CommModel,
    sh: MoEShape,
    saa: bool = True,
    s1: str = "kept",
    with_baseline: bool = True,
    flops_per_s: float | None = None,
    kept_compute: bool = True,
) -> Choice:
    """`auto` for a layer of shape `sh` from the fitted model: Parm's Algorithm 1 (S1 if t_D1 <= t_D2, else
    S2), then the baseline if it is strictly cheaper than that pick (with_baseline=False: the paper's
    Algorithm 1 alone). s1: how S1 is priced ("kept" or "padded"); flops_per_s: add each schedule's
    `expert_flops` (kept rows when kept_compute) at this throughput (None: communication only)."""
    chunks = best_saa_chunks(model, sh) if saa else 1
    times = {"baseline": time_baseline(model, sh), "s1": time_s1(model, sh, s1), "s2": time_s2(model, sh, saa, chunks)}
    if flops_per_s:
        for name in times:
            times[name] += expert_flops(sh, name, s1, kept=kept_compute) / flops_per_s
    if sh.S % sh.n_mp:
        pick = "s2"  # S1 cannot split the tokens evenly over MP
    else:
        pick = "s1" if times["s1"] <= times["s2"] else "s2"
    if with_baseline and times["baseline"] < times[pick]:
        pick = "baseline"
    return Choice(pick, times, chunks, "communication + expert compute" if flops_per_s else "communication")


def expert_flops(sh: MoEShape, schedule: str, s1: str = "padded", kept: bool = False) -> float:
    """Forward + backward expert FLOPs one rank runs (two GEMMs M x H/N_ESP per row, backward 2x forward).

    Rows per rank: the baseline's N_ESP E C buffer rows (every MP rank repeats them); S2 and padded S1
    1/N_MP of them; kept S1 N_ESP min(k S, E C) / N_MP. kept=True (one rank's kept-row experts): the
    baseline and S2 skip the padding too (N_ESP min(k S, E C), / N_MP in S2).
    """
    H = sh.H or sh.M
    per_row = 3 * 2 * 2 * sh.M * H / sh.n_esp
    kept_rows = sh.n_esp * min(sh.k * sh.S, sh.E * sh.C)
    if schedule == "baseline":
        rows = kept_rows if kept else sh.n_esp * sh.E * sh.C
    elif schedule == "s2":
        rows = kept_rows / sh.n_mp if kept else sh.n_esp * sh.E * sh.C_mp
    elif schedule == "s1":
        rows = s1_a2a_elements(sh, s1) / sh.M
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return rows * per_row


# ----------------------------------------------------------------------------- the paper's grid (simulator)

# Parm Table III: P, N_MP, N_ESP, B, L, M / N_ESP (= H / N_ESP), f
PAPER_GRID = {
    "P": (8, 16, 32),
    "n_mp": (1, 2, 4),
    "n_esp": (1, 2, 4),
    "B": (2, 4, 8),
    "L": (512, 1024, 2048),
    "m": (1024, 2048, 4096),
    "f": (1.2, 2.4),
}
# the paper's fitted MP all-gather on its 8-GPU server: alpha [s], beta [s per gathered element]
PAPER_ALLGATHER = AlphaBeta(6.64e-4, 5.38e-10)
# the published fits per testbed (MP all-gather only): A = 8x RTX 4090 (PCIe 4.0), B = 32x RTX 2080Ti (4 per node)
TESTBEDS = {"A": AlphaBeta(6.64e-4, 5.38e-10), "B": AlphaBeta(1.09e-4, 7.14e-10)}
# Parm Table IV: average MoE-layer speedup over DeepSpeed-MoE per (schedule, N_MP, N_ESP):
# columns A (8 GPUs), B-8, B-16, B-32
TABLE_IV_COLUMNS = ("A", "B-8", "B-16", "B-32")
TABLE_IV = {
    ("s1", 2, 2): (2.10, 2.62, 2.46, 2.72),
    ("s1", 2, 4): (2.24, 3.37, 2.85, 2.85),
    ("s1", 4, 2): (3.72, 4.18, 4.12, 3.92),
    ("s1", 4, 4): (4.19, 5.77, 5.08, 4.57),
    ("s2", 2, 2): (1.99, 2.42, 2.20, 2.57),
    ("s2", 2, 4): (2.41, 3.05, 2.44, 2.75),
    ("s2", 4, 2): (3.21, 3.58, 3.81, 4.10),
    ("s2", 4, 4): (4.12, 5.38, 4.82, 4.91),
    ("parm", 2, 2): (2.10, 2.62, 2.46, 2.57),
    ("parm", 2, 4): (2.41, 3.37, 2.85, 2.85),
    ("parm", 4, 2): (3.70, 4.18, 4.12, 4.06),
    ("parm", 4, 4): (4.20, 5.77, 5.08, 4.91),
}
MODEL_KEYS = (
    "all_to_all@ep_esp",
    "all_gather@mp",
    "all_reduce@mp",
    "all_to_all@ep",
    "all_gather@esp",
    "all_reduce@esp",
    "reduce_scatter@esp",
)


def uniform_model(ab: AlphaBeta, **overrides: AlphaBeta) -> CommModel:
    """Every collective of MODEL_KEYS costs `ab`, except those in overrides ('all_to_all' -> every all-to-all,
    'all_gather@mp' -> one entry)."""
    costs = {}
    for key in MODEL_KEYS:
        op = key.split("@")[0]
        costs[key] = overrides.get(key, overrides.get(op, ab))
    return CommModel(costs, "given")


def with_paper_overlap(model: CommModel) -> CommModel:
    """A copy of `model` that prices S2 by eq. (14) when no overlap is fitted: Overlap(V) costs what the
    EP&ESP all-to-all of V costs (the paper defines (alpha_o, beta_o) as the alpha-beta terms of the
    overlapped all-to-all, eq. (7) bounds t_D2 by 2 A2A(V) + AG_MP(E T M), and it measured SAA only
    ~1.1 % faster than running the two collectives one after the other); AG_MP(E T M) is added in full.
    A fitted OVERLAP_KEY already in `model` is kept."""
    costs = dict(model.costs)
    a2a = costs.get("all_to_all@ep_esp")
    if OVERLAP_KEY not in costs and a2a is not None:
        costs[OVERLAP_KEY] = a2a
    return CommModel(costs, model.source)


_GRID_MEANS = ("s1", "s2", "parm", "auto", "picked_s1", "picked_baseline")  # `simulate_grid`'s averages


def simulate_grid(
    model: CommModel,
    k: int = 1,
    saa: bool = True,
    grid: dict | None = None,
    s1: str = "padded",
    paper_baseline: bool = True,
    flops_per_s: float | None = None,
) -> dict:
    """Predicted MoE-layer speedups over the baseline, averaged per (N_MP, N_ESP) like Parm's Table IV.

    Every configuration of `grid` (default PAPER_GRID) where N_MP and N_ESP divide P, with M = H =
    N_ESP * m and one expert per EP rank (E = N_EP = P / N_ESP), top-k; MP and ESP may share GPUs
    (Table IV has N_MP = N_ESP = 4 on 8 GPUs) and the costs do not depend on the group size (a
    first-order what-if). s1: S1's transfer; paper_baseline: the baseline by eq. (1); flops_per_s:
    add `expert_flops` at this throughput (None: communication only). Returns {(n_mp, n_esp): {"s1",
    "s2", "parm" (Algorithm 1's S1/S2 pick), "auto" (baseline, S1 or S2), "picked_s1",
    "picked_baseline" (fractions of parm and auto), "configs"}}.
    """
    g = PAPER_GRID if grid is None else grid
    acc: dict = {}
    for P, n_mp, n_esp, B, L, m, f in itertools.product(*(g[key] for key in PAPER_GRID)):
        if P % n_mp or P % n_esp:
            continue
        n_ep = P // n_esp
        sh = MoEShape(B, L, n_esp * m, n_ep, k, f, n_mp, n_ep, n_esp)
        chunks = best_saa_chunks(model, sh) if saa else 1
        tot = {
            "baseline": time_baseline(model, sh, paper=paper_baseline),
            "s1": time_s1(model, sh, s1),
            "s2": time_s2(model, sh, saa, chunks),
        }
        if flops_per_s:
            for name in tot:
                tot[name] += expert_flops(sh, name, s1) / flops_per_s
        feasible = ("s1", "s2") if sh.S % n_mp == 0 else ("s2",)
        parm = min(feasible, key=lambda x: (tot[x], x))
        auto = "baseline" if tot["baseline"] < tot[parm] else parm
        base = tot["baseline"]
        row = acc.setdefault((n_mp, n_esp), {**dict.fromkeys(_GRID_MEANS, 0.0), "configs": 0})
        row["s1"] += base / tot["s1"]
        row["s2"] += base / tot["s2"]
        row["parm"] += base / tot[parm]
        row["auto"] += base / tot[auto]
        row["picked_s1"] += parm == "s1"
        row["picked_baseline"] += auto == "baseline"
        row["configs"] += 1
    for row in acc.values():
        for key in _GRID_MEANS:
            row[key] /= row["configs"]
    return acc
