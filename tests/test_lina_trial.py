"""Lina's trial (--lina-trial-iters, `megatron_moe.distributed.lina_trial`): Lina is kept only where measured faster.

One 2-process spawn (DP2, the tiny trainer model, 10 iterations) runs the plain trainer, then --lina with the
trial forced to find Lina slower, then forced to find it faster. The trial (2 warm-up iterations with Lina, then
3 with Lina and 3 without, alternating) ends after iteration 8. Checks: the loss curves equal the plain one
within 1e-6 (Lina is exactly the plain all-reduce's values), the gradient syncs seen by the collective observer
take the expected path at every iteration (Lina's micro-ops on lina_dp / lina_expert_dp, or the plain buckets
on dp / expert_dp), Lina's scheduler drained exactly on the iterations it ran, and every rank logged the same
decision.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_moe.arguments import parse_args
from megatron_moe.distributed import observer
from megatron_moe.distributed.lina_trial import (
    WARMUP_ITERS,
    LinaTrial,
    keep_lina,
    packing_start,
    trial_arm,
)
from megatron_moe.moe.packing import PACK_EVERY, PACK_START, TRIAL_ITERS, packing_due
from megatron_moe.testing import spawn
from megatron_moe.training import Trainer
from tiny_run import tiny_args

ITERS = 10
LINA = ("--lina", "--lina-partition-mb", "0.004")


def _train(args) -> dict:
    """One trainer run: its losses, the path of every gradient sync (collapsed runs), Lina's drains, the decision."""
    log = observer.CommLog(max_events=200_000).start()
    trainer = Trainer(parse_args(args))
    try:
        hist = trainer.train()
    finally:
        trainer.stop.restore()
        log.stop()
    paths: list[str] = []
    for e in sorted(log.snapshot(), key=lambda e: e.seq):
        if e.tag in ("grad", "lina") and e.op == "all_reduce":
            path = "lina" if e.group.startswith("lina_") else "plain"
            assert (path == "lina") == (e.tag == "lina"), (e.group, e.tag)
            if not paths or paths[-1] != path:
                paths.append(path)
    lina = trainer.applied.lina
    trial = trainer.lina_trial
    return {
        "chunks": [layer.pipeline_chunks for layer in trainer.model.moe_layers()],
        "loss": [h["loss"] for h in hist],
        "paths": paths,
        "lina_iterations": None if lina is None else lina.iterations,
        "decision": None if trial is None else trial.decision,
    }


def _runs(rank, world, data):
    return {
        "plain": _train(tiny_args(data, ITERS)),
        "slower": _train(tiny_args(data, ITERS, *LINA, "--lina-trial-force-outcome", "slower")),
        "faster": _train(tiny_args(data, ITERS, *LINA, "--lina-trial-force-outcome", "faster")),
        "pipelined_slower": _train(
            tiny_args(data, ITERS, *LINA, "--lina-pipeline-chunks", "2", "--lina-trial-force-outcome", "slower")
        ),
    }


def _same_curve(plain: list, run: list, rank: int, tol: float) -> None:
    assert len(run) == len(plain) == ITERS
    for i, (a, b) in enumerate(zip(plain, run)):
        assert abs(a - b) < tol, f"rank {rank} iteration {i + 1}: {b} vs {a}"


@pytest.fixture(scope="module")
def per_rank(sample_data) -> list:
    """The results of the one 2-process spawn of this module (its docstring)."""
    return spawn(_runs, 2, sample_data, timeout=300)


def test_trial_found_slower_falls_back_to_the_plain_sync_on_the_same_curve(per_rank):
    plain = per_rank[0]["plain"]
    assert plain["paths"] == ["plain"] and plain["decision"] is None
    for rank, runs in enumerate(per_rank):
        run = runs["slower"]
        _same_curve(plain["loss"], run["loss"], rank, 1e-6)
        # iterations 1-3 Lina, 4 plain, 5 Lina, 6 plain, 7 Lina, then plain for good (8-10)
        assert run["paths"] == ["lina", "plain", "lina", "plain", "lina", "plain"], run["paths"]
        assert run["lina_iterations"] == 5  # iterations 1, 2, 3, 5, 7
        assert not run["decision"]["keep"]
        assert "forced slower (--lina-trial-force-outcome): Lina off for the rest of the run" in run["decision"]["line"]
        assert run["decision"]["lina_ms"] > 0 and run["decision"]["plain_ms"] > 0
    assert all(r["slower"]["decision"] == per_rank[0]["slower"]["decision"] for r in per_rank)


def test_trial_found_faster_keeps_lina_after_the_trial(per_rank):
    plain = per_rank[0]["plain"]
    for rank, runs in enumerate(per_rank):
        run = runs["faster"]
        _same_curve(plain["loss"], run["loss"], rank, 1e-6)
        # iterations 1-3 Lina, 4 plain, 5 Lina, 6 plain, 7 Lina, 8 plain, then Lina again (9-10)
        assert run["paths"] == ["lina", "plain", "lina", "plain", "lina", "plain", "lina"], run["paths"]
        assert run["lina_iterations"] == 7  # every iteration but 4, 6 and 8
        assert run["decision"]["keep"]
        assert run["decision"]["line"].endswith("forced faster (--lina-trial-force-outcome): Lina kept")
    assert all(r["faster"]["decision"] == per_rank[0]["faster"]["decision"] for r in per_rank)


def test_trainer_trial_found_slower_also_stops_the_pipelining(per_rank):
    plain = per_rank[0]["plain"]
    for rank, runs in enumerate(per_rank):
        run = runs["pipelined_slower"]
        _same_curve(plain["loss"], run["loss"], rank, 1e-5)
        assert run["chunks"] and all(c == 1 for c in run["chunks"]), run["chunks"]
        assert run["decision"]["line"].endswith("all-to-alls not pipelined")
    assert all(c == 1 for c in per_rank[0]["faster"]["chunks"])  # no --lina-pipeline-chunks: never pipelined


def test_keep_lina_only_when_its_median_is_strictly_lower():
    assert keep_lina([10.0, 30.0, 19.0], [20.0, 20.0, 1.0])  # medians 19 < 20
    assert not keep_lina([20.0, 20.0, 20.0], [10.0, 20.0, 30.0])  # equal: plain
    assert not keep_lina([1.0, 11.0, 11.0], [10.0, 10.0, 100.0])  # the mean would keep Lina; the median does not
    with pytest.raises(ValueError, match="keep_lina needs step times with and without Lina"):
        keep_lina([1.0], [])


def test_trial_alternates_after_the_warm_up_and_refuses_bad_flags():
    arms = [trial_arm(s, 2, 3) for s in range(10)]
    assert arms == [None, None, "lina", "plain", "lina", "plain", "lina", "plain", None, None]
    with pytest.raises(ValueError, match="--lina-trial-force-outcome needs --lina and --lina-trial-iters >= 1"):
        parse_args(["--lina-trial-force-outcome", "slower"])
    with pytest.raises(ValueError, match="--lina-trial-iters must be >= 0, got -1"):
        parse_args(["--lina", "--lina-trial-iters", "-1"])


def test_packing_window_follows_the_lina_trial():
    """The trainer's step schedule: the Lina trial (iterations first+1 .. first+length) first, then the
    K iterations a packing decision compares (due-K+1 .. due), never overlapping; the earliest such due."""
    length = WARMUP_ITERS + 2 * 3  # the default trial: 2 warm-up iterations, 3 with Lina, 3 without
    assert packing_start(0, length, TRIAL_ITERS, PACK_START) == 11  # window 9-11 after the trial's 1-8
    assert packing_start(0, 0, TRIAL_ITERS, PACK_START) == PACK_START  # no trial: iteration 10 as before
    assert packing_start(0, 2 + 2 * 1, 3, PACK_START) == PACK_START  # a short trial (1-4) leaves 8-10 free
    assert packing_start(20, length, 3, PACK_START) == 31  # resumed at 20: trial 21-28, window 29-31
    for first in (0, 5, 20):
        for trial_iters in (1, 3, 6):
            for k in (1, 3, 5):
                length = WARMUP_ITERS + 2 * trial_iters
                start = packing_start(first, length, k, PACK_START)
                trial = set(range(first + 1, first + length + 1))
                dues = [i for i in range(first + 1, first + 60) if packing_due(i, start, PACK_EVERY)]
                assert dues[0] == start >= PACK_START
                for due in dues:  # no packing window holds a step of the Lina trial
                    assert not trial & set(range(due - k + 1, due + 1)), (first, trial_iters, k, due)
                if start > PACK_START:  # and the first due is the earliest that can be
                    assert trial & set(range(start - k, start)), (first, trial_iters, k)


class _Sync:
    """GradSync's one trial-facing call, recorded."""

    def __init__(self):
        self.calls: list = []

    def use_scheduler(self, scheduler) -> None:
        self.calls.append(scheduler)


class _Scheduler:
    closed = False

    def close(self) -> None:
        self.closed = True


class _OneRankTrial(LinaTrial):
    """The trial without a process group: the MAX over one rank is the values themselves."""

    def max_over_world(self, values: list[float]) -> list[float]:
        return list(values)


@pytest.mark.parametrize("outcome", ["slower", "faster"])
def test_trial_turns_the_all_to_all_pipelining_with_its_arms(outcome):
    sync, sched, pipeline = _Sync(), _Scheduler(), []
    ps = SimpleNamespace(device=torch.device("cpu"))
    trial = _OneRankTrial(sync, sched, ps, 2, outcome, warmup=1, pipeline=pipeline.append)
    for _ in range(trial.length):
        trial.before_step()
        trial.after_step()
    keep = outcome == "faster"
    # warm-up untouched, then lina / plain / lina / plain, then the decision
    assert pipeline == [True, False, True, False, keep]
    assert sync.calls == [sched, None, sched, None, sched if keep else None]
    assert sched.closed is not keep
    assert trial.decision["line"].endswith("Lina kept" if keep else "not pipelined")
