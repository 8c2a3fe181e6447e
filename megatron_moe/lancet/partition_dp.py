"""Choosing which ranges of the forward pass to partition, and into how many parts (Lancet Sec. 5).

The forward ops are first merged into groups of about `group_ms` (gamma) ms, so the search is
over tens of groups rather than hundreds of ops. Then a dynamic program over group prefixes:

    T(0) = 0
    T(n) = min over i < n with n - i <= max_range (iota) of
               T(i) + min over k in 1..max_partitions (rho) of P(i, n, k)

where P(i, n, k) is the time of groups i..n-1 split into k parts along the batch (P(i, n, 1):
their sequential time; P = inf for k > 1 when the range cannot be partitioned, e.g. the axis
solver finds no batch axis). T(N) is the best total; back-pointers give the ranges and their k.
Ties prefer the smaller k and, for equal k, the range found first (the longest). Gains below 1e-9
relative count as ties, so round-off in P never makes a pointless split look better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from megatron_moe.lancet.cost import CommCostModel
from megatron_moe.lancet.simulator import SimOp, simulate


@dataclass(frozen=True)
class PlannedRange:
    """Units start..end-1 (groups, or ops for plan_ops) run split into k parts, taking ms."""

    start: int
    end: int
    k: int
    ms: float


@dataclass
class PartitionPlan:
    """total_ms = T(N); ranges cover 0..N-1 in order."""

    total_ms: float
    ranges: list[PlannedRange] = field(default_factory=list)


def group_ops(costs: Sequence[float], group_ms: float, cuts: Collection[int] = ()) -> list[tuple[int, int]]:
    """Merge consecutive ops into groups [start, end) of about `group_ms` ms.

    A group is closed as soon as its cost reaches group_ms, so every group but
    the last costs >= group_ms, and less than group_ms plus its last op.
    `cuts`: op indices where a group must end anyway (a group never spans a
    cut), e.g. the only places a partitioned range may start or end.
    """
    if group_ms <= 0:
        raise ValueError(f"group_ms (gamma) must be > 0, got {group_ms}")
    groups, start, acc = [], 0, 0.0
    for j, c in enumerate(costs):
        acc += c
        if acc >= group_ms or (j + 1) in cuts:
            groups.append((start, j + 1))
            start, acc = j + 1, 0.0
    if start < len(costs):
        groups.append((start, len(costs)))
    return groups


def plan_partitions(
    num_groups: int, range_ms: Callable[[int, int, int], float], max_range: int, max_partitions: int = 8
) -> PartitionPlan:
    """Run the DP over `num_groups` groups.

    range_ms(i, n, k): P(i, n, k) for groups i..n-1 in k parts (math.inf if
    not partitionable); k = 1 must be finite. max_range (iota): longest range
    in groups; max_partitions (rho): largest k.
    """
    if max_range < 1:
        raise ValueError(f"max_range (iota) must be >= 1, got {max_range}")
    if max_partitions < 1:
        raise ValueError(f"max_partitions (rho) must be >= 1, got {max_partitions}")
    best = [0.0] + [math.inf] * num_groups
    choice: list[tuple[int, int, float] | None] = [None] * (num_groups + 1)
    for n in range(1, num_groups + 1):
        for i in range(max(0, n - max_range), n):
            for k in range(1, max_partitions + 1):
                p = range_ms(i, n, k)
                if k == 1 and not math.isfinite(p):
                    raise ValueError(f"range_ms({i}, {n}, 1) must be finite (sequential time), got {p}")
                cand = best[i] + p
                # gains below 1e-9 relative are ties (module docstring): the earlier, smaller k stays
                if cand < best[n] - 1e-9 * max(1.0, abs(cand)):
                    best[n] = cand
                    choice[n] = (i, k, p)
    ranges = []
    n = num_groups
    while n > 0:
        entry = choice[n]
        # Every n >= 1 gets a choice: (n - 1, 1) is always a candidate with a finite cost.
        assert entry is not None, f"no plan chosen for prefix {n}"
        i, k, p = entry
        ranges.append(PlannedRange(i, n, k, p))
        n = i
    return PartitionPlan(best[num_groups], ranges[::-1])


def plan_ops(
    ops: Sequence[SimOp],
    group_ms: float,
    max_range: int,
    max_partitions: int = 8,
    cost_model: CommCostModel | None = None,
    overhead_ms: float = 0.0,
    feasible: Callable[[int, int], bool] | None = None,
    cuts: Collection[int] = (),
) -> PartitionPlan:
    """Group `ops`, run the DP with the timeline simulator as P, and return ranges over op indices.

    feasible(op_start, op_end): may ops op_start..op_end-1 be partitioned along
    the batch (e.g. `axes.solve_axes` on that range is not None)? None: always.
    P(i, n, k) is simulate(ops of groups i..n-1, k, cost_model, overhead_ms).
    cuts: op indices no group may span (see `group_ops`).
    """
    groups = group_ops([op.cost_ms for op in ops], group_ms, set(cuts))
    memo: dict[tuple[int, int, int], float] = {}
    ok: dict[tuple[int, int], bool] = {}  # the axis solver is the slow part: ask once per range

    def range_ms(i: int, n: int, k: int) -> float:
        if (i, n, k) not in memo:
            lo, hi = groups[i][0], groups[n - 1][1]
            if k > 1 and feasible is not None and (lo, hi) not in ok:
                ok[(lo, hi)] = bool(feasible(lo, hi))
            if k > 1 and feasible is not None and not ok[(lo, hi)]:
                memo[(i, n, k)] = math.inf
            else:
                memo[(i, n, k)] = simulate(ops[lo:hi], k, cost_model, overhead_ms).makespan_ms
        return memo[(i, n, k)]

    plan = plan_partitions(len(groups), range_ms, max_range, max_partitions)
    plan.ranges = [PlannedRange(groups[r.start][0], groups[r.end - 1][1], r.k, r.ms) for r in plan.ranges]
    return plan
