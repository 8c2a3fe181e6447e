"""Lancet planning algorithms: IR reachability, Algorithm 1, cost model, simulator, DP, CP-SAT axes."""

from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest
from lancet_blocks import standard_moe_block_ops

from megatron_moe.lancet.axes import AxisOp, AxisRange, op_options, solve_axes
from megatron_moe.lancet.cost import CommCostModel, OpProfiler
from megatron_moe.lancet.ir import Graph, Instr, overlappable_dw
from megatron_moe.lancet.partition_dp import group_ops, plan_ops, plan_partitions
from megatron_moe.lancet.simulator import SimOp, sequential_ms, simulate, split_stages
from megatron_moe.lancet.wgrad_schedule import (
    ATTN_BACKWARD_KEYS,
    DENSE_MLP_BACKWARD_KEYS,
    MOE_BACKWARD_KEYS,
    build_gpt_moe_backward,
    eligible_dw,
    exposed_comm_ms,
    schedule_wgrad,
)

# ---------------------------------------------------------------- IR


def random_graph(rng: random.Random, n: int) -> Graph:
    """A random DAG in program order: each instr reads a few earlier outputs (or pass inputs)."""
    instrs = []
    for j in range(n):
        kind = rng.choice(["dX", "dW", "dW", "a2a", "other"])
        ins = tuple(f"v{p}" for p in range(j) if rng.random() < 0.25) + ("input",)
        instrs.append(Instr(f"i{j}", kind, ins, (f"v{j}",), float(rng.randint(0, 9))))
    return Graph(instrs)


def closure(g: Graph) -> dict[str, set[str]]:
    """reach[a] = instructions reachable from a, by Warshall's algorithm on the edge matrix."""
    names = [i.name for i in g.instrs]
    r = {a.name: {b.name for b in g.instrs if set(b.inputs) & set(a.outputs)} for a in g.instrs}
    for m in names:
        for a in names:
            if m in r[a]:
                r[a] |= r[m]
    return r


def test_graph_rejects_bad_program_order():
    with pytest.raises(ValueError, match="produced by both"):
        Graph([Instr("a", "dX", (), ("v",), 1), Instr("b", "dX", (), ("v",), 1)])
    with pytest.raises(ValueError, match="before its producer"):
        Graph([Instr("a", "dX", ("v",), ("w",), 1), Instr("b", "dX", (), ("v",), 1)])
    with pytest.raises(ValueError, match="kind"):
        Instr("a", "bogus", (), (), 1)


def test_reachability_and_overlappable_match_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        g = random_graph(rng, rng.randint(2, 14))
        reach = closure(g)
        for ins in g.instrs:
            assert g.descendants(ins.name) == reach[ins.name]
            assert g.ancestors(ins.name) == {a for a in reach if ins.name in reach[a]}
        for a in g.of_kind("a2a"):
            expect = [w.name for w in g.of_kind("dW") if w.name not in reach[a.name] and a.name not in reach[w.name]]
            assert overlappable_dw(g, a.name) == expect


# ---------------------------------------------------------------- Algorithm 1


def brute_force_exposed(g: Graph) -> float:
    """Least exposed comm over every assignment of each dW to one eligible all-to-all or none."""
    a2as = [a.name for a in g.of_kind("a2a")]
    dws = [w.name for w in g.of_kind("dW")]
    options = [[None] + [a for a in a2as if w in eligible_dw(g, a)] for w in dws]
    best = math.inf
    for pick in itertools.product(*options):
        assign = {a: [w for w, p in zip(dws, pick) if p == a] for a in a2as}
        best = min(best, exposed_comm_ms(g, assign))
    return best


def test_best_fit_takes_the_dw_closest_to_the_remaining_time():
    # a2a of 10 ms; independent dW of 4, 12, 7 ms before it.
    g = Graph(
        [
            Instr("w4", "dW", ("g",), ("a",), 4),
            Instr("w12", "dW", ("g",), ("b",), 12),
            Instr("w7", "dW", ("g",), ("c",), 7),
            Instr("comm", "a2a", ("x",), ("y",), 10),
        ]
    )
    s = schedule_wgrad(g)
    # the paper's argmin |10 - cost|: 12 (distance 2) beats 7 (3) and 4 (6) and covers the all-to-all
    assert s.assignment == {"comm": ["w12"]}
    assert s.leftover == ["w4", "w7"]
    assert exposed_comm_ms(g, s.assignment) == 0.0 == brute_force_exposed(g)


def test_dw_never_overlaps_an_all_to_all_it_depends_on():
    # d1 feeds from a2a "first", so it may only hide "second" (which it precedes).
    g = Graph(
        [
            Instr("first", "a2a", ("x",), ("y",), 5),
            Instr("dx1", "dX", ("y",), ("gy",), 1),
            Instr("d1", "dW", ("gy",), ("w1",), 5),
            Instr("d0", "dW", ("x",), ("w0",), 3),
            Instr("second", "a2a", ("gy",), ("z",), 6),
        ]
    )
    s = schedule_wgrad(g)
    assert s.assignment == {"first": [], "second": ["d1", "d0"]}
    assert exposed_comm_ms(g, s.assignment) == 5.0 == brute_force_exposed(g)


def test_schedule_properties_on_random_dags():
    rng = random.Random(1)
    for trial in range(60):
        g = random_graph(rng, rng.randint(3, 10))
        reach = closure(g)
        s = schedule_wgrad(g)
        owner = {w: a for a, ws in s.assignment.items() for w in ws}
        assert s.leftover == [w.name for w in g.of_kind("dW") if w.name not in owner]
        assert sum(len(ws) for ws in s.assignment.values()) == len(owner)  # none assigned twice
        for w, a in owner.items():
            assert w not in reach[a] and a not in reach[w]
            assert g.position(w) < g.position(a)
        # Greedy stops early only when no eligible dW is left for that all-to-all.
        for a in g.of_kind("a2a"):
            if sum(g[w].cost_ms for w in s.assignment[a.name]) < a.cost_ms:
                assert all(w in owner for w in eligible_dw(g, a.name))
        assert exposed_comm_ms(g, s.assignment) >= brute_force_exposed(g) - 1e-9


def test_exposed_comm_rejects_bad_assignments():
    g = Graph([Instr("w", "dW", (), ("a",), 1), Instr("c", "a2a", (), ("b",), 3), Instr("c2", "a2a", (), ("d",), 2)])
    assert exposed_comm_ms(g, {}) == 5.0
    with pytest.raises(ValueError, match="not an all-to-all"):
        exposed_comm_ms(g, {"w": []})
    with pytest.raises(ValueError, match="more than one"):
        exposed_comm_ms(g, {"c": ["w"], "c2": ["w"]})


def _costs(moe: bool) -> dict[str, float]:
    keys = (MOE_BACKWARD_KEYS if moe else DENSE_MLP_BACKWARD_KEYS) + ATTN_BACKWARD_KEYS
    c = {k: 1.0 for k in keys}
    c.update(
        {
            "moe.a2a_combine": 4.0,
            "moe.a2a_dispatch": 5.0,
            "moe.gate.dW": 0.5,
            "moe.expert.fc2.dW": 2.0,
            "moe.expert.fc1.dW": 2.0,
        }
    )
    return c


def test_gpt_moe_backward_ir_and_schedule():
    costs = [_costs(False), _costs(True)]  # layer 0 dense, layer 1 MoE
    g = build_gpt_moe_backward(2, [1], costs, {"head.dX": 1.0, "head.dW": 3.0, "embed.dW": 1.0})
    assert [i.name for i in g.instrs[:4]] == ["head.dX", "head.dW", "L1.moe.combine.dX", "L1.moe.a2a_combine"]
    assert len(g) == 2 + len(MOE_BACKWARD_KEYS) + len(DENSE_MLP_BACKWARD_KEYS) + 2 * len(ATTN_BACKWARD_KEYS) + 1
    # The gate's gradient comes from the combine weights only: no path through either all-to-all.
    assert overlappable_dw(g, "L1.moe.a2a_combine") == ["head.dW", "L1.moe.gate.dW"]
    assert overlappable_dw(g, "L1.moe.a2a_dispatch") == [
        "head.dW",
        "L1.moe.expert.fc2.dW",
        "L1.moe.expert.fc1.dW",
        "L1.moe.gate.dW",
    ]
    s = schedule_wgrad(g)
    assert s.assignment == {
        "L1.moe.a2a_combine": ["head.dW"],
        "L1.moe.a2a_dispatch": ["L1.moe.expert.fc2.dW", "L1.moe.expert.fc1.dW"],
    }
    assert exposed_comm_ms(g, s.assignment) == 2.0
    with pytest.raises(ValueError, match="moe.a2a_dispatch"):
        build_gpt_moe_backward(1, [0], {k: 1.0 for k in ATTN_BACKWARD_KEYS + DENSE_MLP_BACKWARD_KEYS})


# ---------------------------------------------------------------- cost model


def test_comm_cost_model_interpolates_and_extrapolates():
    m = CommCostModel([(2048, 1.5), (1024, 1.0), (4096, 2.5)])
    assert m.predict(1536) == 1.25
    assert m.predict(4096) == 2.5
    assert m.predict(8192) == 4.5  # last segment's slope: 1 ms per 2 KB
    assert m.predict(512) == 0.75  # first segment's slope
    assert m.predict(0) == 0.0
    assert m.a2a_part_ms(8192, 4) == m.predict(2048) == 1.5
    with pytest.raises(ValueError, match=">= 2"):
        CommCostModel([(1024, 1.0)])


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_op_profiler_measures_once_and_persists(tmp_path):
    path = str(tmp_path / "ops.json")
    clock, calls = FakeClock(), []

    def op() -> None:
        calls.append(1)
        clock.t += 2e-3

    prof = OpProfiler(path, clock=clock)
    assert prof.time("mm", (4, 8), op, warmup=1, iters=3) == pytest.approx(2.0)
    assert len(calls) == 4
    assert prof.time("mm", (4, 8), op) == pytest.approx(2.0)
    assert len(calls) == 4  # cached, not re-run
    with open(path) as f:
        assert json.load(f) == {"mm|4x8": pytest.approx(2.0)}
    assert os.listdir(tmp_path) == ["ops.json"]  # no temporary file left behind
    again = OpProfiler(path, clock=clock)
    assert again.time("mm", (4, 8), op) == pytest.approx(2.0)
    assert len(calls) == 4
    assert again.time("mm", (4, 16), op, warmup=0, iters=1) == pytest.approx(2.0)
    assert len(calls) == 5


# ---------------------------------------------------------------- simulator


def test_simulator_hand_computed_pipeline():
    ops = [SimOp("a", "compute", 4), SimOp("b", "comm", 6), SimOp("c", "compute", 2)]
    r = simulate(ops, 2)
    # compute: a0 [0,2] a1 [2,4]; comm: b0 [2,5] b1 [5,8]; compute: c0 [5,6] c1 [8,9]
    assert r.timeline == [
        (0, 0, "compute", 0, 2),
        (1, 0, "compute", 2, 4),
        (0, 1, "comm", 2, 5),
        (1, 1, "comm", 5, 8),
        (0, 2, "compute", 5, 6),
        (1, 2, "compute", 8, 9),
    ]
    assert (r.makespan_ms, r.exposed_comm_ms) == (9, 3)  # comm alone in [4,5] and [6,8]
    one = simulate(ops, 1)
    assert (one.makespan_ms, one.exposed_comm_ms) == (12, 6) and sequential_ms(ops) == 12
    ov = simulate(ops, 2, overhead_ms=0.5)
    # compute stages 2.5 and 1.5: a [0,2.5][2.5,5]; b [2.5,5.5][5.5,8.5]; c [5.5,7][8.5,10]
    assert (ov.makespan_ms, ov.exposed_comm_ms) == (10, 2)


def test_simulator_stages_and_comm_model():
    ops = [SimOp("a", "compute", 1), SimOp("b", "compute", 1), SimOp("c", "comm", 2, bytes=8192), SimOp("d", "comm", 2)]
    assert [[o.name for o in st] for st in split_stages(ops)] == [["a", "b"], ["c", "d"]]
    m = CommCostModel([(1024, 1.0), (2048, 1.5), (4096, 2.5)])
    r = simulate(ops, 2, cost_model=m)
    # per part: compute 1; comm predict(4096) + 2/2 = 3.5; comm parts [1,4.5] and [4.5,8]
    assert r.makespan_ms == 8.0 and r.exposed_comm_ms == 6.0
    assert sequential_ms(ops, m) == 2 + 4.5 + 2


# ---------------------------------------------------------------- DP


def brute_force_plan(n: int, table, iota: int, rho: int) -> float:
    best = math.inf
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [j + 1 for j, c in enumerate(cuts) if c] + [n]
        segs = list(zip(bounds, bounds[1:]))
        if any(e - s > iota for s, e in segs):
            continue
        best = min(best, sum(min(table(s, e, k) for k in range(1, rho + 1)) for s, e in segs))
    return best


def test_dp_equals_brute_force_and_honours_limits():
    rng = random.Random(2)
    for trial in range(150):
        n = rng.randint(1, 7)
        iota, rho = rng.randint(1, n), rng.randint(1, 4)
        seq = [rng.randint(1, 9) for _ in range(n)]
        extra = {
            (i, e, k): (math.inf if rng.random() < 0.3 else rng.randint(1, 40))
            for i in range(n)
            for e in range(i + 1, n + 1)
            for k in range(2, 9)
        }

        def table(i, e, k):
            return sum(seq[i:e]) if k == 1 else extra[(i, e, k)]

        plan = plan_partitions(n, table, iota, rho)
        assert plan.total_ms == brute_force_plan(n, table, iota, rho)
        assert [r.start for r in plan.ranges] == [0] + [r.end for r in plan.ranges[:-1]]
        assert plan.ranges[-1].end == n
        for r in plan.ranges:
            assert r.end - r.start <= iota and 1 <= r.k <= rho and r.ms == table(r.start, r.end, r.k)
        assert sum(r.ms for r in plan.ranges) == plan.total_ms


def test_group_ops():
    assert group_ops([1, 2, 3, 1, 1, 5], 3) == [(0, 2), (2, 3), (3, 6)]
    assert group_ops([1, 1], 5) == [(0, 2)]
    assert group_ops([], 5) == []
    with pytest.raises(ValueError, match="group_ms"):
        group_ops([1], 0)


def test_plan_ops_with_simulator_and_feasibility():
    ops = [SimOp("a", "compute", 4), SimOp("b", "comm", 6), SimOp("c", "compute", 2)]
    plan = plan_ops(ops, group_ms=1, max_range=3, max_partitions=2)
    assert plan.total_ms == 9 and [(r.start, r.end, r.k) for r in plan.ranges] == [(0, 3, 2)]
    # Only one-op ranges allowed: nothing overlaps, so partitioning buys nothing and k = 1 wins.
    plan = plan_ops(ops, group_ms=1, max_range=1)
    assert plan.total_ms == 12 and all(r.k == 1 for r in plan.ranges)
    plan = plan_ops(ops, group_ms=1, max_range=3, feasible=lambda s, e: False)
    assert plan.total_ms == 12 and all(r.k == 1 for r in plan.ranges)


def test_plan_ops_with_bpr_gate_starts_partitioned_range_at_gate():
    rng_ops = standard_moe_block_ops(batch_prioritized=True)
    gate_at = [op.name for op in rng_ops.ops].index("gate")
    sim = [
        SimOp(op.name, "comm" if op.kind == "a2a" else "compute", 8.0 if op.kind == "a2a" else 1.0)
        for op in rng_ops.ops
    ]
    plan = plan_ops(
        sim,
        group_ms=0.5,
        max_range=len(sim),
        max_partitions=4,
        overhead_ms=0.05,
        feasible=lambda start, end: solve_axes(rng_ops, start, end) is not None,
    )
    split = [r for r in plan.ranges if r.k > 1]
    assert any(r.start == gate_at for r in split)
    assert all(not (r.start < gate_at < r.end) for r in split)
    assert plan.total_ms < sequential_ms(sim)


# ---------------------------------------------------------------- CP-SAT axes


def test_standard_block_partitions_along_batch():
    sol = solve_axes(standard_moe_block_ops())
    assert sol is not None
    assert sol["x"] == "B" and sol["h"] == "B" and sol["y"] == "B" and sol["next.h"] == "B"
    assert sol["tok"] == "S" and sol["gates"] == "S" and sol["moe_tok"] == "S"
    assert sol["disp"] == sol["disp_x"] == sol["exp_out"] == sol["exp_back"] == "C"
    assert sol["attn.qkv_h"] == "B"  # attention forbids T and H


def test_batch_mixing_op_makes_range_infeasible():
    r = standard_moe_block_ops(next_block=False)
    r.tensors["y_bn"] = ("B", "T", "M")
    r.ops.append(AxisOp("bn", "batch_mixing", ("y",), ("y_bn",)))
    assert solve_axes(r) is None
    assert solve_axes(r, 0, len(r.ops) - 1) is not None  # the same range without it is fine
    r.ops[-1] = AxisOp("bn", "batch_mixing", ("y",), ("y_bn",), {"mixed": ("T",)})
    assert solve_axes(r)["y_bn"] == "B"


def test_batch_prioritized_gate_only_at_range_start():
    assert solve_axes(standard_moe_block_ops(batch_prioritized=True)) is None
    at_gate = solve_axes(standard_moe_block_ops(batch_prioritized=True, start_at_gate=True))
    assert at_gate is not None and at_gate["tok"] == "S" and at_gate["disp"] == "C"
    full = standard_moe_block_ops(batch_prioritized=True)
    g = [op.name for op in full.ops].index("gate")
    assert solve_axes(full, g) is not None
    assert solve_axes(full, g - 1) is None


def test_op_option_templates():
    dims = {"x": ("B", "T", "M"), "y": ("B", "T", "N"), "buf": ("E", "C", "M"), "out": ("E", "C", "M")}
    lin = AxisOp("l", "linear", ("x",), ("y",), {"contract": "M", "out_dim": "N"})
    assert op_options(lin, dims) == [{"x": "B", "y": "B"}, {"x": "T", "y": "T"}]
    a2a = AxisOp("a", "a2a", ("buf",), ("out",))
    assert [o["buf"] for o in op_options(a2a, dims)] == ["C", "M"]
    ln = AxisOp("n", "layernorm", ("x",), ("x2",))
    assert [o["x"] for o in op_options(ln, {**dims, "x2": ("B", "T", "M")})] == ["B", "T"]
    # A range whose input is only splittable along E (not a batch dim) is infeasible.
    r = AxisRange({"buf": ("E", "M"), "out": ("E", "M")}, [AxisOp("a", "a2a", ("buf",), ("out",))])
    assert solve_axes(r) is None
