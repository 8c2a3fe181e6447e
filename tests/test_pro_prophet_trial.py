"""Pro-Prophet's trial (`moe.placement.ProProphet`, the `choose.Trial` "pro-prophet"): the decision is applied
to every later plan, and the rules that are not timing rules hold.

Two gloo ranks, two MoE layers, a trial of one timed pass per alternative (turns of a settling and a timed
iteration) after iteration 1: plain 2-3, placed 4-5, wider 6-7, decided at the end of 7.
"""

import pytest
import torch

from equivalence import MICRO_BATCH, global_batch, tiny_config
from megatron_moe import choose
from megatron_moe.config import Config
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.moe.placement import TRIAL, ProProphet
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.pro_prophet.planner import heaviest_to_all
from megatron_moe.testing import spawn
from tool_modules import load_tool

E = 4
ITERS = 9


def _moves(n: int):
    return lambda c: heaviest_to_all(c, n).replicas if n else [()] * E


def _drive(ps, planner: int, wider: int) -> dict:
    """ITERS forward + backward iterations under a runtime whose planner moves the `planner` heaviest experts
    and whose wider planner the `wider` heaviest: the experts moved in each (over the layers), the decision."""
    torch.manual_seed(0)
    cfg = tiny_config(1, num_experts=E, moe_dropless=True)
    cfg.model.num_layers = 4  # two MoE layers
    model = GPT2MoE(cfg, ps)
    runtime = ProProphet(model.moe_layers(), ps, planner=_moves(planner), wider=_moves(wider), measure_iters=1)
    r, moved = ps.rank("dp"), []
    for it in range(ITERS):
        moved.append(sum(len(runtime.placement_of(la.layer_idx).moved) for la in model.moe_layers()))
        ids, labels = global_batch(ps.size("dp"), seed=it)
        sl = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
        lm, aux = model(ids[sl], labels[sl])
        (lm + aux).backward()
        runtime.end_iteration(it + 1)
    return {"moved": moved, "pick": runtime.decision.pick, "line": runtime.take_trial_line()}


def _run(rank, world):
    ps = initialize_model_parallel(1, 2, 1)
    try:
        out = {}
        for pick in ("plain", "placed", "wider"):
            with choose.override(TRIAL, pick=pick):
                out[pick] = _drive(ps, 1, 2)
        out["nothing"] = _drive(ps, 0, 2)  # the planner moves no expert: untimed plain
        fastest_wider = {"plain": 3.0, "placed": 2.0, "wider": 1.0}
        with choose.override(TRIAL, times=lambda alt, i: fastest_wider[alt]):
            out["same"] = _drive(ps, 1, 1)  # the wider plans are the planner's: no candidate
        return out
    finally:
        destroy_model_parallel()


def test_the_pick_is_applied_to_every_later_iteration_and_the_untimed_rules_hold():
    per_rank = spawn(_run, 2, timeout=300)
    trial = [0, 0, 0, 2, 2, 4, 4]  # iteration 1: no plan yet; then plain, placed, wider (two layers)
    for r in per_rank:
        assert r["plain"]["moved"] == [*trial, 0, 0]
        assert r["placed"]["moved"] == [*trial, 2, 2]
        assert r["wider"]["moved"] == [*trial, 4, 4]
        assert "-> wider (forced" in r["wider"]["line"]
        assert r["nothing"]["moved"] == [0, 0, 0, 0, 0, 4, 4, 0, 0] and r["nothing"]["pick"] == "plain"
        assert r["nothing"]["line"] == "pro-prophet: plain (the planner moved no expert in a placed iteration)"
        assert r["same"]["moved"] == [0, 0, 0, 2, 2, 2, 2, 2, 2] and r["same"]["pick"] == "placed"
        assert "the wider plans were the planner's" in r["same"]["line"]
    assert per_rank[0] == per_rank[1]  # the same decisions on both ranks


def test_bench_trial_flag_and_column():
    bench = load_tool("bench_pro_prophet")
    a = bench.parse_args([])
    assert a.trial_iters == Config().opts.measure_iters and bench.trial_iters(a, "pro_prophet") == a.trial_iters
    assert [bench.trial_iters(a, m) for m in ("none", "heaviest_to_all", "pro_prophet_plan_only")] == [0, 0, 0]
    with pytest.raises(SystemExit):
        bench.parse_args(["--trial-iters", "-1"])
    medians = {"plain_ms": 1800.0, "placed_ms": 1500.04, "wider_ms": 1400.0}
    assert bench.trial_text({"pick": "placed", **medians}) == "placed (1500.0 / 1400.0 / 1800.0)"
    assert bench.trial_text({"pick": "plain", **medians, "wider_ms": None}) == "plain (1500.0 / - / 1800.0)"
    assert bench.trial_text(None) == "-"
