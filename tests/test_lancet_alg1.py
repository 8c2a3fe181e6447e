"""Lancet's Algorithm 1 (dW scheduling) with the paper's rule: argmin |t_remaining - t_dW|."""

import itertools
import math

import pytest

from megatron_moe.lancet.ir import Graph, Instr
from megatron_moe.lancet.wgrad_schedule import best_fit, eligible_dw, exposed_comm_ms, schedule_wgrad


def optimum(g: Graph) -> float:
    """Least exposed communication over every assignment of each dW to one eligible all-to-all or none."""
    a2as = [a.name for a in g.of_kind("a2a")]
    dws = [w.name for w in g.of_kind("dW")]
    options = [[None] + [a for a in a2as if w in eligible_dw(g, a)] for w in dws]
    best = math.inf
    for pick in itertools.product(*options):
        best = min(best, exposed_comm_ms(g, {a: [w for w, p in zip(dws, pick) if p == a] for a in a2as}))
    return best


def _independent(dws: dict, a2as: list) -> Graph:
    """dW instructions (name -> ms) on pass inputs, then all-to-alls (name, ms) on other pass inputs:
    every dW precedes and is independent of every all-to-all."""
    instrs = [Instr(n, "dW", (f"g_{n}",), (f"w_{n}",), c) for n, c in dws.items()]
    instrs += [Instr(n, "a2a", (f"x_{n}",), (f"y_{n}",), c) for n, c in a2as]
    return Graph(instrs)


def test_issue_counter_example_hides_both_all_to_alls():
    # all-to-alls of 10 and 2 ms, dW {2, 11}: the old rule (largest not above, else smallest above)
    # put 2 and then 11 on the first and left the second exposed (2 ms); the closest fit hides both
    g = _independent({"w2": 2.0, "w11": 11.0}, [("a10", 10.0), ("a2", 2.0)])
    s = schedule_wgrad(g)
    assert s.assignment == {"a10": ["w11"], "a2": ["w2"]}
    assert s.leftover == []
    assert exposed_comm_ms(g, s.assignment) == 0.0 == optimum(g)


def test_closest_fit_ties_go_to_program_order():
    g = _independent({"early": 3.0, "late": 7.0}, [("a", 5.0)])
    assert best_fit(g, ["early", "late"], 5.0) == "early"  # |5-3| == |5-7|
    assert best_fit(g, ["early", "late"], 5.5) == "late"
    with pytest.raises(ValueError, match="at least one candidate"):
        best_fit(g, [], 1.0)


def test_chain_of_three_all_to_alls_with_known_optimum():
    # a2a 8, 5, 3 ms; dW 9, 5, 3, 1 ms, all eligible for every all-to-all.
    # By hand: 8 -> 9 (|8-9| = 1 beats 5's 3) covers it; 5 -> 5 exactly; 3 -> 3 exactly; 1 is left.
    g = _independent({"d9": 9.0, "d5": 5.0, "d3": 3.0, "d1": 1.0}, [("x8", 8.0), ("x5", 5.0), ("x3", 3.0)])
    s = schedule_wgrad(g)
    assert s.assignment == {"x8": ["d9"], "x5": ["d5"], "x3": ["d3"]}
    assert s.leftover == ["d1"]
    assert exposed_comm_ms(g, s.assignment) == 0.0 == optimum(g)


def test_dependencies_limit_the_choice_and_greedy_meets_the_optimum():
    # Backward-like IR: a2a "c1" (6 ms) then a dX reading its result, a dW on that dX's output, and a
    # second a2a "c2" (4 ms). dW "early" (4 ms) precedes c1; dW "mid" (6 ms) reads c1's result, so it
    # may only hide c2; "late" (2 ms) is after both.
    g = Graph(
        [
            Instr("early", "dW", ("g0",), ("w_early",), 4.0),
            Instr("c1", "a2a", ("x",), ("y",), 6.0),
            Instr("dx", "dX", ("y",), ("gy",), 1.0),
            Instr("mid", "dW", ("gy",), ("w_mid",), 6.0),
            Instr("c2", "a2a", ("gy",), ("z",), 4.0),
            Instr("late", "dW", ("z",), ("w_late",), 2.0),
        ]
    )
    assert eligible_dw(g, "c1") == ["early"] and eligible_dw(g, "c2") == ["early", "mid"]
    s = schedule_wgrad(g)
    # c1: only "early" (remaining 6 - 4 = 2, nothing else eligible); c2: only "mid" is left (covers 4)
    assert s.assignment == {"c1": ["early"], "c2": ["mid"]}
    assert s.leftover == ["late"]
    assert exposed_comm_ms(g, s.assignment) == 2.0 == optimum(g)


def test_closest_fit_keeps_adding_until_covered():
    # one a2a of 10 ms, dW 6, 3, 2, 2 ms: 10 -> 6 (4 left) -> 3 (|4-3| = 1 beats 2's 2; 1 left)
    # -> 2 (the first of the equal pair; covers it) and the last 2 is left over.
    g = _independent({"d6": 6.0, "d3": 3.0, "d2a": 2.0, "d2b": 2.0}, [("a", 10.0)])
    s = schedule_wgrad(g)
    assert s.assignment == {"a": ["d6", "d3", "d2a"]}
    assert s.leftover == ["d2b"]
    assert exposed_comm_ms(g, s.assignment) == 0.0 == optimum(g)
