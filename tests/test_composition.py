"""Every optimization composes through the MoE layer's stages: the composition matrix through the
real trainer, and what the collective observer sees when Lina and Lancet's partitions run together.

Matrix: MP2 x EP2 (4 processes), 10 iterations of the tiny top-2 model with drops, every
--moe-schedule {baseline, s1, s2} x Lina {off, on} x Lancet {off, wgrad, partition, both}, all in
one spawn. Each combination either keeps the plain run's loss curve within 1e-4 with identical
dropped fractions, or is refused with an error naming both flags (`optimizations.UNSUPPORTED`,
listed in REFUSED below; empty today).
"""

import itertools
import os

import pytest

from megatron_moe import optimizations
from megatron_moe import choose
from megatron_moe.arguments import parse_args
from megatron_moe.distributed import observer
from megatron_moe.testing import spawn
from megatron_moe.training import Trainer
from tiny_run import tiny_args

SCHEDULES = ("baseline", "s1", "s2")
LANCET = {
    "off": [],
    "wgrad": ["--lancet-wgrad"],
    "partition": ["--lancet-partition"],
    "both": ["--lancet-wgrad", "--lancet-partition"],
}
COMBOS = list(itertools.product(SCHEDULES, (False, True), LANCET))
REFUSED: dict = {}  # (schedule, lina, lancet) -> the two flags its error names


def flags(schedule: str, lina: bool, lancet: str) -> list[str]:
    return ["--moe-schedule", schedule] + (["--lina"] if lina else []) + LANCET[lancet]


def _observed(trainer: Trainer) -> dict:
    """From Lina's log: micro-ops launched while an all-to-all was queued or in flight, and counts."""
    evs = trainer.applied.lina.log.snapshot()
    a2a = [e for e in evs if e.op == "all_to_all" and e.phase == "bwd"]
    micro = [e for e in evs if e.op == "all_reduce" and e.tag == "lina"]
    return {
        "launched_during": len(observer.launched_during(micro, a2a)),
        "n_a2a": len(a2a),
        "n_micro": len(micro),
        "n_queued": sum(e.queued is not None for e in a2a),
    }


def _matrix_on_rank(rank, world, data):
    # the planner predicts no gain for this tiny model: partition its MoE range in 2 parts anyway
    os.environ[choose.ENV] = "lancet partitions=2"
    layout = ("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2")
    out = {}
    for combo in COMBOS:
        try:
            trainer = Trainer(parse_args(tiny_args(data, 10, *layout, *flags(*combo))))
        except ValueError as e:
            out[combo] = {"refused": str(e)}
            continue
        hist = trainer.train()
        res = {"curve": [(h["loss"], h["dropped_frac"]) for h in hist], "changes": trainer.applied.changes}
        if combo[1] and combo[2] in ("partition", "both"):
            res["observed"] = _observed(trainer)
        out[combo] = res
    return out


def test_every_combination_keeps_the_curve_or_is_refused_naming_both_flags(sample_data):
    per_rank = spawn(_matrix_on_rank, 4, sample_data, timeout=1500)
    plain = per_rank[0][("baseline", False, "off")]["curve"]
    assert any(d > 0 for _, d in plain), "tokens must be dropped"
    ran = []
    for rank, results in enumerate(per_rank):
        for combo in COMBOS:
            res = results[combo]
            if combo in REFUSED:
                assert all(f in res.get("refused", "") for f in REFUSED[combo]), (combo, res)
                continue
            assert "refused" not in res, f"{combo} refused: {res.get('refused')}"
            assert len(res["curve"]) == 10
            for i, ((l0, d0), (l1, d1)) in enumerate(zip(plain, res["curve"])):
                assert abs(l1 - l0) < 1e-4, f"{combo} iteration {i + 1}: loss {l1} vs {l0}"
                assert d1 == d0, f"{combo} iteration {i + 1}: dropped {d1} vs {d0}"
            schedule, _, lancet = combo
            if lancet in ("partition", "both"):  # really partitioned, with the schedule inside
                assert any(f"with {schedule} inside" in c for c in res["changes"]), (combo, res["changes"])
            ran.append(combo)
    assert len(ran) == 4 * (len(COMBOS) - len(REFUSED))
    # the observer: with Lina and Lancet's partitions, no micro-op starts while an all-to-all of
    # this rank is queued (backward reached a combine step) or in flight
    for results in per_rank:
        for combo, res in results.items():
            if "observed" in res:
                o = res["observed"]
                assert o["n_a2a"] > 0 and o["n_micro"] > 0 and o["n_queued"] > 0, (combo, o)
                assert o["launched_during"] == 0, (combo, o)


def test_unsupported_combinations_name_both_flags():
    """The refusal path itself: an entry of UNSUPPORTED stops `apply` with both flags in the message."""
    cfg = parse_args(["--lina", "--lancet-wgrad", "--moe-schedule", "s2"])
    pairs = (("--lina", None, "--lancet-wgrad", None), ("--moe-schedule", "s1", "--lina", None))
    with pytest.raises(ValueError, match="--lina cannot be combined with --lancet-wgrad"):
        optimizations.check_combination(cfg, pairs)
    cfg.opts.lina = False
    optimizations.check_combination(cfg, pairs)  # one switch alone, another schedule: fine
    cfg.opts.lina, cfg.moe.moe_schedule = True, "s1"
    with pytest.raises(ValueError, match="--moe-schedule s1 cannot be combined with --lina"):
        optimizations.check_combination(cfg, pairs[1:])
