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

With a "wider" arm (`PlacementTrial(wider=True)`: the runtime has a second planner, Algorithm 1
keeping one more move of its greedy order, `planner.plan(extra=1)`), the arms alternate placed /
wider / plain, K iterations each, and the verdict keeps the arm with the lowest median step: plain
-> the empty plan for the rest of the run; placed -> the planner; wider -> the wider planner for
every later plan. A later arm must be strictly faster than an earlier one (plain, placed, wider) to
win a tie. The wider arm is a candidate only if, on the counts it planned from, it moved more experts
than the planner would have (`wider_moved`, set by the runtime), and only when the placed arm itself
moved experts: where the model finds no move worth its cost (skew 0), one move more is not tried on
the trial's few noisy steps (measured: a plain arm timed 20 % slow let a 1-expert move win, which then
ran 10 % slower than no placement); else the rule is placed vs plain as without it. Forced "faster" keeps the faster of the placed
and wider candidates; forced "slower" turns placement off.

Margin (`margin`, --pro-prophet-trial-margin, default 0.02 in the trainer): a placing arm must beat the
plain arm's median by more than this fraction of it, and the wider arm the placed one's likewise; a
gain within the margin keeps the simpler arm. Measured (emulated cluster, 2 nodes x 1 process, skew 0):
with the strict rule the wider arm won by 0.4 % (1906.8 against 1914.6 ms), moved 18 MB per
iteration, and its row then measured 13 % slower than no placement; trial arms of the same graph
differ by a few percent on this emulator.

Settling (`settle` S, --pro-prophet-trial-settle, default 1): each turn of an arm runs S unmeasured
iterations before its timed one, so no arm is timed on the iteration right after a switch. Measured
on the emulated cluster (2 nodes x 1 process, skew 1.2): the first plain iteration after a placed one
took 10-40 % longer than a plain iteration after a plain one (the busy rank's expert compute 1.3-1.6 s
against 0.8 s; more user and system time: memory the placed iterations had not used is touched again),
so alternating single iterations timed the plain arm slow and favoured placing. With S = 1 a turn
is two iterations and the trial `len(arms) * iters * (S + 1)`.

Pure bookkeeping: the runtime (`moe.placement.ProProphet`) stamps, reduces and switches.
"""

from __future__ import annotations

import statistics
from typing import Optional

from megatron_moe.profiling import below, median_below, trial_verdict

OUTCOMES = ("faster", "slower")  # --pro-prophet-trial-force-outcome
FORCE_FLAG = "--pro-prophet-trial-force-outcome"
ARMS = ("placed", "plain")
WIDER_ARMS = ("placed", "wider", "plain")


def keep_placement(placed_ms: list[float], plain_ms: list[float], margin: float = 0.0) -> bool:
    """The trial's rule: keep the placement only when its median step is below the plain one's by more
    than the fraction `margin` (0: strictly below)."""
    return median_below(placed_ms, plain_ms, "keep_placement needs step times with and without placement", margin)


def fastest_arm(medians: dict[str, float], margin: float = 0.0) -> str:
    """The candidate arm with the lowest median step; in the order plain, placed, wider, a later arm
    must be faster than the best so far by more than the fraction `margin` to win (a tie, or a gain
    within the margin, keeps the earlier, simpler one). `medians`: the candidates."""
    best = "plain"
    for arm in ("placed", "wider"):
        if arm in medians and below(medians[arm], medians[best], margin):
            best = arm
    return best


class PlacementTrial:
    """The trial of one run. Iterations are counted from 1 under the runtime; iterations
    `start + 1 .. start + length` are the trial's, cycling through `arms` ("placed", ["wider",] "plain")
    in turns of `settle` + 1 iterations (the last of a turn timed), and the decision is taken at the end
    of the last one (`end`)."""

    def __init__(
        self,
        iters: int,
        start: int,
        force_outcome: Optional[str] = None,
        wider: bool = False,
        settle: int = 0,
        margin: float = 0.0,
    ):
        if iters < 1:
            raise ValueError(f"--pro-prophet-trial-iters must be >= 1 for a trial, got {iters}")
        if settle < 0:
            raise ValueError(f"--pro-prophet-trial-settle must be >= 0, got {settle}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"--pro-prophet-trial-margin must be in [0, 1), got {margin}")
        if start < 1:
            raise ValueError(f"a Pro-Prophet trial starts after iteration 1 or later (the first plans), got {start}")
        if force_outcome is not None and force_outcome not in OUTCOMES:
            raise ValueError(f"{FORCE_FLAG} must be one of {OUTCOMES}, got {force_outcome!r}")
        self.iters, self.start, self.force_outcome, self.settle = iters, start, force_outcome, settle
        self.margin = margin
        self.arms = WIDER_ARMS if wider else ARMS
        self.spans: dict[str, list] = {arm: [] for arm in self.arms}  # (start, end) stamps per arm
        self.moved = False  # a placed iteration of the trial had replicas
        self.wider_moved = False  # the wider arm moved more experts than the planner would have (runtime)
        self.keep: Optional[bool] = None  # the verdict (None: not decided)
        self.kept: Optional[str] = None  # "placed" / "wider" / "off" (None: not decided)
        self.decision: Optional[dict] = None

    @property
    def length(self) -> int:
        """The trial's iterations: every arm `iters` turns of `settle` + 1 iterations."""
        return len(self.arms) * self.iters * (self.settle + 1)

    @property
    def end(self) -> int:
        """The iteration whose end decides."""
        return self.start + self.length

    @property
    def decided(self) -> bool:
        return self.keep is not None

    def arm(self, iteration: int) -> Optional[str]:
        """ "placed" / "wider" / "plain" for a trial iteration (1-based), None before and after the trial."""
        return None if self.decided else self.arm_at(iteration)

    def arm_at(self, iteration: int) -> Optional[str]:
        """The arm iteration `iteration` ran or runs in the trial's schedule (also once decided), None outside it."""
        k = iteration - self.start - 1
        if not 0 <= k < self.length:
            return None
        return self.arms[(k // (self.settle + 1)) % len(self.arms)]

    def timed(self, iteration: int) -> bool:
        """Whether trial iteration `iteration` is its arm's timed one (the last of its turn), not a settling one."""
        return self.arm_at(iteration) is not None and (iteration - self.start - 1) % (self.settle + 1) == self.settle

    def kept_iterations(self, iterations) -> list[bool]:
        """For each of `iterations`: whether it was a timed iteration of the arm the verdict kept (the empty
        plan's arm "plain" when placement went off). Decided trials only."""
        if self.kept is None:
            raise ValueError("PlacementTrial.kept_iterations: the trial is not decided")
        arm = "plain" if self.kept == "off" else self.kept
        return [self.arm_at(i) == arm and self.timed(i) for i in iterations]

    def record(self, iteration: int, span, moved: bool) -> None:
        """Iteration `iteration` ran from span[0] to span[1] (stamps) with `moved` experts replicated or not
        (kept when it is an arm's timed iteration)."""
        arm = self.arm(iteration)
        if arm is None or not self.timed(iteration):
            return
        self.spans[arm].append(span)
        self.moved = self.moved or (arm == "placed" and moved)

    def decide(self, placed_ms: list[float], plain_ms: list[float], wider_ms: Optional[list[float]] = None) -> str:
        """The verdict from the arms' step times [ms] (identical on every rank: MAX over the world); the log line.
        `wider_ms`: the wider arm's (a trial with that arm only)."""
        if (wider_ms is not None) != ("wider" in self.arms):
            raise ValueError("PlacementTrial.decide: wider_ms must be given exactly when the trial has a wider arm")
        medians = {"placed": statistics.median(placed_ms), "plain": statistics.median(plain_ms)}
        if wider_ms is not None:
            medians["wider"] = statistics.median(wider_ms)
        candidates = {"plain": medians["plain"]}
        if self.moved:
            candidates["placed"] = medians["placed"]
        if self.wider_moved and self.moved:  # one more move than a plan the model wanted at all
            candidates["wider"] = medians["wider"]
        fastest = fastest_arm(candidates, self.margin)
        if len(candidates) > 1:
            measured, why = trial_verdict(fastest != "plain", self.force_outcome, FORCE_FLAG)
            if self.margin and self.force_outcome is None:
                why = f"{'<' if measured else 'not <'} by more than {self.margin:.1%}"
        else:
            measured, why = trial_verdict(False, self.force_outcome, FORCE_FLAG)
            why = why if self.force_outcome is not None else "the planner moved no expert"
        if measured:  # kept: the faster placing candidate (forced "faster" with none: the planner's)
            placing = {a: t for a, t in candidates.items() if a != "plain"}
            kept = fastest_arm({"plain": float("inf"), **placing}, self.margin) if placing else "placed"
        else:
            kept = "off"
        self.keep, self.kept = measured, kept
        verdict = {
            "placed": "placement kept",
            "wider": "the wider placement kept (one more expert moved than the model's best)",
            "off": "placement off for the rest of the run (the empty plan)",
        }[kept]
        if wider_ms is None:
            times = (
                f"median step {medians['placed']:.1f} ms with the planner's placement vs "
                f"{medians['plain']:.1f} ms without over {self.iters} iterations each (max over ranks)"
            )
        else:
            note = "" if self.wider_moved else ", its plans the planner's"
            times = (
                f"median step {medians['placed']:.1f} ms with the planner's placement, {medians['wider']:.1f} ms with "
                f"one more expert moved{note}, {medians['plain']:.1f} ms without over {self.iters} iterations each "
                f"(max over ranks)"
            )
        line = f"pro-prophet trial after iteration {self.end}: {times}, {why}: {verdict}"
        self.decision = {
            "keep": measured,
            "kept": kept,
            "placed_ms": medians["placed"],
            "wider_ms": medians.get("wider"),
            "plain_ms": medians["plain"],
            "placed_steps_ms": list(placed_ms),
            "wider_steps_ms": None if wider_ms is None else list(wider_ms),
            "plain_steps_ms": list(plain_ms),
            "trial_ms_total": sum(placed_ms) + sum(plain_ms) + (sum(wider_ms) if wider_ms is not None else 0.0),
            "moved": self.moved,
            "wider_moved": self.wider_moved,
            "margin": self.margin,
            "line": line,
        }
        return line
