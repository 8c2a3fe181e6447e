"""Pro-Prophet's calibrated performance model (pro_prophet.calibration, a departure from the paper):
the fit recovers known scale, Trans/Agg cost and overlap efficiency from synthetic timings, the planner plans with
the fitted model, the calibration iterations alternate no placement and the plan, and the layer
clock pairs each layer's forward and backward stamps."""

import numpy as np
import pytest
import torch

from megatron_moe.pro_prophet.calibration import contention, Calibrator, fit_calibration, with_overhead
from megatron_moe.pro_prophet.clock import LayerClock
from megatron_moe.pro_prophet.perf_model import Calibration, LayerTerms, PerfConstants, PerfModel
from megatron_moe.pro_prophet.planner import plan


def terms(base, trans, agg, fwd, bwd):
    return LayerTerms(base, trans, agg, fwd, bwd)


# two layers per sample; some samples move nothing (trans = agg = 0), the others expose different amounts
SAMPLES = [
    [terms(10.0, 0.0, 0.0, 3.0, 6.0), terms(12.0, 0.0, 0.0, 4.0, 8.0)],
    [terms(8.0, 5.0, 5.0, 3.0, 6.0), terms(9.0, 0.0, 0.0, 4.0, 8.0)],
    [terms(7.0, 9.0, 9.0, 2.0, 4.0), terms(7.5, 6.0, 6.0, 2.5, 5.0)],
    [terms(11.0, 0.0, 0.0, 3.0, 6.0), terms(8.0, 4.0, 4.0, 4.0, 8.0)],
]


def synthetic(scale: float, comm: float, eta: float, overlap: bool):
    """Exact measured times of SAMPLES under T'' (the model's own form) with known constants."""
    cal = Calibration(scale, comm, eta)
    return [(ts, sum(t.time(overlap, cal) for t in ts)) for ts in SAMPLES]


@pytest.mark.parametrize("scale, eta", [(1.3, 0.37), (0.9, 0.0), (1.0, 1.0), (2.5, 0.81)])
def test_fit_with_scheduler_recovers_known_scale_and_overlap_efficiency(scale, eta):
    got = fit_calibration(synthetic(scale, 1.0, eta, True), overlap=True)
    assert got.eta == pytest.approx(eta, abs=1e-12) and got.comm == 1.0
    assert got.scale == pytest.approx(scale, rel=1e-9)


def test_fit_without_scheduler_fits_scale_and_comm():
    got = fit_calibration(synthetic(1.7, 2.2, 0.2, False), overlap=False)
    assert got.scale == pytest.approx(1.7, rel=1e-9) and got.comm == pytest.approx(2.2, rel=1e-9)
    assert got.eta == 1.0  # eq. (6) has no window: the prior, untouched


def test_eta_keeps_its_prior_and_comm_follows_the_scale_when_nothing_moved():
    still = [([terms(10.0, 0.0, 0.0, 3.0, 6.0)], 13.0), ([terms(20.0, 0.0, 0.0, 3.0, 6.0)], 26.0)]
    got = fit_calibration(still, overlap=True, prior_eta=0.6)
    assert got.eta == 0.6 and got.scale == pytest.approx(1.3, rel=1e-12) and got.comm == got.scale


def test_one_plan_tells_the_overlap_efficiency_and_ties_go_to_the_prior():
    one = [([terms(10.0, 0.0, 0.0, 3.0, 6.0)], 10.0), ([terms(6.0, 4.0, 4.0, 2.0, 4.0)], 11.0)]
    got = fit_calibration(one, overlap=True)  # 6 + (4 - 2 eta) + (4 - 4 eta) = 11: eta = 0.5
    assert got.eta == pytest.approx(0.5, abs=1e-12) and got.scale == pytest.approx(1.0, rel=1e-9)
    hidden = [([terms(10.0, 0.0, 0.0, 3.0, 6.0)], 10.0), ([terms(6.0, 1.0, 1.0, 2.0, 4.0)], 6.0)]
    got = fit_calibration(hidden, overlap=True, prior_eta=0.9)  # hidden at every eta >= 0.5: the prior wins
    assert got.eta == 0.9 and got.scale == pytest.approx(1.0, rel=1e-9)


def test_noisy_timings_stay_close():
    rng = np.random.default_rng(0)
    noisy = [(ts, m * (1 + 0.01 * rng.standard_normal())) for ts, m in synthetic(1.2, 1.0, 0.5, True)]
    got = fit_calibration(noisy, overlap=True)
    assert abs(got.scale - 1.2) < 0.05 and abs(got.eta - 0.5) < 0.1


def test_bad_samples_and_values_are_clear_errors():
    with pytest.raises(ValueError, match="at least one"):
        fit_calibration([], overlap=True)
    with pytest.raises(ValueError, match="positive measured and modelled times"):
        fit_calibration([([terms(1.0, 0.0, 0.0, 1.0, 1.0)], 0.0)], overlap=True)
    with pytest.raises(ValueError, match=r"Calibration.eta must be in \[0, 1\]"):
        Calibration(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="Calibration.scale must be a finite number > 0"):
        Calibration(0.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="Calibration.comm must be a finite number >= 0"):
        Calibration(1.0, -1.0, 0.5)


# -- the planner uses the fit --------------------------------------------------------------------
def unit_model(**kw) -> PerfModel:
    """a2a 0, one token costs 1 s of expert compute, one expert's Trans / Agg to every device 16 s."""
    c = PerfConstants(0.0, 0.0, 0.0, 16.0, 0.0, 1.0)
    return PerfModel(c, token_elements=1, param_elements=1, grad_elements=1, overlap=True, **kw)


def test_the_planner_plans_with_the_fitted_overlap_efficiency():
    counts = np.array([[10, 0], [10, 0]])  # expert 0 (rank 0) gets everything
    hidden = plan(counts, unit_model(), alpha=0.0)
    assert hidden.as_dict() == {0: (1,)}  # eq. (8): 3 * 10 + (16 - 10) + 0 < 3 * 20
    exposed = plan(counts, unit_model(calibration=Calibration(1.0, 1.0, 0.0)), alpha=0.0)
    assert exposed.as_dict() == {}  # nothing hides: 3 * 10 + 16 + 16 > 3 * 20
    cal = Calibrator(unit_model(), skip=0, iters=2)
    cal.record(1, [counts], [None], 1.0)  # no placement: T'' = 60 at scale 1 -> measured 60
    cal.record(2, [counts], [[(1,), ()]], 1.0)  # expert 0 on rank 1: base 30, Trans / Agg 16 s each
    assert cal.fit_due(2) and not cal.fit_due(1)
    fitted = cal.fit([60.0, 62.0])  # 30 + 16 + 16: nothing hid
    assert fitted == Calibration(1.0, 1.0, 0.0) and cal.model.calibration == fitted
    assert plan(counts, cal.model, alpha=0.0).as_dict() == {}  # the planner now keeps expert 0 home
    assert not cal.fit_due(2)


def test_the_fixed_overhead_of_replicas_is_measured_per_placed_layer():
    placed = [LayerTerms(8.0, 5.0, 5.0, 3.0, 6.0, True), LayerTerms(9.0, 4.0, 4.0, 4.0, 8.0, True)]
    half = [LayerTerms(7.0, 6.0, 6.0, 2.0, 4.0, True), LayerTerms(9.0, 0.0, 0.0, 4.0, 8.0)]
    plain = [LayerTerms(10.0, 0.0, 0.0, 3.0, 6.0), LayerTerms(12.0, 0.0, 0.0, 4.0, 8.0)]
    cal = Calibration(1.3, 1.0, 0.4)

    def t(ts):
        return sum(x.time(True, cal) for x in ts)

    # 2.5 s more per layer with replicas than the model says; the plain sample is exact
    samples = [(plain, t(plain)), (placed, t(placed) + 5.0), (half, t(half) + 2.5)]
    got = with_overhead(samples, True, cal)
    assert got.overhead == pytest.approx(2.5, rel=1e-12) and (got.scale, got.comm, got.eta) == (1.3, 1.0, 0.4)
    assert with_overhead([(plain, t(plain)), (placed, t(placed))], True, cal).overhead == 0.0
    assert with_overhead([(placed, t(placed) + 5.0)], True, cal) == cal  # nothing to compare with
    assert with_overhead([(plain, t(plain)), (placed, t(placed) - 3.0)], True, cal).overhead == 0.0  # clamped
    # two no-replica samples 1 s apart: 0.5 s of noise comes off the 5 s measured over two placed layers
    noisy = [(plain, t(plain) - 0.5), (plain, t(plain) + 0.5), (placed, t(placed) + 5.0)]
    assert with_overhead(noisy, True, cal).overhead == pytest.approx(2.25, rel=1e-12)
    # placed samples 1.6 s apart (+4.2, +5.8: mean +5): 0.8 s of noise, the larger spread, comes off
    noisy = [(plain, t(plain) - 0.5), (plain, t(plain) + 0.5), (placed, t(placed) + 4.2), (placed, t(placed) + 5.8)]
    assert with_overhead(noisy, True, cal).overhead == pytest.approx(2.1, rel=1e-12)
    assert t(placed) + 5.0 == pytest.approx(sum(x.time(True, got) for x in placed), rel=1e-12)


def test_the_planner_keeps_the_empty_plan_when_the_gain_is_below_the_overhead():
    counts = np.array([[10, 0], [10, 0]])  # no placement: 3 * 20 = 60; expert 0 on rank 1: 30 + (16 - 10) = 36
    assert plan(counts, unit_model(calibration=Calibration(overhead=23.0)), alpha=0.0).as_dict() == {0: (1,)}
    assert plan(counts, unit_model(calibration=Calibration(overhead=25.0)), alpha=0.0).as_dict() == {}
    with pytest.raises(ValueError, match="Calibration.overhead must be a finite number >= 0"):
        Calibration(overhead=-1.0)


def test_calibration_iterations_alternate_no_placement_and_the_plan():
    cal = Calibrator(unit_model(), skip=2, iters=4)
    assert [cal.placement_off(i) for i in range(1, 9)] == [True, False, True, False, True, False, False, False]
    assert [cal.calibrating(i) for i in (1, 6, 7)] == [True, True, False]
    for i in range(1, 8):
        cal.record(i, [np.array([[1, 0], [1, 0]])], [None], float(i))
    assert cal.measured == [3.0, 4.0, 5.0, 6.0] and len(cal.terms) == 4
    assert Calibrator(unit_model(), iters=0).last == 0 and not Calibrator(unit_model(), iters=0).fit_due(0)
    with pytest.raises(ValueError, match="2 times for 4 samples"):
        cal.fit([1.0, 2.0])


def test_the_trial_iterations_are_sampled_and_refitted_once_after_them():
    cal = Calibrator(unit_model(), skip=1, iters=2)
    cal.sample_more(4)  # a trial of 2 + 2 iterations after iteration 3
    assert cal.refit_at == 7 and [cal.sampling(i) for i in (7, 8)] == [True, False]
    counts = [np.array([[1, 0], [1, 0]])]  # no placement: only the scale is fitted
    base = unit_model().terms(counts[0], None).base  # T'' at scale 1
    due, first = [], None
    for i in range(1, 10):
        cal.record(i, counts, [None], 4.0 * base if i <= 3 else 8.0 * base)  # slower after the calibration
        due.append(cal.fit_due(i))
        if due[-1]:
            cal.fit(cal.measured)
            first = first or cal.fitted.scale
    assert due == [False, False, True, False, False, False, True, False, False]
    assert first == pytest.approx(4.0)  # the first fit: samples 2, 3 only
    assert [m / base for m in cal.measured] == pytest.approx([4, 4, 8, 8, 8, 8]) and cal.fits == 2
    # the refit: the first fit times the contention factor of the four later samples (2: twice as slow)
    assert cal.fitted.scale == pytest.approx(8.0) and cal.fitted.comm == pytest.approx(2 * first)


def test_the_refit_uses_the_kept_arms_samples_when_flagged():
    counts = [np.array([[1, 0], [1, 0]])]
    base = unit_model().terms(counts[0], None).base

    def refit(kept):
        cal = Calibrator(unit_model(), skip=1, iters=2)
        cal.sample_more(4)
        times = [4.0, 4.0, 4.0, 8.0, 12.0, 8.0, 12.0]  # iterations 4-7: two arms, 2x and 3x slower
        for i, t in enumerate(times, start=1):
            cal.record(i, counts, [None], t * base)
            if cal.fit_due(i):
                cal.fit(cal.measured, kept if i == 7 else None)
        return cal.fitted.scale

    assert refit([False, True, False, True]) == pytest.approx(12.0)  # the 3x arm alone
    assert refit([True, False, True, False]) == pytest.approx(8.0)
    assert refit([False] * 4) == refit(None)  # nothing flagged: every later sample, as without flags
    assert 8.0 < refit(None) < 12.0
    with pytest.raises(ValueError, match="3 kept flags for 4 later samples"):
        refit([True] * 3)


def test_the_contention_factor_scales_every_modelled_time_and_keeps_the_plan():
    counts = np.array([[10, 0], [10, 0]])
    cal = Calibration(1.0, 1.0, 0.0, overhead=0.5)
    model = unit_model(calibration=cal)
    terms = [model.terms(counts, [(1,), ()]), model.terms(counts, None)]
    t = [x.time(True, cal) for x in terms]
    k = contention([([terms[0]], 3 * t[0]), ([terms[1]], 3 * t[1])], True, cal)  # 3x slower than modelled
    assert (k.scale, k.comm, k.eta, k.overhead) == pytest.approx((3.0, 3.0, 0.0, 1.5))
    assert [x.time(True, k) for x in terms] == pytest.approx([3 * v for v in t])
    slower = unit_model(calibration=k)
    for c in (counts, np.array([[7, 3], [9, 1]]), np.array([[2, 2], [3, 9]])):
        assert plan(c, slower, alpha=0.0).replicas == plan(c, model, alpha=0.0).replicas
    assert contention([], True, cal) == cal
    without = Calibrator(unit_model(), skip=1, iters=2)
    without.sample_more(0)
    assert without.refit_at == 3 and [without.fit_due(i) for i in (3, 7)] == [True, False]


# -- the clock ------------------------------------------------------------------------------------
class Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x, x.sum()


class Ticks:
    """A clock that advances one second per reading."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_layer_clock_pairs_forward_and_backward_of_each_layer():
    a, b = Doubler(), Doubler()
    ticks = Ticks()
    clock = LayerClock([a, b], torch.device("cpu"), clock=ticks)
    x = torch.ones(3, requires_grad=True)
    h = x * 1.0
    y1, _ = a(h)  # readings 1, 2
    y2, _ = b(y1 * 1.0)  # readings 3, 4
    y2.sum().backward()  # b's backward: 5 (output) -> 6 (input); a's: 7 -> 8
    assert clock.take() == (2 - 1) + (4 - 3) + (6 - 5) + (8 - 7)
    assert clock.take() == 0.0  # forgotten
    with torch.no_grad():
        a(torch.ones(3))  # not timed: no reading
    assert ticks.t == 8.0
    clock.remove()
    a(torch.ones(3, requires_grad=True))
    assert ticks.t == 8.0 and clock.take() == 0.0


def test_the_hiding_windows_run_at_the_fitted_compute_scale():
    """Eq. (8)'s windows are compute: at scale 2 a 3 s window (modelled) lasts 6 s and hides a 5 s Trans that
    the window at its modelled length would leave 2 s exposed; eq. (6) hides nothing, whatever the scale."""
    t = terms(10.0, 5.0, 7.0, 3.0, 6.0)
    assert t.time(True, Calibration(2.0, 1.0, 1.0)) == 2.0 * 10.0 + 0.0 + 0.0  # 5 < 2 x 3, 7 < 2 x 6
    assert t.time(True, Calibration(2.0, 1.0, 0.5)) == 20.0 + (5.0 - 3.0) + (7.0 - 6.0)  # eta halves the windows
    assert t.time(True, Calibration(1.0, 3.0, 1.0)) == 10.0 + (15.0 - 3.0) + (21.0 - 6.0)  # comm: dearer transfers
    assert t.time(False, Calibration(2.0, 1.5, 1.0)) == 20.0 + 1.5 * 12.0
    # the contention factor multiplies every term, the exposed ones included: the plan's ranking is kept
    k = contention([([t], 2.0 * 23.0)], True, Calibration(1.0, 1.0, 1.0))
    assert t.time(True, k) == pytest.approx(46.0, rel=1e-12)
