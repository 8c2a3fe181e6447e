"""Every parallel layout equals the one-process reference (loss, every gradient, drops).

fp32, top-1 and top-2 (and the other router policies on a subset), capacity
factor 0.5 so tokens are dropped. One spawn per world size runs all of its
layouts; the parent computes the references and compares.
"""
import pytest

from equivalence import compare, reference, run_layout, tiny_config
from megatron_moe.testing import spawn

LAYOUTS = {
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 1)],                    # MP2, EP2, ESP2, DP2
    4: [(2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 1, 1)],          # MP2xEP2, EP2xESP2, MP2+ESP2, EP4, MP2xDP2
    8: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
}
CASES = [(1, "position"), (2, "position")]
EXTRA_POLICY_CASES = [(1, "batch_prioritized"), (2, "batch_prioritized"), (1, "random"), (2, "random")]


def _cases(world):
    out = []
    for layout in LAYOUTS[world]:
        for k, policy in CASES + (EXTRA_POLICY_CASES if world == 4 else []):
            out.append((layout, k, policy))
    return out


def _run_all(rank, world, cases, use_hooks):
    results = []
    for (mp, ep, esp), k, policy in cases:
        results.append(run_layout(tiny_config(k, policy), mp, ep, esp, use_hooks=use_hooks))
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_matches_one_process_reference(world):
    cases = _cases(world)
    per_rank = spawn(_run_all, world, cases, world == 4, timeout=600)
    refs = {}
    for i, ((mp, ep, esp), k, policy) in enumerate(cases):
        dp = world // mp
        key = (dp, k, policy)
        if key not in refs:
            refs[key] = reference(tiny_config(k, policy), dp)
        assert refs[key][2][0] > 0, "the config must drop tokens"
        compare([per_rank[r][i] for r in range(world)], refs[key],
                f"P={world} MP{mp} EP{ep} ESP{esp} top-{k} {policy}")
