"""Fitting Pro-Prophet's performance model to measured MoE-layer times (a departure from the paper).

Eq. (8) assumes Trans / Agg hide completely behind compute and its terms come from ops profiled
one at a time; on CPU ranks with gloo a transfer takes cycles from the compute it overlaps and the
ops of a layer run slower together than alone. The planner therefore plans with
(`perf_model.Calibration`):

  T'' = scale * (4 T_A2A + 3 T_FEC) + X
  X   = comm (T_Trans + T_Agg)                                                            (eq. (6))
  X   = max(0, comm T_Trans - eta scale (T_FEC + fnec)) + max(0, comm T_Agg - eta scale (T_BEC + bnec))
                                                                                          (eq. (8))
The windows of eq. (8) are compute and scale with it (with unscaled windows, a run whose compute
was 2x slower than profiled priced every large Trans as exposed and kept a plan that measured slower).

`fit_calibration`: least squares on the relative error over samples (the `LayerTerms` of every MoE
layer under the placement used, the measured seconds of those layers, forward + backward):
  eq. (6): scale > 0 and comm >= 0 in closed form (2 x 2 normal equations, comm clamped at 0);
    eta keeps its prior;
  eq. (8): comm = 1 (comm and eta cannot be told apart from one plan); for each eta of a grid of
    `ETA_STEPS + 1` values, scale by fixed-point iteration (`SCALE_ROUNDS` rounds, the windows at
    the previous iterate's scale); the eta with the least residual, ties to the one nearest the
    prior (1.0, the paper's);
  no transfer in the samples: only scale is fitted, comm = scale, eta at its prior.
Then `Calibration.overhead`, the fixed cost of a layer with replicas: the mean extra residual
(measured - T'') per placed layer of the samples with replicas over those without, less the run's
noise (the larger spread of either kind), clamped at 0 (0 when either kind is missing).

`Calibrator` runs the calibration iterations 1 .. skip + iters (counted from the runtime's first,
so a resumed run calibrates too): odd ones without placement, even ones with the uncalibrated
model's plan, so the samples tell the scale apart from the cost of Trans / Agg; iterations
skip + 1 .. skip + iters are sampled (the first `skip` pay one-time costs) and fitted after the
last. With `sample_more(n)` (the runtime's trial) the next n iterations are sampled too and after
them (`refit_at`) the fit is multiplied by one contention factor (`contention`), fitted on the
timed iterations of the arm the run keeps (`kept`): one factor over all arms left the kept
2-expert plan under-predicted by 13-23 %. A uniform factor changes no plan.
Pure data and arithmetic: the runtime (`moe.placement.ProProphet`) measures the times, MAX-reduces
them over ranks (once) and hands them in.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from megatron_moe.pro_prophet.perf_model import Calibration, LayerTerms, PerfModel

ETA_STEPS = 100  # eta on the grid 0, 0.01, ..., 1
SKIP = 2  # calibration iterations not sampled (one-time costs)
ITERS = 4  # sampled calibration iterations
SCALE_ROUNDS = 50  # fixed-point rounds of eq. (8)'s scale (its windows scale with it)
TIE = 1e-9  # residuals within this (relative, plus 1e-15 absolute) of the least count as equal

Sample = tuple[Sequence[LayerTerms], float]  # (terms of every MoE layer, measured seconds)


def _scale_comm(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(scale, comm, residual) minimizing sum ((scale b + comm x) / m - 1)^2 over rows (b, x, m), comm >= 0;
    comm = 1 when the rows cannot tell it apart from scale (no transfer, or x proportional to b)."""
    u = [(b / m, x / m) for b, x, m in rows]
    sbb, sbx, sxx = sum(a * a for a, _ in u), sum(a * c for a, c in u), sum(c * c for _, c in u)
    sb, sx = sum(a for a, _ in u), sum(c for _, c in u)
    det = sbb * sxx - sbx * sbx
    comm = max(0.0, (sbb * sx - sbx * sb) / det) if sxx > 0 and det > 1e-12 * sbb * sxx else 1.0
    scale = (sb - comm * sbx) / sbb
    return scale, comm, sum((scale * a + comm * c - 1.0) ** 2 for a, c in u)


def _scale_given(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(scale, residual) minimizing sum ((scale b + x) / m - 1)^2 over rows (b, x, m) (comm = 1)."""
    u = [(b / m, x / m) for b, x, m in rows]
    scale = sum(a * (1.0 - c) for a, c in u) / sum(a * a for a, _ in u)
    return scale, sum((scale * a + c - 1.0) ** 2 for a, c in u)


def fit_calibration(samples: Sequence[Sample], overlap: bool, prior_eta: float = 1.0) -> Calibration:
    """`Calibration` (scale, comm, eta) fitted to (layer terms, measured seconds) samples (module docstring)."""
    if not samples:
        raise ValueError("fit_calibration needs at least one (terms, measured time) sample")
    for terms, m in samples:
        if not m > 0 or not terms or sum(t.time(overlap, Calibration()) for t in terms) <= 0:
            raise ValueError(f"fit_calibration needs positive measured and modelled times, got {m!r}")
    base = [sum(t.base for t in terms) for terms, _ in samples]

    def rows(eta: float, window_scale: float = 1.0) -> list[tuple[float, float, float]]:
        return [
            (b, sum(t.exposed(overlap, eta, 1.0, window_scale) for t in terms), m)
            for b, (terms, m) in zip(base, samples)
        ]

    def scale_for(eta: float) -> tuple[float, float]:
        """(scale, residual) of eq. (8) at `eta`, comm = 1: the windows at the scale being fitted."""
        fit = _scale_given(rows(eta))
        for _ in range(SCALE_ROUNDS):
            if fit[0] <= 0:
                break
            nxt = _scale_given(rows(eta, fit[0]))
            if abs(nxt[0] - fit[0]) <= 1e-12 * fit[0]:
                fit = nxt
                break
            fit = nxt
        return fit

    if not any(x > 0 for _, x, _ in rows(0.0)):  # nothing moved: only the scale can be seen
        scale = _scale_given(rows(0.0))[0]
        return Calibration(scale, scale, prior_eta)
    if not overlap:
        scale, comm, _ = _scale_comm(rows(prior_eta))
        if scale > 0:
            return with_overhead(samples, overlap, Calibration(scale, comm, prior_eta))
        raise ValueError("fit_calibration: no positive scale fits the samples")
    fits = [(scale_for(i / ETA_STEPS), i / ETA_STEPS) for i in range(ETA_STEPS + 1)]
    fits = [f for f in fits if f[0][0] > 0]
    if not fits:
        raise ValueError("fit_calibration: no positive scale fits the samples")
    least = min(r for (_, r), _ in fits)
    tied = [f for f in fits if f[0][1] <= least * (1 + TIE) + 1e-15]
    (scale, _), eta = min(tied, key=lambda f: (abs(f[1] - prior_eta), -f[1]))
    return with_overhead(samples, overlap, Calibration(scale, 1.0, eta))


def with_overhead(samples: Sequence[Sample], overlap: bool, cal: Calibration) -> Calibration:
    """`cal` plus the fixed overhead of a layer with replicas (module docstring) measured on `samples`."""
    plain: list[float] = []  # residual (measured - T'') of each sample without replicas
    placed: list[tuple[float, int]] = []  # (residual, layers with replicas) of the others
    for terms, m in samples:
        n = sum(1 for t in terms if t.placed)
        resid = m - sum(t.time(overlap, cal) for t in terms)
        if n:
            placed.append((resid, n))
        else:
            plain.append(resid)
    if not placed or not plain:
        return cal
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    base = mean(plain)
    per_layer = [(r - base) / n for r, n in placed]  # each placed sample's extra per layer with replicas
    extra = mean(per_layer)
    noise = max(  # the spread of either kind of sample, per layer with replicas
        max(abs(r - base) for r in plain) / mean([n for _, n in placed]),
        max(abs(x - extra) for x in per_layer),
    )
    if extra - noise <= TIE * mean([m for _, m in samples]):  # none measured beyond the noise
        return cal
    return replace(cal, overhead=extra - noise)


def contention(samples: Sequence[Sample], overlap: bool, cal: Calibration) -> Calibration:
    """`cal` times k, the factor by which `samples` ran slower (k > 1) or faster than `cal` predicts:
    least squares on the relative error, k = sum(u) / sum(u^2) with u = T''(cal) / measured; scale,
    comm and overhead multiplied (eta kept), so every plan stays the same. `cal` when no sample."""
    u = [sum(t.time(overlap, cal) for t in terms) / m for terms, m in samples if m > 0]
    if not u or sum(u) <= 0:
        return cal
    k = sum(u) / sum(x * x for x in u)
    return Calibration(cal.scale * k, cal.comm * k, cal.eta, cal.overhead * k)


class Calibrator:
    """The planner's model and the calibration iterations (module docstring). model: the uncalibrated
    model; skip / iters: calibration iterations not sampled / sampled (iters 0: no calibration)."""

    def __init__(self, model: PerfModel, skip: int = SKIP, iters: int = ITERS):
        if skip < 0 or iters < 0:
            raise ValueError(f"Calibrator: skip and iters must be >= 0, got {skip}, {iters}")
        self.model, self.skip, self.iters = model, skip, iters
        self.extra: float = 0  # iterations after `last` sampled too (`sample_more`), refitted at `refit_at`
        self.terms: list[list[LayerTerms]] = []
        self.measured: list[float] = []
        self.fitted: Calibration | None = None
        self.fits = 0  # fits made

    def sample_more(self, iterations: Optional[int]) -> None:
        """Also sample the `iterations` iterations after the calibration (the runtime's trial) and
        refit after the last of them (`refit_at`, `fit`). None: sample on until a later call gives the
        number (the trial has not begun)."""
        if iterations is not None and iterations < 0:
            raise ValueError(f"Calibrator.sample_more: iterations must be >= 0, got {iterations}")
        self.extra = (math.inf if iterations is None else iterations) if self.iters else 0

    @property
    def refit_at(self) -> float:
        """The iteration after which the last fit is made (`last` without `sample_more`)."""
        return self.last + self.extra if self.iters else 0

    def sampling(self, iteration: int) -> bool:
        """True while iteration `iteration` (1-based) is timed for a fit still to come."""
        return iteration <= self.refit_at

    @property
    def last(self) -> int:
        """The last calibration iteration (0: none)."""
        return self.skip + self.iters if self.iters else 0

    def calibrating(self, iteration: int) -> bool:
        """True while `iteration` (1-based) is a calibration iteration."""
        return iteration <= self.last

    def placement_off(self, iteration: int) -> bool:
        """True when calibration iteration `iteration` runs without placement (the odd ones)."""
        return self.calibrating(iteration) and iteration % 2 == 1

    def record(
        self, iteration: int, counts_LDE: Sequence, replicas_L: Sequence[Sequence[Sequence[int]] | None], seconds: float
    ) -> None:
        """Iteration `iteration` ran the layers' counts [L][D][E] under `replicas_L` and took `seconds`
        (this rank) in its MoE layers; kept when it is a sampled calibration iteration."""
        if self.skip < iteration <= self.refit_at:
            self.terms.append([self.model.terms(c, r) for c, r in zip(counts_LDE, replicas_L)])
            self.measured.append(float(seconds))

    def fit_due(self, iteration: int) -> bool:
        """True after the last calibration iteration and after `refit_at`, once each (then call `fit`)."""
        if not self.iters:
            return False
        first = iteration == self.last and self.fits == 0
        return first or (self.extra > 0 and iteration == self.refit_at and self.fits == 1)

    def fit(self, measured: Sequence[float], kept: Optional[Sequence[bool]] = None) -> Calibration:
        """Fit on the recorded terms and `measured` (the recorded times, maximum over ranks) and plan
        with the result from now on: the first time `fit_calibration`, the second (`refit_at`) that fit
        times the `contention` factor of the samples since, restricted to those flagged in `kept` (one
        flag per later sample) when any is."""
        if len(measured) != len(self.terms):
            raise ValueError(f"Calibrator.fit: {len(measured)} times for {len(self.terms)} samples")
        if self.fits and self.fitted is not None:
            first = self.last - self.skip  # samples of the first fit; the rest came after it
            pairs = list(zip(self.terms[first:], measured[first:]))
            if kept is not None:
                if len(kept) != len(pairs):
                    raise ValueError(f"Calibrator.fit: {len(kept)} kept flags for {len(pairs)} later samples")
                if any(kept):
                    pairs = [p for p, k in zip(pairs, kept) if k]
            self.fitted = contention([(t, m) for t, m in pairs if m > 0], self.model.overlap, self.fitted)
        else:
            samples = [(t, m) for t, m in zip(self.terms, measured) if m > 0]
            self.fitted = fit_calibration(samples, self.model.overlap) if samples else Calibration()
        self.model = replace(self.model, calibration=self.fitted)
        self.fits += 1
        return self.fitted
