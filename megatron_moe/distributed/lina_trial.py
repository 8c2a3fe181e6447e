"""Lina kept only where measured faster than the plain gradient sync: the `choose.Trial` "lina".

Lina computes exactly the plain all-reduce's values, but where the gradient all-reduce is heavy, or
on localhost, holding micro-ops back can cost more than it saves. So "plain" and "lina" take turns
over training iterations (`choose` warm-up rounds first); with --lina-pipeline-chunks > 1 the
all-to-all pipelining is on with Lina and off without, so "plain" is exactly the run without Lina.
Picking "plain" closes the scheduler for the rest of the run.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_moe import choose


class LinaTrial:
    """`before_step()` / `after_step()` around each training iteration while it has the turn; the
    iteration that decides returns the log line."""

    turn = True  # `training.take_turns`: False while another in-training trial measures

    def __init__(self, grad_sync, scheduler, ps, iters: int, pipeline: Optional[Callable[[bool], None]] = None):
        self.grad_sync, self.scheduler, self.pipeline = grad_sync, scheduler, pipeline
        self.trial = choose.Trial("lina", ("plain", "lina"), ps.group("world"), ps.device, iters)

    @property
    def decided(self) -> bool:
        return self.trial.done

    def use(self, lina: bool) -> None:
        """Lina (and its all-to-all pipelining, when the run pipelines) or the plain bucketed sync."""
        self.grad_sync.use_scheduler(self.scheduler if lina else None)
        if self.pipeline is not None:
            self.pipeline(lina)

    def before_step(self) -> None:
        if self.turn and not self.decided:
            self.use(self.trial.next() == "lina")
            self.trial.start()

    def after_step(self) -> Optional[str]:
        decision = self.trial.stop() if self.turn else None  # collective on the pass that decides
        if decision is None:
            return None
        self.use(decision.pick == "lina")
        if decision.pick == "plain":
            self.scheduler.close()
        return decision.line()

    def close(self) -> None:
        """The run ends before the decision: Lina back in place, so that `GradSync.remove` closes it."""
        if not self.decided:
            self.use(True)
