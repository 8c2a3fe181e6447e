"""rank_layout against brute-force enumeration, error messages, and real process groups."""

import itertools

import pytest

from megatron_moe.parallel_state import rank_layout
from megatron_moe.testing import spawn


def brute_force(P, mp, ep, esp):
    """Groups by enumerating coordinates of every rank from the formulas of docs/DESIGN.md "Ranks and groups"."""
    dense = {r: (r % mp, r // mp) for r in range(P)}  # (mp, dp)
    expert = {r: (r % esp, (r // esp) % ep, r // (esp * ep)) for r in range(P)}  # (esp, ep, edp)

    def groups(key):
        out = {}
        for r in range(P):
            out.setdefault(key(r), []).append(r)
        return sorted(out.values())

    return {
        "mp_groups": groups(lambda r: dense[r][1]),
        "dp_groups": groups(lambda r: dense[r][0]),
        "esp_groups": groups(lambda r: (expert[r][1], expert[r][2])),
        "ep_groups": groups(lambda r: (expert[r][0], expert[r][2])),
        "ep_esp_groups": groups(lambda r: expert[r][2]),
        "expert_dp_groups": groups(lambda r: (expert[r][0], expert[r][1])),
    }


def valid_degrees(P):
    divs = [d for d in range(1, P + 1) if P % d == 0]
    for mp, ep, esp in itertools.product(divs, divs, divs):
        if P % (ep * esp) == 0:
            yield mp, ep, esp


def test_rank_layout_matches_brute_force_for_every_valid_layout_up_to_64():
    checked = 0
    for P in range(1, 65):
        for mp, ep, esp in valid_degrees(P):
            lay = rank_layout(P, mp, ep, esp)
            expect = brute_force(P, mp, ep, esp)
            for name, groups in expect.items():
                assert sorted(sorted(g) for g in getattr(lay, name)) == groups, (P, mp, ep, esp, name)
            # every group kind partitions the ranks
            for name in expect:
                flat = sorted(r for g in getattr(lay, name) for r in g)
                assert flat == list(range(P))
            checked += 1
    assert checked > 1000


def test_esp_groups_are_consecutive_and_mp_groups_consecutive():
    lay = rank_layout(16, 4, 2, 2)
    assert lay.mp_groups[1] == [4, 5, 6, 7]
    assert lay.esp_groups[:2] == [[0, 1], [2, 3]]
    assert lay.ep_groups[0] == [0, 2]
    assert lay.ep_esp_groups[0] == [0, 1, 2, 3]
    assert lay.expert_dp_groups[0] == [0, 4, 8, 12]


@pytest.mark.parametrize(
    "args,flag",
    [
        ((8, 3, 1, 1), "--tensor-model-parallel-size 3"),
        ((8, 1, 3, 1), "--expert-model-parallel-size 3"),
        ((8, 1, 2, 3), "--expert-sharding-parallel-size 3"),
        ((8, 0, 1, 1), "--tensor-model-parallel-size"),
        ((8, 1, 4, 4), "= 16 must divide the world size 8"),
    ],
)
def test_invalid_degrees_name_the_flag(args, flag):
    with pytest.raises(ValueError, match=flag):
        rank_layout(*args)


def test_experts_and_ffn_divisibility_errors():
    from megatron_moe.parallel_state import validate_degrees

    with pytest.raises(ValueError, match="--num-experts 6 must be divisible by --expert-model-parallel-size 4"):
        validate_degrees(8, 1, 4, 1, num_experts=6)
    with pytest.raises(ValueError, match="--ffn-hidden-size 10 must be divisible by --expert-sharding"):
        validate_degrees(8, 1, 2, 4, ffn_hidden_size=10)


def _groups_on_rank(rank, world):
    import torch
    import torch.distributed as dist
    from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel

    ps = initialize_model_parallel(2, 2, 1)
    out = {}
    for kind in ("mp", "dp", "ep", "esp", "ep_esp", "expert_dp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=ps.group(kind))
        out[kind] = (ps.rank(kind), ps.size(kind), t.item())
    destroy_model_parallel()
    return out


def test_process_groups_reduce_over_the_layout_groups():
    res = spawn(_groups_on_rank, 4)
    lay = rank_layout(4, 2, 2, 1)
    for rank, out in enumerate(res):
        for kind, (r, n, total) in out.items():
            g = lay.group_of(kind, rank)
            assert (r, n, total) == (g.index(rank), len(g), float(sum(g))), (rank, kind)
