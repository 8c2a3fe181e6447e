"""Parm as published: the (alpha_o, beta_o) fit of eq. (14), S1/S2 volumes per eqs. (13)/(14), and `auto`
choosing among baseline, S1 and S2."""

import numpy as np
import pytest

from megatron_moe.moe.comm_profile import fit_sizes
from megatron_moe.moe.cost_model import (
    OVERLAP_KEY,
    AlphaBeta,
    CommModel,
    MoEShape,
    choose_schedule,
    expert_flops,
    fit_overlap,
    s1_a2a_elements,
    s2_a2a_elements,
    s2_gather_elements,
    time_baseline,
    time_s1,
    time_s2,
    uniform_model,
)


AG = AlphaBeta(2e-4, 1e-9)  # MP all-gather, seconds per gathered element


def _saa_samples(alpha_o: float, beta_o: float, ratio: float, noise: float, seed: int = 0):
    sizes = [256 * 4**i for i in range(10)]  # 1 KB .. 256 MB of fp32, like the profile
    rng = np.random.default_rng(seed)
    times = [(alpha_o + beta_o * v + AG.alpha + AG.beta * ratio * v) * (1 + rng.uniform(-noise, noise)) for v in sizes]
    return sizes, times


def test_overlap_fit_recovers_exact_constants():
    sizes, times = _saa_samples(3e-4, 1.5e-9, ratio=2.0, noise=0.0)
    o = fit_overlap(sizes, times, AG, gather_ratio=2.0)
    assert o.alpha == pytest.approx(3e-4, rel=1e-9) and o.beta == pytest.approx(1.5e-9, rel=1e-9)


def test_overlap_fit_recovers_noisy_constants():
    sizes, times = _saa_samples(5e-4, 2e-9, ratio=0.5, noise=0.02, seed=3)
    o = fit_overlap(sizes, times, AG, gather_ratio=0.5)
    assert o.alpha == pytest.approx(5e-4, rel=0.1) and o.beta == pytest.approx(2e-9, rel=0.05)


def test_overlap_fit_keeps_a_negative_beta():
    # the overlap hides most of the all-gather: Overlap(V) = t(V) - AG(2V) has a negative slope
    sizes, times = _saa_samples(1e-4, -0.5e-9, ratio=2.0, noise=0.0)
    o = fit_overlap(sizes, times, AG, gather_ratio=2.0)
    assert o.beta == pytest.approx(-0.5e-9, rel=1e-9)
    # without the all-gather, the fit describes the whole step
    whole = fit_overlap(sizes, times, None, gather_ratio=2.0)
    assert whole.alpha == pytest.approx(1e-4 + AG.alpha, rel=1e-9) and whole.beta == pytest.approx(1.5e-9, rel=1e-9)


def test_overlap_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_overlap([1024, 1024], [1e-3, 1e-3], AG, 1.0)
    with pytest.raises(ValueError, match="2 sizes but 3 times"):
        fit_overlap([1024, 4096], [1e-3, 1e-3, 2e-3], AG, 1.0)


# ----------------------------------------------------------------------------- volumes


def test_volumes_equal_the_paper_formulas():
    sh = MoEShape(B=4, L=1024, M=1024, E=8, k=2, f=1.25, n_mp=4, n_ep=4, n_esp=2)
    T = 2 * 1.25 * 4 * 1024 / 8  # k f B L / E = 1280, divisible by N_MP
    assert sh.C == T and sh.C_mp * 4 == T
    assert s1_a2a_elements(sh, "padded") == 8 * T * 1024 * 2 / 4  # E T M N_ESP / N_MP
    assert s2_a2a_elements(sh) == 8 * T * 1024 * 2 / 4
    assert s2_gather_elements(sh) == 8 * T * 1024  # AG_MP(E T M), gathered
    assert s1_a2a_elements(sh, "kept") == 2 * min(2 * 4096, 8 * T) * 1024 / 4  # kept choices only
    with pytest.raises(ValueError, match="S1 transfer"):
        s1_a2a_elements(sh, "bogus")
    # all-gathers are priced by their gathered output: beta 1 s per element, nothing else costs
    only_ag = CommModel({"all_gather@mp": AlphaBeta(0.0, 1.0)})
    assert time_s1(only_ag, sh, "padded") == 2 * 4 * 1024 * 1024  # AG_MP(B L M) each way
    assert time_s2(only_ag, sh, saa=False) == 2 * 8 * T * 1024
    # the profile fits all-gathers against the gathered size, the others against the input
    assert fit_sizes("all_gather", 4, [256, 1030]) == [1024, 4128]
    assert fit_sizes("all_to_all", 4, [256, 1030]) == [256, 1032]


def test_kept_s1_is_priced_with_its_extra_collectives():
    sh = MoEShape(B=2, L=64, M=16, E=4, k=2, f=1.5, n_mp=2, n_ep=2, n_esp=1)
    S, C = 128, 96  # C = ceil(2 * 1.5 * 128 / 4)
    a2a_only = CommModel({"all_to_all@ep_esp": AlphaBeta(0.0, 1.0)})
    kept = min(2 * S, 4 * C) * 16 / 2  # N_ESP min(k S, E C) M / N_MP
    assert time_s1(a2a_only, sh, "kept") == 4 * kept + 2 * 1 * 4  # + the counts all-to-all (2 N_ESP E)
    assert time_s1(a2a_only, sh, "padded") == 4 * (4 * C * 16 / 2)
    ar_only = CommModel({"all_reduce@mp": AlphaBeta(1.0, 0.0)})
    assert time_s1(ar_only, sh, "kept") == 2 and time_s1(ar_only, sh, "padded") == 0  # aux sums, gate grad


def test_expert_flops_count_the_baselines_duplicate_work():
    sh = MoEShape(B=4, L=1024, M=1024, E=8, k=2, f=1.25, n_mp=4, n_ep=4, n_esp=2, H=4096)
    per_rank_baseline = 3 * 2 * 2 * (2 * 8 * 1280) * 1024 * 4096 / 2  # rows N_ESP E C, slice H / N_ESP
    assert expert_flops(sh, "baseline") == per_rank_baseline
    assert expert_flops(sh, "s2") == per_rank_baseline / 4
    assert expert_flops(sh, "s1", "padded") == per_rank_baseline / 4
    assert expert_flops(sh, "s1", "kept") == per_rank_baseline / 4 * (2 * 4096) / (8 * 1280)


# ----------------------------------------------------------------------------- auto


def _hand_d1(a2a: AlphaBeta, ag: AlphaBeta, E, T, M, B, L, n_mp, n_esp) -> float:
    """Eq. (13), each way."""
    return 2 * (2 * (a2a.alpha + a2a.beta * E * T * M * n_esp / n_mp) + ag.alpha + ag.beta * B * L * M)


def _hand_d2(a2a: AlphaBeta, ag: AlphaBeta, o: AlphaBeta, E, T, M, n_mp, n_esp) -> float:
    """Eq. (14), each way."""
    y = E * T * M * n_esp / n_mp
    return 2 * ((a2a.alpha + a2a.beta * y) + (o.alpha + o.beta * y) + (ag.alpha + ag.beta * E * T * M))


A2A, AGMP, OVER = AlphaBeta(1e-4, 2e-9), AlphaBeta(1e-4, 1e-9), AlphaBeta(1e-4, 1e-9)


def _model(baseline_cost: AlphaBeta) -> CommModel:
    m = uniform_model(baseline_cost, all_to_all=A2A)
    m.costs["all_to_all@ep_esp"], m.costs["all_gather@mp"], m.costs[OVERLAP_KEY] = A2A, AGMP, OVER
    return m


@pytest.mark.parametrize("n_mp, n_esp, expected", [(4, 1, "s1"), (2, 4, "s2")])
def test_algorithm1_s1_vs_s2_as_the_paper_argues(n_mp, n_esp, expected):
    """Ignoring alphas, t_D1 - t_D2 = (beta_A2A - beta_o) E T M N_ESP / N_MP - beta_AG (E T - B L) M:
    with k f = 2.5, S1 wins when 2.5 (2 - 1) N_ESP / N_MP < 1.5 (more MP, less ESP), S2 otherwise."""
    B, L, M, E, k, f = 4, 1024, 1024, 8, 2, 1.25
    T = k * f * B * L / E
    sh = MoEShape(B, L, M, E, k, f, n_mp=n_mp, n_ep=E, n_esp=n_esp)
    c = choose_schedule(_model(AlphaBeta(1e-4, 2e-9)), sh, s1="padded")
    d1, d2 = _hand_d1(A2A, AGMP, E, T, M, B, L, n_mp, n_esp), _hand_d2(A2A, AGMP, OVER, E, T, M, n_mp, n_esp)
    assert c.times["s1"] == pytest.approx(d1, rel=1e-12) and c.times["s2"] == pytest.approx(d2, rel=1e-12)
    assert (d1 <= d2) == (expected == "s1")
    assert c.schedule == expected and c.times["baseline"] > min(d1, d2)


def test_auto_picks_the_baseline_when_the_model_says_it_is_cheapest():
    # a small layer on a fabric where the EP/ESP collectives are cheap and latency dominates the
    # EP x ESP and MP ones: the baseline's 4 EP all-to-alls beat S1's and S2's latencies
    sh = MoEShape(B=1, L=16, M=64, E=4, k=1, f=1.0, n_mp=2, n_ep=4, n_esp=1)
    cheap = AlphaBeta(1e-5, 1e-10)
    model = uniform_model(cheap)
    slow = AlphaBeta(1e-3, 1e-9)
    model.costs.update({"all_to_all@ep_esp": slow, "all_gather@mp": slow, "all_reduce@mp": slow, OVERLAP_KEY: slow})
    C = 4  # ceil(16 / 4)
    baseline = 4 * (1e-5 + 1e-10 * 4 * C * 64)  # 2 EP all-to-alls each way; ESP has one rank
    c = choose_schedule(model, sh)
    assert c.times["baseline"] == pytest.approx(baseline, rel=1e-12)
    assert c.schedule == "baseline" and c.times["baseline"] < min(c.times["s1"], c.times["s2"])
    assert choose_schedule(model, sh, with_baseline=False).schedule in ("s1", "s2")  # the paper's Algorithm 1
    # the same layer where the baseline's collectives are slow: auto falls back to Algorithm 1's pick
    costly = uniform_model(AlphaBeta(1e-2, 1e-8))
    costly.costs.update({"all_to_all@ep_esp": slow, "all_gather@mp": slow, "all_reduce@mp": slow})
    assert choose_schedule(costly, sh).schedule == choose_schedule(costly, sh, with_baseline=False).schedule


def test_paper_baseline_prices_eq1():
    sh = MoEShape(B=2, L=8, M=4, E=4, k=1, f=1.0, n_mp=1, n_ep=2, n_esp=2)
    only_ag = CommModel({"all_gather@esp": AlphaBeta(0.0, 1.0)})
    assert time_baseline(only_ag, sh, paper=True) == 2 * 8 * 4 * 2  # AG_ESP(B L M N_ESP)
    assert time_baseline(only_ag, sh) == 2 * 4 * 4 * 4  # the runtime gathers N_ESP E C M


# ----------------------------------------------------------------------------- SAA on real groups


def _profile_saa_worker(rank: int, world_size: int):
    from megatron_moe.moe.comm_profile import profile_saa
    from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel

    ps = initialize_model_parallel(2, 2, 1)
    try:
        fit, raw = profile_saa(ps, [1000, 40000], AG, chunks=2, reps=1, warmup=1)
    finally:
        destroy_model_parallel()
    return fit, raw


def test_profile_saa_fits_the_same_numbers_on_every_rank():
    from megatron_moe.testing import spawn

    results = spawn(_profile_saa_worker, 4, timeout=120)
    fits = [r[0] for r in results]
    raws = [r[1] for r in results]
    # sizes rounded up to chunks * |EP x ESP| * N_ESP = 4 elements; MAX over the world -> one table, one fit
    assert raws[0]["sizes"] == [1000, 40000] and raws[0]["chunks"] == 2
    assert all(r == raws[0] for r in raws) and all(f == fits[0] for f in fits)
    assert all(t > 0 for t in raws[0]["times"])
    again = fit_overlap(raws[0]["sizes"], raws[0]["times"], AG, gather_ratio=2.0)
    assert again == fits[0]


# ----------------------------------------------------------------------------- auto on the measured overlap and compute


def test_auto_follows_the_measured_overlap_of_eq14():
    """The same collectives, two measured SAA steps: an overlap that hides the return all-to-all makes
    S2 the pick; one that costs more than running the two one after the other makes it S1 (eq. (14)
    is priced with the fitted (alpha_o, beta_o), not an ideal pipeline)."""
    B, L, M, E, k, f, n_mp, n_esp = 4, 1024, 1024, 8, 2, 1.25, 2, 2
    sh = MoEShape(B, L, M, E, k, f, n_mp=n_mp, n_ep=E, n_esp=n_esp)
    V = s2_a2a_elements(sh)
    sizes = [V // 16, V // 4, V, 4 * V]
    for beta_o, expected in ((0.0, "s2"), (4e-9, "s1")):
        times = [1e-4 + beta_o * v + AGMP.alpha + AGMP.beta * (n_mp / n_esp) * v for v in sizes]
        fit = fit_overlap(sizes, times, AGMP, gather_ratio=n_mp / n_esp)
        assert fit.alpha == pytest.approx(1e-4, rel=1e-6) and fit.beta == pytest.approx(beta_o, abs=1e-15)
        model = _model(AlphaBeta(1e-2, 1e-7))  # a slow baseline: Algorithm 1's pick stands
        model.costs[OVERLAP_KEY] = fit
        c = choose_schedule(model, sh, s1="padded")
        d2 = _hand_d2(A2A, AGMP, fit, E, sh.C, M, n_mp, n_esp)
        assert c.times["s2"] == pytest.approx(d2, rel=1e-9)
        assert c.schedule == expected, (beta_o, c.times)


def test_auto_adds_expert_compute_at_the_measured_throughput():
    """On a slow processor the baseline's duplicate expert work (every MP rank computes every token)
    outweighs its cheaper communication; communication alone picks the baseline."""
    sh = MoEShape(B=1, L=512, M=256, E=4, k=2, f=1.25, n_mp=2, n_ep=2, n_esp=1, H=1024)  # C = 320
    model = uniform_model(AlphaBeta(1e-5, 1e-10))
    slow = AlphaBeta(1e-3, 1e-9)
    model.costs.update({"all_to_all@ep_esp": slow, "all_gather@mp": slow, "all_reduce@mp": slow, OVERLAP_KEY: slow})
    comm = choose_schedule(model, sh)
    assert comm.schedule == "baseline" and comm.priced == "communication"
    rate = 5e10  # 50 GFLOP/s
    c = choose_schedule(model, sh, flops_per_s=rate)
    kept_rows = 2 * 512  # k S choices, fewer than the E C = 1280 slots
    for name in ("baseline", "s1", "s2"):
        assert c.times[name] == pytest.approx(comm.times[name] + expert_flops(sh, name, "kept", kept=True) / rate)
    assert expert_flops(sh, "baseline", kept=True) == 3 * 2 * 2 * kept_rows * 256 * 1024
    assert expert_flops(sh, "s2", kept=True) == expert_flops(sh, "baseline", kept=True) / 2
    assert c.schedule in ("s1", "s2") and c.priced == "communication + expert compute"
    padded = choose_schedule(model, sh, flops_per_s=rate, kept_compute=False)
    assert padded.times["baseline"] - comm.times["baseline"] == pytest.approx(
        3 * 2 * 2 * (4 * 320) * 256 * 1024 / rate
    )  # E C = 1280 padded rows
