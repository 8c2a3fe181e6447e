"""Parm `auto` confirmed by measurement (`megatron_moe.moe.schedule_trial` through `megatron_moe.choose`).

Two 2-process spawns (MP2, the tiny model): one measures a bare MoE layer with injected per-rank timings
where the cost model says baseline and the slowest rank's times say S2; the other runs the trainer with
auto measuring (forced to keep S2 through `MMOE_CHOOSE`, random routing so the router's call counter
matters) against the explicit S2 schedule, and the same run stopped after 2 iterations and resumed: the
losses are bitwise equal. The mechanism's own rules are tested in test_choose.py.
"""

import pytest
import torch

from equivalence import tiny_config
from megatron_moe import choose
from megatron_moe.arguments import parse_args
from megatron_moe.moe.comm_profile import shape_of
from megatron_moe.moe.cost_model import AlphaBeta, choose_schedule, uniform_model
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.schedule_trial import auto_schedule, candidates, measure_schedules
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
        with choose.override("parm layer 1", times=lambda s, i: FAKE_MS[rank][s]):
            faked, decision = measure_schedules(layer, ps, model_choice, 2, 16, 3)
        out = {
            "model": model_choice.schedule,
            "faked": (faked, decision),
            "installed": layer.schedule,
            "installed_choice": layer.schedule_choice,
            "grads": [p.grad is None for p in layer.parameters()],
            "rng_same": torch.equal(rng, torch.get_rng_state()),
            "calls": (calls, layer.router.calls),
        }
        out["real"] = measure_schedules(layer, ps, model_choice, 2, 16, 2)[1]  # real clock: same on both ranks
        cfg.opts.measure_iters = 0
        out["model_only"] = auto_schedule(cfg, ps, layer)[1]
        return out
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def measured() -> list:
    return spawn(_measure_on_rank, 2, timeout=300)


def test_measured_s2_beats_the_models_baseline_on_every_rank(measured):
    for rank, out in enumerate(measured):
        assert out["model"] == "baseline"
        c, d = out["faked"]
        assert c.schedule == "s2" and d.pick == "s2" and out["installed"] == "s2", rank
        assert out["installed_choice"] == c
        assert d.medians == {"baseline": 10.0, "s1": 9.0, "s2": 6.0}  # the slowest rank's, per schedule
        assert d.alternatives == ("baseline", "s2", "s1")  # simplest first
        assert all(out["grads"]), "the measurement left a gradient in .grad"
        assert out["rng_same"]
        assert out["calls"][0] == out["calls"][1]
    real = [out["real"] for out in measured]
    assert real[0].medians == real[1].medians and real[0].pick == real[1].pick  # MAX over ranks
    assert set(real[0].medians) == {"baseline", "s1", "s2"} and min(real[0].medians.values()) > 0
    only = [out["model_only"] for out in measured]
    assert only[0].pick == only[1].pick == "baseline" and not only[0].timed


def test_s1_is_a_candidate_only_where_the_tokens_split_over_mp():
    assert candidates(33, 2) == ["baseline", "s2"]
    assert candidates(32, 2) == ["baseline", "s2", "s1"]


ITERS = 4
MP2 = ("--tensor-model-parallel-size", "2", "--moe-router-policy", "random")


def _curves(rank, world, data, ckpt):
    auto = (*MP2, "--moe-schedule", "auto", "--measure-iters", "2")
    explicit = [h["loss"] for h in pretrain(parse_args(tiny_args(data, ITERS, *MP2, "--moe-schedule", "s2")))]
    measured = [h["loss"] for h in pretrain(parse_args(tiny_args(data, ITERS, *auto)))]
    first = pretrain(parse_args(tiny_args(data, ITERS, *auto, "--save", ckpt, "--exit-interval", "2")))
    second = pretrain(parse_args(tiny_args(data, ITERS, *auto, "--load", ckpt)))
    return explicit, measured, [h["loss"] for h in first + second]


def test_measuring_keeps_the_curve_and_a_resumed_run_reproduces_it_bitwise(sample_data, tmp_path, monkeypatch):
    monkeypatch.setenv(choose.ENV, "parm layer 1=s2")  # the tiny model's MoE layer; spawned ranks inherit it
    for explicit, measured, resumed in spawn(_curves, 2, sample_data, str(tmp_path / "ckpt"), timeout=600):
        assert len(explicit) == ITERS
        assert measured == explicit  # bitwise: no RNG drawn, no router call counted, no gradient left
        assert resumed == explicit
