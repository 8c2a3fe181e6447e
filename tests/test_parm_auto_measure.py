"""Parm `auto` confirmed by measurement (`megatron_moe.moe.schedule_trial`, --parm-auto-measure-iters).

Two 2-process spawns (MP2, the tiny model): one measures a bare MoE layer with injected per-rank timings
where the cost model says baseline and the slowest rank's times say S2; the other runs the trainer with
auto measuring (forced to keep S2, random routing so the router's call counter matters) against the
explicit S2 schedule, and the same run stopped after 2 iterations and resumed: the losses are bitwise equal.
"""

import pytest
import torch

from equivalence import tiny_config
from megatron_moe.arguments import parse_args
from megatron_moe.moe.comm_profile import shape_of
from megatron_moe.moe.cost_model import AlphaBeta, choose_schedule, uniform_model
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.schedule_trial import auto_schedule, candidates, fit_scale, measure_schedules, pick_fastest
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn
from megatron_moe.training import pretrain
from tiny_run import tiny_args

# per rank, ms of each schedule: rank 0 alone would keep S1, the MAX over ranks (10, 9, 6) keeps S2
FAKE_MS = [{"baseline": 10.0, "s1": 5.0, "s2": 6.0}, {"baseline": 3.0, "s1": 9.0, "s2": 6.0}]


def _measure_on_rank(rank, world):
    cfg = tiny_config(2, "random", "auto")
    cfg.train.micro_batch_size = 2
    ps = initialize_model_parallel(2, 1, 1)
    try:
        layer = MoELayer(cfg, ps, seed=7, name="moe", layer_idx=1)
        # communication only: MP2 x EP1 has no baseline collective, so the model says baseline
        model_choice = choose_schedule(uniform_model(AlphaBeta(1e-3, 1e-9)), shape_of(cfg, ps))
        rng, calls = torch.get_rng_state(), layer.router.calls
        forced = measure_schedules(layer, ps, model_choice, 2, 16, 3, timings=lambda s, r: FAKE_MS[rank][s])
        out = {
            "model": model_choice.schedule,
            "forced": forced,
            "installed": layer.schedule,
            "installed_choice": layer.schedule_choice,
            "grads": [p.grad is None for p in layer.parameters()],
            "rng_same": torch.equal(rng, torch.get_rng_state()),
            "calls": (calls, layer.router.calls),
        }
        real = measure_schedules(layer, ps, model_choice, 2, 16, 2)  # real clock: the same on both ranks
        out["real"] = real
        cfg.moe.parm_auto_measure_iters = 0
        out["model_only"] = auto_schedule(cfg, ps, layer)
        return out
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def measured() -> list:
    return spawn(_measure_on_rank, 2, timeout=300)


def test_measured_s2_beats_the_models_baseline_on_every_rank(measured):
    for rank, out in enumerate(measured):
        assert out["model"] == "baseline"
        c = out["forced"]
        assert c.schedule == "s2" and out["installed"] == "s2", rank
        assert out["installed_choice"] == c
        assert c.measured == {"baseline": 10.0, "s1": 9.0, "s2": 6.0}  # the slowest rank's, per schedule
        assert c.model_pick == "baseline"
        predicted = {s: 1e3 * c.times[s] for s in c.measured}
        assert c.scale == pytest.approx(fit_scale(predicted, c.measured))
        assert "model picked baseline" in c.describe() and "measured fwd+bwd layer" in c.describe()
        assert all(out["grads"]), "the measurement left a gradient in .grad"
        assert out["rng_same"]
        assert out["calls"][0] == out["calls"][1]
    real = [out["real"] for out in measured]
    assert real[0] == real[1]  # MAX over ranks: every rank holds the same numbers and pick
    assert set(real[0].measured) == {"baseline", "s1", "s2"} and min(real[0].measured.values()) > 0
    assert real[0].schedule == pick_fastest(real[0].measured, candidates(real[0], 32, 2))
    only = [out["model_only"] for out in measured]
    assert only[0] == only[1] and only[0].measured is None and only[0].model_pick == ""


class _Sizes:
    """The parallel sizes `shape_of` reads (MP2, no EP / ESP)."""

    def size(self, kind: str) -> int:
        return 2 if kind == "mp" else 1


def test_pick_fastest_ties_go_to_the_model_ranking_and_the_scale_fits_by_least_squares():
    assert pick_fastest({"baseline": 2.0, "s1": 1.0, "s2": 1.0}, ["s2", "s1", "baseline"]) == "s2"
    assert pick_fastest({"baseline": 2.0, "s1": 1.0, "s2": 1.0}, ["s1", "s2", "baseline"]) == "s1"
    assert fit_scale({"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 6.0}) == pytest.approx(3.0)
    assert fit_scale({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 3.0}) == pytest.approx(2.0)
    assert fit_scale({"a": 0.0}, {"a": 1.0}) == 0.0
    c = choose_schedule(uniform_model(AlphaBeta(1e-3, 1e-9)), shape_of(tiny_config(2, schedule="auto"), _Sizes()))
    assert candidates(c, 33, 2) == ["baseline", "s2"]  # S1 needs the tokens split evenly over MP
    assert candidates(c, 32, 2)[0] == "baseline"


def test_force_fastest_needs_auto_and_measurement():
    with pytest.raises(ValueError, match="--parm-auto-force-fastest needs --moe-schedule auto"):
        parse_args(["--moe-schedule", "s1", "--parm-auto-force-fastest", "s2"])
    with pytest.raises(ValueError, match="--parm-auto-force-fastest needs"):
        parse_args(["--parm-auto-measure-iters", "0", "--parm-auto-force-fastest", "s2"])
    with pytest.raises(ValueError, match="--parm-auto-measure-iters must be >= 0, got -1"):
        parse_args(["--parm-auto-measure-iters", "-1"])


ITERS = 4
MP2 = ("--tensor-model-parallel-size", "2", "--moe-router-policy", "random")


def _curves(rank, world, data, ckpt):
    auto = (*MP2, "--moe-schedule", "auto", "--parm-auto-measure-iters", "2", "--parm-auto-force-fastest", "s2")
    explicit = [h["loss"] for h in pretrain(parse_args(tiny_args(data, ITERS, *MP2, "--moe-schedule", "s2")))]
    measured = [h["loss"] for h in pretrain(parse_args(tiny_args(data, ITERS, *auto)))]
    first = pretrain(parse_args(tiny_args(data, ITERS, *auto, "--save", ckpt, "--exit-interval", "2")))
    second = pretrain(parse_args(tiny_args(data, ITERS, *auto, "--load", ckpt)))
    return explicit, measured, [h["loss"] for h in first + second]


def test_measuring_keeps_the_curve_and_a_resumed_run_reproduces_it_bitwise(sample_data, tmp_path):
    for explicit, measured, resumed in spawn(_curves, 2, sample_data, str(tmp_path / "ckpt"), timeout=600):
        assert len(explicit) == ITERS
        assert measured == explicit  # bitwise: no RNG drawn, no router call counted, no gradient left
        assert resumed == explicit
