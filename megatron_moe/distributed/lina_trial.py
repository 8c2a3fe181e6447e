"""Lina's trial: keep Lina's scheduler only where it makes steps faster than the plain gradient sync.

Lina's micro-ops are exactly the plain all-reduce's values (the curve is the same either way), but
whether they are faster depends on the model and the link: on a model whose gradient all-reduce is
heavy, or on localhost, holding micro-ops back can cost more than it saves. So after `WARMUP_ITERS`
iterations with Lina, the trial times `iters` iterations with Lina and `iters` with the plain bucketed
all-reduce (`GradSync` without a scheduler), alternating (Lina first), each step's time MAX-reduced
over the world so that every rank sees the same numbers and decides the same; Lina stays on only if
its median step is strictly lower (`keep_lina`), else GradSync goes on without it for the rest of the
run and the scheduler is closed (its threads are idle: every iteration drains it). Switching happens
only between iterations (`before_step` / `after_step`, around the trainer's step).
`force_outcome` ("faster" / "slower", --lina-trial-force-outcome) decides whatever the medians (tests).
With `--lina-pipeline-chunks` > 1 the trial covers Lina's all-to-all pipelining too: `pipeline(on)`
(the trainer's callback over the MoE layers' `set_pipeline_chunks`) turns it on for the Lina arm and off
for the plain arm, and the decision keeps both or neither, so "plain" is exactly the run without Lina.

The trial and expert packing's own trial (`moe.packing`) must not overlap: a packing decision compares
the K steps before a pack with the K after it, and a "before" window holding trial steps (half of
them run without Lina) would compare different gradient syncs. So the Lina trial runs first and
packing is first due at `packing_start` (its window starts after the trial's last step); while the
trial runs, packing is not told about the steps at all (`LinaTrial.running`).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable, Optional


from megatron_moe.distributed.collectives import max_over_group
from megatron_moe.profiling import median_below, span_ms, stamp, trial_verdict

if TYPE_CHECKING:
    from megatron_moe.distributed.grad_sync import GradSync
    from megatron_moe.distributed.lina import LinaScheduler
    from megatron_moe.parallel_state import ParallelState

WARMUP_ITERS = 2  # iterations with Lina before the trial times anything (allocations, Lina's link rate)
OUTCOMES = ("faster", "slower")  # --lina-trial-force-outcome


def keep_lina(lina_ms: list[float], plain_ms: list[float]) -> bool:
    """The trial's rule: keep Lina only when its median step time is strictly below the plain one's."""
    return median_below(lina_ms, plain_ms, "keep_lina needs step times with and without Lina")


def packing_start(first_iteration: int, trial_steps: int, window: int, pack_start: int) -> int:
    """The first iteration (counted as iterations done) at which expert packing may be considered in a run
    that starts after `first_iteration` iterations with a Lina trial of `trial_steps` iterations (0: none):
    not before `pack_start`, and late enough that the `window` iterations a packing decision compares
    (the last `window` up to and including it) all come after the trial's last one."""
    if trial_steps <= 0:
        return pack_start
    return max(pack_start, first_iteration + trial_steps + window)


def max_trial_length(iters: int, warmup: int = WARMUP_ITERS) -> int:
    """The iterations a trial of `iters` per arm takes: its warm-up, both arms, the deciding iteration included."""
    return warmup + 2 * iters


def trial_arm(step: int, warmup: int, iters: int) -> Optional[str]:
    """What the `step`-th iteration (0-based) of the run is timed with: "lina" / "plain" (alternating, Lina
    first) during the trial, None during the warm-up and after the trial."""
    k = step - warmup
    if k < 0 or k >= 2 * iters:
        return None
    return "lina" if k % 2 == 0 else "plain"


class LinaTrial:
    """The trial of one run (module docstring). The trainer calls `before_step()` before each training
    iteration and `after_step(iteration)` after its optimizer step; `after_step` returns the log line
    of the decision at the iteration that ends the trial, else None. `decision` holds it afterwards."""

    def __init__(
        self,
        grad_sync: "GradSync",
        scheduler: "LinaScheduler",
        ps: "ParallelState",
        iters: int,
        force_outcome: Optional[str] = None,
        warmup: int = WARMUP_ITERS,
        pipeline: Optional[Callable[[bool], None]] = None,
    ):
        if iters < 1:
            raise ValueError(f"--lina-trial-iters must be >= 1 for a trial, got {iters}")
        if force_outcome is not None and force_outcome not in OUTCOMES:
            raise ValueError(f"--lina-trial-force-outcome must be one of {OUTCOMES}, got {force_outcome!r}")
        self.grad_sync, self.scheduler, self.ps = grad_sync, scheduler, ps
        self.iters, self.force_outcome, self.warmup = iters, force_outcome, warmup
        self.pipeline = pipeline  # Lina's all-to-all pipelining on / off with the arm (None: not used)
        self.arms_from: Optional[int] = None  # the iteration (0-based) of the first arm, once the warm-up is over
        self.cuda = ps.device.type == "cuda"
        self.steps = 0  # iterations seen by this trial
        self.times: dict[str, list] = {"lina": [], "plain": []}  # (start, end) stamps per arm
        self._arm: Optional[str] = None  # the arm of the iteration being timed
        self._start = None
        self.decision: Optional[dict] = None
        self.done = False

    @property
    def length(self) -> int:
        """Iterations from the first one this trial sees to the one that decides, inclusive."""
        return max_trial_length(self.iters, self.warmup)

    @property
    def running(self) -> bool:
        """The next iteration belongs to the trial (its warm-up, an arm, or the deciding one)."""
        return not self.done

    def before_step(self) -> None:
        """Between iterations: put the next iteration's gradient sync in place and start its clock."""
        if self.done:
            return
        if self.arms_from is None and self.steps >= self.warmup:
            self.arms_from = self.steps  # the warm-up is over
        if self.arms_from is None:  # warm-up
            self._arm = None
            return
        self._arm = trial_arm(self.steps, self.arms_from, self.iters)
        if self._arm is not None:
            self.grad_sync.use_scheduler(self.scheduler if self._arm == "lina" else None)
            self.set_pipeline(self._arm == "lina")
            self._start = stamp(self.cuda)

    def after_step(self) -> Optional[str]:
        """After the optimizer step: record the iteration's time; at the trial's end decide (collective)."""
        if self.done:
            return None
        if self._arm is not None:
            self.times[self._arm].append((self._start, stamp(self.cuda)))
        self.steps += 1
        if self.arms_from is None:
            return None
        if self.steps < self.arms_from + 2 * self.iters:
            return None
        return self.decide()

    def set_pipeline(self, on: bool) -> None:
        """Lina's all-to-all pipelining on or off (nothing when the run does not pipeline)."""
        if self.pipeline is not None:
            self.pipeline(on)

    def max_over_world(self, values: list[float]) -> list[float]:
        """`values` reduced element-wise with MAX over the world (every rank passes as many)."""
        return max_over_group(values, self.ps.group("world"), self.ps.device, "lina trial all_reduce")

    def decide(self) -> str:
        """Compare the medians (MAX over the world), keep or drop Lina for the rest of the run; the log line."""
        n = self.iters
        both = self.max_over_world(span_ms(self.times["lina"], self.cuda) + span_ms(self.times["plain"], self.cuda))
        lina_ms, plain_ms = both[:n], both[n:]  # per step, MAX over the world
        a, b = statistics.median(lina_ms), statistics.median(plain_ms)
        keep, why = trial_verdict(keep_lina(lina_ms, plain_ms), self.force_outcome, "--lina-trial-force-outcome")
        self.set_pipeline(keep)
        if keep:
            self.grad_sync.use_scheduler(self.scheduler)
            verdict = "Lina kept"
        else:
            self.grad_sync.use_scheduler(None)
            self.scheduler.close()
            verdict = "Lina off for the rest of the run: plain bucketed gradient all-reduce"
            if self.pipeline is not None:
                verdict += ", all-to-alls not pipelined"
        line = (
            f"lina trial after iteration {self.steps}: median step {a:.1f} ms with Lina vs {b:.1f} ms without "
            f"over {n} iterations each (max over ranks), {why}: {verdict}"
        )
        self.decision = {
            "lina_ms": a,
            "plain_ms": b,
            "keep": keep,
            "line": line,
            "lina_steps_ms": lina_ms,
            "plain_steps_ms": plain_ms,
            "trial_ms_total": sum(lina_ms) + sum(plain_ms),  # the 2K timed steps (the warm-up not counted)
        }
        self.done = True
        return line

    def close(self) -> None:
        """The run ends (or stops) before the trial did: Lina back in place, so that `GradSync.remove`
        closes it as without a trial. Nothing once the trial decided."""
        if not self.done:
            self.grad_sync.use_scheduler(self.scheduler)
            self.set_pipeline(True)
            self.done = True
