"""Pro-Prophet's planner: Algorithm 1 (greedy lightweight placement), the "k heaviest experts to
every device" comparison, and Algorithm 2's block-wise Trans/Agg schedule, all as pure data.

Legend as in `perf_model`; replica ranks are ranks of the EP group (0..D-1), a plan holds for one
iteration.

Algorithm 1 (`plan`), as in the paper with ties made explicit:
  T_best <- T'(no placement); L <- []; used <- {}
  while not balanced by (7) (max H - min H < alpha * I / E, I = all routed tokens):
      i <- the rank with the most computed tokens H (lowest rank on a tie)
      x <- the not yet used expert of i with the most tokens (lowest index on a tie);
           stop if i has none left
      b <- the n ranks (not the owner) with the fewest tokens for x (lowest rank on a tie)
      replicate x on every other non-owner rank that routes at least one token to x (Fig. 6:
           parameters go only where inputs are routed); append x to L
      T <- T'(placement of L); if T < T_best: T_best, cnt <- T, |L|
  return the placement of L[:cnt]
`extra` (the runtime trial's "wider" arm) keeps L[:min(cnt + extra, |L|)] instead. T' is the
calibrated model's time, fixed overhead of a layer with replicas included, so a plan whose
modelled gain is below it loses to the empty plan. Integer and float arithmetic in a fixed order:
equal counts and constants give the same plan on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_moe.pro_prophet.perf_model import PerfModel, check_counts, loads, normalize_replicas, owner_of


@dataclass(frozen=True)
class PlacementPlan:
    """One layer's placement for one iteration.

    replicas: E sorted tuples, replicas[e] = EP ranks holding a replica of e (never the owner).
    order: the moved experts in the order the planner chose them; excluded: for each, the n ranks
      left out by Algorithm 1 (`heaviest_to_all`: empty tuples).
    predicted_s / baseline_s: T' of the plan / of no placement (None when planned without a model).
    load_before / load_after: computed tokens per rank (H) without / with the plan.
    """

    num_devices: int
    num_experts: int
    replicas: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    excluded: tuple[tuple[int, ...], ...]
    predicted_s: float | None
    baseline_s: float | None
    load_before: tuple[int, ...]
    load_after: tuple[int, ...]

    def as_dict(self) -> dict[int, tuple[int, ...]]:
        """{expert: replica ranks} for the moved experts only, in expert order."""
        return {e: r for e, r in enumerate(self.replicas) if r}

    @property
    def num_transfers(self) -> int:
        """(expert, replica rank) pairs: Trans sends, and Agg receives, this many expert copies."""
        return sum(len(r) for r in self.replicas)

    @property
    def load_std_before(self) -> float:
        """Population standard deviation of the computed tokens per rank without the plan."""
        return float(np.std(np.asarray(self.load_before, dtype=np.float64)))

    @property
    def load_std_after(self) -> float:
        """Population standard deviation of the computed tokens per rank with the plan."""
        return float(np.std(np.asarray(self.load_after, dtype=np.float64)))


def is_balanced(computed: Sequence[int], alpha: float, total_tokens: int, num_experts: int) -> bool:
    """Eq. (7): max(H) - min(H) < alpha * I / E."""
    return max(computed) - min(computed) < alpha * total_tokens / num_experts


def _check_knobs(alpha: float, n: int, num_devices: int) -> None:
    if not np.isfinite(alpha) or alpha < 0:
        raise ValueError(f"--pro-prophet-alpha must be a finite number >= 0, got {alpha!r}")
    if isinstance(n, bool) or int(n) != n or n < 0 or n > max(num_devices - 2, 0):
        raise ValueError(
            f"--pro-prophet-n must be an integer in [0, {max(num_devices - 2, 0)}] "
            f"for {num_devices} expert-parallel ranks, got {n!r}"
        )


def _make_plan(
    counts: np.ndarray,
    replicas: Sequence[Sequence[int]],
    order: Sequence[int],
    excluded: Sequence[Sequence[int]],
    model: PerfModel | None,
) -> PlacementPlan:
    d, e = counts.shape
    reps = normalize_replicas(replicas, d, e)
    before = loads(counts, normalize_replicas(None, d, e))[0]
    after = loads(counts, reps)[0]
    return PlacementPlan(
        num_devices=d,
        num_experts=e,
        replicas=reps,
        order=tuple(int(x) for x in order),
        excluded=tuple(tuple(sorted(int(r) for r in b)) for b in excluded),
        predicted_s=None if model is None else model.layer_time(counts, reps),
        baseline_s=None if model is None else model.layer_time(counts, None),
        load_before=tuple(int(v) for v in before),
        load_after=tuple(int(v) for v in after),
    )


def plan(counts_DE, model: PerfModel, alpha: float, n: int = 0, extra: int = 0) -> PlacementPlan:
    """Algorithm 1 (see the module docstring): the best prefix of the greedy moves under `model`.

    counts_DE: int [D, E] (array, list or tensor); alpha: the balance threshold of eq. (7)
    (--pro-prophet-alpha); n: ranks each moved expert is not sent to (--pro-prophet-n, 0..D-2);
    extra: further moves of the greedy order kept after the best prefix (the trial's "wider" arm).
    With extra = 0 the returned plan's predicted time is never above the no-placement time.
    """
    counts = check_counts(counts_DE)
    d, e = counts.shape
    _check_knobs(alpha, n, d)
    if isinstance(extra, bool) or int(extra) != extra or extra < 0:
        raise ValueError(f"plan: extra must be an integer >= 0, got {extra!r}")
    per = e // d
    total = int(counts.sum())
    replicas: list[tuple[int, ...]] = [() for _ in range(e)]
    best_t, cnt = model.layer_time(counts, replicas), 0
    order: list[int] = []
    excluded: list[tuple[int, ...]] = []
    used: set[int] = set()
    while True:
        h = loads(counts, replicas)[0]
        if d == 1 or is_balanced(h.tolist(), alpha, total, e):
            break
        heavy = int(np.argmax(h))  # first maximum: lowest rank on a tie
        free = [x for x in range(heavy * per, (heavy + 1) * per) if x not in used]
        if not free:
            break
        x = min(free, key=lambda j: (-int(counts[:, j].sum()), j))
        used.add(x)
        others = [r for r in range(d) if r != heavy]
        bottom = sorted(others, key=lambda r: (int(counts[r, x]), r))[:n]
        reps = tuple(r for r in others if r not in bottom and counts[r, x] > 0)
        if not reps:
            continue  # nobody else routes to x: nothing to move
        replicas[x] = reps
        order.append(x)
        excluded.append(tuple(sorted(bottom)))
        t = model.layer_time(counts, replicas)
        if t < best_t:
            best_t, cnt = t, len(order)
    cnt = min(cnt + int(extra), len(order))
    kept = set(order[:cnt])
    final = [replicas[x] if x in kept else () for x in range(e)]
    return _make_plan(counts, final, order[:cnt], excluded[:cnt], model)


def heaviest_to_all(counts_DE, k: int = 2, model: PerfModel | None = None) -> PlacementPlan:
    """The paper's comparison ("top-k"): the k experts with the most tokens (lowest index on a tie)
    replicated on every rank but their owner. `model` only fills in the predicted times."""
    counts = check_counts(counts_DE)
    d, e = counts.shape
    if isinstance(k, bool) or int(k) != k or not 0 <= k <= e:
        raise ValueError(f"heaviest_to_all: k must be an integer in [0, {e}], got {k!r}")
    totals = counts.sum(axis=0)
    top = sorted(range(e), key=lambda j: (-int(totals[j]), j))[:k]
    replicas = [tuple(r for r in range(d) if r != owner_of(x, d, e)) if x in top else () for x in range(e)]
    order = [x for x in top if replicas[x]]
    return _make_plan(counts, replicas, order, [() for _ in order], model)


# -- Algorithm 2: block-wise schedule ----------------------------------------------------------
@dataclass(frozen=True)
class CommLaunch:
    """One Trans or Agg sub-primitive: the experts of `block` it moves, and the compute it hides behind.

    kind: "trans" (forward, owner -> replicas) or "agg" (backward, replicas -> owner).
    with_block / with_compute: launched together with that block's "expert" or "non_expert"
    compute; with_block None and with_compute "blocking": no compute to hide behind (block 0's
    Trans at the start of the forward, block 0's Agg at the end of the backward).
    """

    kind: str
    block: int
    experts: tuple[int, ...]
    with_block: int | None
    with_compute: str


@dataclass(frozen=True)
class BlockSchedule:
    """Algorithm 2 as data: `forward` and `backward` launches, each in launch order."""

    forward: tuple[CommLaunch, ...]
    backward: tuple[CommLaunch, ...]


def _static_share(times: Sequence[float], budget: float) -> int:
    """How many leading entries of `times` fit within `budget` seconds."""
    total, m = 0.0, 0
    for t in times:
        if total + t > budget:
            break
        total += t
        m += 1
    return m


def block_schedule(plans: Sequence[PlacementPlan], model: PerfModel) -> BlockSchedule:
    """Algorithm 2 for L blocks (block = an MoE layer + the non-MoE layer after it); plans[i] is block i's.

    Forward: block 0's Trans blocks, at the start; block i+1's Trans goes with block i's non-expert
    compute for as many of its last experts (plan order) as fit in `model.fnec_s` (the static share),
    the rest with block i's expert compute. Backward (blocks L-1 .. 0): block i+1's Agg goes with
    block i's non-expert backward for its first experts that fit in `model.bnec_s`, the rest with
    block i's expert backward; block 0's Agg blocks, at the end. Blocks without moved experts launch
    nothing; every launch finishes within the iteration.
    """
    forward: list[CommLaunch] = []
    backward: list[CommLaunch] = []
    blocks = len(plans)

    def cost(p: PlacementPlan, params: int) -> list[float]:
        c = model.constants
        return [c.bcast_alpha + c.bcast_beta * params * (len(p.replicas[x]) + 1) / p.num_devices for x in p.order]

    if blocks and plans[0].order:
        forward.append(CommLaunch("trans", 0, plans[0].order, None, "blocking"))
    for i in range(blocks - 1):
        nxt = plans[i + 1]
        if not nxt.order:
            continue
        m = _static_share(cost(nxt, model.param_elements)[::-1], model.fnec_s)
        head, tail = nxt.order[: len(nxt.order) - m], nxt.order[len(nxt.order) - m :]
        if head:
            forward.append(CommLaunch("trans", i + 1, head, i, "expert"))
        if tail:
            forward.append(CommLaunch("trans", i + 1, tail, i, "non_expert"))
    for i in range(blocks - 2, -1, -1):
        nxt = plans[i + 1]
        if not nxt.order:
            continue
        m = _static_share(cost(nxt, model.grad_elements), model.bnec_s)
        if m:
            backward.append(CommLaunch("agg", i + 1, nxt.order[:m], i, "non_expert"))
        if nxt.order[m:]:
            backward.append(CommLaunch("agg", i + 1, nxt.order[m:], i, "expert"))
    if blocks and plans[0].order:
        backward.append(CommLaunch("agg", 0, plans[0].order, None, "blocking"))
    return BlockSchedule(tuple(forward), tuple(backward))
