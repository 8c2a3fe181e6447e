"""Traffic-aware phase 2 of Lina's inference scheduling: the link rows of a placement, the modelled
layer time, and the choice between keeping phase 1's placement and re-planning (hand-computed)."""

from __future__ import annotations

import pytest

from megatron_moe.inference.popularity import (
    Placement,
    add_replicas,
    device_rows,
    layer_cost,
    link_rows,
    plan_placement,
    traffic_aware_replan,
)
from megatron_moe.inference.scheduled import ScheduledMoE, rates

# 2 devices, 4 experts: device 0's tokens chose experts 0 (1), 1 (4) and 3 (2); device 1's chose expert 2 (6)
COUNTS = [[1, 4, 0, 2], [0, 0, 6, 0]]
# phase 1 put experts 0, 1 on device 0 and 2, 3 on device 1
PHASE1 = Placement([[0], [0], [1], [1]])


def test_link_rows_follow_the_even_split_over_replicas():
    # phase 1: only device 0's two choices of expert 3 cross to device 1
    assert link_rows(PHASE1, COUNTS) == ([2, 0], [0, 2])
    # expert 0 on both devices, 8 choices (device 0's 3 first, then device 1's 5): replica 0 takes
    # indices [0, 4) (device 0's 3 stay, 1 of device 1's crosses), replica 1 takes [4, 8) (local)
    assert link_rows(Placement([[0, 1]]), [[3], [5]]) == ([0, 1], [1, 0])
    # expert 0 on device 1 only: all 3 of device 0's cross
    assert link_rows(Placement([[1]]), [[3], [5]]) == ([3, 0], [0, 3])


def test_compute_only_replan_moves_replicas_off_the_tokens_device_and_traffic_aware_keeps_phase1():
    # the compute-only re-plan from the actual counts [1, 4, 6, 2] (n_e = 2 x counts / 13, all < 1,
    # 3 first-fit bins > 2 devices, so least-loaded: 2 -> dev 0, 1 -> dev 1, 3 -> dev 1, 0 -> dev 0)
    replan = plan_placement([2 * c / 13 for c in [1, 4, 6, 2]], 2, 2)
    assert replan.hosts == [[0], [1], [0], [1]]
    # it balances rows better (7 vs 8 on the busiest device) ...
    assert device_rows(replan, [1, 4, 6, 2], 2) == [7, 6]
    assert device_rows(PHASE1, [1, 4, 6, 2], 2) == [5, 8]
    # ... but sends device 1's 6 choices of expert 2 to device 0 and device 0's 4 + 2 to device 1
    assert link_rows(replan, COUNTS) == ([6, 6], [6, 6])
    # equal prices per row: phase 1 costs 8 + (2 + 2) = 12, the re-plan 7 + (6 + 6) = 19
    assert layer_cost(PHASE1, COUNTS, 1.0, 1.0) == 12.0
    assert layer_cost(replan, COUNTS, 1.0, 1.0) == 19.0
    # at most 2 experts per device: no room for a replica, so phase 2 keeps phase 1's placement
    plan, which = traffic_aware_replan(PHASE1, COUNTS, 2, 1.0, 1.0)
    assert (plan.hosts, which) == (PHASE1.hosts, "keep")


def test_the_replan_wins_when_the_link_is_cheap():
    # a link row at 1/100 of an expert row: phase 1 costs 8 + 4 / 100, the re-plan 7 + 12 / 100
    assert layer_cost(PHASE1, COUNTS, 1.0, 0.01) == pytest.approx(8.04)
    plan, which = traffic_aware_replan(PHASE1, COUNTS, 2, 1.0, 0.01)
    assert (plan.hosts, which) == ([[0], [1], [0], [1]], "replan")
    assert layer_cost(plan, COUNTS, 1.0, 0.01) == pytest.approx(7.12)


def test_added_replicas_keep_every_choice_on_its_device():
    # both devices chose expert 0 four times; the trained layout has it on device 0 only:
    # 8 rows there and 4 rows each way over the link (8 + 4 + 4 = 16)
    counts = [[4, 0], [4, 0]]
    static = Placement([[0], [1]])
    assert layer_cost(static, counts, 1.0, 1.0) == 16.0
    # a replica on device 1 takes indices [4, 8): device 1's own choices, so 4 rows each, none crossing;
    # expert 1 has no choices, so it gets no replica
    plan = add_replicas(static, counts, 2, 1.0, 1.0)
    assert plan.hosts == [[0, 1], [1]]
    assert layer_cost(plan, counts, 1.0, 1.0) == 4.0
    assert traffic_aware_replan(static, counts, 2, 1.0, 1.0) == (plan, "keep+replicas")
    # at most one expert per device (raised to E / N = 1): no room, the layout stays
    assert add_replicas(static, counts, 1, 1.0, 1.0).hosts == [[0], [1]]


def test_measured_rates_and_their_fallbacks():
    # [link s, link rows, expert s, expert rows] summed over ranks
    assert rates([0.2, 100.0, 0.3, 1000.0]) == pytest.approx((0.3 / 1000, 0.2 / 100))
    assert rates([0.0, 0.0, 0.3, 1000.0]) == pytest.approx((0.3 / 1000, 0.3 / 1000))  # no link row yet
    assert rates([0.2, 100.0, 0.0, 0.0]) == pytest.approx((0.2 / 100, 0.2 / 100))
    assert rates([0.0, 0.0, 0.0, 0.0]) == (1.0, 1.0)


def test_replicas_filling_every_device_leave_room_for_experts_without_estimate():
    # expert 0 would take both devices' slots (n_e 2 -> 2 replicas) and 3 unestimated experts need
    # room under at most 2 per device: expert 0 gives up its replica on device 1
    assert plan_placement([2.0, 0.0, 0.0, 0.0], 2, 2).hosts == [[0], [0], [1], [1]]


def test_unknown_phase2_pricing_is_refused():
    with pytest.raises(ValueError, match=r"phase-2 pricing must be one of \('traffic', 'compute'\), got 'both'"):
        ScheduledMoE(None, None, "none", phase2_pricing="both")  # type: ignore[arg-type]


def test_every_expert_everywhere_when_single_additions_do_not_pay():
    # device 0 chose experts 0, 1 3 and 2 times, device 1 2 and 3 times; trained layout: 5 rows each,
    # 2 rows each way over the link (5 + 2 + 2 = 9)
    counts = [[3, 2], [2, 3]]
    static = Placement([[0], [1]])
    assert layer_cost(static, counts, 1.0, 1.0) == 9.0
    # one replica more makes a device compute 7 or 8 rows: no single addition pays
    assert add_replicas(static, counts, 2, 1.0, 1.0).hosts == [[0], [1]]
    # both experts on both devices: expert 0's replica 0 takes indices [0, 2) (device 0's), replica 1
    # [2, 5) (device 0's third crosses); expert 1's replica 0 [0, 2) and replica 1 [2, 5) all stay local:
    # rows 4 and 6, one row each way (6 + 1 + 1 = 8)
    everywhere = Placement([[0, 1], [0, 1]])
    assert link_rows(everywhere, counts) == ([1, 0], [0, 1])
    assert layer_cost(everywhere, counts, 1.0, 1.0) == 8.0
    assert traffic_aware_replan(static, counts, 2, 1.0, 1.0) == (everywhere, "everywhere")
    # at most one expert per device: not a candidate
    assert traffic_aware_replan(static, counts, 1, 1.0, 1.0) == (static, "keep")
