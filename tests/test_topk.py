"""Fine-grained experts: the router takes any top-k up to E (DeepSeek / Qwen-style E=64, k=8).

With a capacity, choice j of a token takes its slot after every choice i < j of the same expert in
the routing group (GShard's rule for k = 2, repeated); dropless keeps every choice; the kept weights
are renormalized. Checked against a brute-force reference of the rule, and every layout (MP, EP,
ESP, S1, S2, dropless) against the one-process reference at k = 4 of E = 8.
"""

import pytest
import torch

from equivalence import compare, reference, run_layout, tiny_config
from megatron_moe.moe.router import route
from megatron_moe.testing import spawn


def brute_force_slots(expert_Sk: torch.Tensor, E: int) -> list[list[int]]:
    """The rule, one choice at a time: choice j's slot = choices of that expert taken before it, where
    every choice i < j of every token comes first, then choice j in token order."""
    S, k = expert_Sk.shape
    taken = [0] * E
    slots = [[0] * k for _ in range(S)]
    for j in range(k):
        for s in range(S):
            e = int(expert_Sk[s, j])
            slots[s][j] = taken[e]
            taken[e] += 1
    return slots


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_slots_follow_the_choice_order_rule_and_weights_renormalize(k):
    E, S, cf = 8, 40, 0.5
    logits = torch.randn(S, E, generator=torch.Generator().manual_seed(k))
    r = route(logits, k, cf, 1)
    want = brute_force_slots(r.expert, E)
    C = r.capacity
    assert C == max(-(-int(k * cf * S) // E), 1)
    for s in range(S):
        assert len(set(r.expert[s].tolist())) == k  # k distinct experts
        for j in range(k):
            assert int(r.slot[s, j]) == (want[s][j] if want[s][j] < C else -1)
    # the experts are the top-k of the gates, in order
    assert torch.equal(r.expert, torch.topk(logits, k, dim=1).indices)
    kept = r.slot >= 0
    if k >= 2:
        sums = r.weight.sum(dim=1)
        has = kept.any(dim=1)
        torch.testing.assert_close(sums[has], torch.ones_like(sums[has]))
    assert int((r.weight[~kept] != 0).sum()) == 0
    assert torch.equal(r.counts, torch.bincount(r.expert[kept], minlength=E))


def test_dropless_keeps_every_choice_of_top8():
    r = route(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), 8, 1.0, 1, dropless=True)
    assert bool((r.slot >= 0).all()) and int(r.counts.sum()) == 64 * 8


def test_k_above_the_experts_is_refused():
    from megatron_moe.config import MoEConfig

    with pytest.raises(ValueError, match="exceeds --num-experts"):
        MoEConfig(num_experts=4, moe_router_topk=5)
    with pytest.raises(ValueError, match="--moe-router-topk must be >= 1"):
        MoEConfig(num_experts=4, moe_router_topk=0)


LAYOUTS = [  # (mp, ep, esp, MoE overrides) on 4 ranks
    (2, 2, 1, {}),
    (1, 2, 2, {}),
    (1, 4, 1, {}),
    (2, 2, 1, {"moe_schedule": "s1"}),
    (2, 2, 1, {"moe_schedule": "s2"}),
    (1, 4, 1, {"moe_dropless": True}),
    (2, 2, 1, {"moe_dropless": True, "moe_schedule": "s1"}),
]


def _config(**moe):
    return tiny_config(k=4, num_experts=8, **moe)


def _run_all(rank, world):
    return [run_layout(_config(**moe), mp, ep, esp) for mp, ep, esp, moe in LAYOUTS]


def test_every_layout_matches_one_process_reference_at_top4_of_8():
    per_rank = spawn(_run_all, 4, timeout=600)
    for i, (mp, ep, esp, moe) in enumerate(LAYOUTS):
        ref = reference(_config(**moe), 4 // mp)
        if not moe.get("moe_dropless"):
            assert ref[2][0] > 0, "the config must drop tokens"
        compare([r[i] for r in per_rank], ref, f"top-4 MP{mp} EP{ep} ESP{esp} {moe}")
