"""Parm's cost model: the alpha-beta fit, Algorithm 1's choice, the profile cache, the grid simulator."""

import math

import numpy as np
import pytest

from megatron_moe.moe.comm_profile import _read_cache, profile_sizes, write_cache
from megatron_moe.moe.cost_model import (
    OVERLAP_KEY,
    PAPER_ALLGATHER,
    AlphaBeta,
    CommModel,
    MoEShape,
    best_saa_chunks,
    choose_schedule,
    fit_alpha_beta,
    simulate_grid,
    uniform_model,
)


def test_fit_recovers_alpha_beta_from_exact_timings():
    sizes = profile_sizes(1 << 22)
    assert sizes[0] == 256 and sizes[-1] == 1 << 22 and sizes == sorted(sizes)
    times = [3e-4 + 2e-9 * n for n in sizes]
    ab = fit_alpha_beta(sizes, times)
    assert ab.alpha == pytest.approx(3e-4, rel=1e-9) and ab.beta == pytest.approx(2e-9, rel=1e-9)


def test_fit_recovers_alpha_beta_from_noisy_timings():
    rng = np.random.default_rng(0)
    sizes = profile_sizes(1 << 24)
    times = [(6.64e-4 + 5.38e-10 * n) * (1 + rng.uniform(-0.03, 0.03)) for n in sizes]
    ab = fit_alpha_beta(sizes, times)
    assert ab.alpha == pytest.approx(6.64e-4, rel=0.05) and ab.beta == pytest.approx(5.38e-10, rel=0.05)


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_alpha_beta([1024, 1024], [1e-3, 2e-3])


# Hand computation of Algorithm 1 for N_MP = 2, N_EP = 4, N_ESP = 1, E = 8, top-2, f = 1.2, M = 1024,
# with t = alpha + beta * n: all-to-all (1e-4, 1e-9), MP all-gather (1e-4, 3e-9), MP all-reduce (1e-4, 1e-9).
MODEL = CommModel(
    {
        "all_to_all@ep_esp": AlphaBeta(1e-4, 1e-9),
        "all_gather@mp": AlphaBeta(1e-4, 3e-9),
        "all_reduce@mp": AlphaBeta(1e-4, 1e-9),
    }
)


def _hand(L: int):
    S = 8 * L
    C = math.ceil(2 * 1.2 * S / 8)
    C_mp = math.ceil(C / 2)
    V = 1 * 8 * C_mp * 1024  # S2's all-to-all send buffer: N_ESP E C_mp M
    V1 = 1 * min(2 * S, 8 * C) * 1024 / 2  # S1 sends its kept choices: N_ESP min(kS, EC) M / N_MP
    a2a, a2a1 = 1e-4 + 1e-9 * V, 1e-4 + 1e-9 * V1
    # S1 (kept-only transfer, the runtime's): counts all-gather (2kE per rank, 2kE N_MP gathered),
    #     counts all-to-all (2 N_ESP E), aux all-reduce (E + 1), two all-to-alls and the output
    #     all-gather (S M gathered) each way, gate-grad all-reduce (E M)
    small = (1e-4 + 3e-9 * 64) + (1e-4 + 1e-9 * 16) + (1e-4 + 1e-9 * 9)
    gather = 1e-4 + 3e-9 * S * 1024
    t1 = small + 4 * a2a1 + 2 * gather + (1e-4 + 1e-9 * 8 * 1024)
    # S2: per direction one all-to-all, then SAA over c chunks: a + (c-1) max(a, g) + g,
    #     the all-gather sized by its gathered output E C_mp M N_MP
    saa = []
    for c in (1, 2, 4, 8):
        a, g = 1e-4 + 1e-9 * V / c, 1e-4 + 3e-9 * 8 * C_mp * 1024 * 2 / c
        saa.append(a + (c - 1) * max(a, g) + g)
    t2 = 2 * (a2a + min(saa))
    return t1, t2


@pytest.mark.parametrize("L, expected", [(1024, "s1"), (2, "s2")])
def test_algorithm1_matches_hand_computation(L, expected):
    t1, t2 = _hand(L)
    assert (t1 < t2) == (expected == "s1")
    # the paper's Algorithm 1 (S1 vs S2 only): MODEL prices no baseline collective
    c = choose_schedule(
        MODEL, MoEShape(B=8, L=L, M=1024, E=8, k=2, f=1.2, n_mp=2, n_ep=4, n_esp=1), with_baseline=False
    )
    assert c.schedule == expected
    assert c.times["s1"] == pytest.approx(t1, rel=1e-12) and c.times["s2"] == pytest.approx(t2, rel=1e-12)


def test_algorithm1_picks_s2_for_short_sequences_and_s1_for_long_ones():
    """N_ESP = 1, the paper's MP all-gather fit, an all-to-all with half its beta: as L -> 0 the
    latencies dominate and S2 (fewer collectives) wins; as L grows S2's all-gather, k*f times
    larger than S1's, dominates and S1 wins; the switch happens once."""
    model = uniform_model(PAPER_ALLGATHER, all_to_all=AlphaBeta(PAPER_ALLGATHER.alpha, PAPER_ALLGATHER.beta / 2))
    picks = [
        choose_schedule(
            model, MoEShape(B=4, L=2**i, M=2048, E=16, k=2, f=1.2, n_mp=4, n_ep=4), with_baseline=False
        ).schedule
        for i in range(0, 16)
    ]
    assert picks[0] == "s2" and picks[-1] == "s1"
    switch = picks.index("s1")
    assert all(p == "s1" for p in picks[switch:]), picks


def test_algorithm1_needs_even_mp_split_for_s1():
    c = choose_schedule(MODEL, MoEShape(B=1, L=999, M=1024, E=8, k=2, f=1.2, n_mp=2, n_ep=4), with_baseline=False)
    assert c.schedule == "s2" and c.times["s1"] < c.times["s2"]


def test_saa_chunks_grow_with_the_message():
    tiny = MoEShape(B=1, L=4, M=64, E=8, k=1, f=1.0, n_mp=2, n_ep=4)
    big = MoEShape(B=8, L=2048, M=4096, E=8, k=1, f=1.0, n_mp=2, n_ep=4)
    assert best_saa_chunks(MODEL, tiny) == 1
    assert best_saa_chunks(MODEL, big) == 8


def test_profile_cache_is_reused_only_for_the_same_layout(tmp_path):
    path = str(tmp_path / "comm.json")
    key = {"world_size": 4, "mp": 2, "ep": 2, "esp": 1, "backend": "gloo", "device": "cpu", "procs_per_node": "4"}
    write_cache(path, key, 4096, MODEL, {})  # no SAA overlap: MP2 x EP2 needs one
    assert _read_cache(path, key, 4096) is None
    with_overlap = CommModel({**MODEL.costs, OVERLAP_KEY: AlphaBeta(-1e-5, 2e-10)})
    write_cache(path, key, 4096, with_overlap, {})
    assert not list(tmp_path.glob("*.tmp*")), "the temporary file must be renamed"
    back = _read_cache(path, key, 4096)
    assert back.costs == with_overlap.costs and back.source == "cache"
    assert _read_cache(path, {**key, "mp": 1}, 4096) is None  # another layout
    assert _read_cache(path, key, 1 << 20) is None  # profiled sizes too small
    assert _read_cache(str(tmp_path / "missing.json"), key, 4096) is None


def test_grid_simulator_averages_per_degrees():
    grid = {"P": (8,), "n_mp": (1, 2), "n_esp": (1, 2), "B": (4,), "L": (512, 2048), "m": (1024,), "f": (1.2,)}
    rows = simulate_grid(uniform_model(PAPER_ALLGATHER), k=1, grid=grid)
    assert set(rows) == {(1, 1), (1, 2), (2, 1), (2, 2)} and all(r["configs"] == 2 for r in rows.values())
    # one configuration computed by hand from the module docstring's messages (uniform alpha-beta;
    # the simulator's defaults: the paper's padded S1 (eq. (13)) and baseline (eq. (1)), no compute)
    one = simulate_grid(uniform_model(PAPER_ALLGATHER), k=1, grid=dict(grid, n_mp=(2,), n_esp=(1,), L=(512,)))
    a, b = PAPER_ALLGATHER.alpha, PAPER_ALLGATHER.beta

    def t(n: float) -> float:
        return a + b * n

    S, M, E, C, C_mp = 4 * 512, 1024, 8, 308, 154  # C = ceil(1.2 * 2048 / 8), C_mp = C / N_MP
    baseline = 4 * t(E * C * M)  # 2 all-to-alls each way over EP (ESP has one rank)
    s1 = 2 * (2 * t(E * C * M / 2) + t(S * M))  # eq. (13) each way: E T M N_ESP / N_MP, AG of B L M gathered
    # S2 each way: all-to-all of V = E C_mp M, then SAA (1 chunk is best here: a + c g grows with c)
    s2 = 2 * (2 * t(E * C_mp * M) + t(E * C_mp * M * 2))
    assert one[(2, 1)]["s1"] == pytest.approx(baseline / s1, rel=1e-12)
    assert one[(2, 1)]["s2"] == pytest.approx(baseline / s2, rel=1e-12)
    assert one[(2, 1)]["parm"] == pytest.approx(baseline / min(s1, s2), rel=1e-12)
    assert one[(2, 1)]["picked_s1"] == (s1 <= s2)
    # with compute at 1e13 FLOP/s: the baseline runs E C rows on both MP ranks, S1 and S2 half of them
    fl = simulate_grid(
        uniform_model(PAPER_ALLGATHER), k=1, grid=dict(grid, n_mp=(2,), n_esp=(1,), L=(512,)), flops_per_s=1e13
    )
    comp = 12 * E * C * M * M / 1e13
    assert fl[(2, 1)]["s1"] == pytest.approx((baseline + comp) / (s1 + comp / 2), rel=1e-12)
    assert fl[(2, 1)]["s2"] == pytest.approx((baseline + comp) / (s2 + comp / 2), rel=1e-12)
    # without MP and ESP, S2 and the paper's padded S1 move exactly the baseline's all-to-alls; the
    # runtime's kept-only S1 sends kept choices instead of capacity-padded buffers
    assert rows[(1, 1)]["s2"] == pytest.approx(1.0, rel=1e-12) and rows[(1, 1)]["s1"] == pytest.approx(1.0, rel=1e-12)
    kept = simulate_grid(uniform_model(PAPER_ALLGATHER), k=1, grid=grid, s1="kept")
    assert kept[(1, 1)]["s1"] > 1.0
    # counting the expert compute, pausing MP removes the baseline's N_MP-fold duplicate work
    with_compute = simulate_grid(uniform_model(PAPER_ALLGATHER), k=1, grid=grid, flops_per_s=1e13)
    assert with_compute[(2, 1)]["parm"] > with_compute[(1, 1)]["parm"]
