"""The one measure-and-choose mechanism (`megatron_moe/choose.py`): the rule, the order of passes,
the clock, the override, and the agreement of every rank on one pick.

No test asserts on a real measured time: the times come from `choose.override(times=...)` or from a
fake CUDA clock, so the outcome does not depend on the load of the machine.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from megatron_moe import choose
from megatron_moe.choose import MARGIN, WARMUP, Decision, Trial, forced, measure, override, passes, pick
from megatron_moe.distributed.collectives import LOCAL_GROUP
from megatron_moe.testing import spawn

CPU = torch.device("cpu")


def _table(times: dict[str, list[float]]):
    """An `override(times=...)` callable: the i-th timed pass of `alt` takes times[alt][i] ms."""
    return lambda alt, i: times[alt][i]


def _recorder(names, log: list[str]) -> dict:
    """Alternatives whose one pass appends their name to `log` (in the order of the dict)."""
    return {n: (lambda n=n: log.append(n)) for n in names}


# ----------------------------------------------------------------------------- pick


def test_pick_keeps_the_simplest_on_a_tie_or_a_gain_within_the_margin():
    """The first alternative wins ties and gains of at most MARGIN; a later one must be faster by more."""
    assert MARGIN == 0.02
    assert pick({"a": 10.0, "b": 10.0}, ["a", "b"]) == "a"
    assert pick({"a": 10.0, "b": 9.9}, ["a", "b"]) == "a"  # 1 % faster: within the margin
    assert pick({"a": 10.0, "b": 9.7}, ["a", "b"]) == "b"  # 3 % faster
    assert pick({"a": 10.0, "b": 11.0}, ["a", "b"]) == "a"
    # the order decides which one is the simplest, not the dict's order
    assert pick({"a": 10.0, "b": 9.9}, ["b", "a"]) == "b"
    assert pick({"a": 9.7, "b": 10.0}, ["b", "a"]) == "a"


def test_pick_margin_boundary_is_strict_and_zero_margin_takes_any_gain():
    """A later alternative exactly at best * (1 - margin) does not win; with margin 0 any gain wins."""
    assert pick({"a": 10.0, "b": 5.0}, ["a", "b"], margin=0.5) == "a"
    assert pick({"a": 10.0, "b": 4.999}, ["a", "b"], margin=0.5) == "b"
    assert pick({"a": 10.0, "b": 9.999}, ["a", "b"], margin=0.0) == "b"
    assert pick({"a": 10.0, "b": 10.0}, ["a", "b"], margin=0.0) == "a"


def test_pick_chain_compares_against_the_best_so_far():
    """With three alternatives each later one is compared with the best so far (not the first, not
    the previous)."""
    # b beats a by 10 %; c beats a by 11 % but b only by 1.1 %: b stays
    assert pick({"a": 10.0, "b": 9.0, "c": 8.9}, ["a", "b", "c"]) == "b"
    # b is within the margin of a (a stays best); c beats a by 2.5 % (b by only 1.5 %): c wins
    assert pick({"a": 10.0, "b": 9.9, "c": 9.75}, ["a", "b", "c"]) == "c"
    # c beats b by a lot but a stays best and c is within the margin of a
    assert pick({"a": 10.0, "b": 20.0, "c": 9.9}, ["a", "b", "c"]) == "a"
    assert pick({"a": 10.0, "b": 20.0, "c": 9.0}, ["a", "b", "c"]) == "c"


@pytest.mark.parametrize("margin", [-0.01, 1.0, 1.5])
def test_pick_margin_outside_zero_one_raises(margin):
    """A margin must be in [0, 1)."""
    with pytest.raises(ValueError, match="margin"):
        pick({"a": 1.0, "b": 0.1}, ["a", "b"], margin=margin)


# ----------------------------------------------------------------------------- passes


def test_passes_order_warmup_round_robin_settle_and_turns():
    """Warm-up rounds are untimed; round r starts at alternative r; each turn is `settle` untimed then
    `turn` timed passes; iters is rounded up to whole turns."""
    F, T = False, True
    assert passes(2, 3, warmup=1, settle=1, turn=2) == [
        (0, F), (1, F),  # warm-up round 0
        (0, F), (0, T), (0, T), (1, F), (1, T), (1, T),  # timed round 0 starts at 0
        (1, F), (1, T), (1, T), (0, F), (0, T), (0, T),  # timed round 1 starts at 1
    ]  # fmt: skip
    assert passes(3, 2, warmup=2) == [
        (0, F), (1, F), (2, F),  # warm-up round 0
        (1, F), (2, F), (0, F),  # warm-up round 1 starts at 1
        (0, T), (1, T), (2, T),
        (1, T), (2, T), (0, T),
    ]  # fmt: skip
    assert passes(1, 2, warmup=0) == [(0, T), (0, T)]
    assert WARMUP == 2 and passes(2, 1)[: 2 * WARMUP] == [(0, F), (1, F), (1, F), (0, F)]


@pytest.mark.parametrize(
    "n, iters, warmup, settle, turn", [(2, 5, 2, 0, 1), (3, 4, 1, 2, 3), (4, 7, 0, 1, 2), (2, 1, 3, 0, 4)]
)
def test_passes_every_alternative_gets_at_least_iters_timed_passes(n, iters, warmup, settle, turn):
    """Each alternative gets ceil(iters / turn) * turn timed passes, after warmup * n untimed ones,
    and each turn's timed passes follow `settle` untimed passes of the same alternative."""
    order = passes(n, iters, warmup, settle, turn)
    whole = -(-iters // turn) * turn
    assert whole >= iters
    for alt in range(n):
        assert sum(1 for a, timed in order if a == alt and timed) == whole
        assert sum(1 for a, timed in order if a == alt and not timed) == warmup + settle * whole // turn
    assert not any(timed for _, timed in order[: warmup * n])
    assert len(order) == n * (warmup + (settle + turn) * whole // turn)
    rest = order[warmup * n :]
    for k in range(0, len(rest), settle + turn):
        block = rest[k : k + settle + turn]
        assert len({a for a, _ in block}) == 1
        assert [timed for _, timed in block] == [False] * settle + [True] * turn


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=0, iters=1),
        dict(n=2, iters=0),
        dict(n=2, iters=1, warmup=-1),
        dict(n=2, iters=1, settle=-1),
        dict(n=2, iters=1, turn=0),
    ],
)
def test_passes_bad_arguments_raise(kwargs):
    """n, iters, turn >= 1 and warmup, settle >= 0."""
    with pytest.raises(ValueError, match="passes"):
        passes(**kwargs)


# ----------------------------------------------------------------------------- measure


def test_measure_runs_round_robin_after_warmup_and_picks_by_the_rule_on_the_given_times():
    """`measure` runs every pass (warm-up included) in the order of `passes`; the medians are those of
    the timed passes; the pick follows the margin rule; `line()` names every alternative and the pick."""
    log: list[str] = []
    times = {"a": [10.0, 30.0, 10.0], "b": [9.9, 9.9, 40.0], "c": [9.5, 1.0, 9.5]}
    with override("t.measure", times=_table(times)):
        d = measure("t.measure", _recorder("abc", log), None, CPU, iters=3, warmup=2)
    # warm-up: rounds starting at a and b; timed: rounds starting at a, b, c
    assert log == list("abcbcaabcbcacab")
    assert isinstance(d, Decision) and d.timed
    assert d.alternatives == ("a", "b", "c")
    assert d.samples == times
    assert d.medians == {a: statistics.median(v) for a, v in times.items()} == {"a": 10.0, "b": 9.9, "c": 9.5}
    # b is within 2 % of a (a stays); c is 5 % below a: c
    assert d.pick == "c" and d.reason == "measured"
    line = d.line()
    assert line.startswith("t.measure: median of 3 passes")
    for part in ("a 10.00 ms", "b 9.90 ms", "c 9.50 ms", "-> c", "measured"):
        assert part in line, (part, line)
    assert d.as_dict()["medians_ms"] == d.medians and d.as_dict()["pick"] == "c"


def test_measure_keeps_the_simplest_when_the_gain_is_within_the_margin():
    """A later alternative only 1 % faster is not taken; the same with margin 0 is."""
    times = {"plain": [10.0] * 2, "fancy": [9.9] * 2}
    with override("t.margin", times=_table(times)):
        assert measure("t.margin", _recorder(times, []), None, CPU, iters=2).pick == "plain"
        assert measure("t.margin", _recorder(times, []), None, CPU, iters=2, margin=0.0).pick == "fancy"


def test_measure_one_alternative_is_not_timed_and_not_run():
    """One alternative: an untimed Decision, its callable never runs."""
    log: list[str] = []
    d = measure("t.one", _recorder(["only"], log), None, CPU, iters=5)
    assert log == []
    assert d.pick == "only" and not d.timed and d.medians == {} and d.samples == {}
    assert d.reason == "one alternative"
    assert d.line() == "t.one: only (one alternative)"


def test_untimed_takes_the_forced_alternative():
    """A decision taken without measuring still follows the override."""
    d = choose.untimed("t.untimed", ["a", "b"], "a", "measuring off")
    assert (d.pick, d.timed, d.line()) == ("a", False, "t.untimed: a (measuring off)")
    with override("t.untimed", pick="b"):
        assert choose.untimed("t.untimed", ["a", "b"], "a", "measuring off").pick == "b"


# ----------------------------------------------------------------------------- override


def test_override_pick_forces_and_still_reports_the_measured_pick():
    """A forced pick wins whatever the times; the reason says forced and names the measured pick (by
    the trial's own margin); the medians are still measured."""
    times = {"a": [10.0] * 3, "b": [9.9] * 3, "c": [5.0] * 3}
    log: list[str] = []
    with override("t.force", pick="a", times=_table(times)):
        assert forced("t.force") == "a"
        d = measure("t.force", _recorder("abc", log), None, CPU, iters=3)
        d0 = measure("t.force", _recorder("ab", []), None, CPU, iters=3, margin=0.0)
    assert len(log) == 3 * (WARMUP + 3)  # a forced decision still runs every pass
    assert d.pick == "a" and d.reason.startswith("forced") and "measured c" in d.reason
    assert d.medians == {"a": 10.0, "b": 9.9, "c": 5.0}
    assert "-> a" in d.line()
    # measured with margin 0, b (1 % faster) would have been picked
    assert d0.pick == "a" and "measured b" in d0.reason, d0.reason


def test_override_is_undone_after_the_block_and_nests():
    """Leaving `override` restores what was there before (nothing, or the outer override)."""
    assert forced("t.undo") is None
    with override("t.undo", pick="b"):
        with override("t.undo", pick="c", times=lambda a, i: 1.0):
            assert forced("t.undo") == "c"
            assert "t.undo" in choose._times
        assert forced("t.undo") == "b"
        assert "t.undo" not in choose._times
    assert forced("t.undo") is None
    assert "t.undo" not in choose._forced and "t.undo" not in choose._times
    # undone also when the block raises
    with pytest.raises(RuntimeError):
        with override("t.undo", pick="b"):
            raise RuntimeError
    assert forced("t.undo") is None and "t.undo" not in choose._times


def test_env_forces_a_pick(monkeypatch):
    """MMOE_CHOOSE="name=alternative,..." forces the named decisions; the in-process override wins."""
    monkeypatch.setenv("MMOE_CHOOSE", "t.other=x, t.env = b ")
    assert forced("t.env") == "b" and forced("t.other") == "x" and forced("t.none") is None
    times = {"a": [1.0] * 2, "b": [9.0] * 2}
    with override("t.env", times=_table(times)):
        d = measure("t.env", _recorder("ab", []), None, CPU, iters=2)
    assert d.pick == "b" and d.reason.startswith("forced") and "measured a" in d.reason
    with override("t.env", pick="a"):
        assert forced("t.env") == "a"


@pytest.mark.parametrize("value", ["t.bad", "t.bad=", "t.x=y,,t.bad"])
def test_env_malformed_raises(monkeypatch, value):
    """An item without `=` or without an alternative is an error (empty items are skipped)."""
    monkeypatch.setenv("MMOE_CHOOSE", value)
    with pytest.raises(ValueError, match="MMOE_CHOOSE"):
        forced("t.bad")
    with pytest.raises(ValueError, match="MMOE_CHOOSE"):
        measure("t.bad", _recorder("ab", []), None, CPU, iters=1)


def test_forcing_an_alternative_that_does_not_exist_raises(monkeypatch):
    """A forced pick must be one of the alternatives (override or environment, timed or not)."""
    with override("t.missing", pick="z"):
        with pytest.raises(ValueError, match="cannot force 'z'"):
            measure("t.missing", _recorder("ab", []), None, CPU, iters=1)
        with pytest.raises(ValueError, match="cannot force 'z'"):
            Trial("t.missing", ["a", "b"], None, CPU, iters=1)
        with pytest.raises(ValueError, match="cannot force 'z'"):
            measure("t.missing", _recorder("a", []), None, CPU, iters=1)
    monkeypatch.setenv("MMOE_CHOOSE", "t.missing=z")
    with pytest.raises(ValueError, match="cannot force 'z'"):
        measure("t.missing", _recorder("ab", []), None, CPU, iters=1)


# ----------------------------------------------------------------------------- ranks agree

# The i-th timed pass of each alternative, per rank. Alone, rank 0 picks a (b's median 12 > a's 10)
# and rank 1 picks b (5 < 10). The pass-by-pass MAX is a [40, 10, 40], b [12, 12, 12]: b. (The MAX
# of the medians, a 10 and b 12, would pick a.)
RANK_TIMES = [
    {"a": [10.0, 10.0, 40.0], "b": [12.0, 12.0, 12.0]},
    {"a": [40.0, 10.0, 10.0], "b": [5.0, 5.0, 5.0]},
]


def _agree(rank, world_size):
    times = RANK_TIMES[rank]
    log: list[str] = []
    with override("t.ranks", times=_table(times)):
        alone = measure("t.ranks", _recorder("ab", log), LOCAL_GROUP, CPU, iters=3)
        together = measure("t.ranks", _recorder("ab", []), dist.group.WORLD, CPU, iters=3)
    return alone.as_dict(), together.as_dict(), log


def test_ranks_agree_on_the_max_of_each_pass_and_on_the_pick():
    """Over a group, every timed pass is MAX-reduced: both ranks hold the element-wise MAX of their
    times and take the same pick, though each alone would pick differently (over LOCAL_GROUP)."""
    (alone0, together0, log0), (alone1, together1, log1) = spawn(_agree, 2, timeout=120)
    assert alone0["pick"] == "a" and alone1["pick"] == "b"
    assert alone0["samples_ms"] == RANK_TIMES[0] and alone1["samples_ms"] == RANK_TIMES[1]
    slowest = {a: [max(x, y) for x, y in zip(RANK_TIMES[0][a], RANK_TIMES[1][a])] for a in "ab"}
    assert slowest == {"a": [40.0, 10.0, 40.0], "b": [12.0, 12.0, 12.0]}
    for d in (together0, together1):
        assert d["samples_ms"] == slowest
        assert d["medians_ms"] == {"a": 40.0, "b": 12.0}
        assert d["pick"] == "b" and d["reason"] == "measured"
    assert together0 == together1
    assert log0 == log1 == list("abbaabbaab")


# ----------------------------------------------------------------------------- CUDA clock


class _FakeEvent:
    """A CUDA event on a fake device clock: `record()` stamps the clock's current ms."""

    clock = [0.0]  # ms; replaced per test

    def __init__(self, enable_timing: bool = False):
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.t = None

    def record(self, stream=None):
        self.t = self.clock[0]

    def elapsed_time(self, other: "_FakeEvent") -> float:
        assert self.t is not None and other.t is not None, "an event was not recorded"
        return other.t - self.t


def test_cuda_trial_times_with_events_not_the_host_clock(monkeypatch):
    """On a CUDA device the passes are timed by events (after a synchronize), not by the host clock:
    the fake device clock advances 7 ms per pass of a and 3 ms per pass of b while the host takes
    microseconds. Nothing is allocated on the device before the decision (no GPU here)."""
    clock = [1000.0]
    syncs: list[int] = []
    reduced: list[tuple] = []
    monkeypatch.setattr(_FakeEvent, "clock", clock)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))

    def one_process_max(values, group, device, what):
        reduced.append((list(values), device))
        return list(values)

    monkeypatch.setattr(choose, "max_over_group", one_process_max)
    cost = {"a": 7.0, "b": 3.0}
    trial = Trial("t.cuda", ["a", "b"], None, torch.device("cuda"), iters=3, warmup=1)
    assert trial.cuda
    decision = None
    while decision is None:
        alt = trial.next()
        trial.start()
        clock[0] += cost[alt]  # the work on the device
        decision = trial.stop()
        clock[0] += 100.0  # between passes (not timed)
    assert syncs, "the events must be complete (synchronize) before their times are read"
    assert reduced == [([7.0, 7.0, 7.0, 3.0, 3.0, 3.0], torch.device("cuda"))]
    assert decision.medians == {"a": 7.0, "b": 3.0}
    assert decision.pick == "b"


def test_cuda_fake_times_replace_the_event_times(monkeypatch):
    """`override(times=...)` replaces the events' times as it does the host clock's."""
    monkeypatch.setattr(_FakeEvent, "clock", [0.0])
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(choose, "max_over_group", lambda values, group, device, what: list(values))
    times = {"a": [2.0, 2.0], "b": [4.0, 4.0]}
    with override("t.cuda_fake", times=_table(times)):
        d = measure("t.cuda_fake", _recorder("ab", []), None, torch.device("cuda"), iters=2)
    assert d.samples == times and d.pick == "a"


# ----------------------------------------------------------------------------- Trial driven by the trainer


def test_trial_driven_pass_by_pass():
    """The trainer calls next/start/stop once per iteration: next() names the alternative of the pass
    (the order of `passes`), stop() returns None until the last pass and the Decision at the last;
    afterwards next() and stop() return None. Only timed passes are kept."""
    times = {"x": [5.0, 6.0, 7.0, 8.0], "y": [1.0, 2.0, 3.0, 4.0]}
    with override("t.trial", times=_table(times)):
        trial = Trial("t.trial", ["x", "y"], None, CPU, iters=3, warmup=1, settle=1, turn=2)
        order = passes(2, 3, warmup=1, settle=1, turn=2)
        assert trial.length == len(order) == 14
        seen = []
        for k in range(trial.length):
            assert not trial.done
            alt = trial.next()
            seen.append(alt)
            trial.start()
            out = trial.stop()
            if k < trial.length - 1:
                assert out is None, k
        decision = out
    assert seen == [["x", "y"][a] for a, _ in order]
    assert isinstance(decision, Decision) and trial.decision is decision and trial.done
    assert trial.next() is None and trial.stop() is None
    assert decision.samples == times  # 4 timed passes each (3 rounded up to whole turns of 2)
    assert decision.medians == {"x": 6.5, "y": 2.5} and decision.pick == "y"


@pytest.mark.parametrize("alternatives", [["a"], ["a", "a"], []])
def test_trial_needs_two_distinct_alternatives(alternatives):
    """A trial of fewer than two, or of repeated, alternatives is an error."""
    with pytest.raises(ValueError, match="two or more distinct"):
        Trial("t.few", alternatives, None, CPU, iters=1)
