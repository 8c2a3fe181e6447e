"""Lancet never slower: candidate plans, the measured choice (times injected, no wall-clock
assertions), the contention fit, and measurement leaving the model as it was."""

import json

import pytest
import torch

from megatron_moe.config import OptimizationsConfig
from megatron_moe.lancet.controller import choose_plan, measure_plans, setup
from megatron_moe.lancet.cost import CommCostModel
from megatron_moe.lancet.planner import (
    candidate_plans,
    coarse_budget,
    fit_contention,
    overlapped_ms,
    pick_fastest,
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


def test_candidates_cover_the_switches_and_rank_by_prediction():
    _, plans = _plans(_opts())
    assert sorted(plans) == ["both", "dw", "none", "partition"]
    assert plans["none"].ranges == [] and not plans["none"].wgrad and overlapped_ms(plans["none"]) == 0.0
    assert plans["both"].ranges and plans["both"].wgrad
    top = top_candidates(plans, 2)
    rest = sorted(["dw", "partition", "both"], key=lambda m: plans[m].predicted["iteration_ms"])
    assert top == ["none"] + rest[:2]
    _, only_dw = _plans(OptimizationsConfig(lancet_wgrad=True, lancet_group_ms=0.5))
    assert sorted(only_dw) == ["dw", "none"]
    with pytest.raises(ValueError, match="--lancet-candidates must be >= 1"):
        top_candidates(plans, 0)


def test_planner_keeps_none_when_the_predicted_best_measures_slow(tmp_path):
    opts = _opts(lancet_candidates=3, lancet_report=str(tmp_path / "rep.json"))
    model, plans = _plans(opts)
    best_predicted = min(plans, key=lambda n: plans[n].predicted["iteration_ms"])
    assert best_predicted != "none"  # the cost model alone would pick a plan
    table = {"none": 10.0, "dw": 12.0, "partition": 11.0, "both": 13.0}
    table[best_predicted] = 40.0  # forced slow
    costs, comm = synthetic_costs()
    ctl = setup(model, local_state(), opts, micro_batch=3, seq_length=8, measured=table, costs=costs, comm=comm)
    assert ctl.plan.name == "none" and ctl.plan.ranges == [] and not ctl.plan.wgrad and model.runners == {}
    rep = ctl.write_report(measured_iter_ms=10.5)
    got = json.loads((tmp_path / "rep.json").read_text())["selection"]
    assert got == json.loads(json.dumps(rep["selection"]))
    assert got["chosen"] == "none" and set(got["candidates"]) == set(table)
    assert {n: c["measured_ms"] for n, c in got["candidates"].items()} == table
    assert all(c["source"] == "given" for c in got["candidates"].values())
    assert {n: c["predicted_ms"] for n, c in got["candidates"].items()} == {
        n: p.predicted["iteration_ms"] for n, p in plans.items()
    }
    assert got["prediction_error"] == pytest.approx((plans["none"].predicted["iteration_ms"] - 10.0) / 10.0)
    assert {n: c["ratio_to_none"] for n, c in got["candidates"].items()} == {n: t / 10.0 for n, t in table.items()}


def test_planner_keeps_a_measured_faster_plan_and_ties_keep_none():
    opts = _opts(lancet_candidates=3)
    model, plans = _plans(opts)
    chosen = choose_plan(
        model, local_state(), opts, plans, 3, 8, measured={"none": 10.0, "dw": 8.0, "partition": 9.0, "both": 9.5}
    )
    assert chosen.name == "dw" and chosen.wgrad and chosen.ranges == []
    tie = choose_plan(
        model, local_state(), opts, plans, 3, 8, measured={"none": 10.0, "dw": 10.0, "partition": 10.0, "both": 10.0}
    )
    assert tie.name == "none"
    # within the default 2 % margin "none" stays; beyond it, or with the margin off, the plan wins
    near = {"none": 10.0, "dw": 9.9, "partition": 10.5, "both": 10.4}
    kept = choose_plan(model, local_state(), opts, plans, 3, 8, measured=near)
    assert opts.lancet_measure_margin == 0.02 and kept.name == "none"
    assert kept.selection["measure_margin"] == 0.02 and kept.selection["chosen"] == "none"
    strict = _opts(lancet_candidates=3, lancet_measure_margin=0.0)
    assert choose_plan(model, local_state(), strict, plans, 3, 8, measured=near).name == "dw"
    far = dict(near, dw=9.7)
    assert choose_plan(model, local_state(), opts, plans, 3, 8, measured=far).name == "dw"


def test_rounds_are_compared_pairwise_so_drifting_load_cancels():
    # load grows round by round; "both" is 10 % slower than "none" in two of three rounds, yet its
    # median (19) is below none's (20): the paired ratio keeps "none"
    rounds = {"none": [10.0, 20.0, 30.0], "both": [11.0, 19.0, 33.0], "dw": [10.5, 21.0, 31.0]}
    best, table, ratio = pick_fastest(rounds)
    assert table == {"none": 20.0, "both": 19.0, "dw": 21.0}
    assert best == "none" and ratio["both"] == pytest.approx(1.1) and ratio["dw"] == pytest.approx(1.05)
    best, _, _ = pick_fastest({"none": [10.0, 20.0, 30.0], "both": [9.0, 18.0, 33.0]})
    assert best == "both"  # 0.9, 0.9, 1.1
    with pytest.raises(ValueError, match="needs 'none'"):
        pick_fastest({"both": [1.0]})
    # a margin compares the paired ratio: 0.9 passes 5 %, not 15 %
    assert pick_fastest({"none": [10.0, 20.0, 30.0], "both": [9.0, 18.0, 33.0]}, 0.05)[0] == "both"
    assert pick_fastest({"none": [10.0, 20.0, 30.0], "both": [9.0, 18.0, 33.0]}, 0.15)[0] == "none"


def test_measuring_leaves_the_model_as_it_was():
    cfg = config(1, "random")  # the router's draws depend on its call counter
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(3))

    def loss_after(measure: bool) -> tuple:
        torch.manual_seed(7)
        model = GPT2MoE(cfg, local_state())
        opts = _opts(lancet_candidates=3, lancet_measure_iters=1)
        if measure:
            costs, comm = synthetic_costs()
            plans = candidate_plans(model, local_state(), opts, 3, 8, costs=costs, comm=comm, broadcast=False)
            times = measure_plans(model, local_state(), opts, plans, 3, 8, 1)
            assert sorted(times) == sorted(plans) and all(len(t) == 1 and t[0] > 0 for t in times.values())
            assert all(p.grad is None for p in model.parameters())
        lm, aux = model(ids[:, :-1], ids[:, 1:])
        return (lm + aux).item(), torch.rand(1).item(), [b.moe.router.calls for b in model.blocks if b.is_moe]

    assert loss_after(True) == loss_after(False)


def test_new_flags_are_validated_naming_the_flag():
    with pytest.raises(ValueError, match="--lancet-measure-iters must be >= 0, got -1"):
        OptimizationsConfig(lancet_measure_iters=-1)
    with pytest.raises(ValueError, match="--lancet-measure-warmup must be >= 0, got -1"):
        OptimizationsConfig(lancet_measure_warmup=-1)
    with pytest.raises(ValueError, match="--lancet-candidates must be >= 1, got 0"):
        OptimizationsConfig(lancet_candidates=0)
    for bad in (-0.5, 1.0):
        with pytest.raises(ValueError, match=rf"--lancet-measure-margin must be in \[0, 1\), got {bad}"):
            OptimizationsConfig(lancet_measure_margin=bad)


def test_untimed_rounds_run_before_the_timed_ones():
    """--lancet-measure-warmup untimed rounds of every candidate, then --lancet-measure-iters timed ones."""
    model = GPT2MoE(config(1, "position"), local_state())
    opts = _opts(lancet_candidates=3)
    costs, comm = synthetic_costs()
    plans = candidate_plans(model, local_state(), opts, 3, 8, costs=costs, comm=comm, broadcast=False)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        for warmup, iters in ((0, 1), (3, 2)):
            forwards.clear()
            times = measure_plans(model, local_state(), opts, plans, 3, 8, iters, warmup=warmup)
            assert all(len(t) == iters for t in times.values())
            assert len(forwards) == (warmup + iters) * len(plans)  # one EP rank: no path trial to settle
        with pytest.raises(ValueError, match="--lancet-measure-warmup must be >= 0, got -1"):
            measure_plans(model, local_state(), opts, plans, 3, 8, 1, warmup=-1)
    finally:
        hook.remove()
    assert OptimizationsConfig().lancet_measure_warmup == 4


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
    assert top_candidates(plans, 1) == ["none", full[0], half[0]]
    assert top_candidates(plans, 2) == ["none", *full[:2], *half]
    # where every budget gives the same plan (the other tests' costs pick 2 parts), nothing is timed twice
    _, same = _plans(_opts())
    assert not [n for n in same if "@" in n]


def test_a_half_budget_plan_that_measures_fastest_is_kept(tmp_path):
    costs, _ = synthetic_costs()
    model = GPT2MoE(config(1, "position"), local_state())
    opts = _opts(lancet_max_partitions=3, lancet_candidates=2, lancet_report=str(tmp_path / "rep.json"))
    table = {"none": 10.0, "dw": 9.6, "partition": 8.9, "both": 8.6, "partition@k2": 8.7, "both@k2": 8.1}
    ctl = setup(model, local_state(), opts, micro_batch=3, seq_length=8, measured=table, costs=costs, comm=SLOW_LINK)
    assert ctl.plan.name == "both@k2" and ctl.plan.wgrad and max(r.k for r in ctl.plan.ranges) <= 2
    got = json.loads(json.dumps(ctl.write_report(measured_iter_ms=8.2)["selection"]))
    assert got["chosen"] == "both@k2" and {"both@k2", "partition@k2"} <= set(got["candidates"])
    assert got["candidates"]["both@k2"]["ratio_to_none"] == pytest.approx(0.81)
