"""Lancet never slower: candidate plans, the measured choice (times injected, no wall-clock
assertions), the contention fit, and measurement leaving the model as it was."""

import json

import pytest
import torch

from megatron_moe import choose
from megatron_moe.config import OptimizationsConfig
from megatron_moe.lancet.controller import measure_plans, setup
from megatron_moe.lancet.cost import CommCostModel
from megatron_moe.lancet.planner import (
    candidate_plans,
    coarse_budget,
    fit_contention,
    overlapped_ms,
    top_candidates,
)
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import local_state
from test_lancet_runtime import config, synthetic_costs

SLOW_LINK = CommCostModel([(1.0, 0.5), (4096.0, 30.0)])  # all-to-alls slow enough that block 1 pays for 3 parts


def _opts(**kw) -> OptimizationsConfig:
    return OptimizationsConfig(lancet_wgrad=True, lancet_partition=True, lancet_group_ms=0.5, **kw)


def _plans(opts, policy="position"):
    model = GPT2MoE(config(1, policy), local_state())
    costs, comm = synthetic_costs()
    return model, candidate_plans(model, local_state(), opts, 3, 8, costs=costs, comm=comm, broadcast=False)


def test_fit_contention_recovers_known_constants():
    rows = [(p, o, 1.25 * p + 0.4 * o) for p, o in ((100.0, 0.0), (90.0, 20.0), (80.0, 35.0), (95.0, 5.0))]
    fit = fit_contention(rows)
    assert fit["scale"] == pytest.approx(1.25, rel=1e-9) and fit["contention"] == pytest.approx(0.4, rel=1e-9)
    assert max(abs(e) for e in fit["error_after"]) < 1e-12
    assert fit["error_before"][0] == pytest.approx(100 / 125 - 1)
    pts = [(p, o, p + 5.0 * o) for p, o in ((100.0, 0.0), (90.0, 20.0), (80.0, 35.0))]
    noisy = fit_contention(pts)
    assert noisy["contention"] == 1.0  # bounded: unconstrained it would be 5
    want = sum(p * (m - o) / m**2 for p, o, m in pts) / sum(p * p / m**2 for p, o, m in pts)
    assert noisy["scale"] == pytest.approx(want, rel=1e-12)  # the least-squares scale given contention 1
    only_none = fit_contention([(100.0, 0.0, 120.0)])  # nothing overlapped: the scale alone
    assert only_none["scale"] == pytest.approx(1.2) and only_none["contention"] == 0.0
    with pytest.raises(ValueError, match="positive predicted and measured"):
        fit_contention([(100.0, 0.0, 0.0)])


def test_candidates_cover_the_switches_and_come_simplest_first():
    _, plans = _plans(_opts())
    assert sorted(plans) == ["both", "dw", "none", "partition"]
    assert plans["none"].ranges == [] and not plans["none"].wgrad and overlapped_ms(plans["none"]) == 0.0
    assert plans["both"].ranges and plans["both"].wgrad
    top = top_candidates(plans, 2)
    best_two = sorted(["dw", "partition", "both"], key=lambda m: plans[m].predicted["iteration_ms"])[:2]
    assert top[0] == "none" and set(top[1:]) == set(best_two)
    assert top[1:] == [m for m in ("dw", "partition", "both") if m in best_two]  # simplest first for choose.pick
    _, only_dw = _plans(OptimizationsConfig(lancet_wgrad=True, lancet_group_ms=0.5))
    assert sorted(only_dw) == ["dw", "none"]


def _setup_with_times(model, opts, table, comm=None):
    costs, synthetic_comm = synthetic_costs()
    with choose.override("lancet", times=lambda name, i: table[name]):
        return setup(model, local_state(), opts, micro_batch=3, seq_length=8, costs=costs, comm=comm or synthetic_comm)


def test_planner_keeps_none_when_the_predicted_best_measures_slow(tmp_path):
    opts = _opts(lancet_report=str(tmp_path / "rep.json"))
    model, plans = _plans(opts)
    best_predicted = min(plans, key=lambda n: plans[n].predicted["iteration_ms"])
    assert best_predicted != "none"  # the cost model alone would pick a plan
    table = {"none": 10.0, "dw": 12.0, "partition": 11.0, "both": 13.0}
    table[best_predicted] = 40.0  # measured slow
    ctl = _setup_with_times(model, opts, table)
    assert ctl.plan.name == "none" and ctl.plan.ranges == [] and not ctl.plan.wgrad and model.runners == {}
    rep = ctl.write_report(measured_iter_ms=10.5)
    got = json.loads((tmp_path / "rep.json").read_text())["selection"]
    assert got == json.loads(json.dumps(rep["selection"]))
    names = top_candidates(plans)
    assert got["chosen"] == "none" and set(got["candidates"]) == set(names) and got["decision"]["alternatives"] == names
    assert {n: c["measured_ms"] for n, c in got["candidates"].items()} == {n: table[n] for n in names}
    assert {n: c["predicted_ms"] for n, c in got["candidates"].items()} == {
        n: plans[n].predicted["iteration_ms"] for n in names
    }
    assert got["prediction_error"] == pytest.approx((plans["none"].predicted["iteration_ms"] - 10.0) / 10.0)


def test_planner_keeps_a_plan_faster_by_more_than_the_margin():
    opts = _opts()
    _, plans = _plans(opts)
    last = top_candidates(plans)[-1]
    for gain, kept in ((0.0, "none"), (0.01, "none"), (0.05, last)):
        model, _ = _plans(opts)
        table = {"none": 10.0, "dw": 11.0, "partition": 11.0, "both": 11.0, last: 10.0 * (1 - gain)}
        assert _setup_with_times(model, opts, table).plan.name == kept, gain


def test_measuring_leaves_the_model_as_it_was():
    cfg = config(1, "random")  # the router's draws depend on its call counter
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(3))

    def loss_after(measure: bool) -> tuple:
        torch.manual_seed(7)
        model = GPT2MoE(cfg, local_state())
        opts = _opts(measure_iters=1)
        if measure:
            costs, comm = synthetic_costs()
            plans = candidate_plans(model, local_state(), opts, 3, 8, costs=costs, comm=comm, broadcast=False)
            names = top_candidates(plans)
            d = measure_plans(model, local_state(), opts, plans, names, 3, 8, 1)
            assert list(d.medians) == names and all(len(t) == 1 and t[0] > 0 for t in d.samples.values())
            assert all(p.grad is None for p in model.parameters())
        lm, aux = model(ids[:, :-1], ids[:, 1:])
        return (lm + aux).item(), torch.rand(1).item(), [b.moe.router.calls for b in model.blocks if b.is_moe]

    assert loss_after(True) == loss_after(False)


def test_a_forced_part_count_partitions_every_moe_block_without_measuring():
    costs, comm = synthetic_costs()
    model = GPT2MoE(config(1, "position"), local_state())
    with choose.override("lancet partitions", pick="3"):
        ctl = setup(model, local_state(), _opts(), micro_batch=3, seq_length=8, costs=costs, comm=comm)
    moe_blocks = [i for i, b in enumerate(model.blocks) if b.is_moe]
    assert [(r.layer, r.k) for r in ctl.plan.ranges] == [(i, 3) for i in moe_blocks] and not ctl.plan.selection
    with choose.override("lancet partitions", pick="1"), pytest.raises(ValueError, match="integer >= 2"):
        setup(GPT2MoE(config(1, "position"), local_state()), local_state(), _opts(), micro_batch=3, seq_length=8)


def test_the_coarse_budget_is_half_the_part_budget():
    assert [coarse_budget(r) for r in (1, 2, 3, 4, 8, 9)] == [None, None, 2, 2, 4, 4]


def test_candidates_add_half_budget_plans_and_both_budgets_are_measured():
    """Partitioned modes are also planned with at most half the parts ("<mode>@k<K>"), and the
    measured candidates are the best predicted of each budget: the cost model ranks plans of one
    budget, but what a part costs beyond its ops' profile is not in it."""
    costs, _ = synthetic_costs()
    model = GPT2MoE(config(1, "position"), local_state())
    opts = _opts(lancet_max_partitions=3)
    plans = candidate_plans(model, local_state(), opts, 3, 8, costs=costs, comm=SLOW_LINK, broadcast=False)
    assert sorted(plans) == ["both", "both@k2", "dw", "none", "partition", "partition@k2"]
    for mode in ("partition", "both"):
        fine, coarse = plans[mode], plans[f"{mode}@k2"]
        assert max(r.k for r in fine.ranges) == 3 and coarse.ranges and max(r.k for r in coarse.ranges) <= 2
        assert coarse.wgrad == fine.wgrad and coarse.name == f"{mode}@k2"
    pred = lambda m: plans[m].predicted["iteration_ms"]  # noqa: E731
    full = sorted(["dw", "partition", "both"], key=pred)
    half = sorted(["partition@k2", "both@k2"], key=pred)
    simplest = ["dw", "partition@k2", "partition", "both@k2", "both"]
    assert top_candidates(plans, 1) == ["none"] + [m for m in simplest if m in (full[0], half[0])]
    assert top_candidates(plans, 2) == ["none"] + [m for m in simplest if m in (*full[:2], *half)]
    # where every budget gives the same plan (the other tests' costs pick 2 parts), nothing is timed twice
    _, same = _plans(_opts())
    assert not [n for n in same if "@" in n]


def test_a_half_budget_plan_that_measures_fastest_is_kept(tmp_path):
    model = GPT2MoE(config(1, "position"), local_state())
    opts = _opts(lancet_max_partitions=3, lancet_report=str(tmp_path / "rep.json"))
    table = {"none": 10.0, "dw": 9.6, "partition": 8.9, "both": 8.6, "partition@k2": 8.7, "both@k2": 8.1}
    ctl = _setup_with_times(model, opts, table, comm=SLOW_LINK)
    assert ctl.plan.name == "both@k2" and ctl.plan.wgrad and max(r.k for r in ctl.plan.ranges) <= 2
    got = json.loads(json.dumps(ctl.write_report(measured_iter_ms=8.2)["selection"]))
    assert got["chosen"] == "both@k2" and {"both@k2", "partition@k2"} <= set(got["candidates"])
