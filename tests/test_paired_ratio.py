"""`profiling.paired_ratio`: the benchmarks' paired ratio over round-robin rounds and its bootstrap
confidence interval."""

import random
import statistics

import pytest

from megatron_moe.profiling import paired_ratio


def test_a_constant_ratio_has_no_spread():
    reference = [100.0, 130.0, 90.0, 250.0, 111.0]  # the machine's speed drifts; the ratio does not
    median, lo, hi = paired_ratio([0.9 * r for r in reference], reference)
    assert median == pytest.approx(0.9) and lo == pytest.approx(0.9) and hi == pytest.approx(0.9)


def test_the_median_is_of_the_per_round_ratios_and_lies_in_its_interval():
    candidate = [95.0, 101.0, 88.0, 120.0, 97.0, 93.0, 99.0]
    reference = [100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0]
    median, lo, hi = paired_ratio(candidate, reference)
    assert median == pytest.approx(0.97)  # sorted ratios 0.88 .. 1.20: the fourth
    assert lo <= median <= hi and lo < hi
    assert lo >= 0.88 and hi <= 1.2  # a median of resampled rounds stays within the observed ratios
    # the pairing matters: the same times against other references per round give other ratios
    shuffled = [100.0, 80.0, 120.0, 100.0, 90.0, 110.0, 105.0]
    assert paired_ratio(candidate, shuffled)[0] != pytest.approx(median)


def test_more_rounds_narrow_the_interval_and_a_seed_fixes_it():
    gen = random.Random(7)
    ratios = [gen.gauss(0.95, 0.04) for _ in range(12)]
    ref = [100.0] * len(ratios)
    _, lo12, hi12 = paired_ratio([100.0 * r for r in ratios], ref)
    _, lo48, hi48 = paired_ratio([100.0 * r for r in ratios * 4], ref * 4)
    assert hi48 - lo48 < hi12 - lo12
    again = paired_ratio([100.0 * r for r in ratios], ref)
    assert again == paired_ratio([100.0 * r for r in ratios], ref)  # seeded: reproducible


def test_the_interval_covers_the_true_median_about_as_often_as_stated():
    # rounds drawn around a known median ratio 0.95; a 90 % interval should miss it about one time in ten
    true, level, trials, covered = 0.95, 0.90, 120, 0
    for t in range(trials):
        gen = random.Random(1000 + t)
        ratios = [true + gen.gauss(0.0, 0.03) for _ in range(30)]
        _, lo, hi = paired_ratio(ratios, [1.0] * len(ratios), level=level, resamples=400, seed=t)
        covered += lo <= true <= hi
    assert 0.78 * trials <= covered <= 0.99 * trials, covered
    # and a narrower level misses more often than a wider one on the same data
    gen = random.Random(5)
    ratios = [true + gen.gauss(0.0, 0.03) for _ in range(30)]
    _, lo50, hi50 = paired_ratio(ratios, [1.0] * 30, level=0.5)
    _, lo99, hi99 = paired_ratio(ratios, [1.0] * 30, level=0.99)
    assert lo99 <= lo50 <= statistics.median(ratios) <= hi50 <= hi99 and hi99 - lo99 > hi50 - lo50


@pytest.mark.parametrize(
    "candidate, reference, kwargs",
    [([1.0, 2.0], [1.0], {}), ([], [], {}), ([1.0], [1.0], {"level": 1.0}), ([1.0], [1.0], {"resamples": 0})],
)
def test_bad_input_is_refused(candidate, reference, kwargs):
    with pytest.raises(ValueError, match="paired_ratio"):
        paired_ratio(candidate, reference, **kwargs)
