"""--lina-inference never slower: the scheduled MoE is checked against unscheduled inference and
falls back (megatron_moe/inference/fallback.py); the least-loaded repack of the placement."""

import logging

import pytest
import torch

from megatron_moe.config import Config
from megatron_moe.inference.engine import InferenceEngine, inference_config
from megatron_moe.inference.fallback import CheckedLina
from megatron_moe.inference.popularity import PathProfile, least_loaded, plan_placement
from megatron_moe.inference.scheduled import ScheduledMoE, gate_fingerprint
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel, local_state
from megatron_moe.testing import spawn

NEW = 5  # prefill + 4 decode steps: 5 forwards of 4 MoE layers
PROMPTS = [[5, 17, 3, 99, 42, 7], [1, 2, 8], [7, 8, 9, 10, 11, 12, 13], [64, 3], [30, 31, 32], [88, 3, 9, 1]]


def tiny_config() -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 4, 32, 4, 64
    m.seq_length = m.max_position_embeddings = 24
    m.vocab_size, m.init_method_std = 100, 0.2
    cfg.moe.num_experts, cfg.moe.moe_router_topk, cfg.moe.moe_layer_freq, cfg.train.seed = 8, 2, 1, 7
    return cfg


class ForcedTimes(CheckedLina):
    """The probe's outcome forced: this rank reports `times` (scheduled, unscheduled) seconds."""

    def __init__(self, engine, scheduled, probe_forwards, times):
        super().__init__(engine, scheduled, probe_forwards)
        self.times = times

    def probe_times(self) -> tuple[float, float]:
        return self.times


def _profiled_engine(ps):
    """A seeded random-init engine and a profile of its routing on this rank's prompts."""
    cfg = tiny_config()
    engine = InferenceEngine(GPT2MoE(inference_config(cfg, ps), ps).eval())
    profile = PathProfile(gate_fingerprint(engine), 3, 8, 2)
    engine.set_ffn_runner(ScheduledMoE(engine, None, "none", record_into=profile))
    engine.generate(PROMPTS, 1)
    return engine, profile


def _forced(rank, world, times_per_rank):
    ps = initialize_model_parallel(1, world, 1)
    try:
        engine, profile = _profiled_engine(ps)
        mine = PROMPTS[rank::world]
        engine.set_ffn_runner(None)
        plain = engine.generate(mine, NEW, keep_logits=True)
        out = {}
        for case, times in times_per_rank.items():
            sched = ScheduledMoE(engine, profile, "phase1_2")
            runner = ForcedTimes(engine, sched, 2, times[rank])
            engine.set_ffn_runner(runner)
            got = engine.generate(mine, NEW, keep_logits=True)
            out[case] = (runner.decision, runner.slowest, len(sched.call_s), got)
        return [(o.tokens, o.logits) for o in plain], {
            c: (d, s, n, [(o.tokens, o.logits) for o in g]) for c, (d, s, n, g) in out.items()
        }
    finally:
        destroy_model_parallel()


def test_forced_outcome_every_rank_takes_the_same_path_and_fallback_keeps_the_outputs():
    # rank 0 alone would keep the scheduling in both cases, rank 1 alone would fall back in "keep":
    # the decision uses the slowest rank's time of each way (all-reduce MAX), the same on both ranks
    times = {"fallback": [(1.0, 2.0), (3.0, 2.5)], "keep": [(1.0, 2.0), (1.5, 1.2)]}
    res = spawn(_forced, 2, times, timeout=300)
    expect = {"fallback": ("unscheduled", (3.0, 2.5)), "keep": ("scheduled", (1.5, 2.0))}
    for plain, cases in res:
        for case, (decision, slowest, sched_calls, got) in cases.items():
            assert (decision, slowest) == expect[case]
            # probed forwards run both ways; afterwards only the chosen one (5 forwards x 4 MoE layers)
            assert sched_calls == (2 * 4 if case == "fallback" else 5 * 4)
            assert [t for t, _ in got] == [t for t, _ in plain]
            for (_, lg), (_, ref) in zip(got, plain):
                for a, b in zip(lg, ref):
                    if case == "fallback":  # the unscheduled layer all along: the same bits
                        assert torch.equal(a, b), float((a - b).abs().max())
                    else:  # replicas run GEMMs of other row counts: fp32 round-off only
                        assert torch.allclose(a, b, atol=1e-5, rtol=0), float((a - b).abs().max())


def test_decision_is_logged_and_probe_length_is_checked(caplog):
    ps = local_state()
    engine, profile = _profiled_engine(ps)
    with pytest.raises(ValueError, match="--lina-probe-forwards must be >= 1, got 0"):
        CheckedLina(engine, ScheduledMoE(engine, profile, "phase1_2"), 0)
    runner = ForcedTimes(engine, ScheduledMoE(engine, profile, "phase1_2"), 1, (0.004, 0.003))
    engine.set_ffn_runner(runner)
    with caplog.at_level(logging.INFO, logger="megatron_moe.inference"):
        engine.generate(PROMPTS[:2], 2)
    assert runner.decision == "unscheduled"
    assert (
        "lina inference: scheduled 4.0 ms vs unscheduled 3.0 ms over 4 MoE layer calls (slowest rank): "
        "falling back to unscheduled" in caplog.text
    )


def test_least_loaded_repack_by_hand():
    items = [(0, 0.731), (1, 0.318), (2, 0.195), (3, 0.138)]
    # 0 -> bin 0; 1, 2, 3 -> bin 1 (0.318, 0.513, 0.651 all below 0.731)
    assert least_loaded(items, 2, 4) == [[0], [1, 2, 3]]
    # at most 2 per bin: 3 no longer fits bin 1 and joins bin 0
    assert least_loaded(items, 2, 2) == [[0, 3], [1, 2]]
    # first-fit-decreasing with capacity 1 needs 3 devices ({0}, {1, 2}, {3}: 2 experts at most), so all
    # are repacked: 0.9 -> device 0, 0.5 and 0.4 -> device 1 (0.9), 0.2 -> device 0 (tie: lower device)
    assert plan_placement([0.9, 0.5, 0.4, 0.2], 2, 2).hosts == [[0], [1], [1], [0]]
    # E = 8 on 4 devices: 1.7 -> 2 replicas, first-fit-decreasing packs the rest into 3 devices
    # ({1, 5}, {2, 3, 6}, {4, 7}): one device too many. Dropping a replica leaves expert 0's device at
    # 1.7; keeping both (0.85 each) and packing the 7 others least-loaded onto 2 devices gives
    # {1, 4, 7} = 1.15 and {2, 3, 5, 6} = 1.15: the busiest device is less loaded, so that
    assert plan_placement([1.7, 0.8, 0.5, 0.3, 0.25, 0.2, 0.15, 0.1], 4, 4).hosts == [
        [0, 1],
        [2],
        [3],
        [3],
        [2],
        [3],
        [3],
        [2],
    ]
