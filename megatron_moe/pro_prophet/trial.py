"""Pro-Prophet's runtime trial: keep the planner's placement only where it measured faster than none.

The performance model decides which experts to move, but a plan it predicts near break-even can
measure a loss (a 4 MB expert moved at skew 0 on the emulated cluster: 10 % slower). So, like
Lina's trial (`distributed.lina_trial`), once the calibration is over the runtime times `iters`
iterations with the planner's placement and `iters` with the empty plan, alternating (placement
first), and keeps placing only if the median placed step is strictly below the median plain one;
otherwise every later iteration runs the empty plan, which leaves the autograd graph and the
collectives exactly the plain run's (the counts still ride the count exchange).

A step's time is the span between the starts of two consecutive `ProProphet.end_iteration` calls
(a whole iteration period: forward, backward, optimizer step, whatever the caller does between
iterations, and the planning for that iteration); the spans are MAX-reduced over the world once,
at the decision, so every rank decides the same. If the planner moved no expert in any placed
iteration of the trial, both arms ran the same graph and there is nothing to keep: the verdict
is "off" (the empty plan for the rest of the run). `force_outcome` ("faster" / "slower",
--pro-prophet-trial-force-outcome) decides whatever the times (tests, fixed benchmarks).

Pure bookkeeping: the runtime (`moe.placement.ProProphet`) stamps, reduces and switches.
"""

from __future__ import annotations

import statistics
from typing import Optional

from megatron_moe.profiling import trial_verdict

OUTCOMES = ("faster", "slower")  # --pro-prophet-trial-force-outcome
FORCE_FLAG = "--pro-prophet-trial-force-outcome"
ARMS = ("placed", "plain")


def keep_placement(placed_ms: list[float], plain_ms: list[float]) -> bool:
    """The trial's rule: keep the placement only when its median step is strictly below the plain one's."""
    if not placed_ms or not plain_ms:
        raise ValueError("keep_placement needs step times with and without placement")
    return statistics.median(placed_ms) < statistics.median(plain_ms)


class PlacementTrial:
    """The trial of one run. Iterations are counted from 1 under the runtime; iterations
    `start + 1 .. start + 2 iters` are the trial's, alternating "placed" and "plain" (placed first),
    and the decision is taken at the end of iteration `start + 2 iters` (`end`)."""

    def __init__(self, iters: int, start: int, force_outcome: Optional[str] = None):
        if iters < 1:
            raise ValueError(f"--pro-prophet-trial-iters must be >= 1 for a trial, got {iters}")
        if start < 1:
            raise ValueError(f"a Pro-Prophet trial starts after iteration 1 or later (the first plans), got {start}")
        if force_outcome is not None and force_outcome not in OUTCOMES:
            raise ValueError(f"{FORCE_FLAG} must be one of {OUTCOMES}, got {force_outcome!r}")
        self.iters, self.start, self.force_outcome = iters, start, force_outcome
        self.spans: dict[str, list] = {arm: [] for arm in ARMS}  # (start, end) stamps per arm
        self.moved = False  # a placed iteration of the trial had replicas
        self.keep: Optional[bool] = None  # the verdict (None: not decided)
        self.decision: Optional[dict] = None

    @property
    def end(self) -> int:
        """The iteration whose end decides."""
        return self.start + 2 * self.iters

    @property
    def decided(self) -> bool:
        return self.keep is not None

    def arm(self, iteration: int) -> Optional[str]:
        """ "placed" / "plain" for a trial iteration (1-based), None before and after the trial."""
        k = iteration - self.start - 1
        if self.decided or not 0 <= k < 2 * self.iters:
            return None
        return ARMS[k % 2]

    def record(self, iteration: int, span, moved: bool) -> None:
        """Iteration `iteration` ran from span[0] to span[1] (stamps) with `moved` experts replicated or not."""
        arm = self.arm(iteration)
        if arm is None:
            return
        self.spans[arm].append(span)
        self.moved = self.moved or (arm == "placed" and moved)

    def decide(self, placed_ms: list[float], plain_ms: list[float]) -> str:
        """The verdict from the arms' step times [ms] (identical on every rank: MAX over the world); the log line."""
        a, b = statistics.median(placed_ms), statistics.median(plain_ms)
        if self.moved:
            measured, why = trial_verdict(keep_placement(placed_ms, plain_ms), self.force_outcome, FORCE_FLAG)
        else:
            measured, why = trial_verdict(False, self.force_outcome, FORCE_FLAG)
            why = why if self.force_outcome is not None else "the planner moved no expert"
        self.keep = measured
        verdict = "placement kept" if measured else "placement off for the rest of the run (the empty plan)"
        line = (
            f"pro-prophet trial after iteration {self.end}: median step {a:.1f} ms with the planner's placement vs "
            f"{b:.1f} ms without over {self.iters} iterations each (max over ranks), {why}: {verdict}"
        )
        self.decision = {
            "keep": measured,
            "placed_ms": a,
            "plain_ms": b,
            "placed_steps_ms": list(placed_ms),
            "plain_steps_ms": list(plain_ms),
            "trial_ms_total": sum(placed_ms) + sum(plain_ms),
            "moved": self.moved,
            "line": line,
        }
        return line
