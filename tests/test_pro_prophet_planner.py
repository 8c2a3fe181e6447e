"""Pro-Prophet planner: the performance model (eqs. (1)-(8)), Algorithm 1 against brute force,
the balance condition (7), --pro-prophet-n, determinism, the constant fit, the comparison
"k heaviest to all" and Algorithm 2's block schedule. Single process, no process group."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from megatron_moe.parallel_state import local_state
from megatron_moe.pro_prophet.perf_model import (
    PerfConstants,
    PerfModel,
    fit_constants,
    loads,
    measure_constants,
    time_expert_ffn,
)
from megatron_moe.pro_prophet.planner import CommLaunch, block_schedule, heaviest_to_all, is_balanced, plan


# Unit constants: T' = 4 max R + 3 max H + (Trans + Agg), each moved expert costing P (|rep| + 1) / D
# per primitive, so hand computations stay in integers and simple fractions.
UNIT = PerfConstants(a2a_alpha=0.0, a2a_beta=1.0, bcast_alpha=0.0, bcast_beta=1.0, expert_alpha=0.0, expert_beta=1.0)


def unit_model(p: int, **kw) -> PerfModel:
    return PerfModel(UNIT, token_elements=1, param_elements=p, grad_elements=p, **kw)


def brute_force(counts: np.ndarray, model: PerfModel):
    """(best time, every placement reaching it) over all placements: each expert's replicas any
    subset of the non-owner ranks."""
    d, e = counts.shape
    per = e // d
    options = []
    for x in range(e):
        others = [r for r in range(d) if r != x // per]
        options.append([c for k in range(len(others) + 1) for c in itertools.combinations(others, k)])
    scored = [(model.layer_time(counts, list(p)), tuple(p)) for p in itertools.product(*options)]
    best = min(t for t, _ in scored)
    return best, [p for t, p in scored if t == best]


# -- the model --------------------------------------------------------------------------------
def test_loads_by_hand():
    counts = np.array([[5, 1, 2, 0], [3, 4, 0, 6]])  # D=2, E=4: rank 0 owns 0, 1; rank 1 owns 2, 3
    h, r, g = loads(counts, [(), (), (), ()])
    assert h.tolist() == [5 + 3 + 1 + 4, 2 + 6]
    assert r.tolist() == [3 + 4, 2 + 0]
    assert g.tolist() == [2, 2]
    h, r, g = loads(counts, [(1,), (), (), (0,)])  # rank 1 computes its 3 of expert 0; rank 0 its 0 of 3
    assert h.tolist() == [5 + 1 + 4 + 0, 3 + 2 + 6]
    assert r.tolist() == [4, 2]
    assert g.tolist() == [3, 3]


def test_layer_time_is_eq6_and_eq8():
    c = PerfConstants(
        a2a_alpha=0.5, a2a_beta=0.25, bcast_alpha=2.0, bcast_beta=0.125, expert_alpha=1.0, expert_beta=0.5
    )
    counts = np.array([[8, 4, 1, 3], [2, 6, 7, 1]])
    reps = [(1,), (), (), ()]
    # H = [8+4+6, 2+1+7+1] = [18, 11]; R = [6, 1]; G = [2, 3]; one expert moved to 2 of 2 ranks
    a2a = 0.5 + 0.25 * 4 * 6
    fec = max(1.0 * 2 + 0.5 * 18, 1.0 * 3 + 0.5 * 11)
    trans = 2.0 + 0.125 * 10 * 2 / 2
    agg = 2.0 + 0.125 * 20 * 2 / 2
    m6 = PerfModel(c, token_elements=4, param_elements=10, grad_elements=20)
    assert m6.layer_time(counts, reps) == pytest.approx(4 * a2a + 3 * fec + trans + agg, rel=1e-12)
    m8 = PerfModel(c, token_elements=4, param_elements=10, grad_elements=20, fnec_s=0.5, bnec_s=1.0, overlap=True)
    hidden = 4 * a2a + 3 * fec + max(0.0, trans - fec - 0.5) + max(0.0, agg - 2 * fec - 1.0)
    assert m8.layer_time(counts, reps) == pytest.approx(hidden, rel=1e-12)
    m8_small = PerfModel(c, token_elements=4, param_elements=1000, grad_elements=1000, fnec_s=0.5, overlap=True)
    t_big = 2.0 + 0.125 * 1000
    exposed = (t_big - fec - 0.5) + (t_big - 2 * fec - 0.0)
    assert m8_small.layer_time(counts, reps) == pytest.approx(4 * a2a + 3 * fec + exposed, rel=1e-12)


def test_bad_inputs_are_clear_errors():
    m = unit_model(1)
    with pytest.raises(ValueError, match=r"3 experts do not divide over 2 devices"):
        plan([[1, 2, 3], [4, 5, 6]], m, alpha=1.0)
    with pytest.raises(ValueError, match=r"counts must be integers"):
        plan([[1.5, 2.0], [1.0, 1.0]], m, alpha=1.0)
    with pytest.raises(ValueError, match=r"counts must be >= 0"):
        plan([[-1, 2], [1, 1]], m, alpha=1.0)
    with pytest.raises(ValueError, match=r"--pro-prophet-alpha must be a finite number >= 0, got -0.1"):
        plan([[1, 2], [1, 1]], m, alpha=-0.1)
    with pytest.raises(ValueError, match=r"expert 0 lists its owner as a replica"):
        m.layer_time(np.ones((2, 2), dtype=np.int64), [(0,), ()])
    with pytest.raises(ValueError, match=r"PerfConstants.a2a_beta must be a finite number >= 0"):
        PerfConstants(0.0, -1.0, 0.0, 0.0, 0.0, 0.0)


# -- Algorithm 1 against brute force ----------------------------------------------------------
CASES = [
    # (counts, P, alpha, expected replicas): cases where the greedy reaches the optimum
    ([[60, 1, 1], [50, 1, 1], [40, 1, 1]], 10, 0.5, ((1, 2), (), ())),  # one hot expert, cheap Trans
    ([[60, 1, 1], [50, 1, 1], [40, 1, 1]], 1000, 0.5, ((), (), ())),  # Trans dearer than the imbalance
    ([[40, 30, 2, 2], [40, 30, 2, 2]], 10, 1.0, ((1,), (1,), (), ())),  # two hot experts on one rank
    ([[2, 2, 9, 30], [3, 1, 40, 50]], 10, 0.5, ((), (), (0,), (0,))),  # the hot rank is rank 1
]


@pytest.mark.parametrize("counts,p,alpha,expected", CASES)
def test_greedy_equals_brute_force_optimum(counts, p, alpha, expected):
    counts = np.array(counts)
    model = unit_model(p)
    best, argmins = brute_force(counts, model)
    assert argmins == [expected]  # the case has one optimum, and it is this one
    got = plan(counts, model, alpha=alpha, n=0)
    assert got.replicas == expected
    assert got.predicted_s == best
    assert got.baseline_s == model.layer_time(counts, None)


def test_hand_values_of_the_two_expert_case():
    """D=2, E=4, P=10: no placement 4*70 + 3*140 = 700; expert 0 moved 4*30 + 3*100 + 20 = 440;
    experts 0 and 1 moved 4*4 + 3*78 + 40 = 290."""
    counts = np.array([[40, 30, 2, 2], [40, 30, 2, 2]])
    model = unit_model(10)
    assert model.layer_time(counts, None) == 700
    assert model.layer_time(counts, [(1,), (), (), ()]) == 440
    got = plan(counts, model, alpha=1.0)
    assert (got.baseline_s, got.predicted_s, got.order) == (700, 290, (0, 1))
    assert got.load_before == (140, 8) and got.load_after == (70, 78)


def test_greedy_is_never_worse_than_no_placement():
    rng = np.random.default_rng(0)
    for trial in range(60):
        d = int(rng.choice([2, 3, 4]))
        e = d * int(rng.choice([1, 2]))
        zipf = 1.0 / np.arange(1, e + 1) ** rng.uniform(0, 2)
        counts = rng.multinomial(200, zipf[rng.permutation(e)] / zipf.sum(), size=d)
        model = unit_model(int(rng.integers(1, 200)), overlap=bool(trial % 2), fnec_s=5.0, bnec_s=5.0)
        n = int(rng.integers(0, d - 1)) if d > 2 else 0
        got = plan(counts, model, alpha=float(rng.uniform(0, 1)), n=n)
        assert got.predicted_s <= got.baseline_s
        assert got.predicted_s == model.layer_time(counts, got.replicas)
        assert got.load_after == tuple(loads(counts, got.replicas)[0].tolist())
        assert sum(got.load_after) == sum(got.load_before) == counts.sum()


def test_extra_keeps_the_next_moves_of_the_same_greedy_order():
    """P=100, alpha 0: the greedy order is 0, 1, 2, 3 (rank 0's heavy experts, then the tie 2 / 3 on rank 1
    by index); by hand T'(none) = 700, T'(0) = 4*30 + 3*100 + 2*100 = 620, T'(0, 1) = 4*4 + 3*78 + 4*100
    = 650: the model keeps the 1-expert prefix, extra=1 the 2-expert one, a large extra the whole order."""
    counts = np.array([[40, 30, 2, 2], [40, 30, 2, 2]])
    model = unit_model(100)
    best = plan(counts, model, alpha=0.0)
    assert plan(counts, model, alpha=0.0, extra=0) == best
    assert (best.order, best.replicas, best.predicted_s, best.baseline_s) == ((0,), ((1,), (), (), ()), 620, 700)
    wider = plan(counts, model, alpha=0.0, extra=1)
    assert (wider.order, wider.replicas, wider.predicted_s) == ((0, 1), ((1,), (1,), (), ()), 650)
    assert wider.load_after == (70, 78) and wider.baseline_s == 700
    whole = plan(counts, model, alpha=0.0, extra=9)
    assert whole.order == (0, 1, 2, 3) and whole.replicas == ((1,), (1,), (0,), (0,))
    # stopped by balance (7) after expert 0: nothing further to keep
    assert plan(counts, model, alpha=2.0, extra=1).order == (0,)
    for bad in (-1, 0.5, True):
        with pytest.raises(ValueError, match="plan: extra must be an integer >= 0"):
            plan(counts, model, alpha=0.0, extra=bad)


def test_extra_zero_is_algorithm_1_and_extra_one_extends_its_prefix():
    rng = np.random.default_rng(1)
    grew = 0
    for _ in range(30):
        d = int(rng.choice([2, 4]))
        counts = rng.multinomial(300, rng.dirichlet(np.ones(2 * d)), size=d)
        model = unit_model(int(rng.integers(1, 300)))
        p0 = plan(counts, model, alpha=0.1)
        assert plan(counts, model, alpha=0.1, extra=0) == p0
        p1 = plan(counts, model, alpha=0.1, extra=1)
        assert p1.order[: len(p0.order)] == p0.order and len(p1.order) - len(p0.order) in (0, 1)
        assert all(p1.replicas[x] == p0.replicas[x] for x in p0.order)
        grew += len(p1.order) > len(p0.order)
    assert grew > 0  # the cases do exercise the extra move


# -- balance condition (7) ----------------------------------------------------------------------
def test_balance_condition_is_strict():
    assert not is_balanced([10, 5], alpha=1.0, total_tokens=10, num_experts=2)  # 5 < 5 is false
    assert is_balanced([10, 5], alpha=1.01, total_tokens=10, num_experts=2)


def test_planner_stops_as_soon_as_the_load_is_balanced():
    counts = np.array([[40, 30, 2, 2], [40, 30, 2, 2]])  # I / E = 37
    model = unit_model(10)
    # after moving expert 0, H = [100, 48]: 52 < 2 * 37, balanced, so expert 1 is never tried
    # (moving it would have reached 290 < 440)
    assert plan(counts, model, alpha=2.0).replicas == ((1,), (), (), ())
    # already balanced before any move: max - min = 132 < 4 * 37; nothing moves
    got = plan(counts, model, alpha=4.0)
    assert (got.replicas, got.order, got.predicted_s) == (((),) * 4, (), 700)


# -- --pro-prophet-n ------------------------------------------------------------------------------
def test_n_least_loaded_ranks_are_left_out():
    counts = np.ones((4, 4), dtype=np.int64)
    counts[:, 0] = [100, 50, 5, 30]
    model = unit_model(1)
    p0, p1, p2 = (plan(counts, model, alpha=0.0, n=n) for n in (0, 1, 2))
    assert p0.replicas[0] == (1, 2, 3) and p0.excluded[0] == ()
    assert p1.replicas[0] == (1, 3) and p1.excluded[0] == (2,)
    assert p2.replicas[0] == (1,) and p2.excluded[0] == (2, 3)
    counts[:, 0] = [100, 5, 5, 30]  # a tie: the lower rank is left out
    assert plan(counts, model, alpha=0.0, n=1).replicas[0] == (2, 3)


def test_n_out_of_range_names_the_flag():
    with pytest.raises(
        ValueError,
        match=r"--pro-prophet-n must be an integer in \[0, 2\] for 4 expert-parallel "
        r"ranks, got 3",
    ):
        plan(np.ones((4, 4), dtype=np.int64), unit_model(1), alpha=0.5, n=3)
    with pytest.raises(
        ValueError,
        match=r"--pro-prophet-n must be an integer in \[0, 0\] for 1 expert-parallel "
        r"ranks, got 1",
    ):
        plan(np.ones((1, 4), dtype=np.int64), unit_model(1), alpha=0.5, n=1)
    one = plan([[5, 1, 1, 1]], unit_model(1), alpha=0.0)  # one rank: nothing to move
    assert (one.replicas, one.load_after) == (((),) * 4, (8,))


def test_ranks_without_tokens_for_the_expert_get_no_replica():
    counts = np.array([[90, 1, 1], [30, 1, 1], [0, 1, 1]])
    assert plan(counts, unit_model(1), alpha=0.1).replicas[0] == (1,)


# -- determinism --------------------------------------------------------------------------------
def test_same_plan_from_every_input_form_and_ties_by_index():
    counts = [[50, 50, 1, 1], [50, 50, 1, 1], [1, 1, 9, 1], [1, 1, 1, 9]]  # ranks 0 and 1 tie
    model = unit_model(5)
    plans = [
        plan(c, model, alpha=0.2, n=1)
        for c in (
            counts,
            np.array(counts, dtype=np.int32),
            np.array(counts, dtype=np.float64),
            torch.tensor(counts, device=torch.device("cpu")),
            counts,
        )
    ]
    assert all(p == plans[0] for p in plans)
    assert plans[0].order[0] == 0  # the tie goes to rank 0: its expert first


def test_heaviest_to_all():
    counts = np.array([[1, 7, 3, 7], [1, 2, 3, 2], [1, 0, 3, 0], [1, 1, 3, 1]])  # totals 4, 10, 12, 10
    got = heaviest_to_all(counts, k=2, model=unit_model(4))
    assert got.replicas == ((), (0, 2, 3), (0, 1, 3), ())  # 2, then 1 (ties 1 / 3: the lower index)
    assert got.order == (2, 1)
    assert got.predicted_s == unit_model(4).layer_time(counts, got.replicas)
    assert heaviest_to_all(counts, k=0).replicas == ((),) * 4
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 4\], got 5"):
        heaviest_to_all(counts, k=5)


def test_load_std_before_and_after():
    counts = np.array([[60, 1, 1], [50, 1, 1], [40, 1, 1]])
    got = plan(counts, unit_model(10), alpha=0.5)
    assert got.load_before == (150, 3, 3) and got.load_after == (60, 53, 43)

    def pstd(xs):
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))

    assert got.load_std_before == pytest.approx(pstd([150, 3, 3]), rel=1e-12)
    assert got.load_std_after == pytest.approx(pstd([60, 53, 43]), rel=1e-12)
    assert got.load_std_after * 9 < got.load_std_before


# -- constants ------------------------------------------------------------------------------------
def test_fit_recovers_known_constants():
    true = PerfConstants(
        a2a_alpha=3e-5, a2a_beta=2e-9, bcast_alpha=1e-4, bcast_beta=5e-10, expert_alpha=2e-5, expert_beta=3e-7
    )
    sizes = [256, 1024, 4096, 16384, 65536]
    tokens = [16, 64, 256, 1024]
    got = fit_constants(
        (sizes, [true.a2a_alpha + true.a2a_beta * s for s in sizes]),
        (sizes, [true.bcast_alpha + true.bcast_beta * s for s in sizes]),
        (tokens, [true.expert_alpha + true.expert_beta * t for t in tokens]),
    )
    for name in ("a2a_alpha", "a2a_beta", "bcast_alpha", "bcast_beta", "expert_alpha", "expert_beta"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    with pytest.raises(ValueError, match=r"two or more distinct sizes"):
        fit_constants(([8, 8], [1.0, 1.0]), (sizes, sizes), (tokens, tokens))


def test_expert_timing_and_measurement_guard():
    t = time_expert_ffn(16, 8, 16, torch.device("cpu"), reps=1)
    assert t > 0.0
    with pytest.raises(ValueError, match=r"needs an expert-parallel group of 2 or more ranks \(ep has 1\)"):
        measure_constants(local_state(), token_elements=8, param_elements=256, ffn_hidden=16, max_tokens=64)


# -- Algorithm 2 --------------------------------------------------------------------------------
def test_block_schedule():
    counts = np.array([[40, 30, 2, 2], [40, 30, 2, 2]])
    model = unit_model(10, fnec_s=10.0, bnec_s=10.0)  # each expert's Trans / Agg costs 10 * 2 / 2 = 10
    two = plan(counts, model, alpha=1.0)  # moves experts 0 then 1
    none = plan(counts, unit_model(10**6), alpha=1.0)  # moves nothing
    assert two.order == (0, 1) and none.order == ()
    s = block_schedule([two, two, none, two], model)
    assert s.forward == (
        CommLaunch("trans", 0, (0, 1), None, "blocking"),
        CommLaunch("trans", 1, (0,), 0, "expert"),
        CommLaunch("trans", 1, (1,), 0, "non_expert"),
        CommLaunch("trans", 3, (0,), 2, "expert"),
        CommLaunch("trans", 3, (1,), 2, "non_expert"),
    )
    assert s.backward == (
        CommLaunch("agg", 3, (0,), 2, "non_expert"),
        CommLaunch("agg", 3, (1,), 2, "expert"),
        CommLaunch("agg", 1, (0,), 0, "non_expert"),
        CommLaunch("agg", 1, (1,), 0, "expert"),
        CommLaunch("agg", 0, (0, 1), None, "blocking"),
    )
    roomy = block_schedule([none, two], unit_model(10, fnec_s=25.0, bnec_s=5.0))
    assert roomy.forward == (CommLaunch("trans", 1, (0, 1), 0, "non_expert"),)
    assert roomy.backward == (CommLaunch("agg", 1, (0, 1), 0, "expert"),)
