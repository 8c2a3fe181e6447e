"""The one way the project measures and chooses between alternatives that compute the same values.

Parm's `auto` schedule, Lancet's partition plans, Lina's scheduler, Lina's expert packing and
Pro-Prophet's placement each keep an alternative only if it is measured faster on the real groups.
They all go through this module:

- **Alternatives** are named and listed simplest first (the plain run first).
- **Passes** (`passes`): `warmup` untimed rounds, then timed rounds; in round r the alternatives take
  turns starting at r (round robin, so a slow spell of a shared machine hits all alike); a turn is
  `settle` untimed passes (the first pass after a switch measured slow on the emulated cluster) and
  `turn` timed ones.
- **Clock**: CUDA events on the current stream on a GPU (`profiling.stamp`: the work, not its
  enqueue), the host clock on CPU, where gloo collectives return when complete.
- **Agreement**: every timed pass is MAX-reduced over the group (the step takes as long as its
  slowest rank), so every rank holds the same numbers and picks the same alternative.
- **Rule** (`pick`): going from the simplest, a later alternative replaces the best so far only if
  its median is below the best's by more than `MARGIN` of it. A gain within the margin keeps the
  simpler alternative: measured on the emulated cluster, arms of one graph differ by a few percent.
- **Not timed**: one alternative, or alternatives the caller knows to be the same computation.
- **Override** (tests): `override(name, pick=..., times=...)` in the process, or the environment
  variable `MMOE_CHOOSE="name=alternative,..."` for trainer processes. A forced pick still runs and
  logs the measurement; `times` replaces each timed pass (ms of (alternative, index)) before the MAX.

`measure` runs the passes itself (a layer's or the model's forward + backward before training);
`Trial` lets the trainer run them as training iterations (the alternatives then switch between
iterations). Each decision is a `Decision`, whose `line()` is the logged table.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_moe.distributed.collectives import group_size, max_over_group
from megatron_moe.profiling import span_ms, stamp

MARGIN = 0.02  # a later (less simple) alternative must be faster by more than this fraction
WARMUP = 2  # untimed rounds first: allocations, the groups' first collectives, caches
ENV = "MMOE_CHOOSE"

_forced: dict[str, str] = {}
_times: dict[str, Callable[[str, int], float]] = {}


@contextlib.contextmanager
def override(
    name: str, pick: Optional[str] = None, times: Optional[Callable[[str, int], float]] = None
) -> Iterator[None]:
    """Within the block, decision `name` keeps `pick` whatever the times, and/or its timed passes
    measure `times(alternative, index)` ms instead of the clock (tests)."""
    old = (_forced.get(name), _times.get(name))
    if pick is not None:
        _forced[name] = pick
    if times is not None:
        _times[name] = times
    try:
        yield
    finally:
        if old[0] is None:
            _forced.pop(name, None)
        else:
            _forced[name] = old[0]
        if old[1] is None:
            _times.pop(name, None)
        else:
            _times[name] = old[1]


def forced(name: str) -> Optional[str]:
    """The alternative forced for decision `name` (`override`, then `MMOE_CHOOSE`), or None."""
    if name in _forced:
        return _forced[name]
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ValueError(f"{ENV}: expected name=alternative[,name=alternative], got {item!r}")
        if key.strip() == name:
            return value.strip()
    return None


def pick(medians: dict[str, float], order: Sequence[str], margin: float = MARGIN) -> str:
    """The rule: from the simplest (first of `order`), a later alternative wins only if its median
    is below the best so far by more than the fraction `margin` of it."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"a margin must be in [0, 1), got {margin}")
    best = order[0]
    for name in order[1:]:
        if medians[name] < medians[best] * (1.0 - margin):
            best = name
    return best


def passes(n: int, iters: int, warmup: int = WARMUP, settle: int = 0, turn: int = 1) -> list[tuple[int, bool]]:
    """The order of passes over `n` alternatives: (alternative index, timed). Every alternative gets
    `iters` timed passes rounded up to whole turns."""
    if n < 1 or iters < 1 or warmup < 0 or settle < 0 or turn < 1:
        raise ValueError(
            f"passes: need n, iters, turn >= 1 and warmup, settle >= 0, got {n, iters, warmup, settle, turn}"
        )
    out = [((r + j) % n, False) for r in range(warmup) for j in range(n)]
    for r in range(-(-iters // turn)):
        for j in range(n):
            out += [((r + j) % n, False)] * settle + [((r + j) % n, True)] * turn
    return out


@dataclass
class Decision:
    """What was chosen for `name` among `alternatives` (simplest first), and why."""

    name: str
    alternatives: tuple[str, ...]
    pick: str
    reason: str  # "measured", "forced ...", or why nothing was timed
    medians: dict[str, float] = field(default_factory=dict)  # ms, the slowest rank's passes
    samples: dict[str, list[float]] = field(default_factory=dict)
    margin: float = MARGIN  # the rule's margin this decision was taken with

    @property
    def timed(self) -> bool:
        return bool(self.medians)

    def line(self) -> str:
        """One log line: the alternatives' medians and the pick."""
        if not self.timed:
            return f"{self.name}: {self.pick} ({self.reason})"
        n = len(next(iter(self.samples.values())))
        table = ", ".join(f"{a} {self.medians[a]:.2f} ms" for a in self.alternatives)
        return (
            f"{self.name}: median of {n} passes, slowest rank: {table} -> {self.pick} "
            f"({self.reason}; a less simple alternative must be faster by more than {self.margin:.0%})"
        )

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "alternatives": list(self.alternatives),
            "pick": self.pick,
            "reason": self.reason,
            "medians_ms": dict(self.medians),
            "samples_ms": {k: list(v) for k, v in self.samples.items()},
        }


def untimed(name: str, alternatives: Sequence[str], chosen: str, reason: str) -> Decision:
    """A decision taken without measuring (one alternative, identical alternatives, measuring off)."""
    want = forced(name)
    if want is not None and want not in alternatives:
        raise ValueError(f"{name}: cannot force {want!r}, the alternatives are {', '.join(alternatives)}")
    return Decision(name, tuple(alternatives), want or chosen, reason)


class Trial:
    """Measuring `alternatives` over passes the caller runs. Before each pass, `next()` names the
    alternative to put in place (None once decided); `start()` and `stop()` bracket the pass. The
    `stop()` that ends the last pass decides (collective over `group`) and returns the Decision."""

    def __init__(
        self,
        name: str,
        alternatives: Sequence[str],
        group,
        device: torch.device,
        iters: int,
        warmup: int = WARMUP,
        settle: int = 0,
        turn: int = 1,
        margin: float = MARGIN,
    ):
        if len(set(alternatives)) != len(alternatives) or len(alternatives) < 2:
            raise ValueError(f"{name}: a trial needs two or more distinct alternatives, got {list(alternatives)}")
        self.name, self.alternatives = name, tuple(alternatives)
        self.group, self.device, self.margin = group, device, margin
        self.cuda = device.type == "cuda"
        self.order = passes(len(alternatives), iters, warmup, settle, turn)
        self.spans: dict[str, list] = {a: [] for a in alternatives}
        self.index = 0
        self._start = None
        self.decision: Optional[Decision] = None
        want = forced(name)
        if want is not None and want not in self.alternatives:
            raise ValueError(f"{name}: cannot force {want!r}, the alternatives are {', '.join(self.alternatives)}")

    @property
    def done(self) -> bool:
        return self.decision is not None

    @property
    def length(self) -> int:
        """The passes the trial runs."""
        return len(self.order)

    def next(self) -> Optional[str]:
        """The alternative of the next pass; None once decided."""
        return None if self.done else self.alternatives[self.order[self.index][0]]

    def start(self) -> None:
        self._start = stamp(self.cuda)

    def stop(self) -> Optional[Decision]:
        """End the pass `start()` began; the Decision after the last pass (collective), else None."""
        if self.done:
            return None
        alt, timed = self.order[self.index]
        if timed:
            self.spans[self.alternatives[alt]].append((self._start, stamp(self.cuda)))
        self.index += 1
        return self.decide() if self.index == len(self.order) else None

    def decide(self) -> Decision:
        fake = _times.get(self.name)
        flat = []
        for a in self.alternatives:
            ms = span_ms(self.spans[a], self.cuda)
            flat += [fake(a, i) if fake is not None else v for i, v in enumerate(ms)]
        slowest = max_over_group(flat, self.group, self.device, f"{self.name}: measured times")
        samples, at = {}, 0
        for a in self.alternatives:
            samples[a] = slowest[at : at + len(self.spans[a])]
            at += len(self.spans[a])
        medians = {a: float(statistics.median(v)) for a, v in samples.items()}
        chosen, reason = pick(medians, self.alternatives, self.margin), "measured"
        want = forced(self.name)
        if want is not None:
            chosen, reason = (
                want,
                f"forced ({ENV} or choose.override), measured {pick(medians, self.alternatives, self.margin)}",
            )
        self.decision = Decision(self.name, self.alternatives, chosen, reason, medians, samples, self.margin)
        return self.decision


def measure(
    name: str,
    alternatives: dict[str, Callable[[], None]],
    group,
    device: torch.device,
    iters: int,
    warmup: int = WARMUP,
    margin: float = MARGIN,
) -> Decision:
    """Run `Trial` over `alternatives` (name -> one pass, simplest first) with a barrier before each
    pass, so every rank starts it together; collective. One alternative is not timed."""
    names = list(alternatives)
    if len(names) == 1:
        return untimed(name, names, names[0], "one alternative")
    trial = Trial(name, names, group, device, iters, warmup, margin=margin)
    sync = group_size(group) > 1  # LOCAL_GROUP: this rank alone
    decision = None
    while decision is None:
        alt = trial.next()
        assert alt is not None  # undecided: a next pass
        if sync:
            dist.barrier(group=group)
        trial.start()
        alternatives[alt]()
        decision = trial.stop()
    return decision
