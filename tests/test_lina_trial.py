"""Lina's trial (`megatron_moe.distributed.lina_trial`): the decision is applied to the gradient sync."""

from types import SimpleNamespace

import pytest
import torch

from megatron_moe import choose
from megatron_moe.distributed.lina_trial import LinaTrial


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


@pytest.mark.parametrize("pick", ["plain", "lina"])
def test_the_decision_puts_lina_or_the_plain_sync_in_place_for_the_rest_of_the_run(pick):
    sync, sched, pipeline = _Sync(), _Scheduler(), []
    ps = SimpleNamespace(device=torch.device("cpu"), group=lambda name: None)
    with choose.override("lina", pick=pick):
        trial = LinaTrial(sync, sched, ps, 1, pipeline=pipeline.append)
        lines = []
        for _ in range(trial.trial.length + 2):  # the trial's passes, then two iterations after it
            trial.before_step()
            lines.append(trial.after_step())
    keep = pick == "lina"
    passes = [trial.trial.alternatives[i] == "lina" for i, _ in trial.trial.order]
    assert pipeline == [*passes, keep]  # each pass's alternative, then the pick; nothing after the decision
    assert sync.calls == [sched if on else None for on in pipeline]
    assert sched.closed is not keep
    assert lines[-3].startswith("lina: median of 1 passes, slowest rank: plain ") and f"-> {pick} (forced" in lines[-3]
    assert lines[:-3] == [None] * (trial.trial.length - 1) and lines[-2:] == [None, None]
    trial.close()  # decided: nothing changes any more
    assert len(sync.calls) == len(pipeline)
