"""Pro-Prophet's runtime trial (pro_prophet.trial, moe.placement.ProProphet): after the calibration the
placement is kept only if its timed iterations were faster than those with the empty plan.

- the rule and the arms on injected timings (faster -> kept, slower -> dropped, nothing moved -> off,
  forced outcomes, a gain within --pro-prophet-trial-margin -> the simpler arm), and with the third arm "wider" (one more greedy move): the fastest arm kept, the
  wider arm no candidate when its plans were the planner's;
- two gloo ranks: the verdict comes from the step times MAX-reduced over the ranks (injected spans that
  disagree per rank give one verdict on both); the runtime alternates the planner's plan and the empty
  plan during the trial and, after it, keeps planning (kept) or runs the empty plan for good (dropped);
  with a wider planner it runs placed / wider / plain and after a "wider" verdict plans with it;
- the trainer: the curve with the trial (dropped or kept) equals the run without placement.
"""

import pytest
import torch

from equivalence import MICRO_BATCH, global_batch, tiny_config
from megatron_moe.arguments import parse_args
from megatron_moe.config import Config
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.placement import ProProphet
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.pro_prophet.calibration import Calibrator
from megatron_moe.pro_prophet.perf_model import PerfConstants, PerfModel
from megatron_moe.pro_prophet.planner import heaviest_to_all
from megatron_moe.pro_prophet.trial import PlacementTrial, fastest_arm, keep_placement
from megatron_moe.testing import spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args
from tool_modules import load_tool

E = 4


# ----------------------------------------------------------------------------- the rule, pure


def test_arms_alternate_after_the_start_placement_first():
    t = PlacementTrial(2, start=6)
    assert [t.arm(i) for i in range(5, 12)] == [None, None, "placed", "plain", "placed", "plain", None]
    assert t.end == 10


def test_settling_turns_time_only_the_last_iteration_of_each_turn():
    t = PlacementTrial(2, start=3, wider=True, settle=1)
    assert t.length == 12 and t.end == 15
    arms = [t.arm(i) for i in range(3, 17)]
    turn = ["placed", "placed", "wider", "wider", "plain", "plain"]
    assert arms == [None, *turn, *turn, None]
    assert [i for i in range(1, 17) if t.timed(i)] == [5, 7, 9, 11, 13, 15]
    for i in range(4, 16):  # a settling iteration's span is not recorded: it would carry the switch
        t.record(i, (0.0, 10.0 if t.timed(i) else 99.0), True)
    assert {arm: [b for _, b in spans] for arm, spans in t.spans.items()} == {
        "placed": [10.0, 10.0],
        "wider": [10.0, 10.0],
        "plain": [10.0, 10.0],
    }
    plain = PlacementTrial(1, start=1, settle=2)  # two arms, turns of three
    assert [plain.arm(i) for i in range(2, 9)] == ["placed"] * 3 + ["plain"] * 3 + [None]
    assert [i for i in range(1, 9) if plain.timed(i)] == [4, 7]
    t.wider_moved = True
    t.decide([10.0, 10.0], [12.0, 12.0], [9.0, 9.0])  # the wider arm kept: its timed iterations
    assert t.kept == "wider" and t.arm(7) is None and t.arm_at(7) == "wider"
    assert [i for i, k in zip(range(4, 16), t.kept_iterations(range(4, 16))) if k] == [7, 13]
    off = PlacementTrial(1, start=1, settle=1)
    with pytest.raises(ValueError, match="not decided"):
        off.kept_iterations([2])
    off.decide([2.0], [1.0])  # placement off: the empty plan's timed iterations
    assert off.kept_iterations(range(1, 7)) == [False, False, False, False, True, False]
    with pytest.raises(ValueError, match="--pro-prophet-trial-settle must be >= 0, got -1"):
        PlacementTrial(1, start=1, settle=-1)
    with pytest.raises(ValueError, match="--pro-prophet-trial-settle must be >= 0"):
        parse_args(["--pro-prophet-trial-settle", "-1"])


def _decided(placed, plain, moved=True, force=None) -> PlacementTrial:
    t = PlacementTrial(len(placed), start=1, force_outcome=force)
    for i, (a, b) in enumerate(zip(placed, plain)):
        t.record(2 + 2 * i, (0.0, a), moved)
        t.record(3 + 2 * i, (0.0, b), False)
    t.decide([1e3 * s for _, s in t.spans["placed"]], [1e3 * s for _, s in t.spans["plain"]])
    return t


def test_verdict_from_injected_timings():
    kept = _decided([1.0, 1.2, 0.9], [1.1, 1.3, 1.0])
    assert kept.keep is True and kept.decision["placed_ms"] == 1000.0 and kept.decision["plain_ms"] == 1100.0
    assert "<: placement kept" in kept.decision["line"]
    dropped = _decided([1.1, 1.3, 1.0], [1.0, 1.2, 0.9])
    assert dropped.keep is False and ">=: placement off for the rest of the run" in dropped.decision["line"]
    tie = _decided([1.0], [1.0])  # not strictly faster: dropped
    assert tie.keep is False
    still = _decided([0.5], [1.0], moved=False)  # both arms ran the same graph: nothing to keep
    assert still.keep is False and "the planner moved no expert" in still.decision["line"]
    forced = _decided([2.0], [1.0], force="faster")
    assert forced.keep is True and "forced faster (--pro-prophet-trial-force-outcome)" in forced.decision["line"]
    assert _decided([0.5], [1.0], force="slower").keep is False
    assert keep_placement([1, 3, 2], [2, 3, 3]) is True and keep_placement([2], [2]) is False


def test_three_arms_cycle_placed_wider_plain():
    t = PlacementTrial(2, start=3, wider=True)
    arms = [t.arm(i) for i in range(3, 11)]
    assert arms == [None, "placed", "wider", "plain", "placed", "wider", "plain", None]
    assert t.end == 9


def _decided3(placed, wider, plain, moved=True, wider_moved=True, force=None) -> PlacementTrial:
    """A 3-arm trial fed spans [s] in arm order, decided from them [ms]."""
    t = PlacementTrial(len(placed), start=1, force_outcome=force, wider=True)
    t.wider_moved = wider_moved
    for i, (a, w, b) in enumerate(zip(placed, wider, plain)):
        t.record(2 + 3 * i, (0.0, a), moved)
        t.record(3 + 3 * i, (0.0, w), True)
        t.record(4 + 3 * i, (0.0, b), False)
    ms = {arm: [1e3 * s for _, s in t.spans[arm]] for arm in t.arms}
    t.decide(ms["placed"], ms["plain"], ms["wider"])
    return t


def test_three_arm_verdict_from_injected_timings():
    wider = _decided3([1.1, 1.2, 1.0], [0.9, 1.0, 1.1], [1.3, 1.3, 1.3])
    assert (wider.keep, wider.kept) == (True, "wider")
    d = wider.decision
    assert (d["placed_ms"], d["wider_ms"], d["plain_ms"]) == (1100.0, 1000.0, 1300.0)
    assert d["wider_steps_ms"] == [900.0, 1000.0, 1100.0] and d["trial_ms_total"] == pytest.approx(10_200.0)
    assert d["kept"] == "wider" and "<: the wider placement kept" in d["line"]
    assert "1100.0 ms with the planner's placement, 1000.0 ms with one more expert moved, 1300.0 ms" in d["line"]
    placed = _decided3([0.9], [1.0], [1.3])
    assert (placed.keep, placed.kept) == (True, "placed") and "<: placement kept" in placed.decision["line"]
    off = _decided3([1.1], [1.0], [0.9])  # plain fastest
    assert (off.keep, off.kept) == (False, "off") and ">=: placement off" in off.decision["line"]
    assert _decided3([1.0], [1.0], [1.0]).kept == "off"  # ties keep the simpler arm
    assert _decided3([0.9], [0.9], [1.0]).kept == "placed"
    # the wider arm's plans were the planner's: not a candidate, the 2-arm rule decides
    same = _decided3([1.1], [0.5], [1.0], wider_moved=False)
    assert (same.keep, same.kept) == (False, "off") and "its plans the planner's" in same.decision["line"]
    assert _decided3([0.9], [0.5], [1.0], wider_moved=False).kept == "placed"
    # the placed arm moved nothing (the model wants no move): the wider arm is not tried either
    alone = _decided3([0.5], [0.9], [1.0], moved=False)
    assert alone.kept == "off" and "the planner moved no expert" in alone.decision["line"]
    none = _decided3([0.5], [0.5], [1.0], moved=False, wider_moved=False)
    assert none.kept == "off" and "the planner moved no expert" in none.decision["line"]
    # forced: "faster" keeps the faster placing arm by times, "slower" turns placement off
    assert _decided3([1.2], [1.1], [1.0], force="faster").kept == "wider"
    assert _decided3([1.0], [1.1], [0.5], force="faster").kept == "placed"
    assert _decided3([1.0], [0.5], [2.0], force="faster", wider_moved=False).kept == "placed"
    assert _decided3([1.0], [0.5], [2.0], force="slower").kept == "off"
    assert fastest_arm({"plain": 2.0, "wider": 1.0}) == "wider" and fastest_arm({"plain": 1.0}) == "plain"
    with pytest.raises(ValueError, match="wider_ms must be given exactly when the trial has a wider arm"):
        PlacementTrial(1, start=1, wider=True).decide([1.0], [1.0])


def _decided3m(placed, wider, plain, margin) -> PlacementTrial:
    """A 3-arm trial with a margin, decided from one timed iteration per arm [s]."""
    t = PlacementTrial(1, start=1, wider=True, margin=margin)
    t.wider_moved = True
    for i, (arm, s) in enumerate(zip(t.arms, (placed, wider, plain))):
        t.record(2 + i, (0.0, s), True)
    ms = {arm: [1e3 * s for _, s in t.spans[arm]] for arm in t.arms}
    t.decide(ms["placed"], ms["plain"], ms["wider"])
    return t


def test_a_placement_must_win_by_more_than_the_margin():
    # a measured skew-0 run: wider 1906.8, plain 1914.6 ms (0.4 % apart); strictly faster wins it...
    assert _decided3m(1.939, 1.9068, 1.9146, 0.0).kept == "wider"
    # ...within a 2 % margin the plain graph stays, and the log says why
    off = _decided3m(1.939, 1.9068, 1.9146, 0.02)
    assert (off.keep, off.kept) == (False, "off") and off.decision["margin"] == 0.02
    assert "not < by more than 2.0%: placement off" in off.decision["line"]
    # skew 1.2: the placement wins by far more than the margin
    placed = _decided3m(1.7738, 1.8419, 2.4193, 0.02)
    assert placed.kept == "placed" and "< by more than 2.0%: placement kept" in placed.decision["line"]
    # the wider arm must beat the placed one by the margin too (1 % better: the planner's plan stays)
    assert _decided3m(1.00, 0.99, 1.50, 0.02).kept == "placed"
    assert _decided3m(1.00, 0.97, 1.50, 0.02).kept == "wider"
    # ... and the plain one: placed within the margin of plain, wider beyond it
    assert _decided3m(0.99, 0.95, 1.00, 0.02).kept == "wider"
    # the two-arm rule and the pure helpers
    assert keep_placement([0.99], [1.0], margin=0.02) is False and keep_placement([0.97], [1.0], margin=0.02)
    assert fastest_arm({"plain": 1.0, "placed": 0.985}, 0.02) == "plain"
    assert fastest_arm({"plain": 1.0, "placed": 0.975}, 0.02) == "placed"
    # forced outcomes ignore the margin
    forced = PlacementTrial(1, start=1, force_outcome="faster", margin=0.5)
    forced.record(2, (0.0, 1.0), True)
    forced.record(3, (0.0, 1.0), False)
    assert forced.decide([1000.0], [1000.0]) and forced.kept == "placed"


def test_bad_trial_arguments_name_the_flag():
    with pytest.raises(ValueError, match="--pro-prophet-trial-iters must be >= 1 for a trial, got 0"):
        PlacementTrial(0, start=1)
    with pytest.raises(ValueError, match="--pro-prophet-trial-force-outcome must be one of"):
        PlacementTrial(1, start=1, force_outcome="maybe")
    with pytest.raises(ValueError, match="--pro-prophet-trial-iters must be >= 0"):
        parse_args(["--pro-prophet-trial-iters", "-1"])
    for bad in ("-0.1", "1", "1.5"):
        with pytest.raises(ValueError, match=rf"--pro-prophet-trial-margin must be in \[0, 1\), got {float(bad)}"):
            parse_args(["--pro-prophet-trial-margin", bad])
        with pytest.raises(ValueError, match="--pro-prophet-trial-margin must be in"):
            PlacementTrial(1, start=1, margin=float(bad))
    assert parse_args(["--pro-prophet-trial-margin", "0"]).opts.pro_prophet_trial_margin == 0.0
    assert Config().opts.pro_prophet_trial_margin == 0.02
    with pytest.raises(ValueError, match="--pro-prophet-trial-force-outcome needs --pro-prophet"):
        parse_args(["--pro-prophet-trial-force-outcome", "faster"])
    with pytest.raises(ValueError, match="no --pro-prophet-force-plan"):
        parse_args(
            [
                *("--num-experts", "4", "--pro-prophet", "--pro-prophet-force-plan", "0:1"),
                *("--pro-prophet-trial-force-outcome", "slower"),
            ]
        )


# ----------------------------------------------------------------------------- the runtime, two ranks


def _model(ps):
    torch.manual_seed(0)
    cfg = tiny_config(1, num_experts=E, moe_dropless=True)
    cfg.model.num_layers = 4  # two MoE layers
    return GPT2MoE(cfg, ps)


def _drive(runtime: ProProphet, model, ps, iters: int) -> tuple[list, list]:
    """`iters` forward + backward iterations under `runtime`: the experts moved in each (over the layers)
    and the trial line each iteration's end gave (None mostly)."""
    r, moved, lines = ps.rank("dp"), [], []
    for it in range(iters):
        moved.append(sum(len(runtime.placement_of(la.layer_idx).moved) for la in model.moe_layers()))
        ids, labels = global_batch(ps.size("dp"), seed=it)
        sl = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
        lm, aux = model(ids[sl], labels[sl])
        (lm + aux).backward()
        runtime.end_iteration(it + 1)
        lines.append(runtime.take_trial_line())
    return moved, lines


def _run_trial(ps, force, iters: int = 7, settle: int = 0) -> dict:
    """`iters` iterations (forward + backward) under heaviest-to-all (one expert) with a trial of 2 + 2
    timed iterations (turns of `settle` + 1) after iteration 1; the plan each iteration used, and the decision."""
    model = _model(ps)
    layers = model.moe_layers()
    runtime = ProProphet(
        layers,
        ps,
        planner=lambda c: heaviest_to_all(c, 1).replicas,
        trial_iters=2,
        trial_force_outcome=force,
        trial_settle=settle,
    )
    moved, lines = _drive(runtime, model, ps, iters)
    return {"moved": moved, "lines": lines, "decision": runtime.trial.decision}


def _run_wider(ps, force, same: bool, iters: int = 6) -> dict:
    """`iters` iterations with a trial of 1 + 1 + 1 iterations after iteration 1: the planner moves the heaviest
    expert, the wider planner the two heaviest (or, `same`, the heaviest like the planner)."""
    model = _model(ps)
    layers = model.moe_layers()
    one = lambda c: heaviest_to_all(c, 1).replicas  # noqa: E731
    two = lambda c: heaviest_to_all(c, 2).replicas  # noqa: E731
    runtime = ProProphet(
        layers,
        ps,
        planner=one,
        wider=one if same else two,
        trial_iters=1,
        trial_force_outcome=force,
    )
    moved, _ = _drive(runtime, model, ps, iters)
    return {"moved": moved, "decision": runtime.trial.decision, "in_flight": runtime.planned_in_flight}


def _injected(ps, rank: int, placed: list, plain: list) -> dict:
    """A runtime's trial fed rank-dependent spans [s] through `record`, then decided (one all-reduce)."""
    runtime = ProProphet(_model(ps).moe_layers(), ps, planner=lambda c: [()] * E, trial_iters=len(placed))
    trial = runtime.trial
    for i, (a, b) in enumerate(zip(placed[rank], plain[rank])):
        trial.record(2 + 2 * i, (0.0, a), True)
        trial.record(3 + 2 * i, (0.0, b), True)
    runtime.decide_trial()
    return trial.decision


def _injected3(ps, rank: int, spans: dict) -> dict:
    """A runtime's 3-arm trial fed rank-dependent spans [s] per arm, then decided (one all-reduce)."""
    runtime = ProProphet(
        _model(ps).moe_layers(), ps, planner=lambda c: [()] * E, wider=lambda c: [()] * E, trial_iters=2
    )
    trial = runtime.trial
    trial.wider_moved = True
    for i in range(2):
        for j, arm in enumerate(("placed", "wider", "plain")):
            trial.record(2 + 3 * i + j, (0.0, spans[arm][rank][i]), True)
    runtime.decide_trial()
    return trial.decision


def _start(ps, not_before: int) -> tuple:
    """(trial start, trial end, the calibrator's last sampled iteration) of a calibrated runtime with a
    trial of 1 + 1 iterations that must not start before iteration `not_before`."""
    calib = Calibrator(PerfModel(PerfConstants(0, 0, 1e-6, 0, 0, 1e-6), 1, 1, 1, overlap=True), skip=1, iters=2)
    runtime = ProProphet(
        _model(ps).moe_layers(),
        ps,
        planner=lambda c: [()] * E,
        calibrator=calib,
        trial_iters=1,
        trial_not_before=not_before,
    )
    return runtime.trial.start, runtime.trial.end, calib.refit_at


def _run(rank, world):
    ps = initialize_model_parallel(1, 2, 1)
    try:
        out = {force: _run_trial(ps, force) for force in ("faster", "slower")}
        out["measured"] = _run_trial(ps, None)
        out["settled"] = _run_trial(ps, "faster", iters=11, settle=1)
        # rank 0 alone would keep (median 0.1 < 0.15), rank 1 alone would drop (0.3 >= 0.25); the MAX over
        # ranks per step is placed [0.3, 0.3] vs plain [0.2, 0.4] -> medians 0.3 vs 0.3: dropped on both
        out["disagree"] = _injected(ps, rank, [[0.1, 0.1], [0.3, 0.3]], [[0.2, 0.1], [0.1, 0.4]])
        out["agree"] = _injected(ps, rank, [[0.1, 0.2], [0.2, 0.1]], [[0.3, 0.3], [0.2, 0.2]])
        out["starts"] = [_start(ps, not_before) for not_before in (0, 5)]
        out["wider"] = {force: _run_wider(ps, force, same=False) for force in ("faster", "slower")}
        out["wider_same"] = _run_wider(ps, "faster", same=True)
        # MAX per step: placed [0.3, 0.3], wider [0.2, 0.25], plain [0.4, 0.4]; rank 0 alone would keep placed
        three = {"placed": [[0.1, 0.1], [0.3, 0.3]], "wider": [[0.2, 0.2], [0.1, 0.25]], "plain": [[0.4, 0.4]] * 2}
        out["three"] = _injected3(ps, rank, three)
        return out
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def per_rank():
    return spawn(_run, 2, timeout=300)


def test_the_verdict_is_the_max_over_ranks_and_identical_on_every_rank(per_rank):
    for r in per_rank:
        assert r["disagree"]["placed_steps_ms"] == pytest.approx([300.0, 300.0])
        assert r["disagree"]["plain_steps_ms"] == pytest.approx([200.0, 400.0])
        assert r["disagree"]["keep"] is False
        assert r["agree"]["placed_steps_ms"] == pytest.approx([200.0, 200.0])
        assert r["agree"]["keep"] is True
    measured = [r["measured"]["decision"] for r in per_rank]
    assert measured[0] == measured[1]  # the same times (MAX over ranks), the same verdict
    assert measured[0]["keep"] == keep_placement(measured[0]["placed_steps_ms"], measured[0]["plain_steps_ms"])


def test_the_trial_follows_the_calibration_or_a_later_start_and_the_fit_samples_it(per_rank):
    for r in per_rank:
        # calibration iterations 1-3; the trial right after it, or after iteration 5 (Lina's trial)
        assert r["starts"] == [(3, 5, 5), (5, 7, 7)]


def test_the_runtime_alternates_then_keeps_or_drops_the_placement(per_rank):
    for r in per_rank:
        # iteration 1: no plan yet; 2, 4: placed arm (one expert per layer, two layers); 3, 5: plain arm
        assert r["faster"]["moved"] == [0, 2, 0, 2, 0, 2, 2]
        assert r["slower"]["moved"] == [0, 2, 0, 2, 0, 0, 0]
        for force in ("faster", "slower"):
            lines = r[force]["lines"]
            assert lines[:4] == [None] * 4 and lines[5:] == [None, None]
            assert "pro-prophet trial after iteration 5: median step" in lines[4]
            assert f"forced {force} (--pro-prophet-trial-force-outcome)" in lines[4]
    assert per_rank[0]["measured"]["moved"][:5] == [0, 2, 0, 2, 0]
    assert per_rank[0]["measured"]["moved"] == per_rank[1]["measured"]["moved"]


def test_the_runtime_runs_each_arm_for_its_settling_turn(per_rank):
    for r in per_rank:
        # iteration 1: no plan yet; turns of two: placed 2-3, plain 4-5, placed 6-7, plain 8-9; decided at 9
        assert r["settled"]["moved"] == [0, 2, 2, 0, 0, 2, 2, 0, 0, 2, 2]
        assert "pro-prophet trial after iteration 9: median step" in r["settled"]["lines"][8]
        d = r["settled"]["decision"]
        assert len(d["placed_steps_ms"]) == len(d["plain_steps_ms"]) == 2  # the timed iterations only


def test_the_three_arm_verdict_is_the_max_over_ranks_and_identical_on_every_rank(per_rank):
    for r in per_rank:
        assert r["three"]["placed_steps_ms"] == pytest.approx([300.0, 300.0])
        assert r["three"]["wider_steps_ms"] == pytest.approx([200.0, 250.0])
        assert r["three"]["kept"] == "wider" and r["three"]["keep"] is True
    assert per_rank[0]["three"] == per_rank[1]["three"]


def test_the_runtime_plans_with_the_wider_planner_after_a_wider_verdict(per_rank):
    for r in per_rank:
        # iteration 1: no plan; 2: placed (one expert per layer, two layers), 3: wider (two per layer),
        # 4: plain; decided at the end of 4: the wider planner's plans from then on (in flight too)
        # forced "faster" keeps the faster placing arm by its measured times: the later plans follow it
        kept = r["wider"]["faster"]
        after = {"wider": [4, 4], "placed": [2, 2]}[kept["decision"]["kept"]]
        assert kept["moved"] == [0, 2, 4, 0, *after] and kept["decision"]["wider_moved"] is True
        faster = "wider" if kept["decision"]["wider_ms"] < kept["decision"]["placed_ms"] else "placed"
        assert kept["decision"]["kept"] == faster
        assert kept["in_flight"] > 0
        off = r["wider"]["slower"]
        assert off["moved"] == [0, 2, 4, 0, 0, 0] and off["decision"]["kept"] == "off"
        # the wider planner's plans were the planner's: no candidate, forced "faster" keeps "placed"
        same = r["wider_same"]
        assert same["moved"] == [0, 2, 2, 0, 2, 2]
        assert same["decision"]["kept"] == "placed" and same["decision"]["wider_moved"] is False
    assert per_rank[0]["wider"] == per_rank[1]["wider"]


# ----------------------------------------------------------------------------- the trainer

EP2 = ("--moe-dropless", "--expert-model-parallel-size", "2")
TRIAL = (
    "--pro-prophet",
    "--pro-prophet-alpha",
    "0",
    "--pro-prophet-trial-iters",
    "1",
    "--pro-prophet-trial-settle",
    "0",
)


def _curves(rank, world, data):
    def run(*extra):
        return pretrain(parse_args(tiny_args(data, 10, *EP2, *extra)))

    return {
        "plain": run(),
        "dropped": run(*TRIAL, "--pro-prophet-trial-force-outcome", "slower"),
        "kept": run(*TRIAL, "--pro-prophet-trial-force-outcome", "faster"),
    }


def test_trainer_curve_with_the_trial_equals_the_run_without_placement(sample_data):
    per_rank = spawn(_curves, 2, sample_data, timeout=600)
    for rank, runs in enumerate(per_rank):
        plain = runs["plain"]
        for name in ("dropped", "kept"):
            assert len(runs[name]) == 10
            for i, (a, b) in enumerate(zip(plain, runs[name])):
                assert abs(a["loss"] - b["loss"]) < 1e-5, f"{name} rank {rank} iteration {i + 1}"
        # calibration 1-6, trial: 7 placed, 8 wider, 9 plain (the empty plan), decided at the end of 9
        assert runs["dropped"][8]["pro_prophet_replicas"] == 0
        assert [h["pro_prophet_replicas"] for h in runs["dropped"][9:]] == [0]
        assert all(p == {} for h in runs["dropped"][8:] for p in h["pro_prophet_plan"].values())
        assert runs["kept"][8]["pro_prophet_replicas"] == 0
    # the same plans on every rank, before and after the decision
    for name in ("dropped", "kept"):
        assert [h["pro_prophet_plan"] for h in per_rank[0][name]] == [h["pro_prophet_plan"] for h in per_rank[1][name]]


# ----------------------------------------------------------------------------- the benchmark's flags


def test_bench_trial_flags_and_column(capsys):
    bench = load_tool("bench_pro_prophet")
    a = bench.parse_args([])
    k = Config().opts.pro_prophet_trial_iters  # the trainer's default
    assert a.trial_iters == k == 5 and bench.trial_iters(a, "pro_prophet") == k
    assert a.trial_settle == Config().opts.pro_prophet_trial_settle == 1
    assert [bench.trial_iters(a, m) for m in ("none", "heaviest_to_all", "pro_prophet_plan_only")] == [0, 0, 0]
    for argv, message in (
        (["--trial-iters", "-1"], "--trial-iters must be >= 0"),
        (["--trial-settle", "-1"], "--trial-settle must be >= 0"),
        (["--trial-iters", "0", "--trial-force-outcome", "faster"], "--trial-force-outcome needs --trial-iters >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    kept = {"keep": True, "kept": "placed", "placed_ms": 1500.04, "wider_ms": 1400.0, "plain_ms": 1800.0}
    assert bench.trial_text(kept) == "placed (1500.0 / 1400.0 / 1800.0)" and bench.trial_text(None) == "-"
    assert bench.trial_text({**kept, "kept": "wider"}) == "wider (1500.0 / 1400.0 / 1800.0)"
    assert bench.trial_text({**kept, "keep": False, "kept": "off", "wider_ms": None}) == "off (1500.0 / - / 1800.0)"
